"""Device timing shared by the engine's search and final round and the benchmarks: L2 flushed
before every run; a search's configs sampled one after another (`search_kernels` for kernels
alone, `search_runs` for configs timed whole), a final round's and a bench row's candidates
timed in turns with CUDA events (`time_interleaved`)."""
import contextlib
import math

import torch

_flush_bufs = {}                 # device index -> 256 MiB scratch (several times any L2)


def _flush_l2():
    dev = torch.cuda.current_device()
    buf = _flush_bufs.get(dev)
    if buf is None:
        buf = _flush_bufs[dev] = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device=dev)
    buf.zero_()


_flush_times = {}          # device -> microseconds of one _flush_l2 on it


def flush_us():
    """Microseconds one L2 flush takes on the current device (the median of 5, after one
    untimed; measured once per device). A timed run's host work overlaps the flush queued
    before it, so a run's eager time holds the host's only past this."""
    dev = torch.cuda.current_device()
    us = _flush_times.get(dev)
    if us is None:
        _flush_l2()
        times = []
        for _ in range(5):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            _flush_l2()
            e.record()
            times.append((s, e))
        torch.cuda.synchronize()
        us = _flush_times[dev] = sorted(s.elapsed_time(e) for s, e in times)[2] * 1e3
    return us


def release():
    """Drop the flush buffers (the engine does after each final round: a user's process should
    not keep 256 MiB per GPU for tuning)."""
    _flush_bufs.clear()


MAX_BLOCK_RUNS = 2000        # a sustained block of a microsecond kernel: runs, not milliseconds
# A sustained block (block_ms): long enough that a heavy kernel's clock settles at its own power
# draw (the engine's final round for tensor-core keys, `bench --sustained`).
SUSTAINED_BLOCK_MS = 100.0
# Untimed runs of every candidate before the first timed block: a GPU that was idle or lightly
# loaded (compiles, host work, a search's gaps) runs its first 100-200 ms of heavy work at
# boost clocks, up to 20% faster than once the power limit holds it (H200), which would favour
# whichever candidate is timed first.
PREHEAT_MS = 300.0


def time_interleaved(candidates, rounds=5, reps=10, warmup=5, block_ms=0.0,
                     preheat_ms=PREHEAT_MS):
    """Median device time in microseconds of each (label, fn, context) candidate, L2 flushed
    before each run. The candidates take turns in blocks of `reps` runs (`rounds` times), so
    clock and power drift during a row falls on all of them alike instead of on whichever ran
    last. `context` (a context-manager factory, or None) is entered around each block, outside
    the timed events. A candidate that raises, in its warm-up or in any later run, is left out
    from then on: its label maps to the exception instead of a time, and the others are timed
    as before. Odd rounds run the candidates in reverse order.

    block_ms > 0 times the sustained regime: each block first runs its candidate untimed for
    about block_ms / 2, then times at least `reps` runs and at least block_ms / 2 of them, so
    every candidate is timed at the clock its own load settles at (the power limit, for heavy
    kernels), as long runs of one kernel in training or triton's do_bench see it, not in the
    idle gaps a slower or host-bound neighbour leaves (references/search-strategies.md, A/B
    method).

    Before the first timed block the candidates run untimed in turn for about preheat_ms in
    all (PREHEAT_MS), so that none is timed at the boost clocks of a GPU coming out of idle."""
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
    if live:
        _flush_l2()     # (its buffer first: no memory for it fails the timing, not a candidate)
    events = {label: [] for label, _, _ in live}

    def each(order, step):
        """step(label, fn, ctx) for each candidate of `order` (a copy of live); one that raises
        is out, and its timed runs with it."""
        for candidate in order:
            label, fn, ctx = candidate
            try:
                step(label, fn, ctx)
            except Exception as e:
                result[label] = e
                live.remove(candidate)
                del events[label]

    runs = {label: (0, reps) for label, _, _ in live}     # (untimed, timed) runs a block
    run_ms = {}
    if block_ms > 0 or preheat_ms > 0:
        def estimate(label, fn, ctx):
            run_ms[label] = _one_run_ms(fn, ctx)
        each(live[:], estimate)
    if block_ms > 0:
        for label, _, _ in live:
            n = min(MAX_BLOCK_RUNS, max(reps, _runs_for(block_ms / 2, run_ms[label])))
            runs[label] = (n, n)
    if preheat_ms > 0 and live:
        share = preheat_ms / len(live)

        def preheat(label, fn, ctx):
            with (ctx or contextlib.nullcontext)():
                _untimed(fn, min(MAX_BLOCK_RUNS, _runs_for(share, run_ms[label])))
        each(live[:], preheat)

    def block(label, fn, ctx):
        untimed, timed = runs[label]
        with (ctx or contextlib.nullcontext)():
            _untimed(fn, untimed)
            for _ in range(timed):
                s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                _flush_l2()
                s.record()
                fn()
                e.record()
                events[label].append((s, e))
    for r in range(rounds):
        # every other round in reverse, so that no candidate always follows the same one or
        # always comes last (a sustained rotation heats the GPU as it goes)
        each(live[:] if r % 2 == 0 else live[::-1], block)
    torch.cuda.synchronize()
    for label, pairs in events.items():
        ts = sorted(s.elapsed_time(e) * 1e3 for s, e in pairs)
        result[label] = ts[len(ts) // 2]
    return result


def _untimed(fn, n):
    """n runs of fn, each after an L2 flush, as the timed ones run, with no events."""
    for _ in range(n):
        _flush_l2()
        fn()


def _runs_for(ms, run_ms):
    return math.ceil(ms / max(run_ms, 1e-4))


def _one_run_ms(fn, ctx):
    """Milliseconds of one run with its L2 flush (what a sustained block repeats)."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with (ctx or contextlib.nullcontext)():
        s.record()
        _flush_l2()
        fn()
        e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e)


def time_us(fn, reps=50, warmup=10):
    """Median device time of fn() in microseconds (L2 flushed before each run)."""
    us = time_interleaved([("fn", fn, None)], rounds=1, reps=reps, warmup=warmup)["fn"]
    if isinstance(us, Exception):
        raise us
    return us


# The search's sampling of kernel-only configs (`search_kernels`).
SEARCH_WARMUP = 3            # untimed runs before a config's first samples (the first compiles)
SEARCH_BATCH = 5             # samples a config takes at a time, and at least
SEARCH_LEADERS = 5           # the fastest this many are sampled until their means settle
SEARCH_MAX_SAMPLES = 1000
# A config stops once its samples add up to this: at 10-15 ms a run, a settled mean needs far
# fewer than the 400 samples a 5 s budget allows under a power-capped clock's noise.
SEARCH_MAX_SAMPLING_US = 1_000_000


class NoValidConfig(ValueError):
    """Every config of a search failed; `failures` holds each one's (config, type, message)."""

    def __init__(self, message, failures):
        super().__init__(message)
        self.failures = failures


class _Sampled:
    """One config's samples: a running mean and the half-width of its 95% confidence interval
    (Welford's update); `one()` takes a sample."""
    __slots__ = ("config", "one", "n", "mean", "m2", "half")

    def __init__(self, config, one):
        self.config, self.one = config, one
        self.n, self.mean, self.m2, self.half = 0, 0.0, 0.0, 0.0

    def add(self, us):
        self.n += 1
        delta = us - self.mean
        self.mean += delta / self.n
        self.m2 += delta * (us - self.mean)
        if self.n > 1:
            self.half = 1.96 * math.sqrt(self.m2 / (self.n - 1) / self.n)

    def settled(self):
        return self.n >= SEARCH_BATCH and (
            self.half <= 0.01 * self.mean or self.half <= 0.5 or
            self.n >= SEARCH_MAX_SAMPLES or self.mean * self.n >= SEARCH_MAX_SAMPLING_US)


def search_kernels(configs, stream, grid_fn, kernel_fn, args_fn):
    """Time each config's kernel alone, as cuTile's `exhaustive_search` does (its benchmark
    primitive: one launch, L2 flushed before it, device time), sampled as `sample_configs`
    says. kernel_fn(config) gives the kernel to launch. Returns cuTile's `TuningResult`; raises
    NoValidConfig (a ValueError "No valid config ..." with the first error, as cuTile's search
    raises, and every config's in `failures`) when every config failed."""
    from cuda.tile._cext import _benchmark

    def one(cfg):
        kernel, grid = kernel_fn(cfg), grid_fn(cfg)      # (raising: the op's error)
        return lambda: _benchmark(stream, grid, kernel, args_fn(cfg), True)
    return sample_configs([(cfg, one(cfg)) for cfg in configs])


def search_runs(runs):
    """Time each (config, fn) pair's fn whole (a config whose kernel reads what an earlier
    kernel of its run writes, or whose cost includes its other kernels), one run a sample: the
    L2 flushed before it, device time by CUDA events. Sampled and returned as
    `search_kernels`."""
    return sample_configs([(cfg, lambda fn=fn: _time_one(fn)) for cfg, fn in runs])


def _time_one(fn):
    """Microseconds of device time of one run of fn, the L2 flushed before it."""
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    _flush_l2()
    s.record()
    fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e) * 1e3


def sample_configs(configs):
    """Sample each (config, one) pair, one() giving one sample in microseconds:
    SEARCH_WARMUP untimed runs, then samples in batches of SEARCH_BATCH until the mean settles
    (the 95% interval within 1% of it or 0.5 us, or SEARCH_MAX_SAMPLES samples, or
    SEARCH_MAX_SAMPLING_US of them). Only the SEARCH_LEADERS fastest must settle; another
    config samples on only while its interval reaches below the slowest of those. (cuTile's
    search counts any settled config among its leaders, a slow one that settled in its first
    batch too, and then samples every other config until it settles or has 5 s of samples:
    12-14 s of 15 s searches at 10-15 ms GEMM keys, by their records;
    references/search-strategies.md.) Returns cuTile's `TuningResult`; raises NoValidConfig
    when every config failed."""
    from cuda.tile.tune import Measurement, TuningResult
    if not configs:
        raise ValueError("Search space is empty.")
    sampled, failures = [], []

    def sample(s, runs, warmup=0):
        """`runs` more samples of s after `warmup` untimed runs; a config that raises is a
        failure, sampled no more."""
        try:
            for _ in range(warmup):
                s.one()
            for _ in range(min(runs, SEARCH_MAX_SAMPLES - s.n)):
                s.add(s.one())
        except Exception as e:
            failures.append((s.config, type(e), str(e)))
            sampled.remove(s)
    for cfg, one in configs:
        sampled.append(_Sampled(cfg, one))
        sample(sampled[-1], SEARCH_BATCH, warmup=SEARCH_WARMUP)
    while True:         # the leaders until each is settled (a batch can change who leads)
        leaders = sorted(sampled, key=lambda s: s.mean)[:SEARCH_LEADERS]
        unsettled = [s for s in leaders if not s.settled()]
        if not unsettled:
            break
        sample(unsettled[0], SEARCH_BATCH)
    if leaders:
        cutoff = leaders[-1].mean
        for s in list(sampled):
            while s in sampled and not s.settled() and s.mean - s.half < cutoff:
                sample(s, SEARCH_BATCH)
    done = [Measurement(config=s.config, mean_us=s.mean, error_margin_us=s.half,
                        num_samples=s.n) for s in sampled]
    if not done:
        cfg, etype, msg = failures[0]
        raise NoValidConfig(f"No valid config found in search space.\nConfig: {cfg}\n"
                            f"{etype.__name__}: {msg}", tuple(failures))
    return TuningResult(best=min(done, key=lambda m: m.mean_us), successes=tuple(done),
                        failures=tuple(failures))
