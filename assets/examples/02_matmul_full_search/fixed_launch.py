"""Before: the matmul kernel launched with one hand-picked tile (128x128x64, occupancy 1), the
choice that is good for big square GEMMs, used here for a skinny one (M = 128)."""
import cuda.tile as ct
import torch

from tiletune import cdiv
from tiletune.timing import time_us
from tiletune.ops.matmul import matmul_kernel

M, N, K = 128, 4096, 4096
torch.manual_seed(0)
a = torch.randn(1, M, K, device="cuda", dtype=torch.bfloat16)
b = torch.randn(1, K, N, device="cuda", dtype=torch.bfloat16)
c = torch.empty(1, M, N, device="cuda", dtype=torch.bfloat16)

TM, TN, TK, GROUP_M = 128, 128, 64, 8
kernel = matmul_kernel.replace_hints(occupancy=1, num_ctas=1)
grid = (cdiv(M, TM) * cdiv(N, TN), 1)


def run():
    ct.launch(torch.cuda.current_stream(), grid, kernel, (a, b, c, TM, TN, TK, GROUP_M))


run()
res = c.double()
r = torch.randn(res.shape, device="cuda", dtype=torch.float64,
                generator=torch.Generator("cuda").manual_seed(1))
print(f"checksum={res.square().sum().item():.9e}")   # the squared norm
print(f"projection={(res * r).sum().item():.9e}")    # on a random vector: any wrong value moves it
print(f"us={time_us(run):.2f}")
