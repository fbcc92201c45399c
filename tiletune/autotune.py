"""The tune-once / cache / launch engine.

An op declares, per kernel family, one `Autotuner`: the kernel, its config space, and what a
launch needs (grid, arguments, optionally scratch, a multi-launch run, the work done). Its
wrapper then makes one call per launch:

    tuner.launch(key, device_index, *inputs)

That call is the whole fast path: one dict lookup of the key's launch plan (kernel, grid,
config), the arguments, `ct.launch`. A miss maps the key to its tuning key (dynamic sizes
bucketed) and, where that misses too, goes through `tune`: DISABLE_AUTOTUNE=1 -> the first
config; else the persistent store; else a search over the op's configs
(`timing.search_kernels`, compiled in parallel first, see tiletune/precompile.py), then a final
round that times its close finishers and the default in turns (sustained blocks for long
tensor-core kernels); then `replace_hints` once and cache.
"""
import contextlib
import dataclasses
import functools
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import threading
import time
import warnings
from types import SimpleNamespace
from typing import Callable, Optional

try:
    import fcntl
except ImportError:             # (not POSIX: searches take no cross-process lock)
    fcntl = None

import cuda.tile as ct
import torch

from tiletune import device as _device
from tiletune import distributed
from tiletune import env
from tiletune import precompile
from tiletune import store
from tiletune import timing
from tiletune.space import INT32_MAX, next_pow2

log = logging.getLogger("tiletune")


# Errors of a stored winner's first launch that say nothing about the config: raised to the
# caller, the store entry kept.
_NOT_THE_CONFIG = (ValueError, TypeError, torch.OutOfMemoryError,
                   ct.TileCompilerTimeoutError)


# What a launch reports after an earlier kernel faulted (launches are asynchronous, so a fault
# of the config itself shows at a later synchronization, never at its own first launch): the
# context is lost, and the launched config is not to blame.
_STICKY_FAULTS = ("ILLEGAL_ADDRESS", "illegal memory access", "LAUNCH_FAILED",
                  "unspecified launch failure", "MISALIGNED_ADDRESS", "misaligned address",
                  "ILLEGAL_INSTRUCTION", "illegal instruction", "HARDWARE_STACK_ERROR",
                  "device-side assert", "ECC_UNCORRECTABLE", "uncorrectable ECC")


def _earlier_fault(error):
    text = str(error)
    return any(s in text for s in _STICKY_FAULTS)


def _configure_logging():
    """TILETUNE_LOG=1: every tuning at INFO on a handler of the `tiletune` logger only;
    TILETUNE_LOG=0: silent, even the one line a long search prints. The user's root logger is
    never touched."""
    level = os.environ.get("TILETUNE_LOG", "").strip()
    if level and env.flag_off(level):
        log.setLevel(logging.ERROR)
    elif level:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(name)s: %(message)s"))
        log.addHandler(handler)
        log.propagate = False      # (a root handler of the application would print it twice)
        log.setLevel(logging.INFO)


_configure_logging()

MAX_CONFIGS = 30
# The final round: the search's configs within FINAL_MARGIN of its best (at most FINALISTS) and
# the default are timed again, in turns, over a longer stretch. The search takes a few
# samples per config one config after another; on an H200 under sustained load its ranking of
# heavy GEMMs did not hold (a config 1% ahead in the search ran 7% behind the default when timed
# in turns): the final round decides.
FINAL_MARGIN = 0.05
FINALISTS = 4
# A sustained final round (below) takes the FINALISTS fastest whatever their distance: kernel
# times sampled one config after another rank heavy GEMMs against their sustained clocks
# coarsely. H100, gated_mlp_dx 16384 x 4096 -> 14336: one search put the 2-CTA 256x256 config
# 6.0% behind its best, out of the 5% margin, and kept a config that an earlier search's
# sustained round (another H100; that config 1.1% behind there) had timed 9% slower (5949.95
# against 5405.60 us); in the H100 shipped file 5 sustained winners stood 5.1-20.1% behind
# their searches' best. A finalist costs about SUSTAINED_FINAL_ROUNDS blocks of 100 ms.
# The default keeps its place unless a finalist leads it in the final round by more than
# KEEP_DEFAULT_MARGIN: one config timed twice in one process reads up to ~2% apart, and a pick
# that leads by less than that need not lead when timed again (grouped GEMM on an H100: picks
# 0.1-1.1% ahead of the default in their sustained final rounds ran level with it sustained and
# under do_bench, and from 2% behind to 7% ahead of it in turns; references/search-strategies.md,
# The final round).
KEEP_DEFAULT_MARGIN = 0.02
# Tensor-core keys of at least SUSTAINED_FINAL_US run their final round sustained: each finalist
# in blocks of timing.SUSTAINED_BLOCK_MS, so its clock settles at its own power draw, as in a
# training loop's long stretches of GEMMs (and triton's do_bench). Short blocks in turns let
# the power-hungry configs run at the clock their neighbours' idle gaps leave: on an H200 the
# grouped GEMM's 128x128 configs ran 5-17% slower sustained than in turns while its 128x256
# ones held within 1.3% at the DeepSeek-like keys, which reverses their ranking
# (references/search-strategies.md, A/B method). The sustained round starts after
# timing.PREHEAT_MS of untimed runs (after the search's idle compiles the card runs its first
# 100-200 ms of heavy work at boost clocks) and takes three rounds: with two and no pre-heat,
# one H200 bench's final rounds timed the default 10-20% over its own bench rows at two grouped
# keys and chose configs that those rows put 1-5% behind it.
SUSTAINED_FINAL_US = 100.0
SUSTAINED_FINAL_ROUNDS = 3
# (a compile's timeout reaches the poll() of subprocess.run in milliseconds, a C int: past
# about 24 days every compile raised OverflowError, and the search failed every config)
MAX_COMPILE_TIMEOUT_SEC = 1e6
COMPILE_TIMEOUT_SEC = env.number("TILETUNE_COMPILE_TIMEOUT_SEC", 60.0,
                                 maximum=MAX_COMPILE_TIMEOUT_SEC)


# cuTile's compile timeout is one setting of the process, not of a thread (ct.compiler_timeout
# saves and restores it): searches on several GPUs at once share one entry of it, the first
# setting it and the last putting back what was there. (Each entering its own, one search
# ending left the other compiling without a timeout, and the timeout set for good after both.)
_timeout_guard = threading.Lock()
_timeout_held = []          # [the entered ct.compiler_timeout, number of searches inside it]


@contextlib.contextmanager
def _compile_timeout():
    """ct.compiler_timeout(COMPILE_TIMEOUT_SEC) around a search's compiles, shared with the
    searches running at the same time in other threads."""
    with _timeout_guard:
        if not _timeout_held:
            setting = ct.compiler_timeout(COMPILE_TIMEOUT_SEC)
            setting.__enter__()
            _timeout_held[:] = [setting, 0]
        _timeout_held[1] += 1
    try:
        yield
    finally:
        with _timeout_guard:
            _timeout_held[1] -= 1
            if not _timeout_held[1]:
                setting = _timeout_held.pop(0)
                _timeout_held.clear()
                setting.__exit__(None, None, None)


# A search that takes longer than this says so in one line (op, key, seconds, winner) even
# without TILETUNE_LOG, so a slow first call does not look like a hang.
LONG_SEARCH_SEC = 2.0

# One lock per device: two searches on one GPU would disturb each other's timings; searches on
# different GPUs run at once.
_search_locks = {}
_search_locks_guard = threading.Lock()


def _search_lock(dev):
    if isinstance(dev, int):
        index = dev
    elif isinstance(dev, torch.device):
        index = dev.index or 0
    else:
        index = str(dev)
    lock = _search_locks.get(index)
    if lock is None:
        with _search_locks_guard:
            lock = _search_locks.setdefault(index, threading.RLock())
    return lock


# Processes that share a store and a GPU (serving workers on one card, two jobs of one user)
# would time their searches on top of each other and save winners of disturbed timings: a file
# lock per physical GPU in the store's folder takes their searches in turns, and a process
# reads the store again once it holds the lock (the other's winner, if it searched the same
# key). Best effort: no store, no fcntl, a folder that cannot hold the file, or a wait past
# GPU_LOCK_WAIT_SEC (after which this process stops taking that lock) searches without it.
# Not taken in a job of several ranks (set_process_group): they agree through the group.
GPU_LOCK_WAIT_SEC = env.number("TILETUNE_GPU_LOCK_WAIT_SEC", 300.0)
_gpu_locks = threading.local()    # .held: this thread's {lock path: [descriptor, depth]}
_gpu_lock_fds = set()             # every descriptor holding a GPU lock in this process
_gpu_locks_given_up = set()       # paths held past the wait limit once: not waited for again


@contextlib.contextmanager
def _gpu_turn(dev, what):
    """This process's turn to search on dev's GPU. Re-entrant within a thread (flock on a
    second descriptor of one file would wait for this process itself); another thread of this
    process waits for it as another process would."""
    folder, gpu = store.cache_dir(), _device.uuid(dev)
    if folder is None or gpu is None or fcntl is None:
        yield
        return
    path = os.path.join(folder, f"gpu-{gpu}.lock")
    held = getattr(_gpu_locks, "held", None)
    if held is None:
        held = _gpu_locks.held = {}
    if path in held:
        held[path][1] += 1
        try:
            yield
        finally:
            held[path][1] -= 1
        return
    fd = None
    try:
        fd = _take_gpu_lock(path, what)
        held[path] = [fd, 1]
        yield
    finally:
        held.pop(path, None)
        if fd is not None:
            _gpu_lock_fds.discard(fd)
            os.close(fd)                # (closing releases the lock)


def _take_gpu_lock(path, what):
    """A descriptor holding the lock at path, or None where it cannot be taken (searched
    without it). An interrupt while waiting closes the descriptor."""
    if path in _gpu_locks_given_up:
        return None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)    # flock takes a read-only one too
        except OSError:
            return None
    try:
        if _try_flock(fd):
            _gpu_lock_fds.add(fd)
            return fd
        log.warning("tiletune: %s: waiting for another process's search on this GPU (lock "
                    "file %s; at most %.0f s, TILETUNE_GPU_LOCK_WAIT_SEC)", what, path,
                    GPU_LOCK_WAIT_SEC)
        deadline = time.monotonic() + GPU_LOCK_WAIT_SEC
        while time.monotonic() < deadline:
            time.sleep(0.02)
            if _try_flock(fd):
                _gpu_lock_fds.add(fd)
                return fd
    except OSError as error:
        # flock itself refused (ENOSYS, ENOLCK, EOPNOTSUPP: a Lustre mount without -o flock,
        # NFS without its lock daemon): the lock is best effort, so search without it
        os.close(fd)
        _gpu_locks_given_up.add(path)
        env.warn_once(("tiletune.gpu_lock", path),
                      f"tiletune: {what}: this GPU's search lock ({path}) cannot be taken on "
                      f"its filesystem ({error}); this process searches without it, so "
                      "searches of other processes on this GPU may disturb its timings")
        return None
    except BaseException:
        os.close(fd)
        raise
    os.close(fd)
    _gpu_locks_given_up.add(path)
    env.warn_once(("tiletune.gpu_lock", path),
                  f"tiletune: {what}: another process held this GPU's search lock ({path}) for "
                  f"more than {GPU_LOCK_WAIT_SEC:.0f} s (TILETUNE_GPU_LOCK_WAIT_SEC); this "
                  "process now searches without it, so searches of the two may disturb each "
                  "other's timings")
    return None


def _try_flock(fd):
    """Whether the lock was taken now (an error other than "held elsewhere" raises)."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _after_fork_in_child():
    """A child forked while some thread searched holds a copy of that search's lock descriptor,
    which would keep the parent's GPU lock taken for as long as the child lives, and a copy of
    the search lock no thread of the child will release: closed and replaced."""
    global _search_locks, _search_locks_guard, _gpu_locks, _timeout_guard
    for fd in _gpu_lock_fds:
        with contextlib.suppress(OSError):
            os.close(fd)
    _gpu_lock_fds.clear()
    _gpu_locks = threading.local()
    _search_locks, _search_locks_guard = {}, threading.Lock()
    _timeout_guard = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


_searches_must_decide = 0      # > 0: inside searches_must_decide()


@contextlib.contextmanager
def searches_must_decide():
    """Within it, a first launch whose search failed for the moment raises TuningFailedError
    instead of running the default config: for `tune` and `bench`, whose output is the
    searches' winners (a default standing in would read as tuned)."""
    global _searches_must_decide
    _searches_must_decide += 1
    try:
        yield
    finally:
        _searches_must_decide -= 1


ERROR_LINES = 20      # of an error message, in a TuningFailedError and a compile report


def message_lines(message):
    """The non-blank lines of an error's message, at most ERROR_LINES (then one saying how many
    more): a compiler error's first line is "Return code 1", and what tileiras said comes
    after it, so the first line alone tells nothing."""
    lines = [line.rstrip() for line in str(message).splitlines() if line.strip()]
    if len(lines) > ERROR_LINES:
        lines = lines[:ERROR_LINES] + [f"... ({len(lines) - ERROR_LINES} more lines)"]
    return lines


FULL_MESSAGES = 3     # distinct failure messages a TuningFailedError gives in full


class TuningFailedError(RuntimeError):
    """Every config failed. `.failures` is a list of (config, error type name, message).

    The text gives each config's error with its message's lines (a compiler error's first line
    is "Return code 1"; what the compiler said follows it), FULL_MESSAGES distinct ones in full:
    a message given for an earlier config, and those past the first FULL_MESSAGES, by their
    first line (the whole of each is in `.failures`)."""

    def __init__(self, op, key, failures):
        self.op, self.key, self.failures = op, key, list(failures)
        lines, given = [f"tiletune: every config of {op} failed for key {key}:"], set()
        for cfg, etype, msg in self.failures:
            text = message_lines(msg or "") or [""]
            said = (etype, tuple(text))
            if len(text) > 1 and (said in given or len(given) >= FULL_MESSAGES):
                lines.append(f"  {cfg}: {etype}: {text[0]} (the rest "
                             f"{'as above' if said in given else 'in .failures'})")
                continue
            lines.append(f"  {cfg}: {etype}: {text[0]}")
            lines += [f"    {line}" for line in text[1:]]
            if len(text) > 1:
                given.add(said)
        super().__init__("\n".join(lines))


def disabled():
    """True when DISABLE_AUTOTUNE=1: misses take the op's first (default) config, no search.
    A value that is neither on nor off (2, y) warns once and is off."""
    value = os.environ.get("DISABLE_AUTOTUNE")
    if env.flag_on(value):
        return True
    if value is not None and not env.flag_off(value):
        env.warn_once(("DISABLE_AUTOTUNE", value),
                      f"tiletune: DISABLE_AUTOTUNE={value!r} is neither on (1, on, yes, true) nor "
                      "off (0, off, no, false, or blank): autotuning stays on")
    return False


def bucket(n):
    """Dynamic dims (tokens = batch x seq) are keyed by their next power of two."""
    return next_pow2(n)


def bucketed(*positions):
    """A `tune_key`: the launch key with the sizes at `positions` bucketed."""
    def tune_key(key):
        key = list(key)
        for i in positions:
            key[i] = next_pow2(key[i])
        return tuple(key)
    return tune_key


def config_dict(cfg):
    return dict(vars(cfg)) if isinstance(cfg, SimpleNamespace) else dict(cfg)


@dataclasses.dataclass
class Work:
    """What one launch moves and computes, for achieved GB/s and TFLOP/s in the records."""
    bytes: float = 0.0
    flops: float = 0.0

    def rates(self, us):
        out = {}
        if self.bytes:
            out["gb_per_s"] = self.bytes / us / 1e3
        if self.flops:
            out["tflop_per_s"] = self.flops / us / 1e6
        return out


def _work_size(work):
    """One number for a launch's work (its FLOPs, else its bytes), or None."""
    return None if work is None else (work.flops or work.bytes or None)


def _at_size(timings, size):
    """Timings of a job's ranks, taken at each rank's real size (which a bucketed key shares),
    scaled to `size` (the concluding rank's) in proportion to their work: ranked side by side
    raw, the configs a smaller rank timed would look faster than they are."""
    if not size:
        return timings
    out = []
    for t in timings:
        work = t.get("work")
        if work and work != size:
            t = dict(t, mean_us=t["mean_us"] * size / work,
                     error_us=t.get("error_us", 0.0) * size / work)
        out.append(t)
    return out


def _compiler_gave_no_verdict(error, message):
    """A compile that timed out, or whose compiler a signal ended ("Return code -9": killed,
    as the operating system's out-of-memory killer does), says nothing about the config."""
    return error == "CompilerTimeoutError" or (
        error == "CompilerExecutionError" and message.startswith("Return code -"))


def _of_the_moment(failures):
    """Every failure of a search ((error type name, message) pairs) says nothing about its
    config: the GPU's memory was full (the search's buffers), or a compile timed out or was
    killed. Such a key is searched again at its next call instead of failing for the
    process."""
    return all(error == "OutOfMemoryError" or _compiler_gave_no_verdict(error, message)
               for error, message in failures)


@dataclasses.dataclass
class Search:
    """What a miss needs to search one key; built only on a miss.

    shape:   keyword arguments for the op's config generator (besides `arch`).
    grid_fn: cfg -> grid.  args_fn: cfg -> kernel args (cheap: called for every sample;
             search with scratch outputs, split buffers for in-place kernels, never clones).
    work:    bytes/FLOPs of one launch, for the record's achieved rate.
    run_fn:  (cfg, kernel) -> None, for configs that launch more than their kernel (split-K's
             reduction): the final round times it instead of one launch of the kernel.
    partly_timed: cfg -> bool, True where the search's time leaves out part of the config's
             launch sequence (split-K's sum kernel). Such times are lower bounds, so the final
             round's margin counts from the fastest fully timed config, which always joins it.
    timed_by_run: cfg -> bool, True for configs the search times through run_fn: a kernel that
             cannot run alone (it reads what an earlier kernel of run_fn writes), or one whose
             later launches cost too unevenly across configs for a lower bound to rank them.
    """
    shape: dict
    grid_fn: Callable
    args_fn: Callable
    work: Optional[Work] = None
    run_fn: Optional[Callable] = None
    partly_timed: Optional[Callable] = None
    timed_by_run: Optional[Callable] = None


def _sampled(sample, index):
    """(timings, failures) in `Autotuner._measure`'s form from one of timing's searches:
    `sample()` returns a TuningResult or raises NoValidConfig with every config's error;
    index(config) is the config's index in the key's config list."""
    try:
        result = sample()
        successes, failed = result.successes, result.failures
    except timing.NoValidConfig as e:
        successes, failed = (), e.failures
    return ([{"i": index(m.config), "mean_us": m.mean_us, "error_us": m.error_margin_us,
              "samples": m.num_samples} for m in successes],
            [{"i": index(c), "error": t.__name__, "message": msg} for c, t, msg in failed])


@dataclasses.dataclass
class TuningRecord:
    """What happened when a key was resolved: where the config came from and what it cost."""
    op: str
    key: tuple
    config: dict
    source: str                  # "search", "store", "shipped" (the package's winners),
                                 # "default" (DISABLE_AUTOTUNE, or a search that failed
                                 # for the moment), "capture", "agreed"
                                 # (another rank of the job decided; nothing timed here)
    timings: list = dataclasses.field(default_factory=list)   # [{config, mean_us, ...}] fastest first
    failures: list = dataclasses.field(default_factory=list)  # [{config, error, message}]
    search_s: float = 0.0
    best_us: Optional[float] = None
    rates: dict = dataclasses.field(default_factory=dict)
    final: list = dataclasses.field(default_factory=list)    # [{config, median_us}] fastest first
    # with a process group (tiletune.distributed): how the job agreed on this key ({ranks, rank,
    # mode, how, by, role, timed, wait_s, took_over}); empty in a process tuning on its own
    agreement: dict = dataclasses.field(default_factory=dict)

    def to_json(self):
        d = dataclasses.asdict(self)
        d["key"] = [str(k) for k in self.key]
        return d


HINTS = ("occupancy", "num_ctas", "num_worker_warps", "opt_level")


def default_hints(cfg):
    """The compiler hints a config carries (occupancy, num_ctas, num_worker_warps, opt_level)."""
    return {h: getattr(cfg, h) for h in HINTS if hasattr(cfg, h)}


_registry = {}


class Autotuner:
    """Tune-once/cache/launch for one kernel family.

    A launch key (the first argument of `launch`) ends with the device index that `launch`
    gets: the store and the ranks of a job read that last element as 0, so that a winner found
    on one GPU serves every GPU of the model (`job_key`). A key that does not end with it (an
    int flag last, say) would have that element read as 0 on a device of that index.

    name:    unique op name (store file name, logs).
    kernel:  a bare `ct.kernel`, or a function cfg -> bare kernel when configs pick variants.
    configs: generator(arch, **space(*inputs)) yielding SimpleNamespace configs, default first,
             at most 30.
    default: the config to use if the generator yields nothing.

    What a launch needs, as functions of the config and the `inputs` the op passes to `launch`
    (after the key and the device index):
    space(*inputs) -> dict: the config generator's keyword arguments.
    grid(cfg, dev, *inputs) -> grid.   args(cfg, *inputs) -> kernel arguments. Both run on every
             call: keep them to arithmetic and a tuple.
    scratch(cfg, dev, *inputs) -> (shape tuple, dtype) or None: a temporary buffer a launch
             needs (float32 partials); it is allocated per launch (like the first input, a
             tensor on the launch's device), appended to the inputs of `grid`,
             `args` and `run` (None where the config needs none), and returned by `launch`. A
             search shares one buffer among its configs.
    run(cfg, kernel, stream, dev, *inputs): for configs that launch more than their kernel
             (split-K's sum): runs instead of the one `ct.launch`; the final round times it.
             With `tune_key`, a config for which `scratch` gives no buffer launches its
             kernel alone, on the grid planned at the key's first launch, not through `run`
             (without `tune_key`, `run` launches it, its buffer None).
    partly_timed(cfg) -> bool: True where the search's time of the kernel leaves out part of
             `run` (so it is a lower bound: the final round decides).
    timed_by_run(cfg) -> bool: True where the search times `run` instead of the kernel: the
             kernel reads what an earlier kernel of `run` writes (a schedule), so it cannot be
             timed alone, or the rest of `run` costs so unevenly across configs (the decode
             combine's share grows with the split count) that a lower bound would misrank them.
    work(*inputs) -> Work: bytes/FLOPs of one launch, for the record's achieved rate.
    search_inputs(*inputs) -> inputs: what the search launches instead (built once per miss):
             in-place kernels search their split-buffer twin (`search_kernel`, same body and
             traffic, separate input and output arrays) on scratch outputs, so the user's data
             is untouched until the one in-place launch with the winner.
    tune_key(key) -> key: the tuning key (store, records, `cache`) of a launch key, which
             buckets its dynamic sizes (one search for every batch of tokens between two
             powers of two); `bucketed(i, ...)` makes one. Given, the op promises that a launch
             key holds every size its grid and scratch depend on, and both are computed once per
             launch key (for configs that `run` does not launch) instead of on every call.
             Default: the launch key is the tuning key, and the grid is computed on every call.
    hints:   cfg -> hint dict for `replace_hints` (default: occupancy/num_ctas/warps/opt_level).
    """

    def __init__(self, name, kernel, configs, *, default, space=None, grid=None, args=None,
                 scratch=None, run=None, partly_timed=None, timed_by_run=None, work=None,
                 search_kernel=None, search_inputs=None, tune_key=None, hints=default_hints):
        if name in _registry:
            raise ValueError(f"an Autotuner named {name!r} already exists")
        self.name = name
        self._kernel = kernel
        self.configs = configs
        self.default = default
        self.hints = hints
        self._search_kernel = search_kernel
        self._space, self._grid, self._args, self._scratch = space, grid, args, scratch
        self._run, self._partly_timed, self._work = run, partly_timed, work
        self._timed_by_run = timed_by_run
        self._search_inputs = search_inputs
        self.tune_key = tune_key or _same_key
        # the grid is planned once per launch key only where the op says its keys are exact
        self._exact_keys = tune_key is not None
        self._plans_grid = self._exact_keys and scratch is None and run is None
        # launch key -> (kernel, grid, cfg, scratch spec): the fast path reads only this
        self._plans = {}
        self.cache = _TuningCache(self._plans)  # tuning key -> (cfg, tuned kernel)
        self.records = {}        # key -> TuningRecord
        self.searches = 0        # number of exhaustive searches run (tests, stats)
        self._capture_cache = {}  # key -> (cfg, kernel) used while a CUDA graph is captured
        self._failed = {}        # key -> its failures: a TuningFailedError of them is raised
                                 # again without a new search (unless no failure was its
                                 # config's: `_of_the_moment`)
        self._hinted = {}        # (bare kernel, hints, device) -> the one object built with them
        self._unproven = {}      # key -> store key of a stored winner not yet launched
        self._again = set()      # keys a job decided as failed for the moment: next round
        self._warned_capture = False
        self.launch = self._fast_path()
        _registry[name] = self

    # -- the fast path ------------------------------------------------------------------------
    def _fast_path(self, checked=False):
        """`launch(key, dev, *inputs)`, built once with the op's functions bound as locals: a
        hit costs a dict lookup, the arguments and `ct.launch`; with `tune_key` the grid too
        was computed on the key's first launch. checked=True (tests): recompute the grid on
        every call and fail where the planned one differs."""
        plan_get, first, name = self._plans.get, self._first_launch, self.name
        grid, args, scratch, run = self._grid, self._args, self._scratch, self._run

        # cuTile refuses strides past 2^31 - 1 elements (OverflowError); the usual cause is a
        # size-1 dim of a big tensor (a[None]): such a launch is retried with those strides
        # made small (no cost on the fast path when it does not happen).
        if scratch is None and run is None:
            def launch_config(cfg, kernel, dev, inputs, cfg_grid):
                if cfg_grid is None:
                    cfg_grid = grid(cfg, dev, *inputs)
                try:
                    ct.launch(_device.current_stream(dev), cfg_grid, kernel, args(cfg, *inputs))
                except OverflowError as e:
                    inputs = int32_strides(name, inputs, e)
                    ct.launch(_device.current_stream(dev), cfg_grid, kernel, args(cfg, *inputs))

            if self._plans_grid:
                def launch(key, dev, *inputs):
                    plan = plan_get(key)
                    if plan is None:
                        return first(key, dev, inputs, launch_config)
                    kernel, cfg_grid, cfg, _ = plan
                    try:
                        ct.launch(_device.current_stream(dev), cfg_grid, kernel,
                                  args(cfg, *inputs))
                    except OverflowError as e:
                        launch_config(cfg, kernel, dev, int32_strides(name, inputs, e), cfg_grid)
            else:
                def launch(key, dev, *inputs):
                    plan = plan_get(key)
                    if plan is None:
                        return first(key, dev, inputs, launch_config)
                    launch_config(plan[2], plan[0], dev, inputs, None)

            def launch_checked(key, dev, *inputs):
                plan = plan_get(key)
                if plan is not None and plan[1] is not None:
                    _check_grid(name, key, plan[1], grid(plan[2], dev, *inputs))
                return launch(key, dev, *inputs)
            return launch_checked if checked else launch

        def launch_with_scratch_or_run(key, dev, *inputs):
            plan = plan_get(key)
            if plan is None:
                return first(key, dev, inputs, launch_config_with_scratch_or_run)
            kernel, cfg_grid, cfg, spec = plan
            if cfg_grid is None:
                return launch_config_with_scratch_or_run(cfg, kernel, dev, inputs, None)
            # its kernel alone on the planned grid, with the planned scratch (or none)
            buf = None if spec is None else inputs[0].new_empty(*spec[0], dtype=spec[1])
            try:
                ct.launch(_device.current_stream(dev), cfg_grid, kernel, args(cfg, *inputs, buf))
            except OverflowError as e:
                return launch_config_with_scratch_or_run(cfg, kernel, dev,
                                                         int32_strides(name, inputs, e), None)
            return buf

        def launch_config_with_scratch_or_run(cfg, kernel, dev, inputs, _grid):
            try:
                return launch_config_unfitted(cfg, kernel, dev, inputs)
            except OverflowError as e:
                return launch_config_unfitted(cfg, kernel, dev, int32_strides(name, inputs, e))

        def launch_config_unfitted(cfg, kernel, dev, inputs):
            buf = None
            if scratch is not None:
                spec = scratch(cfg, dev, *inputs)
                if spec is not None:
                    # new_empty with int sizes: about 1 us less host time than
                    # torch.empty(shape, dtype=, device=)
                    buf = inputs[0].new_empty(*spec[0], dtype=spec[1])
                inputs = (*inputs, buf)
            if run is not None:
                run(cfg, kernel, _device.current_stream(dev), dev, *inputs)
            else:
                ct.launch(_device.current_stream(dev), grid(cfg, dev, *inputs), kernel,
                          args(cfg, *inputs))
            return buf

        def launch_checked_with_scratch_or_run(key, dev, *inputs):
            plan = plan_get(key)
            if plan is not None and plan[1] is not None:
                _check_grid(name, key, plan[1], grid(plan[2], dev, *inputs, None))
                if plan[3] is not None:
                    _check_grid(name, key, plan[3], scratch(plan[2], dev, *inputs), "scratch")
            return launch_with_scratch_or_run(key, dev, *inputs)
        return launch_checked_with_scratch_or_run if checked else launch_with_scratch_or_run

    def _first_launch(self, key, dev, inputs, launch_config):
        """A miss of `launch`: resolve the key's tuning key, launch, and keep the launch's plan
        (kernel, grid, config) under the key. A winner read from the store, or a job's decision
        this rank did not time, that no longer launches (a driver or device that refuses its
        kernel) is deleted from the store, the key is searched again (in a job: in the key's
        next round), and the new winner launches. Errors that say nothing about the
        config (bad inputs, out of memory, a compile timeout on a busy host) go to the caller
        and leave the store alone."""
        tkey = self.tune_key(key)
        # The marker before the entry: a stored entry is marked before it is cached, and
        # unmarked only after it is dropped (or has launched).
        skey = self._unproven.get(tkey)
        entry = self.cache.get(tkey)
        cached = entry is not None
        if entry is None:
            entry = self._resolve_first(tkey, dev, inputs)
            skey = self._unproven.get(tkey)
            cached = self.cache.get(tkey) is entry      # (a pick during graph capture is not)
        if skey is None:
            try:
                return self._launch_planned(key, tkey, entry, dev, inputs, launch_config)
            except Exception:
                if not cached or self.cache.get(tkey) is entry:
                    raise
                # another thread's first launch of this stored entry failed and dropped it
                # after this thread read it: launch what replaced it
                entry = self.cache.get(tkey) or self._resolve_first(tkey, dev, inputs)
                return self._launch_planned(key, tkey, entry, dev, inputs, launch_config)
        try:
            result = self._launch_planned(key, tkey, entry, dev, inputs, launch_config)
        except _NOT_THE_CONFIG:
            raise                            # still unproven: a later launch decides
        except Exception as e:
            if _earlier_fault(e) or _compiler_gave_no_verdict(type(e).__name__, str(e)):
                # an earlier kernel's fault (the context is lost), or a compile killed on a
                # busy host: nothing said about the config, which stays unproven
                raise
            # Every thread whose first launch of the entry fails lands here; the first one
            # drops it, the others launch whatever is cached or resolved after.
            with _search_lock(dev):
                if self.cache.get(tkey) is entry:
                    log.warning("tiletune: %s %s: the stored or agreed config %s failed to "
                                "launch; searching again. %s: %s", self.name, tkey,
                                config_dict(entry[0]), type(e).__name__,
                                "\n  ".join(message_lines(e)))
                    store.delete(self.name, skey)
                    self.cache.pop(tkey, None)
                    self.records.pop(tkey, None)
                    self._unproven.pop(tkey, None)
            entry = self.cache.get(tkey) or self._resolve_first(tkey, dev, inputs, False)
            return self._launch_planned(key, tkey, entry, dev, inputs, launch_config)
        self._unproven.pop(tkey, None)
        return result

    def _resolve_first(self, key, dev, inputs, use_store=True):
        """`_resolve` for a first launch: a search that failed for the moment gives the default
        (`_default_for_now`)."""
        try:
            return self._resolve(key, dev, inputs, use_store)
        except TuningFailedError as e:
            return self._default_for_now(key, dev, inputs, e)

    def _default_for_now(self, key, dev, inputs, error):
        """A first launch whose search failed with nothing of its configs' own (every failure
        out of memory for the search's buffers on a full GPU, or a compile that timed out or was
        killed on a busy host), outside a job: the default config serves the key for the rest
        of the process, with a warning and nothing stored (the next process searches), instead
        of failing the caller's step. A key whose configs failed on their own, and a job's key
        (its ranks meet in the key's next round), raise `error`."""
        if key in self._failed or distributed.current() is not None or _searches_must_decide:
            raise error
        with _search_lock(dev):
            hit = self.cache.get(key)
            if hit is not None:
                return hit
            cfg = self.config_list(_device.arch(dev), self._space(*inputs))[0]
            failures = [{"config": c, "error": kind, "message": message}
                        for c, kind, message in error.failures]
            kinds = sorted({kind for _, kind, _ in error.failures})
            warnings.warn(f"tiletune: {self.name} {key}: the search failed for the moment "
                          f"({', '.join(kinds)}); the default config serves this key for the "
                          "rest of the process (tiletune.clear_cache() searches again; `python "
                          "-m tiletune tune` tunes keys ahead, before a run fills the GPU)")
            record = TuningRecord(self.name, key, config_dict(cfg), "default", [], failures)
            return self._finish(key, cfg, record, None, dev)

    def _launch_planned(self, key, tkey, entry, dev, inputs, launch_config):
        cfg, kernel = entry
        cfg_grid, spec = self._planned(cfg, dev, inputs)
        result = launch_config(cfg, kernel, dev, inputs, cfg_grid)
        if self.cache.get(tkey) is entry:    # not a config picked during graph capture
            self._plans[key] = (kernel, cfg_grid, cfg, spec)
            if self.cache.get(tkey) is not entry:
                # the cache changed in between (clear_cache() in another thread), and with it
                # went the plans: this one must not outlive its entry either
                self._plans.pop(key, None)
        return result

    def planned_config(self, key):
        """The config a launch key has launched with in this process, or None before its first
        launch (an op whose plan depends on the winner asks before it launches)."""
        plan = self._plans.get(key)
        return None if plan is None else plan[2]

    def _planned(self, cfg, dev, inputs):
        """(grid, scratch spec) a launch key's plan keeps; grid None: both computed on every
        call. Planned where the op's keys are exact (`tune_key`) for a config that launches its
        kernel alone: no scratch and no run, a scratch buffer but no run (its spec planned too;
        `grid` must not read the buffer), or `scratch` giving none for it."""
        if self._plans_grid:
            return self._grid(cfg, dev, *inputs), None
        if self._exact_keys and self._scratch is not None:
            spec = self._scratch(cfg, dev, *inputs)
            if spec is None or self._run is None:
                return self._grid(cfg, dev, *inputs, None), spec
        return None, None

    def _resolve(self, key, dev, inputs, use_store=True):
        """Tune a key that missed: the Search over the op's declared functions, built lazily (a
        store hit or DISABLE_AUTOTUNE allocates nothing)."""
        if self._grid is None or self._args is None or self._space is None:
            raise TypeError(f"{self.name}: launch() needs the tuner's space, grid and args")
        if isinstance(dev, int) and (dev < 0 or not torch.cuda.is_available()):
            raise ValueError(f"{self.name}: cuTile kernels run on a CUDA GPU; got device index "
                             f"{dev} (a CPU tensor's get_device() is -1)"
                             + ("" if torch.cuda.is_available() else " and no GPU is visible"))
        shape = self._space(*inputs)
        inputs = int32_strides(self.name, inputs)      # what the search launches must launch
        return self.tune(key, dev, lambda cfgs: self._search_for(dev, inputs, shape, cfgs),
                         shape=shape, use_store=use_store)

    def _search_for(self, dev, inputs, shape, cfgs):
        """The Search over the declared functions, for the configs `cfgs` of `shape`."""
        search_inputs = self._search_inputs(*inputs) if self._search_inputs else inputs
        with_scratch = (lambda c: search_inputs)
        if self._scratch is not None:
            with_scratch = _shared_scratch(self._scratch, search_inputs, dev, cfgs)
        grid, args, run = self._grid, self._args, self._run
        stream = _device.current_stream
        return Search(
            shape=shape,
            grid_fn=lambda c: grid(c, dev, *with_scratch(c)),
            args_fn=lambda c: args(c, *with_scratch(c)),
            work=self._work(*inputs) if self._work else None,
            run_fn=(lambda c, k: run(c, k, stream(dev), dev, *with_scratch(c))) if run else None,
            partly_timed=self._partly_timed, timed_by_run=self._timed_by_run)

    # -- pieces -----------------------------------------------------------------------------
    def base_kernel(self, cfg):
        return _pick(self._kernel, cfg)

    def search_kernel(self, cfg):
        return _pick(self._search_kernel or self._kernel, cfg)

    def build(self, cfg):
        """The launchable kernel for a config: `replace_hints` once, with exactly its hints."""
        return self.base_kernel(cfg).replace_hints(**self.hints(cfg))

    def _with_hints(self, kernel, cfg, dev):
        """kernel.replace_hints(cfg's hints), one object per (kernel, hints, device) for the
        process's life. Each such object has its own JIT cache: sharing it between the search,
        the final round and the launch traces each config's kernel once per device in this
        process, not once per stage (0.03-0.5 s a trace). None is ever dropped, not even by
        `clear()`: a kernel object unloads its compiled code when freed, and a CUDA graph
        captured with it would then replay code that is gone (references/reliability.md)."""
        hints = self.hints(cfg)
        try:
            memo = (kernel, tuple(sorted(hints.items())), dev)
            hash(memo)
        except TypeError:                # an unhashable hint value: keyed by its text
            memo = (kernel, repr(sorted(hints.items())), dev)
        built = self._hinted.get(memo)
        if built is None:
            # (setdefault: where two threads build one at once, as a capture's miss, which takes
            # no lock, beside a search can, both get the first stored; the other, freed, would
            # unload the code a graph captured with it replays)
            made = kernel.replace_hints(**hints)
            built = self._hinted.setdefault(memo, made)
            if built is made:
                precompile.track(built)
        return built

    def _search_kernels(self, dev):
        """Each config's kernel as the search launches it: the object the final round and the
        launch share."""
        return lambda cfg: self._with_hints(self.search_kernel(cfg), cfg, dev)

    def config_list(self, arch, shape):
        cfgs = list(self.configs(arch, **shape))
        if len(cfgs) > MAX_CONFIGS:
            raise ValueError(f"{self.name}: config space has {len(cfgs)} configs (max {MAX_CONFIGS})")
        return cfgs or [self.default]

    def _fingerprint(self, cfgs):
        """The config space and the code of every kernel it compiles (`precompile.kernel_code`:
        a changed helper is a changed kernel; host code is not)."""
        h = hashlib.sha256()
        h.update(json.dumps([config_dict(c) for c in cfgs], sort_keys=True, default=str).encode())
        kernels = {id(k): k for c in cfgs for k in (self.base_kernel(c), self.search_kernel(c))}
        for k in kernels.values():
            for part in precompile.kernel_code(k._pyfunc):
                h.update(part)
        return h.hexdigest()[:16]

    def store_key(self, key, dev, cfgs):
        """The persistent store's key: the job key (device-neutral) and what makes a winner
        stale elsewhere (GPU model, arch, versions, the config space and kernel code)."""
        parts = [str(k) for k in job_key(key, dev)] + [
            _device.gpu_name(dev), _device.arch(dev), f"cuda-tile {ct.__version__}",
            f"tileiras {tileiras_version()}", f"space {self._fingerprint(cfgs)}"]
        return " | ".join(parts)

    def agreement_name(self, key, dev, cfgs):
        """How every rank of a job names this key: op, job key and config space (the part of
        the store key that does not depend on which GPU of the model a rank drives)."""
        return " | ".join([self.name] + [str(k) for k in job_key(key, dev)]
                          + [f"space {self._fingerprint(cfgs)}"])

    def _find(self, cfgs, stored):
        """The config equal to a stored one, compared as JSON sees them (tuples are lists)."""
        for c in cfgs:
            if _as_json(config_dict(c)) == stored:
                return c
        return None

    # -- the miss path ----------------------------------------------------------------------
    def tune(self, key, dev, search, shape=None, use_store=True):
        """Resolve a key that missed the cache; returns (cfg, kernel) and caches it. `dev` is the
        device (index); `search` a Search, or a function of the config list that builds one,
        called only if a search runs (`shape` then gives the config generator's arguments).
        use_store=False: search even if the store holds a winner (which the search replaces)."""
        if isinstance(search, Search):
            shape = search.shape
        _device.check_supported(self.name, dev)
        if torch.cuda.is_current_stream_capturing():
            return self._resolve_during_capture(key, dev, shape)
        with _search_lock(dev):
            hit = self.cache.get(key)
            if hit is not None:          # another thread resolved it while we waited
                return hit
            cfgs = self.config_list(_device.arch(dev), shape)
            if disabled():               # before anything else: the default, always
                record = TuningRecord(self.name, key, config_dict(cfgs[0]), "default")
                return self._finish(key, cfgs[0], record, None, dev)
            failed = self._failed.get(key)
            if failed is not None:       # every config failed for this key: no new search
                # (a new error each time: one raised again keeps the frames, and so the
                # tensors, of every call it went through)
                raise TuningFailedError(self.name, key, failed)
            skey = self.store_key(key, dev, cfgs)
            stored, cfg = self._from_store(skey, cfgs) if use_store else (None, None)
            agreement = distributed.current()
            if agreement is not None:
                return self._tune_agreed(agreement, key, dev, cfgs, skey, cfg, stored, search,
                                         use_store)
            if cfg is not None:
                return self._stored(key, dev, cfg, skey, stored)
            with _gpu_turn(dev, f"{self.name} {key}"):
                if use_store:         # another process may have saved it while we waited
                    stored, cfg = self._from_store(skey, cfgs)
                    if cfg is not None:
                        return self._stored(key, dev, cfg, skey, stored)
                if not isinstance(search, Search):
                    search = search(cfgs)
                cfg, record = self._search(key, dev, cfgs, search)
                store.save(self.name, skey, _entry(record))
            return self._finish(key, cfg, record, search, dev)

    def _from_store(self, skey, cfgs):
        """(the store's entry for skey, its config among cfgs): None for what is missing."""
        stored = store.load(self.name, skey)
        cfg = self._find(cfgs, stored.get("config")) if isinstance(stored, dict) else None
        return stored, cfg

    def _stored(self, key, dev, cfg, skey, stored):
        """Resolve key to the store's (or a shipped) winner cfg; unproven until it launches."""
        self._unproven[key] = skey
        record = TuningRecord(self.name, key, config_dict(cfg), store.source_of(stored),
                              stored.get("timings") or [], stored.get("failures") or [],
                              stored.get("search_s") or 0.0, stored.get("best_us"),
                              stored.get("rates") or {}, stored.get("final") or [])
        return self._finish(key, cfg, record, None, dev)

    def _tune_agreed(self, agreement, key, dev, cfgs, skey, cfg, stored, search, use_store):
        """A miss in a job of several ranks (tiletune/distributed.py): the ranks agree on one
        config, each timing a share of the configs; the rank whose decision stands writes the
        store. Called under the device's search lock, after DISABLE_AUTOTUNE and the store."""
        t0 = time.perf_counter()
        built, compiled = [], {}

        def the_search():
            if not built:
                built.append(search if isinstance(search, Search) else search(cfgs))
            return built[0]

        def measure(indices, ahead=()):
            if not built:
                self.searches += 1       # this rank times configs of the key
            timings, failures = self._measure(key, dev, cfgs, indices, the_search(), ahead,
                                              compiled)
            size = _work_size(the_search().work)
            for t in timings if size else ():
                t["work"] = size         # this rank's real size (the key buckets it)
            return timings, failures

        def conclude(timings, failures):
            try:
                return _entry(self._conclude(key, dev, cfgs, _at_size(
                    timings, _work_size(the_search().work)), failures, the_search(), t0)[1])
            except TuningFailedError as e:
                return {"failed": [list(f) for f in e.failures]}

        mine = None
        if cfg is not None:       # this rank's stored winner: published as the decision
            mine = _as_json(dict(stored, config=config_dict(cfg)))
        again = key in self._again
        self._again.discard(key)
        name = self.agreement_name(key, dev, cfgs)
        outcome = agreement.agree(name, len(cfgs), measure, conclude, stored=mine,
                                  fresh=again or not use_store)
        entry = outcome.entry
        if "failed" in entry and not outcome.timed and \
                _of_the_moment((kind, message) for _, kind, message in entry["failed"]):
            # other ranks' failure of the moment (out of memory there), which this rank had no
            # part in: the key's next round at once, instead of raising it here (the ranks that
            # failed open the same round at their next call)
            outcome = agreement.agree(name, len(cfgs), measure, conclude, stored=mine,
                                      fresh=True)
            entry = outcome.entry
        if "failed" in entry:
            failures = [tuple(f) for f in entry["failed"]]
            error = TuningFailedError(self.name, key, failures)
            if _of_the_moment((kind, message) for _, kind, message in failures):
                # the decision stands for this round: every rank that read it opens the key's
                # next round at its next call (each counts its own rounds, so they meet there)
                self._again.add(key)
            else:
                self._failed[key] = failures
            raise error
        decided = self._find(cfgs, entry.get("config"))
        if decided is None:
            raise distributed.DistributedTuningError(
                f"tiletune: {self.name} {key}: rank {outcome.by}'s decision "
                f"{entry.get('config')} is not a config of this rank's space")
        if cfgs.index(decided) not in outcome.timed:
            # Not launched on this rank yet (its stored winner, or another rank's pick): if its
            # first launch fails, the key is searched again in its next round, which every rank
            # whose launch fails the same way joins (tiletune/distributed.py, `fresh`).
            self._unproven[key] = skey
        if cfg is not None and decided == cfg:   # the winner this rank's store holds
            source = store.source_of(stored)
        else:
            source = "search" if outcome.timed else "agreed"
            if outcome.decided_here:             # once per job: the rank whose decision stands
                store.save(self.name, skey, dict(entry, saved=time.strftime("%Y-%m-%dT%H:%M:%S")))
        record = TuningRecord(self.name, key, entry["config"], source, entry.get("timings") or [],
                              entry.get("failures") or [], entry.get("search_s") or 0.0,
                              entry.get("best_us"), entry.get("rates") or {},
                              entry.get("final") or [], outcome.info(agreement))
        return self._finish(key, decided, record, built[0] if built else None, dev)

    def _search(self, key, dev, cfgs, search):
        """Time every config, then the final round: (winning cfg, record)."""
        t0 = time.perf_counter()
        self.searches += 1
        timings, failures = self._measure(key, dev, cfgs, range(len(cfgs)), search)
        return self._conclude(key, dev, cfgs, timings, failures, search, t0)

    def _measure(self, key, dev, cfgs, indices, search, ahead=(), compiled=None):
        """Compile and time the configs at `indices`: ([{i, mean_us, error_us, samples}],
        [{i, error, message}]), `i` being the config's index in `cfgs`. ahead: configs that a later call may
        time, compiled in this call's batch; compiled: {i: the compiler's rejection or None}
        across the calls of one search (configs in it are not compiled again)."""
        indices = list(indices)
        subset = [cfgs[i] for i in indices]
        stream = torch.cuda.current_stream(dev)
        compiled = {} if compiled is None else compiled
        batch = [i for i in dict.fromkeys([*indices, *ahead]) if i not in compiled]
        if len(batch) > 1 and precompile.enabled():
            # compile every config at once in worker processes and hand each cubin to the
            # config's kernel object, which the search, the final round and the launch share.
            # Configs the compiler rejects are failures already: the search skips them.
            arch = _device.arch(dev)
            bare = [self.search_kernel(cfgs[i]) for i in batch]
            launching = [self._with_hints(k, cfgs[i], dev) for i, k in zip(batch, bare)]
            refused, cubins = precompile.precompile(
                [(k, self.hints(cfgs[i]), search.args_fn(cfgs[i]), launched)
                 for i, k, launched in zip(batch, bare, launching)], arch, COMPILE_TIMEOUT_SEC)
            for j, (sig, cubin) in cubins.items():
                precompile.hand_over(launching[j], sig, arch, cubin)
            compiled.update({i: refused.get(j) for j, i in enumerate(batch)})
        rejected = {j: compiled[i] for j, i in enumerate(indices) if compiled.get(i)}
        # A compile timeout in a loaded parallel precompile is no verdict on the config, nor is
        # a compiler killed by a signal (out of memory among many parallel compiles): the search
        # compiles it again, alone. So does every config if the precompile rejected all.
        rejected = {j: e for j, e in rejected.items() if not _compiler_gave_no_verdict(*e[:2])}
        if rejected and len(rejected) == len(subset):
            log.warning("tiletune: %s %s: the parallel precompile rejected every config; "
                        "compiling them one at a time", self.name, key)
            rejected = {}
        failures = [{"i": indices[j], "error": rejected[j][0], "message": rejected[j][1]}
                    for j in sorted(rejected)]
        candidates = [(indices[j], c) for j, c in enumerate(subset) if j not in rejected]
        by_run = search.timed_by_run or (lambda c: False)
        timings, more = self._time_runs([(i, c) for i, c in candidates if by_run(c)], search, dev)
        failures += more
        candidates = [(i, c) for i, c in candidates if not by_run(c)]
        if not candidates:
            return timings, failures
        ids = {id(c): i for i, c in candidates}

        def where(c):        # the search hands back the configs it was given
            i = ids.get(id(c))
            return i if i is not None else next(i for i, d in candidates if d == c)
        with _compile_timeout():
            more, failed = _sampled(lambda: timing.search_kernels(
                [c for _, c in candidates], stream, search.grid_fn, self._search_kernels(dev),
                search.args_fn), where)
        return timings + more, failures + failed

    def _time_runs(self, candidates, search, dev):
        """Time the (index, config) pairs through search.run_fn, each run whole, sampled as
        the kernels alone are (`timing.search_runs`): (timings, failures) in `_measure`'s
        form. A config whose run raises is a failure."""
        if not candidates:
            return [], []
        stream = torch.cuda.current_stream(dev)
        runs = [(i, self._runner(c, search, stream, dev)) for i, c in candidates]
        try:
            with _compile_timeout(), torch.cuda.device(dev):
                return _sampled(lambda: timing.search_runs(runs), lambda i: i)
        finally:
            timing.release()

    def _conclude(self, key, dev, cfgs, timings, failures, search, t0):
        """From the timings of `_measure` (of one process, or merged over a job's ranks): the
        ranking, the final round of the close finishers on this GPU, the record. Raises
        TuningFailedError when nothing was timed. Ties go to the earlier config."""
        if not timings:
            failed = [(config_dict(cfgs[f["i"]]), f["error"], f["message"]) for f in failures]
            if not _of_the_moment((f["error"], f["message"]) for f in failures):
                self._failed[key] = failed
            raise TuningFailedError(self.name, key, failed)
        ranked = sorted((SimpleNamespace(config=cfgs[t["i"]], mean_us=t["mean_us"], t=t)
                         for t in sorted(timings, key=lambda t: t["i"])),
                        key=lambda m: m.mean_us)
        extra = ("rank", "ranks")        # who timed it, in a job of several ranks
        record_timings = [dict({"config": config_dict(m.config), "mean_us": m.mean_us,
                                "error_us": m.t["error_us"], "samples": m.t["samples"]},
                               **{k: m.t[k] for k in extra if k in m.t}) for m in ranked]
        record_failures = [dict({"config": config_dict(cfgs[f["i"]]), "error": f["error"],
                                 "message": f["message"]}, **{k: f[k] for k in extra if k in f})
                           for f in failures]
        # A partly timed config (its search time is a lower bound) wins only in the final round.
        anchor = next((m for m in ranked
                       if not (search.partly_timed and search.partly_timed(m.config))), ranked[0])
        best, best_us, final = anchor.config, anchor.mean_us, []
        regime = ("sustained" if search.work and search.work.flops and best_us >= SUSTAINED_FINAL_US
                  else "turns")
        finalists = self._finalists(ranked, anchor, cfgs[0],
                                    None if regime == "sustained" else FINAL_MARGIN)
        if len(finalists) > 1:
            stream = torch.cuda.current_stream(dev)
            try:
                # (a kernel only the final round runs, such as split-K's sum, compiles here)
                with _compile_timeout(), torch.cuda.device(dev):
                    final, failed = self._final_round(finalists, search, stream, best_us, dev,
                                                      regime)
            except Exception as e:     # e.g. no memory left for the L2 flush: keep the anchor
                log.info("%s %s: final round skipped: %s: %s", self.name, key,
                         type(e).__name__, str(e)[:200])
                final, failed = [], []
            finally:
                timing.release()
            # a finalist whose run raised (a kernel only its run launches, such as split-K's sum,
            # did not build) is out of the round, and the record keeps its error
            record_failures += [{"config": config_dict(c), "error": type(e).__name__,
                                 "message": f"in the final round: {e}"} for c, e in failed]
            if final:
                best, best_us = self._final_pick(final, cfgs[0])
            elif failed and not _of_the_moment((type(e).__name__, str(e)) for _, e in failed):
                # every finalist's run raised: none may win on its search time; the fastest
                # config outside the round does, or the key fails where there is none
                out = [c for c, _ in failed]
                rest = [m for m in ranked if not any(m.config is c for c in out)]
                if not rest:
                    every = [(f["config"], f["error"], f["message"]) for f in record_failures]
                    self._failed[key] = every
                    raise TuningFailedError(self.name, key, every)
                pick = next((m for m in rest if not (search.partly_timed
                                                     and search.partly_timed(m.config))), rest[0])
                best, best_us = pick.config, pick.mean_us
            final = [{"config": config_dict(c), "median_us": us, "timing": regime}
                     for c, us in final]
        elapsed = time.perf_counter() - t0
        rates = search.work.rates(best_us) if search.work else {}
        record = TuningRecord(self.name, key, config_dict(best), "search", record_timings,
                              record_failures, elapsed, best_us, rates, final)
        return best, record

    @staticmethod
    def _finalists(ranked, anchor, default, margin):
        """The anchor (the fastest fully timed config), the configs within `margin` of it (at
        most FINALISTS, fastest first; the FINALISTS fastest where margin is None) and the
        default."""
        cut = math.inf if margin is None else anchor.mean_us * (1 + margin)
        finalists = [m.config for m in ranked[:FINALISTS] if m.mean_us <= cut]
        if anchor.config not in finalists:
            finalists.append(anchor.config)
        if default not in finalists and any(m.config is default for m in ranked):
            finalists.append(default)
        return finalists

    @staticmethod
    def _final_pick(final, default):
        """(cfg, us) of the final round [(cfg, us)] fastest first: the fastest, or the default
        where the fastest leads it by at most KEEP_DEFAULT_MARGIN."""
        fastest_us = final[0][1]
        for cfg, us in final:
            if cfg == default and us <= fastest_us * (1 + KEEP_DEFAULT_MARGIN):
                return cfg, us
        return final[0]

    def _final_round(self, finalists, search, stream, best_us, dev, regime="turns"):
        """([(cfg, median us)] fastest first, [(cfg, error)] of those whose run raised): the
        finalists timed in turns, ~10 ms blocks, or sustained blocks (SUSTAINED_FINAL_US)."""
        runs = [(i, self._runner(c, search, stream, dev), None) for i, c in enumerate(finalists)]
        if regime == "sustained":
            us = timing.time_interleaved(runs, rounds=SUSTAINED_FINAL_ROUNDS, reps=3, warmup=2,
                                         block_ms=timing.SUSTAINED_BLOCK_MS)
        else:
            reps = max(3, min(20, int(10000 / max(best_us, 1.0))))
            # (blocks of at most 20 runs under 100 us: the whole round is shorter than a boost)
            us = timing.time_interleaved(runs, rounds=5, reps=reps, warmup=2, preheat_ms=0)
        timed = [(c, us[i]) for i, c in enumerate(finalists) if not isinstance(us[i], Exception)]
        failed = [(c, us[i]) for i, c in enumerate(finalists) if isinstance(us[i], Exception)]
        return sorted(timed, key=lambda t: t[1]), failed

    def _runner(self, c, search, stream, dev):
        """One timed run of config c: the op's run_fn where it has one, else its kernel's
        launch on the search's grid and arguments."""
        kernel = self._with_hints(self.search_kernel(c), c, dev)
        if search.run_fn is not None:
            return lambda: search.run_fn(c, kernel)
        grid, args = search.grid_fn(c), search.args_fn(c)
        return lambda: ct.launch(stream, grid, kernel, args)

    def _finish(self, key, cfg, record, search, dev):
        kernel = self._with_hints(self.base_kernel(cfg), cfg, dev)
        if search is not None and self._search_kernel is None:
            # One launch with the search's (scratch) arguments, still under the lock: the JIT
            # compiles the tuned kernel here, once, instead of in whichever threads launch it
            # first. (Not for in-place kernels: their search arguments belong to the twin.)
            # As the final round runs it: through the op's run where it has one, since a
            # kernel that reads what an earlier kernel of the run writes (the grouped GEMM's
            # schedule) cannot run alone.
            self._runner(cfg, search, torch.cuda.current_stream(dev), dev)()
        entry = (cfg, kernel)
        self.records[key] = record
        self.cache[key] = entry
        if record.source == "search":
            self._log_search(record)
        else:
            log.info("%s %s: %s config %s", self.name, key, record.source, record.config)
        return entry

    def _log_search(self, record):
        rate = " ".join(f"{k}={v:.1f}" for k, v in record.rates.items())
        line = (f"tuned {self.name} {list(map(str, record.key))} in {record.search_s:.1f}s: "
                f"{record.config} {record.best_us or 0.0:.2f} us {rate}".rstrip()
                + f" ({len(record.timings)} configs, {len(record.failures)} failed)")
        # a long search is said even without TILETUNE_LOG (a slow first call is not a hang)
        log.log(logging.WARNING if record.search_s >= LONG_SEARCH_SEC else logging.INFO, line)
        if record.final:
            log.info("  final round (%s): %s", record.final[0].get("timing", "turns"), ", ".join(
                f"{f['config']} {f['median_us']:.2f} us" for f in record.final))
        for f in record.failures:      # why a config failed matters as much as the winner
            log.info("  %s failed: %s: %s", f["config"], f["error"], str(f["message"])[:300])

    def _resolve_during_capture(self, key, dev, shape):
        """No search while a CUDA graph is captured: stored winner or the default, warn once."""
        hit = self._capture_cache.get(key)
        if hit is not None:
            return hit
        if not self._warned_capture:
            warnings.warn(f"tiletune: {self.name} key {key} was first seen during CUDA graph "
                          "capture; using the stored or default config without tuning. Run the "
                          "op once before capturing to tune it.")
            self._warned_capture = True
        cfgs = self.config_list(_device.arch(dev), shape)
        cfg = None
        if not disabled():
            stored = store.load(self.name, self.store_key(key, dev, cfgs))
            cfg = self._find(cfgs, stored.get("config")) if isinstance(stored, dict) else None
        cfg = cfg or cfgs[0]
        agreement = None if disabled() else distributed.current()
        if agreement is not None:     # a decision the job made stands; else this one becomes it
            stands = agreement.decide_now(self.agreement_name(key, dev, cfgs),
                                          {"config": config_dict(cfg)})
            cfg = self._find(cfgs, stands.get("config")) or cfg
        entry = (cfg, self._with_hints(self.base_kernel(cfg), cfg, dev))
        self._capture_cache[key] = entry
        self.records.setdefault(key, TuningRecord(self.name, key, config_dict(cfg), "capture"))
        return entry

    def clear(self):
        self.searches = 0
        self._failed.clear()
        self._again.clear()
        self._unproven.clear()
        self.cache.clear()
        self._plans.clear()
        self.records.clear()
        self._capture_cache.clear()
        # (not _hinted: the compiled kernels stay loaded; see _with_hints)


def _same_key(key):
    return key


class _TuningCache(dict):
    """tuning key -> (cfg, kernel). The launch plans built from its entries are dropped whenever
    it changes, so a plan never outlives the entry it came from (tests and the bench swap
    entries in and out)."""

    def __init__(self, plans):
        super().__init__()
        self._plans = plans

    def _changed(self):
        # (after each change, never before it: a plan written in between by a thread that read
        # the old entry would outlive it)
        self._plans.clear()

    def __setitem__(self, key, value):
        super().__setitem__(key, value)
        self._changed()

    def __delitem__(self, key):
        super().__delitem__(key)
        self._changed()

    def pop(self, *args):
        value = super().pop(*args)
        self._changed()
        return value

    def popitem(self):
        item = super().popitem()
        self._changed()
        return item

    def clear(self):
        super().clear()
        self._changed()

    def update(self, *args, **kwargs):
        super().update(*args, **kwargs)
        self._changed()

    def setdefault(self, key, default=None):
        value = super().setdefault(key, default)
        self._changed()
        return value


def _check_grid(name, key, planned, grid, what="grid"):
    if tuple(planned) != tuple(grid):
        raise AssertionError(f"{name}: launch key {key} planned {what} {planned} but this call's "
                             f"{what} is {grid}: the key misses a size the {what} depends on")


def jit_size_class(n):
    """A size the JIT specializes as it does n: 1 (a constant), a multiple of 16, a multiple of
    4 (a 16-byte float32 row), or none of these."""
    return 1 if n == 1 else 16 if n % 16 == 0 else 4 if n % 4 == 0 else 5


class StandIns:
    """Buffers handed to a kernel for an output nobody reads (statistics only a backward would
    read, in a call no gradient reaches): a few elements whose stores past their end are
    dropped, saving the output's allocation. The JIT specializes an array on its size-1 dims,
    sizes that are multiples of 16 and strides' 16-byte alignment, so a stand-in is made as
    the real output would be (`make(like, *sizes)`), at sizes of the same classes: one
    compiled kernel serves calls with and without the output. One per device and size class,
    found by exact sizes on the hot path (one dict lookup).

    Shared by every stream, thread and CUDA graph of the device: kernels only store into a
    stand-in, so concurrent or replayed stores race only with each other and nothing reads
    them. A tensor that is not a plain one (made under a fake-tensor mode, as make_fx or a
    memory estimator traces with) is handed out but not kept: kept, every later call would
    launch on it."""

    def __init__(self, make):
        self._make = make
        self._by_sizes = {}     # (device, *sizes) -> stand-in
        self._by_class = {}     # (device, *size classes) -> stand-in

    def get(self, like, dev, *sizes):
        buf = self._by_sizes.get((dev, *sizes))
        if buf is None:
            classes = tuple(jit_size_class(n) for n in sizes)
            buf = self._by_class.get((dev, *classes))
            if buf is None:
                buf = self._make(like, *classes)
                if type(buf) is not torch.Tensor:
                    return buf
                buf = self._by_class.setdefault((dev, *classes), buf)
            self._by_sizes[(dev, *sizes)] = buf
        return buf

    def clear(self):
        self._by_sizes.clear()
        self._by_class.clear()


def int32_strides(name, inputs, error=None):
    """`inputs` with the strides of each tensor's size-1 dims made small where they pass
    2^31 - 1 elements (any stride serves a dim of size 1; the largest other stride keeps TMA's
    16-byte rule). ValueError naming the kernel where a real dim's stride or a size passes it, or
    (given the launch's OverflowError) where nothing could be changed."""
    out, changed = [], False
    for t in inputs:
        if isinstance(t, torch.Tensor) and t.dim() and max(t.stride()) > INT32_MAX:
            real = [st for n, st in zip(t.shape, t.stride()) if n > 1]
            if max(real, default=0) > INT32_MAX or max(t.shape) > INT32_MAX:
                raise ValueError(
                    f"{name}: an input of shape {tuple(t.shape)} and strides {t.stride()} "
                    "reaches past 2^31 - 1 elements in one dim, more than a cuTile kernel "
                    "indexes; split it (for instance per batch)")
            small = max(real, default=1)
            t = t.as_strided(t.shape, [small if n == 1 else st
                                       for n, st in zip(t.shape, t.stride())],
                             t.storage_offset())
            changed = True
        out.append(t)
    if error is not None and not changed:
        raise ValueError(f"{name}: the launch was refused: {error} (cuTile kernels index sizes "
                         "and strides up to 2^31 - 1 elements)") from error
    return tuple(out)


def job_key(key, dev):
    """The key as the whole job names it. An op's launch key ends with its device index
    (`x.get_device()`), kept in memory so that cuda:1 never launches a kernel resolved for
    cuda:0; the store and the ranks of a job read that index as 0, so a winner found on one GPU
    serves every GPU of the model (0 keeps the keys of stores written on one GPU)."""
    if key and not isinstance(dev, bool) and type(key[-1]) is type(dev) and key[-1] == dev:
        if isinstance(dev, int) and dev > 0:
            return (*key[:-1], 0)
        if isinstance(dev, torch.device) and dev.index:
            return (*key[:-1], torch.device(dev.type, 0))
    return key


def _entry(record):
    """The store entry (and a job's published decision) of a searched record."""
    return _as_json({"config": record.config, "best_us": record.best_us,
                     "search_s": round(record.search_s, 3), "rates": record.rates,
                     "timings": record.timings, "final": record.final,
                     "failures": record.failures, "saved": time.strftime("%Y-%m-%dT%H:%M:%S")})


def _as_json(value):
    """value as it reads back from the store (tuples become lists, other objects strings)."""
    return json.loads(json.dumps(value, default=str))


@functools.lru_cache(maxsize=None)
def tileiras_version():
    """The version of the tileiras cuTile compiles with, as store keys name it ("13.4.92"): the
    pip package's where cuTile's binary is that package's, else what the binary cuTile finds (a
    CUDA toolkit's: cuTile takes it when the pip compiler packages are missing or their versions
    disagree) reports, else "unknown". Asked once per process, on the first miss."""
    try:
        from cuda.tile._compile import _find_compiler_bin
        binary = os.path.realpath(_find_compiler_bin().path)
    except Exception:
        return "unknown"
    try:
        package = importlib.metadata.distribution("nvidia-cuda-tileiras")
        if any(os.path.realpath(package.locate_file(f)) == binary
               for f in package.files or () if f.name == os.path.basename(binary)):
            return package.version
    except importlib.metadata.PackageNotFoundError:
        pass
    try:
        import re
        import subprocess
        out = subprocess.run([binary, "--version"], capture_output=True, text=True,
                             timeout=30).stdout
        found = re.search(r"\bV(\d+\.\d+\.\d+)", out)
        return found.group(1) if found else "unknown"
    except Exception:
        return "unknown"


def _shared_scratch(scratch, inputs, dev, cfgs):
    """cfg -> inputs + (its scratch buffer,) for a search: one allocation per dtype, as large as
    the largest config needs; each config gets a view of its own shape."""
    specs = [s for s in (scratch(c, dev, *inputs) for c in cfgs) if s is not None]
    sizes = {}
    for shape, dtype in specs:
        n = 1
        for d in shape:
            n *= d
        sizes[dtype] = max(sizes.get(dtype, 0), n)
    flat = {dt: torch.empty(n, dtype=dt, device=dev) for dt, n in sizes.items()}
    views = {}

    def with_scratch(cfg):
        v = views.get(id(cfg))
        if v is None:
            spec = scratch(cfg, dev, *inputs)
            if spec is None:
                v = views[id(cfg)] = (*inputs, None)
            else:
                shape, dtype = spec
                n = 1
                for d in shape:
                    n *= d
                v = views[id(cfg)] = (*inputs, flat[dtype][:n].view(shape))
        return v
    return with_scratch


def _pick(kernel, cfg):
    return kernel if isinstance(kernel, ct.kernel) else kernel(cfg)


def tuners():
    """Every Autotuner created so far, by name."""
    return dict(_registry)


def clear_cache():
    """Forget every in-memory tuning result (the persistent store is untouched). The compiled
    kernels stay loaded for the process's life: a CUDA graph captured before the call may
    still replay them."""
    for t in _registry.values():
        t.clear()


def records():
    """Every TuningRecord of this process: {op name: {key: record}}."""
    return {name: dict(t.records) for name, t in _registry.items() if t.records}
