"""Does precompiling pay? Tunes a few keys in a fresh process (empty CUDA_TILE_CACHE_DIR expected)
and prints, per search, its wall time and the part spent precompiling (TILETUNE_LOG=1 for more).
It also records every signature the JIT compiles and every one the workers compiled, and prints
the JIT signatures no worker compiled (those are the disk-cache misses), parameter by parameter."""
import time

import cuda.tile._execution as _execution
import torch

import tiletune
from tiletune import precompile

jit_signatures, worker_params = [], []
_jit_compile = _execution.kernel._compile


def _recording_compile(self, signature, context, compute_capability=None):
    jit_signatures.append((self._pyfunc.__name__, signature))
    return _jit_compile(self, signature, context, compute_capability)


_execution.kernel._compile = _recording_compile
_run_jobs = precompile.run_jobs


def _recording_run_jobs(jobs_list, *a, **k):
    worker_params.extend((name, tuple(params)) for _, _, name, _, params, _ in jobs_list)
    return _run_jobs(jobs_list, *a, **k)


precompile.run_jobs = _recording_run_jobs
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
compiled = worker_params          # a list: constraints compare by value
missed = [(n, sig) for n, sig in jit_signatures if (n, tuple(sig.parameters)) not in compiled]
print(f"JIT compiles: {len(jit_signatures)}, not precompiled: {len(missed)}")
for name, sig in missed[:3]:
    near = [p for n, p in worker_params if n == name]
    print(f"  {name}: JIT {sig.calling_convention}")
    for i, param in enumerate(sig.parameters):
        if near and near[0][i] != param and type(param).__name__ == "ArrayConstraint":
            print(f"    param {i}: JIT    {param}\n             worker {near[0][i]}")
