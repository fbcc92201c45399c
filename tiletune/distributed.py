"""Multi-GPU tuning: every rank of a process group launches the same config for the same key.

    import torch.distributed as dist
    from tiletune import distributed
    dist.init_process_group("nccl")
    distributed.set_process_group()          # WORLD; or a group, e.g. one per tensor-parallel set

Configs differ in reduction order (split-K, tile shapes), so ranks that tune on their own drift
apart bit by bit, and ranks that finish tuning at different times stall the next collective. With
a group set, a key that misses the in-memory cache is resolved through the group's c10d store
(the one `init_process_group` made; no collective is ever called) by work sharing with one
set-once decision:

1. If the key's decision is already in the store, take it (no search).
2. A rank whose persistent store holds a winner publishes it as the decision.
3. Otherwise the key's configs are cut into W chunks (config i in chunk i mod W). A rank that
   meets the key takes the next chunk with an atomic counter (`store.add`), times it, and
   publishes its timings; once it has timed one chunk it takes every chunk still left. The
   chunks nobody has taken yet are compiled in the first chunk's batch, so a rank alone on a
   key compiles once, as a search outside a job does. A rank that finds nothing left asks
   to be the finisher (`compare_set`, first one wins); the finisher waits for every chunk's
   timings, ranks the merged timings (ties go to the earlier config), runs the final round on
   its own GPU (the close finishers and the default, timed in turns on one GPU: timings of two
   GPUs are no basis for a 1 % call) and publishes the decision, the full tuning record.
   Everyone else waits for the decision.
4. The decision is written with `compare_set(key, "", value)`: the first value is the one every
   rank reads, whoever wrote it and however (a search, a stored winner, a rank that gave up
   waiting). Agreement never depends on timing; only the wall time does. The rank whose value
   won writes it to the persistent store: once per job.

Nobody ever waits for a rank that has not started on the key. Every wait is for a chunk that a
rank took and is timing, or for the finisher's final round, so a key that only one rank meets
costs that rank a search of its own and nobody a timeout, and ranks that meet keys in
different orders do not block one another (each key is still searched once in the job). The
timeout (default 300 s) guards against a rank that stopped inside a search: past it a waiting
rank times what is missing itself and publishes (on_timeout="local", a warning), or raises
DistributedTuningError (on_timeout="raise"). A rank can also stall inside its chunk rather
than die: a search synchronizes its stream, which DDP makes wait on the step's all-reduces, so a
rank that runs a step ahead (no host sync between steps) and takes a chunk of a key the other
rank meets in the previous step's backward waits for that rank's all-reduce while that rank
waits for its chunk. The timeout resolves this (the waiting rank takes the chunk over and the
decision stands); a host sync per step (`loss.item()`) rules it out. A short timeout costs at
most work timed twice, never a disagreement.

mode="replicate" is the other design: every rank times every config and the
finisher merges the mean times of the ranks that had started by then. It costs every rank a
whole search (no wall-time gain) and is there to be measured against "share".

Every rank of the group must call set_process_group the same number of times (each call opens a
fresh namespace in the store). The ranks must run one GPU model: the decision is a config of the
shared space. Keys name the device index an op put last in its key as 0 here (and in the
persistent store), so rank 3 on cuda:3 meets the key rank 0 meets on cuda:0; in memory, keys
keep their device, so a process that drives several GPUs never launches one device's kernel on
another.
"""
import contextlib
import dataclasses
import datetime
import hashlib
import json
import logging
import math
import numbers
import threading
import time

log = logging.getLogger("tiletune")

DEFAULT_TIMEOUT_SEC = 300.0
MODES = ("share", "replicate")
ON_TIMEOUT = ("local", "raise")
ABANDONED = {"abandoned": True}     # what a rank publishes of a share it could not time
_POLL_MIN_SEC, _POLL_MAX_SEC = 0.001, 0.02     # a wait checks the store this often
_UNCLAIMED = "unclaimed"     # every chunk published, the finish claimed by no rank


class DistributedTuningError(RuntimeError):
    """The ranks of a job could not agree on a config (timeout with on_timeout="raise", or a
    decision that is not a config of this rank's space)."""


_agreement = None           # the Agreement the engine consults on a miss; None: no group
_epochs = 0                 # set_process_group calls in this process: one store namespace each


def set_process_group(group=None, *, timeout=DEFAULT_TIMEOUT_SEC, on_timeout="local",
                      mode="share", store=None, rank=None, world_size=None):
    """Tune as one job over `group` (a torch.distributed ProcessGroup; None: WORLD, which needs
    `init_process_group` first). Every rank of the group must call this, as many times as the
    others. Returns the Agreement now in use.

    timeout:    seconds a rank waits for work another rank took (a chunk's timings, the final
                round) before it acts on `on_timeout`.
    on_timeout: "local" (default): time what is missing here and publish; the first decision
                in the store still wins on every rank. "raise": DistributedTuningError.
    mode:       "share" (default): each rank times a share of the configs. "replicate": every
                rank times every config, the finisher merges their means.
    store, rank, world_size: a c10d Store of your own (and this process's place in the job)
                instead of the group's.
    The tuning results this process holds are forgotten (`tiletune.clear_cache()`; the
    compiled kernels stay): keys a warm-up met before the call resolve again through the
    group, their stored winners offered as the job's decisions, so every rank launches the
    same config."""
    global _agreement, _epochs
    op = "set_process_group"
    if mode not in MODES:
        raise ValueError(f"{op}: mode must be one of {MODES}, not {mode!r}")
    if on_timeout not in ON_TIMEOUT:
        raise ValueError(f"{op}: on_timeout must be one of {ON_TIMEOUT}, not {on_timeout!r}")
    if isinstance(timeout, datetime.timedelta):     # (what init_process_group takes)
        timeout = timeout.total_seconds()
    if isinstance(timeout, bool) or not isinstance(timeout, numbers.Real):
        raise TypeError(f"{op}: timeout must be a number of seconds or a timedelta, not "
                        f"{type(timeout).__name__}")
    if not 0 < timeout < math.inf:
        raise ValueError(f"{op}: timeout must be a positive number of seconds, not {timeout!r}")
    if store is None or rank is None or world_size is None:
        import torch.distributed as dist
        if not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError("tiletune.distributed.set_process_group: call "
                               "torch.distributed.init_process_group first (or pass store, "
                               "rank and world_size)")
        if rank is None:
            rank = dist.get_rank(group)
        if world_size is None:
            world_size = dist.get_world_size(group)
        if store is None and 0 <= rank < world_size:     # (a non-member is refused below)
            store = _group_store(group)
    if not 0 <= rank < world_size:
        raise ValueError(f"this process (rank {rank}) is not a member of the group "
                         f"of {world_size} ranks")
    from tiletune import autotune          # (autotune imports this module)
    autotune.clear_cache()
    _epochs += 1
    _agreement = Agreement(store, rank, world_size, prefix=f"tiletune/{_epochs}",
                           timeout=float(timeout), on_timeout=on_timeout, mode=mode, group=group)
    return _agreement


def get_process_group():
    """The Agreement in use (its `.group`, `.rank`, `.world_size`), or None."""
    return _agreement


def clear_process_group():
    """Tune each process on its own again."""
    global _agreement
    _agreement = None


def current():
    """What the engine reads on a miss (None when no group is set)."""
    return _agreement


def _group_store(group):
    from torch.distributed import distributed_c10d as c10d
    pg = group if group is not None else c10d._get_default_group()
    try:
        return c10d._get_process_group_store(pg)
    except (AttributeError, KeyError):
        if group is None:
            return c10d._get_default_store()
        raise RuntimeError("tiletune: cannot find this process group's c10d store; pass "
                           "set_process_group(group, store=..., rank=..., world_size=...)")


@dataclasses.dataclass
class Outcome:
    """How one rank resolved one key: the decision's entry and what this rank did for it."""
    entry: dict = None
    decided_here: bool = False   # this rank's value is the decision (it writes the store)
    how: str = ""                # the decision's origin: "search" (ranks shared it), "alone"
                                 # (one rank timed all), "store" (a rank's stored winner)
    by: int = -1                 # the rank that published the decision
    role: str = ""               # this rank: "finisher", "helper" (timed, did not decide),
                                 # "waiter" (timed nothing), "adopted" (found the decision),
                                 # "store" (published its stored winner)
    timed: list = dataclasses.field(default_factory=list)    # config indices timed here
    wait_s: float = 0.0          # time spent waiting for other ranks
    took_over: bool = False      # this rank timed what a silent rank had taken

    def info(self, agreement):
        return {"ranks": agreement.world_size, "rank": agreement.rank, "mode": agreement.mode,
                "how": self.how, "by": self.by, "role": self.role, "timed": list(self.timed),
                "wait_s": round(self.wait_s, 4), "took_over": self.took_over}


class Agreement:
    """The set-once, work-sharing protocol over a c10d Store (see the module docstring)."""

    def __init__(self, store, rank, world_size, *, prefix="tiletune", timeout=DEFAULT_TIMEOUT_SEC,
                 on_timeout="local", mode="share", group=None):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.prefix, self.timeout, self.on_timeout, self.mode = prefix, timeout, on_timeout, mode
        self.group = group
        self._generations = {}
        self._lock = threading.Lock()

    # -- store access ---------------------------------------------------------------------------
    def _get(self, key):
        """The value, or None; never blocks on a missing key."""
        if not self.store.check([key]):
            return None
        value = self.store.get(key)
        return value.decode() if isinstance(value, bytes) else value

    def _set_once(self, key, value):
        """compare_set(key, "", value): the value now under key (ours if we were first)."""
        now = self.store.compare_set(key, "", value)
        return now.decode() if isinstance(now, bytes) else now

    def _namespace(self, name, fresh):
        digest = hashlib.sha256(name.encode()).hexdigest()[:24]
        with self._lock:
            gen = self._generations.get(digest, 0) + (1 if fresh else 0)
            self._generations[digest] = gen
        return f"{self.prefix}/{digest}/{gen}"

    def _wait(self, ready, out, deadline):
        """ready() until it returns something (returned) or the deadline passes (None)."""
        t0, delay = time.monotonic(), _POLL_MIN_SEC
        try:
            while True:
                value = ready()
                if value is not None:
                    return value
                now = time.monotonic()
                if now >= deadline:
                    return None
                time.sleep(min(delay, deadline - now))
                delay = min(delay * 2, _POLL_MAX_SEC)
        finally:
            out.wait_s += time.monotonic() - t0

    # -- the protocol ---------------------------------------------------------------------------
    def decide_now(self, name, entry):
        """Publish `entry` as the decision for `name` unless one stands, and return the entry
        that stands; never waits (the CUDA-graph capture path: a rank that meets a key first
        while capturing picks its stored or default config, and every rank then takes it)."""
        mine = json.dumps({"entry": entry, "by": self.rank, "how": "capture"}, sort_keys=True)
        return json.loads(self._set_once(self._namespace(name, False) + "/d", mine))["entry"]

    def agree(self, name, n, measure, conclude, stored=None, fresh=False):
        """Resolve one key over the job. name: the key as every rank spells it (device-neutral,
        with its config space). n: the number of configs. measure(indices, ahead) -> (timings,
        failures) as the engine's `_measure` returns them; `ahead`: configs this rank may time
        next, to compile in the same batch. conclude(timings, failures) -> the
        entry to publish (ranking and final round on this GPU). stored: this rank's stored
        entry, if any. fresh: the key's next round even if it was decided (the decision did
        not launch here); each rank counts its own rounds per key, so the ranks on which the
        decision failed alike meet in the same round. Returns an Outcome."""
        ns = self._namespace(name, fresh)
        out = Outcome()
        found = self._decided(ns)
        if found is not None:
            return self._adopt(found, out, "adopted")
        if stored is not None:
            return self._decide(ns, stored, "store", out, role="store")
        if self.mode == "replicate":
            return self._replicate(ns, n, measure, conclude, out)
        return self._share(ns, n, measure, conclude, out)

    def _decided(self, ns):
        text = self._get(ns + "/d")
        return None if text is None else json.loads(text)

    def _adopt(self, decision, out, role):
        out.entry, out.how, out.by = decision["entry"], decision["how"], decision["by"]
        out.role = out.role or role
        return out

    def _decide(self, ns, entry, how, out, role):
        mine = json.dumps({"entry": entry, "by": self.rank, "how": how}, sort_keys=True)
        now = self._set_once(ns + "/d", mine)
        out.decided_here = now == mine
        out.role = role if out.decided_here or role != "store" else "adopted"
        return self._adopt(json.loads(now), out, role)

    def _time(self, indices, measure, out, ahead=()):
        """measure(indices, ahead) with this rank's mark on each result, and the error it
        raised or None. A config that fails is in the failures measure returns; an error raised
        (out of memory, a broken compile pool, an interrupt) says nothing about the configs:
        the caller publishes its share as abandoned, so that nobody waits for it and the rank
        that concludes times those configs itself, then raises it here."""
        try:
            timings, failures = measure(indices, ahead)
            error = None
        except BaseException as e:          # noqa: B902 (published, then raised again)
            timings, failures, error = [], [], e
        for t in timings + failures:
            t["rank"] = self.rank
        out.timed += list(indices)
        return timings, failures, error

    def _timed_out(self, what):
        message = (f"tiletune: rank {self.rank} waited {self.timeout:.0f} s for {what}; "
                   "the rank that took it seems to have stopped")
        if self.on_timeout == "raise":
            raise DistributedTuningError(message + " (on_timeout='raise')")
        log.warning("%s: timing it here (on_timeout='local'); the first decision published "
                    "still holds on every rank", message)

    # share: each rank times the chunks it takes ------------------------------------------------
    def _share(self, ns, n, measure, conclude, out):
        chunks = max(1, min(self.world_size, n))

        def chunk(c):
            return [i for i in range(n) if i % chunks == c]
        step, took = 1, False
        while True:
            found = self._decided(ns)
            if found is not None:
                return self._adopt(found, out, "helper" if out.timed else "adopted")
            top = self.store.add(ns + "/next", step)
            taken = [c for c in range(top - step, top) if c < chunks]
            if not taken:
                break
            # The chunks nobody has taken yet are compiled with this one: a rank that turns
            # out to be alone on the key would otherwise compile them in a second batch.
            ahead = [i for c in range(top, chunks) for i in chunk(c)]
            took = True
            timings, failures, error = self._time([i for c in taken for i in chunk(c)],
                                                  measure, out, ahead)
            for c in taken:
                mine = set(chunk(c))
                self.store.set(f"{ns}/c{c}", json.dumps(ABANDONED if error is not None else {
                    "timings": [t for t in timings if t["i"] in mine],
                    "failures": [f for f in failures if f["i"] in mine]}))
            if error is not None:
                raise error
            step = chunks               # after a first chunk, take all that are left
        keys = [f"{ns}/c{c}" for c in range(chunks)]
        # a rank that timed no chunk concludes only once every chunk is published (abandoned,
        # say, by ranks that raised): while one is being timed, its rank, which gets here
        # next, concludes with the finalists it has compiled
        if (took or self.store.check(keys)) and \
                self._set_once(ns + "/fin", str(self.rank)) == str(self.rank):
            out.role = "finisher"
            with self._giving_up_on_error(ns):
                found = self._await_all(ns, keys, out, "the timings of configs another rank took")
                if isinstance(found, dict):
                    return self._adopt(found, out, "finisher")
                return self._finish(ns, chunk, keys, measure, conclude, out)
        out.role = "helper" if out.timed else "waiter"
        if self._await_decision(ns, out, keys) is not None:
            return out
        with self._giving_up_on_error(ns):
            return self._finish(ns, chunk, keys, measure, conclude, out)

    @contextlib.contextmanager
    def _giving_up_on_error(self, ns):
        """The finishing rank's work: where it raises, the rank says so before the error
        propagates, so that a waiting rank concludes at once instead of after its timeout."""
        try:
            yield
        except BaseException:
            self.store.set(ns + "/gave_up", str(self.rank))
            raise

    def _await_decision(self, ns, out, chunks=None):
        """Wait for the finishing rank's decision: adopt it (returns out), or, where that rank
        raised or the timeout passed (`_timed_out`), return None for this rank to conclude.
        chunks (share mode): the chunks' store keys; where every chunk is published and no rank
        claims the finish (the ranks that took them raised before they could), this rank claims
        it and concludes (None) instead of waiting out the timeout."""
        def unclaimed():
            if chunks is None or self._get(ns + "/fin") is not None or \
                    not self.store.check(chunks):
                return None
            return _UNCLAIMED
        deadline = time.monotonic() + self.timeout
        while True:
            found = self._wait(lambda: self._decided(ns) or self._get(ns + "/gave_up") or
                               unclaimed(), out, deadline)
            if found is not _UNCLAIMED:
                break
            if self._set_once(ns + "/fin", str(self.rank)) == str(self.rank):
                log.warning("tiletune: the ranks that timed a key's configs raised; rank %s "
                            "concludes it", self.rank)
                out.role, out.took_over = "finisher", True
                return None
        if isinstance(found, dict):
            return self._adopt(found, out, out.role)
        if found is None:
            self._timed_out("the decision of the finishing rank")
        else:
            log.warning("tiletune: rank %s, which was concluding a key, raised; rank %s "
                        "concludes it", found, self.rank)
        out.took_over = True
        return None

    def _await_all(self, ns, keys, out, what):
        """Wait until every store key in `keys` is set (True) or the key is decided (the
        decision, a dict); on timeout, `_timed_out(what)` (raises, or returns None to go on
        locally)."""
        found = self._wait(lambda: self._decided(ns) or (True if self.store.check(keys)
                                                          else None),
                           out, time.monotonic() + self.timeout)
        if found is None:
            self._timed_out(what)
        return found

    def _finish(self, ns, chunk, keys, measure, conclude, out):
        """Merge every chunk's timings (timing here those missing or abandoned), conclude,
        decide."""
        timings, failures = [], []
        for c, key in enumerate(keys):
            text = self._get(key)
            part = None if text is None else json.loads(text)
            if part is None or part == ABANDONED:   # its rank stopped (past a timeout) or raised
                out.took_over = out.took_over or part is None
                t, f, error = self._time(chunk(c), measure, out)
                if error is not None:
                    raise error
                part = {"timings": t, "failures": f}
            timings += part["timings"]
            failures += part["failures"]
        return self._conclude(ns, timings, failures, conclude, out)

    def _conclude(self, ns, timings, failures, conclude, out):
        found = self._decided(ns)       # a stored winner or a take-over may have come first
        if found is not None:
            return self._adopt(found, out, out.role)
        timings.sort(key=lambda t: t["i"])
        ranks = {t["rank"] for t in timings + failures if isinstance(t.get("rank"), int)}
        for t in timings + failures:
            ranks.update(t.get("ranks", ()))
        entry = conclude(timings, failures)
        return self._decide(ns, entry, "search" if len(ranks) > 1 else "alone", out, out.role)

    # replicate: every rank times every config --------------------------------------------------
    def _replicate(self, ns, n, measure, conclude, out):
        member = self.store.add(ns + "/members", 1)
        found = self._decided(ns)
        if found is not None:
            return self._adopt(found, out, "adopted")
        timings, failures, error = self._time(list(range(n)), measure, out)
        self.store.set(f"{ns}/m{member}", json.dumps(
            ABANDONED if error is not None else {"timings": timings, "failures": failures}))
        if error is not None:
            raise error
        if self._set_once(ns + "/fin", str(self.rank)) != str(self.rank):
            out.role = "helper"
            if self._await_decision(ns, out) is not None:
                return out
            return self._conclude(ns, *_mean_of([(timings, failures)]), conclude, out)
        out.role = "finisher"
        with self._giving_up_on_error(ns):
            members = self.store.add(ns + "/members", 0)    # those that started before this
            keys = [f"{ns}/m{m}" for m in range(1, members + 1)]
            found = self._await_all(ns, keys, out, "the timings of ranks that started on this "
                                    "key")
            if isinstance(found, dict):
                return self._adopt(found, out, "finisher")
            parts = [part for part in (json.loads(text) for text in map(self._get, keys)
                                       if text is not None) if part != ABANDONED]
            return self._conclude(ns, *_mean_of([(p["timings"], p["failures"]) for p in parts]),
                                  conclude, out)


def _mean_of(parts):
    """Merge every rank's timings of every config: a config any rank failed is a failure (its
    first error); the others get the mean of the ranks' means."""
    failed, times = {}, {}
    for timings, failures in parts:
        for f in failures:
            failed.setdefault(f["i"], f)
        for t in timings:
            times.setdefault(t["i"], []).append(t)
    timings = []
    for i in sorted(times):
        if i in failed:
            continue
        ts = times[i]
        timings.append({"i": i, "mean_us": sum(t["mean_us"] for t in ts) / len(ts),
                        "error_us": max(t["error_us"] for t in ts),
                        "samples": sum(t["samples"] for t in ts),
                        "ranks": sorted(t["rank"] for t in ts)})
    failures = [dict((k, v) for k, v in f.items() if k != "rank") | {"ranks": [f["rank"]]}
                for _, f in sorted(failed.items())]
    return timings, failures
