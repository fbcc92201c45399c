"""tiletune: cuTile kernels that tune themselves once per shape, cache the winner, and launch it.

Ops live in `tiletune.ops` (e.g. `from tiletune.ops.rms_norm import rms_norm`); the engine that
tunes them is public, for your own cuTile kernels too:

    from tiletune import Autotuner
    tuner = Autotuner("my_op", my_kernel, my_configs,
                      default=SimpleNamespace(tile=64, occupancy=2),
                      space=lambda x, y: dict(n=x.shape[1]),
                      grid=lambda cfg, dev, x, y: (cdiv(x.shape[0], cfg.tile),),
                      args=lambda cfg, x, y: (x, y, cfg.tile))
    tuner.launch(key, x.get_device(), x, y)      # tunes on the first call of a key

Environment: DISABLE_AUTOTUNE=1 (no search: each op's first, default config),
TILETUNE_CACHE_DIR (persistent store; `off` disables), TILETUNE_SHIPPED (`off`: ignore the
winners shipped with the package, used where the store has no row; a folder or .json file: read
those instead), TILETUNE_LOG=1 (log each tuning at INFO; 0: silent).
"""
import os as _os

from tiletune.autotune import (Autotuner, TuningFailedError, TuningRecord, Work, bucket,
                               bucketed, clear_cache, disabled, records, tuners)
from tiletune.device import arch
from tiletune.space import cdiv, next_pow2

__version__ = "0.1.0"

__all__ = ["Autotuner", "TuningFailedError", "TuningRecord", "Work", "arch", "bucket", "bucketed",
           "cdiv", "clear_cache", "disabled", "next_pow2", "records", "start_compile_workers",
           "tuners"]


def start_compile_workers(n=None):
    """Start the processes that compile a search's configs (TILETUNE_COMPILE_JOBS of them, or
    n) now, in the background, so that they are ready for this process's first search, which
    otherwise compiles in its own threads (tracing one config at a time) for the seconds they
    take to start: call it at the top of a training script whose keys may miss the store.
    Workers left without work exit after two minutes. A no-op where parallel compiles are off
    (TILETUNE_COMPILE_JOBS 0 or 1, or cuTile's disk cache disabled)."""
    from tiletune import precompile
    if n is not None and (isinstance(n, bool) or not isinstance(n, int)):
        raise TypeError(f"start_compile_workers: n must be an int or None, got "
                        f"{type(n).__name__}")
    if n is not None and n < 1:
        raise ValueError(f"start_compile_workers: n must be at least 1, got {n}")
    precompile.warm(n)


# In a source checkout, ops/, suites/ and cases/ sit beside this package and install as its
# subpackages (pyproject's package-dir). When this folder is what Python imports (the repo root
# is the working directory, whatever was installed), find them there too.
_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "ops", "__init__.py")) and \
        _os.path.isfile(_os.path.join(_root, "pyproject.toml")):
    __path__.append(_root)
