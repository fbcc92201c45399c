"""Before: the block-scaled FP8 GEMM of a DeepSeek-V3-like projection (4096 tokens, 7168 -> 2048,
e4m3, 1x128 activation scales, 128x128 weight scales, each 128-K product promoted to float32)
launched with one hand-picked config: the 128x128 tile that suits a bf16 GEMM of this size, 8
worker warps, occupancy 1, one CTA per output tile, each block's product scaled into the
accumulator before the next one starts."""
import cuda.tile as ct
import torch

from tiletune.ops.fp8_gemm import fp8_mm_block_kernel, quantize_fp8_reference
from tiletune.timing import time_us

M, K, N = 4096, 7168, 2048
torch.manual_seed(0)
x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5
a, scale_a = quantize_fp8_reference(x, "block1x128")        # (M, K/128), M-major
w8, scale_w = quantize_fp8_reference(w, "block128x128")     # (N/128, K/128)
b, scale_b = w8.t(), scale_w.t()                             # b (K, N) column-major
out = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)

TM, TN, GROUP_M = 128, 128, 8
kernel = fp8_mm_block_kernel.replace_hints(occupancy=1, num_ctas=1, num_worker_warps=8)
grid = (-(-M // TM) * -(-N // TN),)


def run():
    ct.launch(torch.cuda.current_stream(), grid, kernel,
              (a, b, scale_a, scale_b, out, TM, TN, GROUP_M, 1, 128, False, False, False, 0,
               False))


run()
res = out.double()
r = torch.randn(res.shape, device="cuda", dtype=torch.float64,
                generator=torch.Generator("cuda").manual_seed(1))
print(f"checksum={res.square().sum().item():.9e}")   # the squared norm
print(f"projection={(res * r).sum().item():.9e}")    # on a random vector: any wrong value moves it
print(f"us={time_us(run):.2f}")
