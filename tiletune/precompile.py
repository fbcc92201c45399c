"""Compile a search's configs in parallel before the search times them.

`exhaustive_search` JIT-compiles its configs one after another, and one compile is 0.3-5 s of
tileiras. Before a search, the engine hands every config's kernel and JIT signature (read off the
search's real arguments) to a pool of worker processes that compile them at once; each compile
lands in cuTile's on-disk cubin cache (`CUDA_TILE_CACHE_DIR`), so the search's own compiles are
cache hits. Threads would not help: cuTile serializes compiles within one process.

Worker processes are spawned (never forked: the parent holds a CUDA context and threads), kept
for the life of the process, and import only the kernels' own modules. `TILETUNE_COMPILE_JOBS`
sets their number (default: CPU count, at most 16); 0 or 1, or a disabled cuTile disk cache,
turns precompiling off and the search compiles serially as before.
"""
import io
import logging
import os
import sys
import time

log = logging.getLogger("tiletune")

_pool = None


def jobs():
    env = os.environ.get("TILETUNE_COMPILE_JOBS", "").strip()
    if env:
        return max(int(env), 0)
    return min(os.cpu_count() or 1, 16)


def disk_cache_dir():
    from cutile_cache._env import get_cache_dir_from_env
    return get_cache_dir_from_env()


def enabled():
    return jobs() > 1 and disk_cache_dir() is not None


def _executor():
    global _pool
    if _pool is None:
        import multiprocessing
        from concurrent.futures import ProcessPoolExecutor
        _pool = ProcessPoolExecutor(jobs(), mp_context=multiprocessing.get_context("spawn"))
    return _pool


def kernel_location(kernel):
    """(module, attribute) under which a worker process finds this very kernel, or None."""
    fn = kernel._pyfunc
    module = sys.modules.get(fn.__module__)
    if fn.__module__ == "__main__" or module is None or getattr(module, fn.__name__, None) is not kernel:
        return None
    return fn.__module__, fn.__name__


def compile_worker(module, name, hints, params, calling_convention, arch, timeout_sec):
    """In a worker: compile module.name with these hints for one signature. Returns None, or
    (error type name, message, whether it is cuTile's verdict on the kernel)."""
    import importlib
    import cuda.tile as ct
    from cuda.tile.compilation import CallingConvention, KernelSignature, export_kernel
    kernel = getattr(importlib.import_module(module), name).replace_hints(**hints)
    sig = KernelSignature(list(params), CallingConvention.from_code(calling_convention))
    try:
        with ct.compiler_timeout(timeout_sec):
            export_kernel(kernel, [sig], io.BytesIO(), gpu_code=arch, output_format="cubin")
    except Exception as e:
        return type(e).__name__, str(e), isinstance(e, ct.TileError)
    return None


def precompile(items, arch, timeout_sec):
    """items: [(bare kernel, hints dict, launch args)]. Compiles them in parallel into the disk
    cache. Returns {index: (error type, message)} for items the compiler rejected; items that
    could not be sent to a worker are left for the search to compile itself."""
    from cuda.tile.compilation import CallingConvention, KernelSignature
    cc = CallingConvention.cutile_python_v2()
    t0 = time.perf_counter()
    futures = {}
    for i, (kernel, hints, args) in enumerate(items):
        where = kernel_location(kernel)
        if where is None:
            continue
        try:
            sig = KernelSignature.from_kernel_args(kernel, args, cc)
        except Exception:         # an argument the signature reader does not know: JIT decides
            continue
        futures[i] = _executor().submit(compile_worker, *where, hints, sig.parameters, cc.code,
                                        arch, timeout_sec)
    errors = {}
    for i, fut in futures.items():
        try:
            err = fut.result(timeout=timeout_sec + 60)
        except Exception as e:        # worker trouble is not a verdict on the config
            log.warning("tiletune: precompile worker failed (%s: %s); the search compiles "
                        "serially", type(e).__name__, e)
            continue
        if err is not None and err[2]:
            errors[i] = err[:2]
    log.info("precompiled %d of %d configs for %s in %.1fs (%d rejected)", len(futures),
             len(items), arch, time.perf_counter() - t0, len(errors))
    return errors
