"""tiletune: cuTile kernels that tune themselves once per shape, cache the winner, and launch it.

Ops live in `tiletune.ops` (e.g. `from tiletune.ops.rms_norm import rms_norm`); the engine that
tunes them is public, for your own cuTile kernels too:

    from tiletune import Autotuner, Search
    tuner = Autotuner("my_op", my_kernel, my_configs, default=SimpleNamespace(occupancy=2))
    cfg, kernel = tuner.cache.get(key) or tuner.tune(key, x, Search(shape=..., grid_fn=...,
                                                                       args_fn=...))
    ct.launch(stream, grid(cfg), kernel, args)

Environment: DISABLE_AUTOTUNE=1 (no search: each op's first, default config),
TILETUNE_CACHE_DIR (persistent store; `off` disables), TILETUNE_LOG=1 (log each tuning at INFO).
"""
from tiletune.autotune import (Autotuner, Search, TuningFailedError, TuningRecord, Work, bucket,
                               clear_cache, disabled, next_pow2, records, tuners)
from tiletune.device import arch

__version__ = "0.1.0"

__all__ = ["Autotuner", "Search", "TuningFailedError", "TuningRecord", "Work", "arch", "bucket",
           "clear_cache", "disabled", "next_pow2", "records", "tuners"]

OPS = ("rms_norm", "rope", "rms_norm_rope", "matmul", "fmha")   # op modules under tiletune.ops, in the order the CLI runs them
