"""Host-side cost of the RMSNorm forward/backward paths (tiny shape: the GPU is never the limit)."""
import cProfile
import pstats
import threading

import cuda.tile as ct
import torch

from tiletune.bench import host_us
from tiletune.device import current_stream
from tiletune.ops import rms_norm as R

x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
w = torch.rand(1024, device="cuda", dtype=torch.bfloat16)
dy = torch.randn_like(x)
y, rstd = R._forward(x, w, 1e-6)
dx = torch.empty_like(x)
R._backward(dy, x, w, rstd)
(cfg, kernel), = R._bwd.cache.values()
partial = torch.empty((64, 1024), device="cuda", dtype=torch.float32)
args = (dy, x, w, rstd, dx, partial, 1 / 1024, cfg.tile_m, cfg.tile_n)
grid = (1,)
s = current_stream(0)
res = {"forward": host_us(lambda: R._forward(x, w, 1e-6)),
       "backward": host_us(lambda: R._backward(dy, x, w, rstd)),
       "bwd_bare_launch": host_us(lambda: ct.launch(s, grid, kernel, args)),
       "partial_sum": host_us(lambda: partial.sum(0)),
       "empty": host_us(lambda: torch.empty((64, 1024), device="cuda"))}


def in_thread(fn, key):
    def run():
        torch.cuda.set_device(0)
        res[key] = host_us(fn)
    t = threading.Thread(target=run)
    t.start()
    t.join()


in_thread(lambda: ct.launch(s, grid, kernel, args), "bwd_bare_launch_other_thread")
in_thread(lambda: R._backward(dy, x, w, rstd), "backward_other_thread")
print({k: round(v, 2) for k, v in res.items()})
pr = cProfile.Profile()
pr.enable()
for _ in range(300):
    R._backward(dy, x, w, rstd)
torch.cuda.synchronize()
pr.disable()
pstats.Stats(pr).sort_stats("tottime").print_stats(12)
