"""Does precompiling pay? Tunes a few keys in a fresh process (empty CUDA_TILE_CACHE_DIR expected)
and prints, per search, its wall time and the part spent precompiling (TILETUNE_LOG=1 for more)."""
import time

import torch

import tiletune
from tiletune import precompile

spent = []
_orig = precompile.precompile


def _timed(*a, **k):
    t0 = time.perf_counter()
    try:
        return _orig(*a, **k)
    finally:
        spent.append(time.perf_counter() - t0)


precompile.precompile = _timed
from tiletune.ops.matmul import matmul          # noqa: E402
from tiletune.ops.rms_norm import rms_norm      # noqa: E402


def rms_small():
    x = torch.randn(3, 7, device="cuda", requires_grad=True)
    w = torch.rand(7, device="cuda", requires_grad=True)
    rms_norm(x, w).sum().backward()


def mm_batched():
    a = torch.randn(3, 130, 70, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(3, 70, 90, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    matmul(a, b).sum().backward()


for name, fn in (("rms_norm 3x7 f32 fwd+bwd", rms_small), ("matmul batched fwd+bwd", mm_batched)):
    n0 = len(spent)
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    print(f"{name}: {time.perf_counter() - t0:.1f}s total, precompile "
          f"{' '.join(f'{s:.1f}' for s in spent[n0:])}s", flush=True)
for op, recs in tiletune.records().items():
    for key, r in recs.items():
        print(f"  {op} {key}: search {r.search_s:.1f}s, {len(r.timings)} timed, "
              f"{len(r.failures)} failed, best {r.config}")
