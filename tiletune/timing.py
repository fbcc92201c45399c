"""Device timing shared by the engine's final round and the benchmarks: CUDA events, L2 flushed
before every run, candidates timed in turns."""
import contextlib

import torch

_flush_bufs = {}                 # device index -> 256 MiB scratch (several times any L2)


def _flush_l2():
    dev = torch.cuda.current_device()
    buf = _flush_bufs.get(dev)
    if buf is None:
        buf = _flush_bufs[dev] = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=dev)
    buf.zero_()


def release():
    """Drop the flush buffers (the engine does after each final round: a user's process should
    not keep 256 MiB per GPU for tuning)."""
    _flush_bufs.clear()


def time_interleaved(candidates, rounds=5, reps=10, warmup=5):
    """Median device time in microseconds of each (label, fn, context) candidate, L2 flushed
    before each run. The candidates take turns in blocks of `reps` runs (`rounds` times), so
    clock and power drift during a row falls on all of them alike instead of on whichever ran
    last. `context` (a context-manager factory, or None) is entered around each block, outside
    the timed events. A candidate whose warm-up raises is left out: its label maps to the
    exception instead of a time."""
    result, live = {}, []
    for label, fn, ctx in candidates:
        try:
            with (ctx or contextlib.nullcontext)():
                for _ in range(warmup):
                    fn()
            live.append((label, fn, ctx))
        except Exception as e:
            result[label] = e
    torch.cuda.synchronize()
    events = {label: [] for label, _, _ in live}
    for _ in range(rounds):
        for label, fn, ctx in live:
            with (ctx or contextlib.nullcontext)():
                for _ in range(reps):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    _flush_l2()
                    s.record()
                    fn()
                    e.record()
                    events[label].append((s, e))
    torch.cuda.synchronize()
    for label, pairs in events.items():
        ts = sorted(s.elapsed_time(e) * 1e3 for s, e in pairs)
        result[label] = ts[len(ts) // 2]
    return result


def time_us(fn, reps=50, warmup=10):
    """Median device time of fn() in microseconds (L2 flushed before each run)."""
    us = time_interleaved([("fn", fn, None)], rounds=1, reps=reps, warmup=warmup)["fn"]
    if isinstance(us, Exception):
        raise us
    return us
