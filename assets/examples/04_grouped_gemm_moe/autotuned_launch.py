"""After: the same kernel through the op's tuner: the first launch searches the sm_90 space
(tile shapes, worker warps, occupancy, the L2 swizzle, and how x's rows are read: TMA through
one view stepping a row at a time, or gathers; the space's 256-row 2-CTA clusters are taller
than this key's 128-row groups, so they leave it here), keyed by (E, K, N, bucket(T), dtype,
layouts, device), not by the token split, so a new routing next step reuses it; every later
call is a dict lookup and a ct.launch of the cached, already-hinted kernel."""
import torch

from tiletune.ops import grouped_gemm as GG
from tiletune.timing import time_us

E, T, K, N = 64, 8192, 2048, 1536
torch.manual_seed(0)
x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
w = (torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16) / K ** 0.5).transpose(-2, -1)
offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * (T // E)
out = torch.empty(T, N, device="cuda", dtype=torch.bfloat16)


def run():
    GG.launch(x, w, offs, out)           # what grouped_mm(x, w, offs) runs, into `out`


run()                                    # tunes once
print(f"best={next(iter(GG._grouped.records.values())).config}")
res = out.double()
r = torch.randn(res.shape, device="cuda", dtype=torch.float64,
                generator=torch.Generator("cuda").manual_seed(1))
print(f"checksum={res.square().sum().item():.9e}")   # the squared norm
print(f"projection={(res * r).sum().item():.9e}")    # on a random vector: any wrong value moves it
print(f"us={time_us(run):.2f}")
