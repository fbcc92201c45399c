"""Multi-GPU tuning (tiletune/distributed.py) on CPU: the agreement protocol with threads as ranks
over one c10d HashStore; the engine with a stand-in search in one process (devices kept apart, the
store shared by every device of a model); every op's keys carry the device; and a job of two
processes over gloo running the engine's real miss path (tests/cpu/dist_worker.py)."""
import datetime
import json
import logging
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import cuda.tile as ct
import cuda.tile.tune
import pytest
import torch
import torch.distributed as dist

from tiletune import autotune, device, distributed, store, timing
from tiletune.autotune import Autotuner, Search, job_key
from tiletune.distributed import Agreement, DistributedTuningError

from tests.cpu import test_engine
from tests.cpu.stand_ins import resolve_misses_to_default, stand_in_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# -- the protocol: threads as ranks over one store ------------------------------------------------

def ranks(world, store=None, **kw):
    store = store or dist.HashStore()
    return [Agreement(store, r, world, prefix="t", **kw) for r in range(world)]


def fake_measure(rank, log, delay=0.0, fail=(), aheads=None):
    """measure(indices, ahead): config i takes 10 + i + rank us (so a rank alone would pick
    config 0), those in `fail` fail; logs (rank, i) of what it timed, and each call's `ahead`
    into `aheads`."""
    def measure(indices, ahead=()):
        if aheads is not None:
            aheads.append(list(ahead))
        time.sleep(delay)
        log.extend((rank, i) for i in indices)
        timings = [{"i": i, "mean_us": 10.0 + i + rank, "error_us": 0.1, "samples": 5}
                   for i in indices if i not in fail]
        return timings, [{"i": i, "error": "RuntimeError", "message": "boom"}
                         for i in indices if i in fail]
    return measure


def conclude(timings, failures):
    """The engine's conclude, reduced: the fastest merged timing wins, ties to the earlier."""
    best = min(timings, key=lambda t: (t["mean_us"], t["i"]))
    return {"config": {"i": best["i"]}, "timings": timings, "failures": failures}


def together(fns):
    """Run fns at once, one thread each; their results (or exceptions) in order."""
    results, gate = [None] * len(fns), threading.Barrier(len(fns))

    def run(k):
        gate.wait()
        try:
            results[k] = fns[k]()
        except Exception as e:
            results[k] = e
    threads = [threading.Thread(target=run, args=(k,)) for k in range(len(fns))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    return results


def test_ranks_share_the_configs_and_take_one_decision():
    log, job = [], ranks(3)
    out = together([lambda a=a: a.agree("k", 7, fake_measure(a.rank, log, 0.2), conclude)
                    for a in job])
    assert all(o.entry == out[0].entry for o in out)
    timed = sorted(i for _, i in log)
    assert timed == list(range(7))                      # every config timed once in the job
    assert {r for r, _ in log} == {0, 1, 2}             # by all three ranks
    assert sum(o.decided_here for o in out) == 1 and {o.how for o in out} == {"search"}
    assert sorted(o.role for o in out) == ["finisher", "helper", "helper"]
    finisher = next(o for o in out if o.role == "finisher")
    assert [t["i"] for t in finisher.entry["timings"]] == list(range(7))


def test_a_key_one_rank_meets_costs_it_no_wait_and_the_others_take_its_decision():
    log, job = [], ranks(2, timeout=5.0)
    t0 = time.perf_counter()
    alone = job[1].agree("x", 4, fake_measure(1, log), conclude)
    assert time.perf_counter() - t0 < 1.0 and alone.wait_s < 0.5
    assert alone.how == "alone" and alone.decided_here and sorted(alone.timed) == [0, 1, 2, 3]
    assert alone.entry["config"] == {"i": 0}
    later = job[0].agree("x", 4, fake_measure(0, log), conclude)
    assert later.role == "adopted" and later.timed == [] and later.entry == alone.entry
    assert len(log) == 4


def test_a_rank_compiles_the_chunks_nobody_took_with_its_own():
    """Alone on a key, a rank times its chunk, then the rest: the rest is compiled in the first
    call's batch (`ahead`), so the second call compiles nothing new."""
    log, aheads, job = [], [], ranks(3, timeout=5.0)
    out = job[2].agree("y", 7, fake_measure(2, log, aheads=aheads), conclude)
    assert out.how == "alone" and sorted(out.timed) == list(range(7))
    assert [sorted(a) for a in aheads] == [[1, 2, 4, 5], []]    # chunks 1 and 2 of (0, 3, 6)


def test_keys_met_in_opposite_orders_do_not_wait_for_each_other():
    log, job = [], ranks(2, timeout=30.0)

    def walk(a, names):
        return [a.agree(n, 4, fake_measure(a.rank, log, 0.2), conclude) for n in names]
    t0 = time.perf_counter()
    r0, r1 = together([lambda: walk(job[0], "AB"), lambda: walk(job[1], "BA")])
    assert time.perf_counter() - t0 < 5.0                # no timeout in the way
    assert r0[0].entry == r1[1].entry and r0[1].entry == r1[0].entry
    per_key = {}
    for o, name in zip(r0 + r1, "ABBA"):
        per_key.setdefault(name, []).extend(o.timed)
    assert all(sorted(v) == [0, 1, 2, 3] for v in per_key.values())   # each key searched once


def test_a_stored_winner_published_mid_search_is_the_decision():
    log, job = [], ranks(2)
    stored = {"config": {"i": 3}, "timings": []}

    def late_store():
        time.sleep(0.1)
        return job[0].agree("s", 4, fake_measure(0, log), conclude, stored=stored)
    searching, publishing = together([
        lambda: job[1].agree("s", 4, fake_measure(1, log, 0.4), conclude), late_store])
    assert publishing.role == "store" and publishing.decided_here
    assert searching.entry == stored and searching.how == "store" and not searching.decided_here


def rank_0_timed_every_chunk(job, name):
    """What rank 0 of a 2-rank job leaves in the store after taking both chunks of a 4-config
    key and publishing their timings (config i at 20 - i us); returns the key's namespace."""
    ns = job[0]._namespace(name, False)
    job[0].store.add(ns + "/next", 2)
    for c in range(2):
        job[0].store.set(f"{ns}/c{c}", json.dumps({"timings": [
            {"i": i, "mean_us": 20.0 - i, "error_us": 0.1, "samples": 5, "rank": 0}
            for i in range(c, 4, 2)], "failures": []}))
    return ns


def test_a_rank_waiting_for_a_stopped_finisher_takes_over():
    """Rank 0 took every chunk, published their timings and claimed the final round, then
    stopped: rank 1 waits `timeout`, then decides from the published timings."""
    job = ranks(2, timeout=0.3)
    ns = rank_0_timed_every_chunk(job, "d")
    job[0].store.compare_set(ns + "/fin", "", "0")
    log = []
    out = job[1].agree("d", 4, fake_measure(1, log), conclude)
    assert out.took_over and out.decided_here and 0.3 <= out.wait_s < 1.0
    assert log == [] and out.entry["config"] == {"i": 3}     # rank 0's timings, none retimed


@pytest.mark.parametrize("mode", ["share", "replicate"])
@pytest.mark.parametrize("policy", ["local", "raise"])
def test_a_finisher_that_raises_hands_the_key_over_at_once(mode, policy):
    """The rank concluding a key raises (out of memory in its final round, say): it says so
    before the error propagates, and the waiting ranks conclude at once (well inside their
    timeout, whatever on_timeout says, since no rank stopped)."""
    job, log, raised, lock = ranks(3, timeout=5.0, on_timeout=policy, mode=mode), [], [], \
        threading.Lock()

    def first_raises(timings, failures):     # the first rank to conclude runs out of memory
        with lock:
            if not raised:
                raised.append(True)
                raise MemoryError("out of memory in the final round")
        return conclude(timings, failures)
    t0 = time.monotonic()
    outs = together([lambda r=r: job[r].agree("k", 3, fake_measure(r, log, delay=0.1 * r),
                                              first_raises) for r in range(3)])
    assert time.monotonic() - t0 < 3.0
    errors = [o for o in outs if isinstance(o, BaseException)]
    done = [o for o in outs if not isinstance(o, BaseException)]
    assert len(errors) == 1 and isinstance(errors[0], MemoryError) and len(done) == 2
    assert done[0].entry == done[1].entry and any(o.took_over for o in done)


def test_a_process_outside_the_group_is_told_so(monkeypatch):
    """dist.new_group([0]) seen from rank 1: rank and world size -1; the error says the process
    is no member, before any lookup of the group's store."""
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_rank", lambda group=None: -1)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: -1)
    monkeypatch.setattr(distributed, "_group_store", lambda group: pytest.fail("looked up"))
    with pytest.raises(ValueError, match="is not a member of the group"):
        distributed.set_process_group(group=object())


def test_a_rank_that_timed_no_chunk_concludes_only_once_every_chunk_is_published():
    """Rank 0 took both chunks and is timing them; rank 1 arrives: it timed nothing, so it
    waits for rank 0's decision instead of concluding (here rank 0 never comes: rank 1 takes
    over after its timeout). Where every chunk is published, abandoned by a rank that raised,
    a late rank concludes at once."""
    job = ranks(2, timeout=0.3)
    ns = job[0]._namespace("late", False)
    job[0].store.add(ns + "/next", 2)
    log = []
    out = job[1].agree("late", 4, fake_measure(1, log), conclude)
    assert out.role == "waiter" and out.took_over and out.wait_s >= 0.3
    assert sorted(i for _, i in log) == [0, 1, 2, 3]
    ns = job[0]._namespace("abandoned", False)
    job[0].store.add(ns + "/next", 2)
    for c in range(2):
        job[0].store.set(f"{ns}/c{c}", json.dumps(distributed.ABANDONED))
    log = []
    out = job[1].agree("abandoned", 4, fake_measure(1, log), conclude)
    assert out.role == "finisher" and out.wait_s < 0.3 and sorted(i for _, i in log) == [0, 1, 2, 3]


@pytest.mark.parametrize("policy", ["local", "raise"])
def test_a_waiter_concludes_at_once_when_the_rank_that_took_every_chunk_raises(policy):
    """Rank 0 timed a chunk, took the rest and raised while timing them (out of memory): its
    chunks are published abandoned and no rank claims the finish. Rank 1, which arrived
    meanwhile and found no chunk left, claims it and concludes at once (it waited out its
    whole timeout, then raised on on_timeout='raise' that rank 0 'seems to have stopped')."""
    job, log, calls, second = ranks(2, timeout=5.0, on_timeout=policy), [], [], \
        threading.Event()

    def raises_in_its_second_batch(indices, ahead=()):
        calls.append(list(indices))
        if len(calls) == 1:
            return fake_measure(0, log)(indices, ahead)
        second.set()                       # rank 0 holds every chunk now
        time.sleep(0.2)
        raise torch.cuda.OutOfMemoryError("out of memory")
    first = []

    def rank0():
        try:
            job[0].agree("k", 4, raises_in_its_second_batch, conclude)
        except torch.cuda.OutOfMemoryError as e:
            first.append(e)
    worker = threading.Thread(target=rank0)
    worker.start()
    second.wait(5)
    t0 = time.monotonic()
    out = job[1].agree("k", 4, fake_measure(1, log), conclude)
    worker.join(10)
    assert first and time.monotonic() - t0 < 2.0
    assert out.role == "finisher" and out.took_over and out.decided_here
    assert sorted(i for r, i in log if r == 1) == [1, 3]       # the abandoned chunk, timed here


def test_a_finisher_times_a_chunk_whose_rank_stopped_or_raises_if_told():
    for policy in ("local", "raise"):
        job = ranks(2, timeout=0.3, on_timeout=policy)
        job[0].store.add(job[0]._namespace("c", False) + "/next", 1)   # chunk 0, never timed
        log = []
        if policy == "raise":
            with pytest.raises(DistributedTuningError, match="waited 0 s for the timings"):
                job[1].agree("c", 4, fake_measure(1, log), conclude)
            continue
        out = job[1].agree("c", 4, fake_measure(1, log), conclude)
        assert out.took_over and sorted(i for _, i in log) == [0, 1, 2, 3]


@pytest.mark.parametrize("mode", ["share", "replicate"])
def test_a_rank_whose_search_raises_abandons_its_share_to_the_others(mode):
    """An error a rank's search raises (out of memory, an interrupt) says nothing about the
    configs: nobody waits for that rank, the rank that concludes times its share itself, and no
    config is recorded as failed (a stored winner would otherwise never time them again)."""
    job, log = ranks(2, timeout=10.0, mode=mode), []

    def broken(indices, ahead=()):
        raise torch.cuda.OutOfMemoryError("out of memory")
    t0 = time.perf_counter()
    bad, good = together([lambda: job[0].agree("e", 4, broken, conclude),
                          lambda: job[1].agree("e", 4, fake_measure(1, log, 0.3), conclude)])
    assert isinstance(bad, torch.cuda.OutOfMemoryError) and time.perf_counter() - t0 < 5.0
    assert good.entry["failures"] == [] and good.entry["config"] == {"i": 0}
    assert sorted(t["i"] for t in good.entry["timings"]) == [0, 1, 2, 3]
    assert sorted(i for _, i in log) == [0, 1, 2, 3]        # all timed by the healthy rank


def test_fresh_opens_a_new_round():
    job, log = ranks(1), []
    first = job[0].agree("f", 2, fake_measure(0, log), conclude)
    again = job[0].agree("f", 2, fake_measure(0, log), conclude)
    assert again.role == "adopted" and len(log) == 2
    fresh = job[0].agree("f", 2, fake_measure(0, log), conclude, fresh=True)
    assert fresh.decided_here and len(log) == 4 and first.entry == fresh.entry


def test_replicate_mode_merges_every_ranks_means():
    log, job = [], ranks(2, mode="replicate")
    out = together([lambda a=a: a.agree("r", 3, fake_measure(a.rank, log, 0.3, fail={2}
                                                             if a.rank else ()), conclude)
                    for a in job])
    assert out[0].entry == out[1].entry and sorted(log) == [(r, i) for r in (0, 1)
                                                            for i in range(3)]
    timings = out[0].entry["timings"]
    assert [(t["i"], t["mean_us"], t["ranks"]) for t in timings] == [(0, 10.5, [0, 1]),
                                                                    (1, 11.5, [0, 1])]
    assert [(f["i"], f["ranks"]) for f in out[0].entry["failures"]] == [(2, [1])]


def test_set_process_group_checks_its_arguments():
    with pytest.raises(ValueError, match="mode"):
        distributed.set_process_group(mode="gather")
    with pytest.raises(ValueError, match="on_timeout"):
        distributed.set_process_group(on_timeout="hang")
    if not dist.is_initialized():
        with pytest.raises(RuntimeError, match="init_process_group"):
            distributed.set_process_group()
    with pytest.raises(ValueError, match="not a member"):
        distributed.set_process_group(store=dist.HashStore(), rank=2, world_size=2)
    for bad, error in (("600", TypeError), (True, TypeError), (0, ValueError),
                       (float("inf"), ValueError), (datetime.timedelta(0), ValueError)):
        with pytest.raises(error, match="^set_process_group: timeout must be"):
            distributed.set_process_group(store=dist.HashStore(), rank=0, world_size=1,
                                          timeout=bad)
    assert distributed.get_process_group() is None
    try:
        job = distributed.set_process_group(store=dist.HashStore(), rank=0, world_size=1,
                                            timeout=datetime.timedelta(minutes=10))
        assert job.timeout == 600.0
    finally:
        distributed.clear_process_group()


def test_another_ranks_failure_of_the_moment_opens_the_next_round_at_once(engine):
    """Rank 0 met the key alone and every config ran out of memory there: its decision is that
    failure. Rank 1, which had no part in it, opens the key's next round in the same call and
    searches (it raised TuningFailedError for an out-of-memory it never had); rank 0's next
    call, in that round, adopts rank 1's decision."""
    t, x = engine.tuner, torch.zeros(4)
    store = dist.HashStore()
    distributed.set_process_group(store=store, rank=1, world_size=2)
    try:
        cfgs = t.config_list("sm_90", dict(n=16))
        name = t.agreement_name((16, 0), 0, cfgs)
        rank0 = Agreement(store, 0, 2, prefix=distributed.current().prefix)
        oom = [[autotune.config_dict(c), "OutOfMemoryError", "CUDA out of memory. Tried to "
                "allocate 2.00 GiB"] for c in cfgs]
        rank0.agree(name, len(cfgs), lambda i, a=(): ([], []), lambda tm, f: {"failed": oom})
        t.launch((16, 0), 0, x, 16)
        assert engine.searched and t.records[(16, 0)].config == {"tile": 16, "occupancy": 2}
        again = rank0.agree(name, len(cfgs), lambda i, a=(): pytest.fail("timed"),
                            lambda tm, f: pytest.fail("concluded"), fresh=True)
        assert again.role == "adopted" and again.entry["config"] == {"tile": 16, "occupancy": 2}
    finally:
        distributed.clear_process_group()


def test_ranks_of_different_sizes_under_one_bucketed_key_are_ranked_at_one_size(engine):
    """Two ranks meet one tuning key at different real sizes (the key buckets rows): rank 1,
    half rank 0's work, times occupancies 1 and 4 (12 and 11 us at rank 0's size), rank 0
    times occupancy 2 (10 us). Ranked raw, rank 1's 5.5 us won; scaled by each timing's work
    to the concluding rank's size, occupancy 2 does."""
    t = Autotuner(f"dist_sized_{id(engine)}", _k, test_engine._space,
                  default=SimpleNamespace(tile=8, occupancy=1), space=lambda x, n: dict(n=n),
                  grid=lambda c, dev, x, n: (1,), args=lambda c, x, n: (x, c.tile),
                  work=lambda x, n: autotune.Work(bytes=4.0 * n))
    store = dist.HashStore()
    distributed.set_process_group(store=store, rank=0, world_size=2)
    try:
        cfgs = t.config_list("sm_90", dict(n=32))
        other = Agreement(store, 1, 2, prefix=distributed.current().prefix)
        started = threading.Event()
        fin = other._namespace(t.agreement_name((32, 0), 0, cfgs), False) + "/fin"

        def rank1_measure(indices, ahead=()):
            started.set()
            deadline = time.monotonic() + 20      # until rank 0 timed its chunk and concludes
            while not store.check([fin]) and time.monotonic() < deadline:
                time.sleep(0.005)
            return [{"i": i, "mean_us": 5.0 + 0.5 * abs(cfgs[i].occupancy - 2), "error_us": 0.1,
                     "samples": 5, "work": 2.0 * 32} for i in indices], []
        other_out = []
        rank1 = threading.Thread(target=lambda: other_out.append(other.agree(
            t.agreement_name((32, 0), 0, cfgs), len(cfgs), rank1_measure,
            lambda tm, f: pytest.fail("rank 1 concluded"))))
        rank1.start()
        started.wait(5)                           # rank 1 holds chunk 0 (occupancies 1 and 4)
        t.launch((32, 0), 0, torch.zeros(4), 32)
        rank1.join(10)
        assert engine.searched == [[2]]           # rank 0 timed chunk 1 only
        assert t.records[(32, 0)].config == {"tile": 32, "occupancy": 2}
        assert other_out[0].entry["config"] == {"tile": 32, "occupancy": 2}
    finally:
        distributed.clear_process_group()


def test_keys_resolved_before_the_group_resolve_again_through_it(engine):
    """A warm-up call before set_process_group resolved a key on this rank alone; the job then
    decided it otherwise: the call after set_process_group takes the job's decision (a cache
    hit never asks the group, so every rank must start from an empty cache)."""
    t, x = engine.tuner, torch.zeros(4)
    t.launch((32, 0), 0, x, 32)
    mine = t.records[(32, 0)].config
    store = dist.HashStore()
    distributed.set_process_group(store=store, rank=0, world_size=2)
    try:
        cfgs = t.config_list("sm_90", dict(n=32))
        other = Agreement(store, 1, 2, prefix=distributed.current().prefix)
        # rank 1 meets the key first in the job; its timings favour config 0
        out = other.agree(t.agreement_name((32, 0), 0, cfgs), len(cfgs), fake_measure(1, []),
                          lambda timings, failures: {"config": autotune.config_dict(
                              cfgs[conclude(timings, failures)["config"]["i"]])})
        decided = out.entry["config"]
        assert decided != mine
        t.launch((32, 0), 0, x, 32)
        assert t.records[(32, 0)].config == decided
    finally:
        distributed.clear_process_group()


# -- the engine in one process ----------------------------------------------------------------------

_k, _space = test_engine._k, test_engine._space    # the stand-in kernel and its space


@pytest.fixture
def engine(monkeypatch, tmp_path):
    """The engine with the GPU stood in for: occupancy 2 wins the search and the final round."""
    stand_in_gpu(monkeypatch, tmp_path / "store", "Fake H100")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)   # devices 0 and 1
    launches, searched = [], []
    monkeypatch.setattr(ct, "launch", lambda stream, grid, kernel, args: launches.append(kernel))

    def search(space, stream, grid_fn, kernel, args_fn):
        searched.append([c.occupancy for c in space])
        ok = [cuda.tile.tune.Measurement(config=c, mean_us=10.0 + abs(c.occupancy - 2),
                                         num_samples=5, error_margin_us=0.1) for c in space]
        return cuda.tile.tune.TuningResult(best=ok[0], successes=ok, failures=[])
    monkeypatch.setattr(timing, "search_kernels", search)
    # the final round (the winner and the default) agrees with the search
    monkeypatch.setattr(timing, "time_interleaved", lambda c, **kw: {i: 10.0 + i for i, _, _ in c})
    monkeypatch.setattr(distributed, "_agreement", None)
    monkeypatch.setattr(autotune, "_registry", dict(autotune._registry))   # dropped after
    t = Autotuner(f"dist_engine_{id(tmp_path)}", _k, _space,
                  default=SimpleNamespace(tile=8, occupancy=1),
                  space=lambda x, n: dict(n=n), grid=lambda c, dev, x, n: (1,),
                  args=lambda c, x, n: (x, c.tile))
    yield SimpleNamespace(tuner=t, launches=launches, searched=searched)


def test_job_key_reads_the_device_index_an_op_puts_last_as_0():
    assert job_key((4096, torch.bfloat16, 3), 3) == (4096, torch.bfloat16, 0)
    assert job_key((4096, 0), 0) == (4096, 0)
    assert job_key((4096, 7), 3) == (4096, 7)            # not its device: kept
    assert job_key((4096, True), 1) == (4096, True)       # a flag, not an index
    assert job_key(("k", torch.device("cuda", 2)), torch.device("cuda", 2)) == \
        ("k", torch.device("cuda", 0))
    assert job_key((), 1) == ()


def test_a_second_gpu_gets_its_own_kernel_and_the_first_gpus_stored_winner(engine):
    """Keys on cuda:1 never reuse what was resolved for cuda:0 in memory (own cache entry, own
    kernel object, own launch plan); the store serves both (one search, one row)."""
    t, x = engine.tuner, torch.zeros(4)
    t.launch((16, 0), 0, x, 16)
    t.launch((16, 1), 1, x, 16)
    assert len(engine.searched) == 1 and t.records[(16, 1)].source == "store"
    (cfg0, k0), (cfg1, k1) = t.cache[(16, 0)], t.cache[(16, 1)]
    assert cfg0 == cfg1 and k0 is not k1
    engine.launches.clear()
    for dev in (0, 1, 1, 0):
        t.launch((16, dev), dev, x, 16)
    assert engine.launches == [k0, k1, k1, k0]
    assert t._plans[(16, 0)][0] is k0 and t._plans[(16, 1)][0] is k1
    (skey,) = store.entries(t.name)[t.name]
    assert skey.startswith("16 | 0 | Fake H100")


def test_a_hit_never_consults_the_process_group(engine, monkeypatch):
    t, x = engine.tuner, torch.zeros(4)
    t.launch((16, 0), 0, x, 16)
    monkeypatch.setattr(distributed, "current", lambda: pytest.fail("consulted on a hit"))
    t.launch((16, 0), 0, x, 16)
    assert len(engine.launches) == 3          # warm launch after the search, then two calls


def test_a_job_of_one_rank_tunes_stores_once_and_records_the_agreement(engine):
    t, x = engine.tuner, torch.zeros(4)
    distributed.set_process_group(store=dist.HashStore(), rank=0, world_size=1)
    try:
        t.launch((32, 0), 0, x, 32)
        rec = t.records[(32, 0)]
        assert rec.source == "search" and rec.config == {"tile": 32, "occupancy": 2}
        assert rec.agreement["how"] == "alone" and rec.agreement["role"] == "finisher"
        assert [tm["rank"] for tm in rec.timings] == [0, 0, 0]
        assert len(store.entries(t.name)[t.name]) == 1
        t.clear()                           # the job's decision stands: nothing timed again
        store.clear()
        t.launch((32, 0), 0, x, 32)
        assert t.records[(32, 0)].source == "agreed" and len(engine.searched) == 1
        assert store.entries() == {}         # adopting a decision writes nothing
    finally:
        distributed.clear_process_group()


def test_capture_takes_the_jobs_decision(engine, monkeypatch):
    t, x = engine.tuner, torch.zeros(4)
    monkeypatch.setenv("TILETUNE_CACHE_DIR", "off")
    distributed.set_process_group(store=dist.HashStore(), rank=0, world_size=1)
    try:
        t.launch((64, 0), 0, x, 64)
        t.clear()
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        with pytest.warns(UserWarning, match="capture"):
            cfg, _ = t.tune((64, 0), 0, Search(dict(n=64), lambda c: (1,), lambda c: ()))
        assert cfg.occupancy == 2 and len(engine.searched) == 1
    finally:
        distributed.clear_process_group()


def test_a_key_first_met_in_capture_becomes_the_jobs_decision(engine, monkeypatch):
    """A rank that meets a key first while capturing a CUDA graph (no search there) publishes
    the config it takes, so the job's later resolution of the key (any rank, here this one
    after the capture) adopts it instead of searching another; nothing is stored (nothing was
    tuned)."""
    t, x = engine.tuner, torch.zeros(4)
    distributed.set_process_group(store=dist.HashStore(), rank=0, world_size=2)
    try:
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
        with pytest.warns(UserWarning, match="capture"):
            cfg, _ = t.tune((64, 0), 0, Search(dict(n=64), lambda c: (1,), lambda c: ()))
        assert cfg.occupancy == 1 and engine.searched == []     # the default, not searched
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
        t.clear()
        t.launch((64, 0), 0, x, 64)
        rec = t.records[(64, 0)]
        assert rec.config["occupancy"] == 1 and rec.source == "agreed" and engine.searched == []
        assert rec.agreement["how"] == "capture" and store.entries() == {}
    finally:
        distributed.clear_process_group()


def test_a_job_decision_failed_for_the_moment_opens_the_keys_next_round(engine, monkeypatch):
    """Every config failed out of memory (no verdict on any of them): the job's decision for
    the key is that failure, and each rank that read it searches the key's next round at its
    next call, as a single process searches again, instead of raising it for the job's life.
    A failure of the configs' own stays decided."""
    x, t = torch.zeros(4), engine.tuner
    real_search = timing.search_kernels

    distributed.set_process_group(store=dist.HashStore(), rank=0, world_size=1)
    try:
        for (etype, message), again in (((torch.cuda.OutOfMemoryError, "CUDA out of memory"),
                                         True),
                                        ((type("TileTypeError", (Exception,), {}), "bad"),
                                         False)):
            key = (16 if again else 32, 0)

            def nothing_timed(space, *a):
                raise timing.NoValidConfig("No valid config",
                                           [(c, etype, message) for c in space])
            monkeypatch.setattr(timing, "search_kernels", nothing_timed)
            with pytest.raises(autotune.TuningFailedError):
                t.launch(key, 0, x, key[0])
            monkeypatch.setattr(timing, "search_kernels", real_search)
            searched = len(engine.searched)
            if again:
                t.launch(key, 0, x, key[0])
                assert len(engine.searched) == searched + 1 and key in t.cache
            else:
                with pytest.raises(autotune.TuningFailedError):
                    t.launch(key, 0, x, key[0])
                assert len(engine.searched) == searched
    finally:
        distributed.clear_process_group()


def test_an_adopted_decision_that_fails_to_launch_is_searched_again_in_the_next_round(
        engine, monkeypatch, caplog):
    """A decision this rank adopted without timing it (another rank's stored winner, say one
    tuned under a driver that no longer takes its kernel) fails its first launch here: one
    warning, the key is searched in its next round (the round every rank whose launch fails the
    same way joins, so they agree again), the new winner launches and is the job's decision."""
    x = torch.zeros(4)
    t = Autotuner(f"dist_refused_{id(engine)}", _k, _space,
                  default=SimpleNamespace(tile=8, occupancy=1), space=lambda x, n: dict(n=n),
                  grid=lambda c, dev, x, n: (1,), args=lambda c, x, n: (x, c.occupancy))
    distributed.set_process_group(store=dist.HashStore(), rank=0, world_size=2)
    try:
        cfgs = t.config_list(device.arch(0), dict(n=16))
        distributed.current().decide_now(t.agreement_name((16, 0), 0, cfgs),
                                         {"config": autotune.config_dict(cfgs[2])})  # occupancy 4
        refused, launched = [], []

        def launch(stream, grid, kernel, args):
            if args[1] == 4:
                refused.append(args)
                raise RuntimeError("CUDA_ERROR_NO_BINARY_FOR_GPU")
            launched.append(args)
        monkeypatch.setattr(ct, "launch", launch)
        with caplog.at_level(logging.WARNING, logger="tiletune"):
            t.launch((16, 0), 0, x, 16)
        assert len(refused) == 1 and "failed to launch" in caplog.text
        assert launched[-1] == (x, 2) and t.records[(16, 0)].config["occupancy"] == 2
        assert sorted(sum(engine.searched, [])) == [1, 2, 4]           # both chunks, here
        t.launch((16, 0), 0, x, 16)
        assert launched[-1] == (x, 2) and len(refused) == 1
        t.clear()                       # the next round's decision stands: no search again
        t.launch((16, 0), 0, x, 16)
        assert t.records[(16, 0)].config["occupancy"] == 2 and launched[-1] == (x, 2)
        assert len(engine.searched) == 2 and len(refused) == 1
    finally:
        distributed.clear_process_group()


def test_a_decision_timed_here_that_fails_to_launch_is_the_callers_error(engine, monkeypatch):
    """As outside a job: a config this rank launched in its own search is not searched again
    when a later launch fails (the error says something about the inputs or the GPU)."""
    x = torch.zeros(4)
    t = engine.tuner
    distributed.set_process_group(store=dist.HashStore(), rank=0, world_size=1)
    try:
        t.launch((32, 0), 0, x, 32)             # searched here: the first launch succeeds
        t._plans.clear()
        monkeypatch.setattr(ct, "launch", lambda *a: (_ for _ in ()).throw(RuntimeError("bad")))
        with pytest.raises(RuntimeError, match="bad"):
            t.launch((32, 0), 0, x, 32)
        assert len(engine.searched) == 1
    finally:
        distributed.clear_process_group()


# -- every op keys its launches by device ------------------------------------------------------------

def _device_runs():
    from tests.cpu import test_launch_plans as plans
    from tiletune.ops import gated_mlp as GM
    from tiletune.ops import matmul as MM
    bf16 = torch.bfloat16

    def matmul(m):
        a, b = torch.randn(1, m, 64, dtype=bf16), torch.randn(1, 64, 96, dtype=bf16)
        MM.launch(a, b, torch.empty(1, m, 96, dtype=bf16))

    def gated(m):
        x, w = torch.randn(1, m, 64, dtype=bf16), torch.randn(1, 64, 96, dtype=bf16)
        y = torch.empty(1, m, 96, dtype=bf16)
        GM.launch(x, w, w, y, y, y, 0, False)
    runs = {op: (run, small) for op, (run, small, _) in plans.OPS.items()
            if op != "rms_norm_wide_backward"}       # that entry passes a key by hand
    runs.update(matmul=(matmul, 100), gated_mlp=(gated, 100))
    return runs


DEVICE_RUNS = _device_runs()


@pytest.mark.parametrize("op", DEVICE_RUNS)
def test_every_op_keys_its_launches_by_device(launches, monkeypatch, op):
    """The op runs as if on cuda:0, then on cuda:1 (ct.launch stubbed): each tuner it uses
    resolves a key per device, the keys differ only in their last part, the device index (which
    the store and a job read as 0), and the cuda:1 run launches only kernels resolved for it."""
    from tiletune.ops import fp8_gemm as F8

    resolve_misses_to_default(monkeypatch, lambda tuner, dev: f"{tuner.name} kernel for {dev}")
    monkeypatch.setattr(F8, "device_arch", lambda dev: "sm_90")
    autotune.clear_cache()
    run, size = DEVICE_RUNS[op]
    try:
        for dev in (0, 1):
            monkeypatch.setitem(device._SM_COUNT, dev, 132)
            monkeypatch.setattr(torch.Tensor, "get_device", lambda self, d=dev: d)
            del launches[:]
            run(size)
            assert launches and all(k.endswith(f"for {dev}") for _, k, _ in launches)
        tuned = {name: list(t.cache) for name, t in autotune.tuners().items() if t.cache}
        assert tuned
        for name, keys in tuned.items():
            assert sorted(k[-1] for k in keys) == [0, 1], (name, keys)
            k0, k1 = sorted(keys, key=lambda k: k[-1])
            assert k0[:-1] == k1[:-1] and job_key(k1, 1) == k0, (name, keys)
    finally:
        autotune.clear_cache()


# -- a job of two processes over gloo --------------------------------------------------------------

@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """Both ranks of tests/cpu/dist_worker.py, run once: {rank: what it saw}."""
    folder = tmp_path_factory.mktemp("job")
    env = {k: v for k, v in os.environ.items()
           if k not in ("TILETUNE_CACHE_DIR", "DISABLE_AUTOTUNE", "TILETUNE_LOG")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    worker = os.path.join(ROOT, "tests", "cpu", "dist_worker.py")
    procs = [subprocess.Popen([sys.executable, worker, str(r), "2", str(folder)], cwd=ROOT,
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
             for r in range(2)]
    outputs = []
    try:
        for p in procs:
            outputs.append(p.communicate(timeout=120)[0].decode(errors="replace"))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    results = {}
    for r in range(2):
        path = folder / f"rank{r}.json"
        assert path.exists(), f"rank {r} wrote nothing:\n{outputs[r][-3000:]}"
        results[r] = json.loads(path.read_text())
        assert "error" not in results[r], results[r].get("error")
    results["folder"] = folder
    results["output"] = outputs
    return results


def _same(job, name):
    a, b = job[0][name], job[1][name]
    return a["config"] == b["config"], a, b


def test_job_ranks_that_would_disagree_alone_launch_one_config(job):
    for n in range(2):
        a, b = job[0]["same_order"][n], job[1]["same_order"][n]
        assert a["config"] == b["config"]
        ra, rb = a["record"], b["record"]
        assert (ra["config"], ra["timings"], ra["final"], ra["failures"]) == \
            (rb["config"], rb["timings"], rb["final"], rb["failures"])
        assert {t["rank"] for t in ra["timings"]} == {0, 1}      # timed by both ranks
        assert ra["agreement"]["how"] == "search" and ra["agreement"]["by"] in (0, 1)
    for n, tile in enumerate((16, 32)):                 # each config timed once in the job
        timed = [o for r in (0, 1) for t, o in job[r]["same_order_timed"] if t == tile]
        assert sorted(timed) == [1, 2, 4, 8]
        roles = sorted(job[r]["same_order"][n]["record"]["agreement"]["role"] for r in (0, 1))
        assert roles == ["finisher", "helper"]


def test_job_stores_each_decision_once(job):
    saves = job[0]["saves"] + job[1]["saves"]
    assert len(saves) == len({tuple(s) for s in saves})
    shared = [s for s in saves if s[1].split(" | ")[0] in ("16", "32")]
    assert len(shared) == 2 and all(" | 0 | Fake H100 |" in s[1] for s in shared)


def test_job_a_key_only_one_rank_meets_does_not_hang(job):
    extra = job[1]["extra"]
    assert extra["seconds"] < 2.0 and extra["record"]["agreement"]["how"] == "alone"
    assert extra["record"]["agreement"]["wait_s"] < 0.5 and "extra" not in job[0]


def test_job_keys_met_in_opposite_orders_agree_without_waiting(job):
    for n in ("128", "256"):
        assert job[0]["opposite"][n]["config"] == job[1]["opposite"][n]["config"]
        timed = [o for r in (0, 1) for t, o in job[r]["opposite_timed"] if str(t) == n]
        assert sorted(timed) == [1, 2, 4, 8]            # one search per key in the job
    assert max(job[0]["opposite_s"], job[1]["opposite_s"]) < 5.0


def test_job_warm_starts_from_a_store_written_on_one_gpu(job):
    same, a, b = _same(job, "warm")
    assert same and job[0]["warm_timed"] == [] and job[1]["warm_timed"] == []
    assert a["record"]["key"] == ["512", "0"] and b["record"]["key"] == ["512", "1"]
    assert {a["record"]["source"], b["record"]["source"]} == {"store"}


def test_job_one_ranks_stored_winner_is_the_jobs_decision(job):
    same, a, b = _same(job, "own_store")
    assert same and a["config"]["occupancy"] == 4
    assert a["record"]["source"] == "store" and b["record"]["source"] == "agreed"
    assert job[1]["own_store_timed"] == [] and job[1]["own_store_rows"] == 0


def test_job_a_rank_that_stopped_mid_search_costs_the_timeout_then_its_configs(job):
    dead = job[1]["dead"]
    assert dead["record"]["agreement"]["took_over"] and 2.0 <= dead["seconds"] < 10.0
    assert dead["record"]["agreement"]["timed"] and len(dead["record"]["timings"]) == 4
    assert job[1]["dead_log"] and "on_timeout='local'" in job[1]["dead_log"][0]
    assert "waited 2 s" in job[1]["raise"] and "on_timeout='raise'" in job[1]["raise"]
    assert 2.0 <= job[1]["raise_s"] < 10.0


def test_job_replicate_mode_times_everything_everywhere_and_agrees(job):
    same, a, b = _same(job, "replicate")
    assert same
    for r in (0, 1):
        assert sorted(o for _, o in job[r]["replicate_timed"]) == [1, 2, 4, 8]
    assert all(t["ranks"] == [0, 1] for t in a["record"]["timings"])


def test_job_every_config_failing_fails_every_rank_alike(job):
    assert job[0]["all_fail"] == job[1]["all_fail"] and len(job[0]["all_fail"]) == 4


def test_the_two_gpu_script_passes_its_dry_run(tmp_path):
    """tests/gpu/distributed_2gpu.py (what the 2-GPU test runs under torchrun) on CPU over gloo,
    torch math behind stand-in tuners: its checks pass with the agreement on."""
    env = {k: v for k, v in os.environ.items() if k not in ("DISABLE_AUTOTUNE", "TILETUNE_LOG")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         os.path.join(ROOT, "tests", "gpu", "distributed_2gpu.py"), "--dry-run", "--dir",
         str(tmp_path), "--steps", "2", "--hidden", "64", "--heads", "4", "--inter", "128",
         "--vocab", "256", "--watchdog", "100"],
        capture_output=True, text=True, timeout=150, cwd=ROOT, env=env)
    text = out.stdout + out.stderr
    assert out.returncode == 0 and "RESULT: PASS" in text, text[-4000:]
    assert text.count("PASS") >= 8 and "FAIL" not in text
