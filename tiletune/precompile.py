"""Compile a search's configs in parallel before the search times them.

`exhaustive_search` JIT-compiles its configs one after another, and cuTile holds one global lock
per process around every compile: a 28-config matmul search on ragged shapes spent 67-86 s of
its wall time compiling (H200 machine, 16 cores, measured). Before a search, the engine hands
each config's kernel and JIT signature (read off the search's real arguments) to worker
processes that compile them at once with the public `export_kernel`; every cubin lands in
cuTile's on-disk cache (`CUDA_TILE_CACHE_DIR`), so the search's own compiles are cache hits.

Workers are plain subprocesses (`python -m tiletune.precompile`) fed a pickled job list on stdin:
no multiprocessing, so nothing re-imports the user's main script, and no fork of a process that
holds a CUDA context. They import only the kernels' own modules and never touch the GPU.
`TILETUNE_COMPILE_JOBS` sets how many run at once (default: CPU count, at most 16); 0 or 1, or a
disabled cuTile disk cache, turns this off and the search compiles serially.

A config cuTile rejects here (a TileError: bad tile shape, compiler error, compile timeout) is
reported as that config's failure and not searched. Parallel compiles run slower each, so a
config near the compile timeout may time out here that would just pass serially; such tiles
are too slow to compile to belong in a space anyway.
"""
import io
import logging
import os
import pickle
import subprocess
import sys
import time

log = logging.getLogger("tiletune")


def jobs():
    """How many compile processes: TILETUNE_COMPILE_JOBS (below 0 counts as 0), by default the
    CPU count, at most 16. A value that is not an integer (e.g. auto) warns once and is the
    default."""
    from tiletune import env
    return max(env.integer("TILETUNE_COMPILE_JOBS", min(os.cpu_count() or 1, 16)), 0)


def enabled():
    from cutile_cache._env import get_cache_dir_from_env
    return jobs() > 1 and get_cache_dir_from_env() is not None


def kernel_location(kernel):
    """(module, attribute) under which another process finds this very kernel, or None."""
    fn = kernel._pyfunc
    module = sys.modules.get(fn.__module__)
    if fn.__module__ == "__main__" or getattr(module, fn.__name__, None) is not kernel:
        return None
    return fn.__module__, fn.__name__


def compile_job(module, name, hints, params, calling_convention, arch, timeout_sec):
    """Compile module.name with these hints for one signature. Returns None, or (error type
    name, message, whether it is cuTile's verdict on the kernel rather than trouble here)."""
    import importlib
    import cuda.tile as ct
    from cuda.tile.compilation import CallingConvention, KernelSignature, export_kernel
    try:
        kernel = getattr(importlib.import_module(module), name).replace_hints(**hints)
        sig = KernelSignature(list(params), CallingConvention.from_code(calling_convention))
        with ct.compiler_timeout(timeout_sec):
            export_kernel(kernel, [sig], io.BytesIO(), gpu_code=arch, output_format="cubin")
    except Exception as e:
        return type(e).__name__, str(e), isinstance(e, ct.TileError)
    return None


def run_jobs(jobs_list, arch, timeout_sec, workers):
    """Compile [(index, module, name, hints, params, cc code)] in `workers` subprocesses.
    Returns {index: None or error tuple}; jobs whose worker died are missing."""
    chunks = [jobs_list[i::workers] for i in range(workers)]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    procs = []
    for chunk in chunks:
        p = subprocess.Popen([sys.executable, "-m", "tiletune.precompile", arch, str(timeout_sec)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.DEVNULL, env=env)
        p.stdin.write(pickle.dumps(chunk))
        p.stdin.close()
        p.stdin = None            # so communicate() below only reads
        procs.append(p)
    results = {}
    deadline = time.monotonic() + max(len(c) for c in chunks) * timeout_sec + 120
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(deadline - time.monotonic(), 1))
            results.update(pickle.loads(out))
        except Exception as e:     # worker trouble is not a verdict on the configs
            p.kill()
            log.warning("tiletune: a precompile worker failed (%s); the search compiles its "
                        "configs itself", type(e).__name__)
    return results


def precompile(items, arch, timeout_sec):
    """items: [(bare kernel, hints dict, launch args)]. Compiles them in parallel into the disk
    cache. Returns {index: (error type, message)} for items the compiler rejected; items that
    cannot be located or signed are left for the search to compile."""
    from cuda.tile.compilation import CallingConvention, KernelSignature
    cc = CallingConvention.cutile_python_v2()
    t0 = time.perf_counter()
    work = []
    for i, (kernel, hints, args) in enumerate(items):
        where = kernel_location(kernel)
        if where is None:
            continue
        try:
            sig = KernelSignature.from_kernel_args(kernel, args, cc)
        except Exception:         # an argument the signature reader does not know: JIT decides
            continue
        work.append((i, *where, hints, sig.parameters, cc.code))
    if not work:
        return {}
    results = run_jobs(work, arch, timeout_sec, min(jobs(), len(work)))
    rejected = {i: err[:2] for i, err in results.items() if err is not None and err[2]}
    log.info("precompiled %d of %d configs for %s in %.1fs (%d rejected)", len(results),
             len(items), arch, time.perf_counter() - t0, len(rejected))
    return rejected


def _worker_main():
    arch, timeout_sec = sys.argv[1], float(sys.argv[2])
    result_pipe, sys.stdout = sys.stdout.buffer, sys.stderr   # stray prints must not corrupt it
    chunk = pickle.loads(sys.stdin.buffer.read())
    result_pipe.write(pickle.dumps({i: compile_job(*job, arch, timeout_sec) for i, *job in chunk}))


if __name__ == "__main__":
    _worker_main()
