"""Before: the grouped GEMM kernel of a Qwen3-MoE-like expert projection (64 experts, 8192
tokens, 2048 -> 1536, (E, N, K) weights seen transposed) launched with one hand-picked config:
small 64x64 tiles because the groups are small (128 rows each), gather loads, occupancy 2, a
persistent grid of SMs x occupancy CTAs walking their work items. The token split lives on the
device (int32 cumulative end offsets); the kernel derives its work from it."""
import cuda.tile as ct
import torch

from tiletune.ops.grouped_gemm import grouped_mm_kernel
from tiletune.timing import time_us

E, T, K, N = 64, 8192, 2048, 1536
torch.manual_seed(0)
x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
w = (torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5).transpose(-2, -1)
offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * (T // E)
out = torch.empty(T, N, device="cuda", dtype=torch.bfloat16)

TM, TN, TK, GROUP_M, GATHER, WALK = 64, 64, 64, 8, True, 1
kernel = grouped_mm_kernel.replace_hints(occupancy=2, num_ctas=1)
grid = (torch.cuda.get_device_properties(0).multi_processor_count * 2,)


def run():
    ct.launch(torch.cuda.current_stream(), grid, kernel,
              (x, w, offs, out, TM, TN, TK, GROUP_M, GATHER, WALK))


run()
res = out.double()
r = torch.randn(res.shape, device="cuda", dtype=torch.float64,
                generator=torch.Generator("cuda").manual_seed(1))
print(f"checksum={res.square().sum().item():.9e}")   # the squared norm
print(f"projection={(res * r).sum().item():.9e}")    # on a random vector: any wrong value moves it
print(f"us={time_us(run):.2f}")
