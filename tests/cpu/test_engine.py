"""The engine's own logic, driven through its real code; a stand-in replaces only the GPU search."""
import errno
import fcntl
import inspect
import json
import logging
import os
import sqlite3
import subprocess
import sys
import threading
import time
import warnings
from types import SimpleNamespace

import cuda.tile as ct
import cuda.tile.tune
from cuda.tile._exception import Loc
import pytest
import torch

import tiletune.env
from tiletune import autotune, precompile, store, timing
from tiletune.autotune import Autotuner, Search, TuningFailedError, Work, bucket

from tests.cpu.stand_ins import fork, stand_in_gpu, wait_child

REAL_SEARCH = timing.search_kernels          # (the fixture stands a fake in for it)


@ct.kernel
def _k(x, T: ct.Constant[int]):
    ct.store(x, (ct.bid(0),), ct.load(x, (ct.bid(0),), (T,)))


def _space(arch, n):
    for occ in (1, 2, 4):
        yield SimpleNamespace(tile=n, occupancy=occ)


class FakeSearch:
    """Stands in for timing.search_kernels: times are a function of the config; counts
    calls."""

    def __init__(self, fail=(), delay=0.0, best_occ=2, base_us=10.0):
        self.calls, self.fail, self.delay, self.best_occ = 0, set(fail), delay, best_occ
        self.base_us = base_us
        # cfg -> (error type name, message) of a failing config
        self.error = lambda c: ("RuntimeError", f"boom {c.occupancy}")

    def __call__(self, space, stream, grid_fn, kernel, args_fn):
        self.calls += 1
        built = [kernel(c) for c in space]            # what the real search launches
        self.kernels = [k._pyfunc.__name__ for k in built]
        time.sleep(self.delay)
        ok, bad = [], []
        for c in space:
            if c.occupancy in self.fail:
                name, message = self.error(c)
                bad.append((c, type(name, (Exception,), {}), message))
            else:
                ok.append(cuda.tile.tune.Measurement(config=c, mean_us=self.base_us + abs(c.occupancy - self.best_occ),
                                                     num_samples=5, error_margin_us=0.1))
        if not ok:
            raise timing.NoValidConfig("No valid config found in search space.", bad)
        return cuda.tile.tune.TuningResult(best=min(ok, key=lambda m: m.mean_us), successes=ok, failures=bad)


class FakeFinalRound:
    """Stands in for the final round's timing: finalist i takes times[i] us (default: their
    order, 10 us apart); records what it was given."""

    def __init__(self):
        self.calls, self.times, self.kwargs = [], None, []

    def __call__(self, candidates, **kw):
        self.calls.append([label for label, _, _ in candidates])
        self.kwargs.append(kw)
        if isinstance(self.times, Exception):
            raise self.times
        for _, fn, _ in candidates:      # one run each, so tests see what the round launches
            fn()
        return {label: (self.times or {}).get(label, 10.0 * (1 + label))
                for label, _, _ in candidates}


class FakeRuns:
    """Stands in for timing.search_runs: the config of index i takes times[i] us (default
    10 * (1 + i)), an exception there being its failure; runs each config's run once, so tests
    see what the runs launch; records the indices it was given."""

    def __init__(self):
        self.calls, self.times = [], {}

    def __call__(self, runs):
        self.calls.append([i for i, _ in runs])
        ok, bad = [], []
        for i, fn in runs:
            us = self.times.get(i, 10.0 * (1 + i))
            try:
                fn()
                if isinstance(us, Exception):
                    raise us
                ok.append(cuda.tile.tune.Measurement(config=i, mean_us=us, num_samples=5,
                                                     error_margin_us=0.1))
            except Exception as e:
                bad.append((i, type(e), str(e)))
        if not ok:
            raise timing.NoValidConfig("No valid config found in search space.", bad)
        return cuda.tile.tune.TuningResult(best=min(ok, key=lambda m: m.mean_us),
                                           successes=ok, failures=bad)


@pytest.fixture
def env(monkeypatch, tmp_path):
    stand_in_gpu(monkeypatch, tmp_path / "store", "Fake H200")
    launches = []
    monkeypatch.setattr(ct, "launch", lambda *a, **k: launches.append(a))   # the GPU stand-in
    fake = FakeSearch()
    monkeypatch.setattr(timing, "search_kernels", fake)
    final = FakeFinalRound()
    monkeypatch.setattr(timing, "time_interleaved", final)
    runs = FakeRuns()
    monkeypatch.setattr(timing, "search_runs", runs)
    made = []

    def make(name="op", configs=_space):
        t = Autotuner(f"{name}{len(made)}_{id(made)}", _k, configs, default=SimpleNamespace(tile=8, occupancy=1))
        made.append(t)
        return t
    yield SimpleNamespace(fake=fake, final=final, runs=runs, make=make, path=tmp_path / "store",
                          launches=launches)
    for t in made:
        autotune._registry.pop(t.name, None)


def search(n=16):
    return Search(shape=dict(n=n), grid_fn=lambda c: (1,), args_fn=lambda c: ())


def resolve(t, key, n=16):
    return t.cache.get(key) or t.tune(key, 0, search(n))


def test_bucket_is_next_power_of_two():
    assert [bucket(n) for n in (1, 2, 3, 5, 1000, 1024, 1025)] == [1, 2, 4, 8, 1024, 1024, 2048]


def test_miss_searches_once_then_hits(env, monkeypatch):
    t = env.make()
    cfg, kern = resolve(t, ("k", 1))
    assert cfg.occupancy == 2 and env.fake.calls == 1 and t.searches == 1
    rec = t.records[("k", 1)]
    assert rec.source == "search" and rec.config == {"tile": 16, "occupancy": 2}
    assert len(rec.timings) == 3 and rec.timings[0]["mean_us"] == 10.0
    # the hit path: no search and no replace_hints
    monkeypatch.setattr(ct.kernel, "replace_hints", lambda *a, **k: pytest.fail("replace_hints on a hit"))
    assert resolve(t, ("k", 1)) == (cfg, kern)
    assert env.fake.calls == 1
    # launched on the miss: the final round's two finalists (winner occ 2, default occ 1), then
    # the tuned kernel once (compiled under the lock)
    assert [k._compiler_options.occupancy for _, _, k, _ in env.launches] == [2, 1, 2]
    assert env.launches[-1][2] is kern


def test_clear_cache_keeps_the_launched_kernel_objects(env):
    """A kernel object unloads its compiled code when freed, and a CUDA graph captured before
    `clear_cache()` may still replay it: clearing forgets results, never kernel objects."""
    import gc
    import weakref
    t = env.make()
    _, kern = resolve(t, ("k",))
    alive = weakref.ref(kern)
    del kern
    autotune.clear_cache()
    gc.collect()
    assert alive() is not None and not t.cache and not t.records
    _, again = resolve(t, ("k",))        # resolved again (from the store): the same object
    assert again is alive()


def test_unhashable_hints_still_build_one_object(env):
    t = env.make()      # (cuTile's per-arch hint values are not hashable)
    t.hints = lambda cfg: {"occupancy": ct.ByTarget(sm_90=cfg.occupancy, default=1)}
    cfg = SimpleNamespace(tile=8, occupancy=2)
    assert t._with_hints(_k, cfg, 0) is t._with_hints(_k, cfg, 0)


def test_two_threads_building_one_configs_kernel_get_one_object(env, monkeypatch):
    """A miss during capture takes no lock: where it builds a config's kernel while another
    thread builds the same one, both get one object (the second stored replaced the first,
    which its thread had launched; freed, it would unload code a captured graph replays)."""
    t = env.make()
    cfg, others = SimpleNamespace(tile=8, occupancy=2), []
    build = ct.kernel.replace_hints

    def build_while_another_thread_builds(self, **hints):
        if not others:
            others.append(None)
            others[0] = t._with_hints(_k, cfg, 0)
        return build(self, **hints)
    monkeypatch.setattr(ct.kernel, "replace_hints", build_while_another_thread_builds)
    mine = t._with_hints(_k, cfg, 0)
    assert mine is others[0] is t._with_hints(_k, cfg, 0)


def test_tuned_kernel_carries_exactly_the_winning_hints(env):
    t = env.make()
    _, kern = resolve(t, ("k",))
    assert kern._compiler_options.occupancy == 2


def test_disable_autotune_takes_first_config_without_search(env, monkeypatch):
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    t = env.make()
    cfg, _ = resolve(t, ("k",))
    assert cfg.occupancy == 1 and env.fake.calls == 0
    assert t.records[("k",)].source == "default"
    assert not env.path.exists() or not any(env.path.iterdir())


def test_empty_generator_falls_back_to_hard_coded_default(env, monkeypatch):
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    t = env.make(configs=lambda arch, n: iter(()))
    assert resolve(t, ("k",))[0] == SimpleNamespace(tile=8, occupancy=1)


def test_more_than_30_configs_is_refused(env):
    t = env.make(configs=lambda arch, n: (SimpleNamespace(occupancy=i) for i in range(31)))
    with pytest.raises(ValueError, match="max 30"):
        resolve(t, ("k",))


def test_store_round_trip_skips_search(env):
    t1 = env.make("a")
    resolve(t1, ("k", 7))
    t1.clear()
    t1.searches = 0
    cfg, _ = resolve(t1, ("k", 7))
    assert t1.searches == 0 and cfg.occupancy == 2 and t1.records[("k", 7)].source == "store"
    assert len(t1.records[("k", 7)].timings) == 3     # the search's record survives the process
    entries = store.entries(t1.name)[t1.name]
    (skey,) = entries
    assert "Fake H200" in skey and "sm_90" in skey and f"cuda-tile {ct.__version__}" in skey


def test_changed_config_space_does_not_reuse_stale_winner(env):
    t = env.make()
    resolve(t, ("k",), n=16)
    t.clear()
    t.configs = lambda arch, n: (SimpleNamespace(tile=n, occupancy=o) for o in (1, 2, 8))
    resolve(t, ("k",), n=16)
    assert env.fake.calls == 2


def test_corrupt_store_is_ignored_and_kept(env):
    t = env.make()
    env.path.mkdir(parents=True)
    (env.path / store.DB_NAME).write_text("{not a database" * 100)
    with pytest.warns(UserWarning, match="cannot use the cache database"):
        resolve(t, ("k",))
    assert env.fake.calls == 1
    assert (env.path / store.DB_NAME).read_text() == "{not a database" * 100   # not deleted


def test_foreign_store_file_is_ignored(env):
    t = env.make()
    env.path.mkdir(parents=True)
    with sqlite3.connect(env.path / store.DB_NAME) as conn:
        conn.execute("CREATE TABLE other (x)")
    with pytest.warns(UserWarning):
        resolve(t, ("k",))
    assert env.fake.calls == 1


def test_store_off(env, monkeypatch):
    monkeypatch.setenv("TILETUNE_CACHE_DIR", "off")
    t = env.make()
    resolve(t, ("k",))
    t.clear()
    resolve(t, ("k",))
    assert env.fake.calls == 2 and not env.path.exists()


def test_all_configs_failing_raises_with_every_error(env, monkeypatch):
    env.fake.fail = {1, 2, 4}
    t = env.make()
    with pytest.raises(TuningFailedError) as e:
        resolve(t, ("k",))
    assert len(e.value.failures) == 3
    assert all(f"boom {o}" in str(e.value) for o in (1, 2, 4))


def test_partial_failures_are_recorded_and_logged(env, caplog):
    env.fake.fail = {4}
    t = env.make()
    with caplog.at_level(logging.INFO, logger="tiletune"):
        resolve(t, ("k",))
    rec = t.records[("k",)]
    assert [f["config"]["occupancy"] for f in rec.failures] == [4] and len(rec.timings) == 2
    assert any("failed" in r.getMessage() and "boom 4" in r.getMessage() for r in caplog.records)


def test_eight_threads_on_a_cold_key_search_once(env):
    env.fake.delay = 0.2
    t = env.make()
    results = []
    threads = [threading.Thread(target=lambda: results.append(resolve(t, ("cold",)))) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert env.fake.calls == 1 and len(results) == 8 and len({id(r[1]) for r in results}) == 1


def _hold_gpu_lock(env):
    """The GPU's search lock held as another process holds it (a descriptor of its own)."""
    env.path.mkdir(parents=True, exist_ok=True)
    fd = os.open(env.path / "gpu-GPU-stand-in-0.lock", os.O_RDWR | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    return fd


def test_a_search_waits_for_another_process_on_the_gpu_and_takes_its_winner(env):
    """Another process searching on this GPU (with this store) holds its lock: a miss waits,
    then reads the winner that process saved instead of searching; had it saved none, the miss
    searches once the lock is free."""
    t = env.make()
    cfgs = t.config_list("sm_90", dict(n=16))
    theirs = cfgs[2]                                 # not what this process's search would pick
    fd = _hold_gpu_lock(env)

    released = []

    def other_process():
        time.sleep(0.3)
        store.save(t.name, t.store_key(("k",), 0, cfgs), {"config": autotune.config_dict(theirs)})
        released.append(time.monotonic())
        os.close(fd)
    threading.Thread(target=other_process).start()
    cfg, _ = resolve(t, ("k",))
    assert released and time.monotonic() >= released[0] and env.fake.calls == 0
    assert cfg.occupancy == theirs.occupancy and t.records[("k",)].source == "store"
    fd = _hold_gpu_lock(env)
    threading.Timer(0.3, os.close, (fd,)).start()
    cfg, _ = resolve(t, ("k2",))
    assert env.fake.calls == 1 and cfg.occupancy == 2


def test_a_search_inside_a_search_on_the_gpu_does_not_wait_for_itself(env, monkeypatch):
    """A search whose runs miss another key on the same GPU (an op timing its helper kernels)
    holds the GPU's lock already: the inner search runs at once."""
    outer, inner = env.make(), env.make()
    fake, done, entered = env.fake, [], []

    def search_that_misses(*a, **kw):
        if not entered:
            entered.append(1)
            done.append(resolve(inner, ("inner",)))
        return fake(*a, **kw)
    monkeypatch.setattr(timing, "search_kernels", search_that_misses)
    worker = threading.Thread(target=lambda: done.append(resolve(outer, ("outer",))))
    worker.start()
    worker.join(timeout=10)
    assert not worker.is_alive() and len(done) == 2 and fake.calls == 2


def test_a_gpu_lock_held_past_the_wait_limit_searches_anyway(env, monkeypatch):
    monkeypatch.setattr(autotune, "GPU_LOCK_WAIT_SEC", 0.2)
    monkeypatch.setattr(tiletune.env, "_warned", set())
    fd = _hold_gpu_lock(env)
    t = env.make()
    try:
        with pytest.warns(UserWarning, match="held this GPU's search lock"):
            resolve(t, ("k",))
    finally:
        os.close(fd)
    assert env.fake.calls == 1


def test_a_filesystem_without_flock_searches_without_the_gpu_lock(env, monkeypatch):
    """flock refused by the store folder's filesystem (ENOSYS: Lustre mounted without -o
    flock; NFS without its lock daemon gives ENOLCK): the lock is best effort, so the miss
    searches without it, warned once, and the next key does not try it again."""
    monkeypatch.setattr(tiletune.env, "_warned", set())
    tries = []

    def no_flock(fd, how):
        tries.append(how)
        raise OSError(errno.ENOSYS, "Function not implemented")
    monkeypatch.setattr(autotune.fcntl, "flock", no_flock)
    t = env.make()
    with pytest.warns(UserWarning, match="cannot be taken on its filesystem"):
        cfg, _ = resolve(t, ("k",))
    resolve(t, ("k2",))
    assert env.fake.calls == 2 and len(tries) == 1 and cfg is not None


def test_a_child_forked_during_a_search_neither_holds_the_gpu_lock_nor_waits(env, monkeypatch):
    """A child forked during a search (another thread of the program) got copies of the
    search's GPU lock descriptor, which kept the parent's next search waiting for its own
    child, and of the held search lock, on which the child's first miss waited forever: the
    child closes the one and replaces the other."""
    monkeypatch.setattr(autotune, "GPU_LOCK_WAIT_SEC", 5.0)
    t = env.make()
    fake, kids, release = env.fake, [], os.pipe()

    def child():
        resolve(t, ("child key",))              # its own miss, at once
        os.read(release[0], 1)                  # then lives on until the parent is done
        return 0

    def search_that_forks(*a, **kw):
        if not kids:
            kids.append(None)                   # (set before the fork: the child forks none)
            kids[0] = fork(child, from_thread=True)
        return fake(*a, **kw)
    monkeypatch.setattr(timing, "search_kernels", search_that_forks)
    resolve(t, ("k1",))
    start = time.monotonic()
    resolve(t, ("k2",))                         # the child is alive: it holds no lock
    took = time.monotonic() - start
    os.write(release[1], b"x")
    assert wait_child(kids[0]) == 0 and took < 2.0, took


def test_miss_during_graph_capture_does_not_search(env, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    t = env.make()
    with pytest.warns(UserWarning, match="capture"):
        cfg, _ = resolve(t, ("k",))
    assert env.fake.calls == 0 and cfg.occupancy == 1
    assert ("k",) not in t.cache      # tuned properly on the next miss outside capture
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    resolve(t, ("k",))
    assert env.fake.calls == 1


def test_capture_uses_stored_winner(env, monkeypatch):
    t = env.make()
    resolve(t, ("k",))
    t.clear()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.warns(UserWarning):
        assert resolve(t, ("k",))[0].occupancy == 2


def test_a_launch_failing_during_graph_capture_raises_its_own_error_once(env, monkeypatch):
    """A config picked during capture is not cached: its failed launch is the caller's, not
    taken for a stored entry another thread dropped (no second launch, no search)."""
    x = torch.zeros(4)
    t = _declared(env, monkeypatch, "captured", grid=lambda c, dev, x, n: (1,),
                  args=lambda c, x, n: (x, c.occupancy))
    tries = []

    def launch(stream, grid, kernel, args):
        tries.append(args)
        raise RuntimeError("operation not permitted when stream is capturing")
    monkeypatch.setattr(ct, "launch", launch)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.warns(UserWarning, match="capture"), \
            pytest.raises(RuntimeError, match="not permitted when stream is capturing"):
        t.launch(("k",), "cpu", x, 32)
    assert len(tries) == 1 and env.fake.calls == 0


_WRITER = """
import sys
from tiletune import store
for i in range(40):
    store.save("shared", f"p{sys.argv[1]}-{i}", {"config": {"i": i}})
"""


def test_store_writes_from_several_processes_keep_every_entry(tmp_path):
    env = dict(os.environ, TILETUNE_CACHE_DIR=str(tmp_path))
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(p)], env=env) for p in range(4)]
    assert all(p.wait(timeout=120) == 0 for p in procs)
    with sqlite3.connect(tmp_path / store.DB_NAME) as conn:
        rows = conn.execute(f"SELECT key FROM {store.TABLE} WHERE op = 'shared'").fetchall()
    assert len(set(rows)) == 160


def test_store_clear(env):
    t = env.make()
    resolve(t, ("k",))
    assert store.clear() == 1 and store.entries() == {}


@ct.kernel
def _k_twin(x, y, T: ct.Constant[int]):
    ct.store(y, (ct.bid(0),), ct.load(x, (ct.bid(0),), (T,)))


def test_in_place_kernel_searches_its_split_buffer_twin(env):
    t = Autotuner(f"inplace_{id(env)}", _k, _space, default=SimpleNamespace(tile=8, occupancy=1),
                  search_kernel=_k_twin)
    try:
        cfg, kern = t.cache.get(("k",)) or t.tune(("k",), 0, search())
    finally:
        autotune._registry.pop(t.name, None)
    assert env.fake.kernels == ["_k_twin"] * 3
    assert kern._pyfunc.__name__ == "_k" and kern._compiler_options.occupancy == 2
    # the final round (winner occ 2, default occ 1) times the twin on the search's arguments;
    # no warm launch of the in-place kernel: its arguments belong to the twin
    assert [k._pyfunc.__name__ for _, _, k, _ in env.launches] == ["_k_twin"] * 2
    assert [k._compiler_options.occupancy for _, _, k, _ in env.launches] == [2, 1]


def test_cli_cache_show_lists_timings(env, capsys):
    from tiletune.__main__ import main
    t = env.make()
    resolve(t, ("k", 3))
    assert main(["cache", "show", "-v"]) == 0
    out = capsys.readouterr().out
    assert t.name in out and "3 configs timed, 0 failed" in out and out.count(" us  {") == 3
    assert main(["cache", "clear"]) == 0 and store.entries() == {}


def test_configs_the_precompile_rejects_are_failures_not_searched(env, monkeypatch):
    sent = []
    monkeypatch.setattr(precompile, "enabled", lambda: True)
    monkeypatch.setattr(precompile, "precompile",
                        lambda items, arch, timeout: sent.append(items) or
                        ({1: ("TileTypeError", "tile too large")}, {}))  # occupancy 2 rejected
    t = env.make()
    cfg, _ = t.tune(("k",), 0, search())
    assert len(sent[0]) == 3 and env.fake.calls == 1
    rec = t.records[("k",)]
    assert [(f["config"]["occupancy"], f["error"]) for f in rec.failures] == [(2, "TileTypeError")]
    assert cfg.occupancy != 2 and len(rec.timings) == 2


def test_configs_compiled_ahead_are_not_compiled_again_and_keep_their_verdict(env, monkeypatch):
    """A job's rank times the configs of a key in chunks: `ahead` compiles the next chunk with
    this one, and the next call compiles nothing (a rejection found ahead still counts)."""
    sent = []
    monkeypatch.setattr(precompile, "enabled", lambda: True)
    monkeypatch.setattr(precompile, "precompile", lambda items, arch, timeout: (
        sent.append(len(items)) or ({2: ("TileTypeError", "too large")}, {})))
    t = env.make()
    cfgs, done = t.config_list("sm_90", {"n": 16}), {}
    timings, failures = t._measure(("k",), 0, cfgs, [0], search(), ahead=[1, 2], compiled=done)
    assert sent == [3] and [x["i"] for x in timings] == [0] and failures == []
    timings, failures = t._measure(("k",), 0, cfgs, [1, 2], search(), compiled=done)
    assert sent == [3] and [x["i"] for x in timings] == [1]
    assert [(f["i"], f["error"]) for f in failures] == [(2, "TileTypeError")]


def test_the_workers_cubins_go_to_the_kernels_the_search_launches(env, monkeypatch):
    """Each compiled config's cubin is handed to the very kernel object the search, the final
    round and the launch share (one per kernel, hints and device)."""
    handed = []
    monkeypatch.setattr(precompile, "enabled", lambda: True)
    monkeypatch.setattr(precompile, "precompile", lambda items, arch, timeout: (
        {}, {j: (f"sig{j}", f"cubin{j}") for j in range(len(items))}))
    monkeypatch.setattr(precompile, "hand_over", lambda *a: handed.append(a))
    t = env.make()
    cfg, kernel = t.tune(("k",), 0, search())
    cfgs = t.config_list("sm_90", {"n": 16})
    assert [(sig, cubin) for _, sig, _, cubin in handed] == [(f"sig{j}", f"cubin{j}")
                                                             for j in range(len(cfgs))]
    assert [k for k, *_ in handed] == [t._with_hints(t.search_kernel(c), c, 0) for c in cfgs]
    assert {arch for _, _, arch, _ in handed} == {"sm_90"}       # the stand-in GPU's


def test_final_round_can_overturn_the_search(env):
    """The search's close finishers and the default are timed again in turns; that decides."""
    env.fake.best_occ = 4          # search: occ 4 10 us, occ 2 12 us, occ 1 (the default) 13 us
    env.final.times = {0: 9.0, 1: 8.5}
    t = env.make()
    cfg, _ = resolve(t, ("k", 7))
    assert env.final.calls == [[0, 1]]          # the winner (occ 4) and the default (occ 1)
    assert cfg.occupancy == 1
    rec = t.records[("k", 7)]
    assert rec.best_us == 8.5 and rec.config == {"tile": 16, "occupancy": 1}
    assert [f["config"]["occupancy"] for f in rec.final] == [1, 4]
    assert rec.timings[0]["config"]["occupancy"] == 4        # the search's own ranking is kept
    assert json.loads(json.dumps(rec.to_json()))["final"][0]["median_us"] == 8.5
    # the store keeps the final round; a second process reads the same winner
    t.clear()
    cfg2, _ = resolve(t, ("k", 7))
    assert cfg2.occupancy == 1 and t.records[("k", 7)].source == "store"
    assert t.records[("k", 7)].final == rec.final


@pytest.mark.parametrize("base_us, work, regime", [
    (200.0, Work(flops=1e12), "sustained"),
    (autotune.SUSTAINED_FINAL_US, Work(flops=1e12), "sustained"),
    (50.0, Work(flops=1e12), "turns"),          # short kernels: the power limit does not bind
    (200.0, Work(bytes=1e9), "turns"),          # memory-bound: no tensor-core clock to settle
    (200.0, None, "turns"),
])
def test_long_tensor_core_keys_run_their_final_round_sustained(env, base_us, work, regime):
    env.fake.base_us = base_us
    t = env.make()
    s = Search(shape=dict(n=16), grid_fn=lambda c: (1,), args_fn=lambda c: (), work=work)
    t.tune(("k", 13), 0, s)
    kw = env.final.kwargs[-1]
    if regime == "sustained":
        assert kw["block_ms"] == timing.SUSTAINED_BLOCK_MS
        assert kw["rounds"] == autotune.SUSTAINED_FINAL_ROUNDS
    else:
        assert kw.get("block_ms", 0) == 0 and kw["rounds"] == 5
    rec = t.records[("k", 13)]
    assert len(rec.final) > 1 and {f["timing"] for f in rec.final} == {regime}
    # the store keeps the regime; a second process reads it back
    t.clear()
    t.tune(("k", 13), 0, s)
    assert t.records[("k", 13)].source == "store"
    assert t.records[("k", 13)].final == rec.final


@pytest.mark.parametrize("work, finalists", [
    (Work(flops=1e12), 4),        # sustained: the four fastest, 7% behind the best too
    (Work(bytes=1e9), 3),         # in turns: those within FINAL_MARGIN
])
def test_a_sustained_final_round_takes_the_fastest_whatever_their_distance(env, work, finalists):
    env.fake.base_us, env.fake.best_occ = 100.0, 1          # 100, 101, 103, 107, 115 us
    t = env.make(configs=lambda arch, n: (SimpleNamespace(tile=n, occupancy=o)
                                          for o in (1, 2, 4, 8, 16)))
    t.tune(("k", 21), 0, Search(shape=dict(n=16), grid_fn=lambda c: (1,), args_fn=lambda c: (),
                                work=work))
    assert [f["config"]["occupancy"] for f in t.records[("k", 21)].final] == \
        [1, 2, 4, 8][:finalists]


def test_no_final_round_when_the_default_wins_alone(env):
    env.fake.best_occ = 1          # the default is 1 us ahead of the next: 10% > FINAL_MARGIN
    t = env.make()
    cfg, _ = resolve(t, ("k", 8))
    assert cfg.occupancy == 1 and env.final.calls == [] and t.records[("k", 8)].final == []


def test_a_failing_final_round_keeps_the_search_pick(env, monkeypatch, caplog):
    released = []
    monkeypatch.setattr(timing, "release", lambda: released.append(1))
    env.final.times = RuntimeError("CUDA out of memory")
    t = env.make()
    with caplog.at_level(logging.INFO, logger="tiletune"):
        cfg, _ = resolve(t, ("k", 9))
    assert cfg.occupancy == 2 and t.records[("k", 9)].final == []
    assert t.records[("k", 9)].best_us == 10.0
    assert "final round skipped: RuntimeError: CUDA out of memory" in caplog.text
    assert released == [1]          # the flush buffer is dropped either way


def test_a_finalist_whose_run_fails_in_the_final_round_is_a_recorded_failure(env, caplog):
    """A config that fails only in the final round (a kernel only its run launches, such as
    split-K's sum, does not build) does not win, and the record keeps its error like any
    other failure's (it left no trace)."""
    env.final.times = {0: RuntimeError("sum kernel refused")}   # occ 2, the search's winner
    t = env.make()
    with caplog.at_level(logging.INFO, logger="tiletune"):
        cfg, _ = resolve(t, ("k", 15))
    rec = t.records[("k", 15)]
    assert cfg.occupancy == 1 and [f["config"]["occupancy"] for f in rec.final] == [1]
    assert [(f["config"]["occupancy"], f["error"], f["message"]) for f in rec.failures] == [
        (2, "RuntimeError", "in the final round: sum kernel refused")]
    assert "sum kernel refused" in caplog.text
    t.clear()
    resolve(t, ("k", 15))                       # the store keeps it
    assert t.records[("k", 15)].failures == rec.failures


def test_final_round_runs_the_ops_runner_when_given(env):
    """Configs that launch more than their kernel (split-K's sum) are timed whole."""
    ran = []
    t = env.make()
    s = Search(shape=dict(n=16), grid_fn=lambda c: (1,), args_fn=lambda c: (),
               run_fn=lambda c, kernel: ran.append((c.occupancy, kernel._compiler_options.occupancy)))
    cfg, _ = t.cache.get(("k", 10)) or t.tune(("k", 10), 0, s)
    # the final round times winner and default, each with its hinted kernel; then the winner's
    # warm launch goes through the runner too (not its kernel alone)
    assert ran == [(2, 2), (1, 1), (2, 2)] and env.launches == []


def test_partly_timed_configs_count_the_margin_from_the_fastest_whole_one(env):
    """A split-K config's search time leaves out its sum kernel, so it is a lower bound: the
    margin counts from the fastest fully timed config, which joins the final round."""
    env.fake.best_occ = 4          # search: occ 4 10 us (partly timed), occ 2 12 us, occ 1 13 us
    t = env.make()
    s = Search(shape=dict(n=16), grid_fn=lambda c: (1,), args_fn=lambda c: (),
               run_fn=lambda c, kernel: None, partly_timed=lambda c: c.occupancy == 4)
    t.cache.get(("k", 11)) or t.tune(("k", 11), 0, s)
    # without partly_timed only occ 4 and the default would be timed again (occ 2 is 20% behind)
    assert sorted(f["config"]["occupancy"] for f in t.records[("k", 11)].final) == [1, 2, 4]


def test_without_a_final_round_a_partly_timed_config_does_not_win(env):
    """Its search time is a lower bound: if the final round fails, the fastest whole one wins."""
    env.fake.best_occ = 4          # search: occ 4 10 us (partly timed), occ 2 12 us, occ 1 13 us
    env.final.times = RuntimeError("CUDA out of memory")
    t = env.make()
    s = Search(shape=dict(n=16), grid_fn=lambda c: (1,), args_fn=lambda c: (),
               run_fn=lambda c, kernel: None, partly_timed=lambda c: c.occupancy == 4)
    cfg, _ = t.cache.get(("k", 12)) or t.tune(("k", 12), 0, s)
    assert cfg.occupancy == 2 and t.records[("k", 12)].best_us == 12.0


def test_configs_timed_by_run_are_timed_whole_and_the_rest_alone(env):
    """A kernel that reads what an earlier kernel of `run` writes (grouped_mm's schedule)
    cannot be timed alone: the search times `run` for it, the kernel alone for the others,
    and the ranking holds both."""
    ran = []
    env.runs.times = {2: 5.0}        # the run-timed config (index 2 of the space): 5 us
    t = env.make()
    s = Search(shape=dict(n=16), grid_fn=lambda c: (1,), args_fn=lambda c: (),
               run_fn=lambda c, kernel: ran.append(c.occupancy),
               timed_by_run=lambda c: c.occupancy == 4)
    cfg, _ = t.tune(("k", 13), 0, s)
    assert env.runs.calls == [[2]] and ran[0] == 4
    assert len(env.fake.kernels) == 2                  # the search saw occ 1 and 2
    rec = t.records[("k", 13)]
    assert {m["config"]["occupancy"]: m["mean_us"] for m in rec.timings} == {
        4: 5.0, 2: 10.0, 1: 11.0}
    assert cfg.occupancy == 4


def test_a_run_timed_config_that_raises_is_a_failure(env):
    env.runs.times = {2: RuntimeError("schedule refused")}
    t = env.make()
    s = Search(shape=dict(n=16), grid_fn=lambda c: (1,), args_fn=lambda c: (),
               run_fn=lambda c, kernel: None, timed_by_run=lambda c: c.occupancy == 4)
    cfg, _ = t.tune(("k", 14), 0, s)
    assert cfg.occupancy == 2
    assert [(f["config"]["occupancy"], f["error"]) for f in t.records[("k", 14)].failures] == [
        (4, "RuntimeError")]


# -- the launch idiom: an op declares grid, arguments, scratch and run once ---------------------

def _declared(env, monkeypatch, name, **hooks):
    # a registry of the test's own: an id() reused by a later test cannot collide
    monkeypatch.setattr(autotune, "_registry", dict(autotune._registry))
    t = Autotuner(f"{name}_{id(env)}", _k, _space, default=SimpleNamespace(tile=8, occupancy=1),
                  space=lambda x, n, *rest: dict(n=n), **hooks)
    return t


def test_the_winners_first_launch_goes_through_its_run(env, monkeypatch):
    """After the search the engine launches the winner once (the JIT compiles it then). A kernel
    timed by its run reads what the run's earlier kernel writes into scratch (the grouped GEMM's
    schedule): it is launched through the run, never alone on another config's scratch."""
    alone = []

    def launch(stream, grid, kernel, args):
        if args[0] == "kernel" and args[2] is not None and not bool((args[2] == args[1]).all()):
            alone.append(args[1])          # the kernel on a schedule its run did not write
        env.launches.append(args)
    monkeypatch.setattr(ct, "launch", launch)

    def run(c, kernel, stream, dev, x, n, table):
        if table is not None:
            table.fill_(c.occupancy)                       # the schedule kernel
        ct.launch(stream, (1,), kernel, ("kernel", c.occupancy, table))
    env.runs.times = {1: 5.0, 2: 5.1}                     # the search's two leaders
    env.final.times = {0: 4.0, 1: 5.0, 2: 5.1}            # the last finalist timed is not the winner
    t = _declared(env, monkeypatch, "by_run",
                  scratch=lambda c, dev, x, n: ((c.occupancy, 3), torch.int32)
                  if c.occupancy > 1 else None,
                  grid=lambda c, dev, x, n, table: (1,),
                  args=lambda c, x, n, table: ("kernel", c.occupancy, table),
                  run=run, timed_by_run=lambda c: c.occupancy > 1)
    t.launch(("k",), "cpu", torch.zeros(4), 16)
    assert t.cache[("k",)][0].occupancy > 1 and alone == []


def test_launch_tunes_once_then_launches_the_cached_kernel(env, monkeypatch):
    x = torch.zeros(4)
    t = _declared(env, monkeypatch, "plain",
                  grid=lambda c, dev, x, n: (n // c.tile, dev),
                  args=lambda c, x, n: (x, c.tile),
                  work=lambda x, n: Work(bytes=8 * n))
    t.launch(("k",), "cpu", x, 32)
    assert env.fake.calls == 1 and t.records[("k",)].rates["gb_per_s"] > 0
    cfg, kernel = t.cache[("k",)]
    env.launches.clear()
    assert t.launch(("k",), "cpu", x, 32) is None
    assert env.launches == [("stream", (1, "cpu"), kernel, (x, 32))]
    assert env.fake.calls == 1


def test_clear_cache_in_another_thread_during_a_first_launch_leaves_no_plan(env, monkeypatch):
    """clear_cache() in another thread between a first launch's reading of its entry and the
    writing of its launch plan: the plan is not kept (it outlived the cleared entry, and the key
    launched its old config on the fast path, never resolved again)."""
    x, cleared = torch.zeros(4), []
    t = _declared(env, monkeypatch, "cleared", grid=lambda c, dev, x, n: (1,),
                  args=lambda c, x, n: (x, c.occupancy))

    def get_then_clear(key, default=None):
        found = dict.get(t.cache, key, default)
        if found is not None and not cleared:
            cleared.append(key)
            autotune.clear_cache()           # as another thread would, right after this read
        return found
    monkeypatch.setattr(t.cache, "get", get_then_clear, raising=False)
    t.launch(("k",), "cpu", x, 16)
    assert cleared == [("k",)] and t._plans == {}
    t.launch(("k",), "cpu", x, 16)           # resolved again: from the store
    assert t.records[("k",)].source == "store" and env.fake.calls == 1


def test_launch_keys_in_one_bucket_share_a_tuning_and_plan_their_own_grid(env, monkeypatch):
    """Launch keys (k, n) tune under (k, bucket(n)): one search for n = 20 and 30; each launch
    key computes its grid once, on its first launch."""
    x, grids = torch.zeros(4), []
    t = _declared(env, monkeypatch, "planned", tune_key=autotune.bucketed(1),
                  grid=lambda c, dev, x, n: grids.append(n) or (n,),
                  args=lambda c, x, n: (x, c.tile))
    launch = t._fast_path()           # the production fast path (tests run a checked one)
    for n in (20, 30, 20, 30, 20):
        launch(("k", n), "cpu", x, n)
    assert env.fake.calls == 1 and list(t.cache) == [("k", 32)] and list(t.records) == [("k", 32)]
    assert [g for _, g, _, _ in env.launches[-5:]] == [(20,), (30,), (20,), (30,), (20,)]
    grids.clear()
    launch(("k", 20), "cpu", x, 20)
    assert grids == []                                   # planned: no grid computed
    t.cache[("k", 32)] = t.cache[("k", 32)]              # any change of the cache drops plans
    launch(("k", 20), "cpu", x, 20)
    assert grids == [20]


def test_with_scratch_and_run_a_config_without_scratch_is_planned(env, monkeypatch):
    """An op with scratch and run (grouped_mm's table walk, split-K): a config whose scratch
    gives no buffer launches its kernel alone on the grid planned at its key's first launch;
    one with a buffer goes through run on every call; the checked path still checks the plan."""
    x, grids, ran = torch.zeros(4), [], []
    t = _declared(env, monkeypatch, "planned_run", tune_key=autotune.bucketed(1),
                  grid=lambda c, dev, x, n, buf: grids.append(n) or (n,),
                  args=lambda c, x, n, buf: (x, c.tile, buf),
                  scratch=lambda c, dev, x, n: None if c.occupancy != 4 else ((2,), torch.int32),
                  run=lambda c, k, stream, dev, x, n, buf: ran.append(buf))
    launch = t._fast_path()
    for n in (20, 20, 30):
        launch(("k", n), "cpu", x, n)
    won = t.cache[("k", 32)][0]
    assert env.fake.calls == 1 and won.occupancy == 2
    ran.clear()                          # (the search's final round times through run)
    grids.clear()
    for n in (20, 20, 30):
        launch(("k", n), "cpu", x, n)
    assert ran == [] and grids == []                     # planned: no run, no grid
    assert [g for _, g, _, _ in env.launches[-3:]] == [(20,), (20,), (30,)]
    assert env.launches[-1][3] == (x, won.tile, None)
    with pytest.raises(AssertionError, match="misses a size the grid depends on"):
        t._fast_path(checked=True)(("k", 20), "cpu", x, 25)
    t.cache[("k", 32)] = (SimpleNamespace(tile=16, occupancy=4), t.cache[("k", 32)][1])
    launch(("k", 20), "cpu", x, 20)
    launch(("k", 20), "cpu", x, 20)
    assert [tuple(b.shape) for b in ran] == [(2,), (2,)]   # with scratch: run, every call


def test_with_scratch_and_no_run_the_grid_and_the_scratch_are_planned(env, monkeypatch):
    """An op with scratch and no run (RMSNorm's backward partials): its key's first launch plans
    the grid and the buffer's shape and dtype; every call still gets a buffer of its own; the
    checked path fails where the key misses a size the scratch depends on."""
    x, specs, grids = torch.zeros(4), [], []
    t = _declared(env, monkeypatch, "planned_scratch", tune_key=autotune.bucketed(1),
                  grid=lambda c, dev, x, n, m, buf: grids.append(n) or (n,),
                  args=lambda c, x, n, m, buf: (x, c.tile, buf),
                  scratch=lambda c, dev, x, n, m: specs.append(m) or ((c.occupancy, m),
                                                                      torch.float32))
    launch = t._fast_path()
    launch(("k", 20), "cpu", x, 20, 3)
    won = t.cache[("k", 32)][0]
    specs.clear()
    grids.clear()
    bufs = [launch(("k", 20), "cpu", x, 20, 3) for _ in range(2)]
    assert specs == [] and grids == []                   # planned: neither computed again
    assert [tuple(b.shape) for b in bufs] == [(won.occupancy, 3)] * 2
    assert bufs[0].dtype == torch.float32 and bufs[0].data_ptr() != bufs[1].data_ptr()
    assert env.launches[-1][1:] == ((20,), env.launches[-1][2], (x, won.tile, bufs[1]))
    with pytest.raises(AssertionError, match="misses a size the scratch depends on"):
        t._fast_path(checked=True)(("k", 20), "cpu", x, 20, 4)


def test_without_a_tune_key_the_grid_is_computed_on_every_call(env, monkeypatch):
    """The safe default for an op (or a user's kernel) that made no promise about its keys."""
    x = torch.zeros(4)
    t = _declared(env, monkeypatch, "per_call", grid=lambda c, dev, x, n: (n,),
                  args=lambda c, x, n: (x, c.tile))
    launch = t._fast_path()
    for n in (20, 30):
        launch(("k",), "cpu", x, n)
    assert [g for _, g, _, _ in env.launches[-2:]] == [(20,), (30,)]


def test_a_launch_key_missing_a_size_of_the_grid_fails_the_checked_fast_path(env, monkeypatch):
    x = torch.zeros(4)
    t = _declared(env, monkeypatch, "unplanned", tune_key=autotune.bucketed(1),
                  grid=lambda c, dev, x, n: (n,), args=lambda c, x, n: (x, c.tile))
    checked = t._fast_path(checked=True)
    checked(("k", 32), "cpu", x, 20)
    with pytest.raises(AssertionError, match="misses a size the grid depends on"):
        checked(("k", 32), "cpu", x, 30)                 # n is not in the key


@pytest.mark.parametrize("hooks", ["plain", "scratch"])
def test_a_stored_winner_that_fails_to_launch_is_searched_again(env, monkeypatch, caplog, hooks):
    """The winner read from the store raises at its first launch (say a driver that refuses its
    kernel): one warning, the entry is deleted, the key is searched again and the new winner
    launches; the next process finds the new entry. A launch error of a searched winner is the
    caller's: no second search."""
    x = torch.zeros(4)
    extra = dict(scratch=lambda c, dev, x, n: None) if hooks == "scratch" else {}
    t = _declared(env, monkeypatch, hooks, grid=lambda c, dev, x, n, *buf: (1,),
                  args=lambda c, x, n, *buf: (x, c.occupancy), **extra)
    t.launch(("k",), "cpu", x, 32)                  # search: occupancy 2 wins, stored
    assert env.fake.calls == 1
    t.clear()
    env.fake.best_occ = 4                           # what a new search would pick
    refused = []

    def launch(stream, grid, kernel, args):
        if args[1] == 2 and not refused:
            refused.append(args)
            raise RuntimeError("CUDA_ERROR_NO_BINARY_FOR_GPU")
        env.launches.append(args)
    monkeypatch.setattr(ct, "launch", launch)
    env.launches.clear()
    with caplog.at_level(logging.WARNING, logger="tiletune"):
        t.launch(("k",), "cpu", x, 32)
    assert refused and env.fake.calls == 2
    assert "failed to launch" in caplog.text and "searching again" in caplog.text
    assert env.launches[-1] == (x, 4) and t.cache[("k",)][0].occupancy == 4
    (entry,) = store.entries(t.name)[t.name].values()
    assert entry["config"]["occupancy"] == 4
    monkeypatch.setattr(ct, "launch", lambda *a: (_ for _ in ()).throw(RuntimeError("bad")))
    t.clear()
    env.fake.best_occ = 1
    with pytest.raises(RuntimeError, match="bad"):   # a searched winner's error is not retried
        t.launch(("k2",), "cpu", x, 32)


def _stored_winner_the_driver_refuses(t, env, monkeypatch, x, delay=0.0):
    """t's key ("k",) searched (occupancy 2 wins, stored) and forgotten; a new search would
    pick occupancy 4; launches of occupancy 2 then raise as a driver refusing the kernel would
    (after `delay` s)."""
    t.launch(("k",), "cpu", x, 32)
    t.clear()
    env.fake.best_occ = 4

    def launch(stream, grid, kernel, args):
        if args[1] == 2:
            time.sleep(delay)
            raise RuntimeError("CUDA_ERROR_NO_BINARY_FOR_GPU")
        env.launches.append(args)
    monkeypatch.setattr(ct, "launch", launch)


def test_threads_meeting_a_stored_winner_that_fails_to_launch_all_recover(env, monkeypatch):
    """Two threads make the first launch of a key whose stored winner the driver refuses: the
    first to fail drops it and searches again; the other, failing on the same entry, launches
    the new winner instead of raising."""
    x = torch.zeros(4)
    t = _declared(env, monkeypatch, "race", grid=lambda c, dev, x, n: (1,),
                  args=lambda c, x, n: (x, c.occupancy))
    _stored_winner_the_driver_refuses(t, env, monkeypatch, x, delay=0.2)
    errors = []

    def work():
        try:
            t.launch(("k",), "cpu", x, 32)
        except Exception as e:
            errors.append(e)
    threads = [threading.Thread(target=work) for _ in range(2)]
    threads[0].start()
    time.sleep(0.05)
    threads[1].start()
    for th in threads:
        th.join()
    assert errors == [] and t.cache[("k",)][0].occupancy == 4 and env.fake.calls == 2
    assert env.launches[-2:] == [(x, 4), (x, 4)]


def test_a_thread_that_read_a_stored_winner_another_dropped_launches_its_replacement(
        env, monkeypatch):
    """Thread B reads the key's stored winner; thread A's first launch of it fails, drops it,
    searches again and launches the new winner; then B launches the entry it read, which fails
    too: B launches the replacement instead of raising."""
    x = torch.zeros(4)
    t = _declared(env, monkeypatch, "dropped", grid=lambda c, dev, x, n: (1,),
                  args=lambda c, x, n: (x, c.occupancy))
    _stored_winner_the_driver_refuses(t, env, monkeypatch, x)
    t.tune(("k",), "cpu", lambda cfgs: None, shape=dict(n=32))   # the stored winner, unproven
    assert ("k",) in t._unproven
    b_read, a_done, errors = threading.Event(), threading.Event(), []
    entries = t.cache

    class Pausing(dict):
        def get(self, key, default=None):
            value = dict.get(self, key, default)
            if threading.current_thread().name == "B" and not b_read.is_set():
                b_read.set()
                a_done.wait(5)       # A drops the entry and recovers between B's reads
            return value
    t.cache = Pausing(entries)

    def b():
        try:
            t.launch(("k",), "cpu", x, 32)
        except Exception as e:
            errors.append(e)
    thread_b = threading.Thread(target=b, name="B")
    thread_b.start()
    assert b_read.wait(5)
    t.launch(("k",), "cpu", x, 32)                  # A
    a_done.set()
    thread_b.join(5)
    assert errors == [] and env.fake.calls == 2 and env.launches[-2:] == [(x, 4), (x, 4)]


@pytest.mark.parametrize("error", [torch.OutOfMemoryError("CUDA out of memory"),
                                   ct.TileCompilerTimeoutError("compile timed out", "", "13.4"),
                                   ct.TileCompilerExecutionError(-9, "Killed", Loc.unknown(),
                                                                 "", "13.4"),
                                   ValueError("bad input"),
                                   RuntimeError("CUDA_ERROR_ILLEGAL_ADDRESS: an illegal memory "
                                                "access was encountered")],
                         ids=["oom", "compile timeout", "compile killed", "value error",
                              "earlier fault"])
def test_a_stored_winner_meeting_a_transient_error_stays_stored(env, monkeypatch, error):
    """An error of the first launch that says nothing about the stored config (out of memory,
    a compile timed out or killed on a loaded host, bad inputs, an earlier kernel's fault) goes
    to the
    caller: the store entry stays, nothing is searched, and the next launch still checks the
    stored winner."""
    x = torch.zeros(4)
    t = _declared(env, monkeypatch, "transient", grid=lambda c, dev, x, n: (1,),
                  args=lambda c, x, n: (x, c.occupancy))
    t.launch(("k",), "cpu", x, 32)
    t.clear()
    failures = [error]

    def launch(stream, grid, kernel, args):
        if failures:
            raise failures.pop()
        env.launches.append(args)
    monkeypatch.setattr(ct, "launch", launch)
    with pytest.raises(type(error)):
        t.launch(("k",), "cpu", x, 32)
    assert env.fake.calls == 1 and len(store.entries(t.name)[t.name]) == 1
    t.launch(("k",), "cpu", x, 32)                   # the stored winner launches
    assert env.fake.calls == 1 and env.launches[-1] == (x, 2)


@pytest.mark.parametrize("value, off", [("1", False), ("yes", False), ("0", True), ("", True),
                                       ("2", True), ("y", True)])
def test_disable_autotune_values(monkeypatch, value, off):
    """On: 1, on, yes, true, enable(d); off: 0, off, no, false, disable(d), blank; anything
    else warns once and leaves autotuning on."""
    monkeypatch.setenv("DISABLE_AUTOTUNE", value)
    monkeypatch.setattr(autotune.env, "_warned", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert autotune.disabled() is not off
        autotune.disabled()
    assert len(caught) == (value in ("2", "y"))


def test_disable_autotune_wins_over_a_key_whose_every_config_failed(env, monkeypatch):
    t = _declared(env, monkeypatch, "allfail", grid=lambda c, dev, x, n: (1,),
                  args=lambda c, x, n: (x, c.occupancy))
    t._failed[("k",)] = [({"occupancy": 1}, "RuntimeError", "boom")]
    with pytest.raises(autotune.TuningFailedError):
        t.launch(("k",), "cpu", torch.zeros(4), 32)
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    t.launch(("k",), "cpu", torch.zeros(4), 32)      # the default, as the contract says
    assert env.fake.calls == 0 and env.launches[-1][3][1] == next(_space("sm_90", 32)).occupancy


def test_launch_scratch_is_allocated_per_launch_and_shared_in_the_search(env, monkeypatch):
    seen = []
    t = _declared(env, monkeypatch, "scratch",
                  scratch=lambda c, dev, x, n: ((c.occupancy, n), torch.float32),
                  grid=lambda c, dev, x, n, part: (part.shape[0],),
                  args=lambda c, x, n, part: seen.append(part) or (x, part))
    part = t.launch(("k",), "cpu", torch.zeros(4), 16)
    # the search's views (final round, warm launch) share one buffer as large as the largest
    # config's (occupancy 4)
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in seen[:-1]}
    assert list(storages.values()) == [4 * 16 * 4]
    assert {tuple(p.shape) for p in seen[:-1]} == {(1, 16), (2, 16)}
    bases = set(storages)
    assert part.shape == (2, 16) and part.dtype == torch.float32      # the winner's own buffer
    assert part.untyped_storage().data_ptr() not in bases
    assert env.launches[-1][1] == (2,)


def test_launch_with_a_run_hook_and_no_scratch_for_some_configs(env, monkeypatch):
    ran = []
    t = _declared(env, monkeypatch, "run",
                  scratch=lambda c, dev, x, n: None if c.occupancy == 1 else ((n,), torch.float32),
                  grid=lambda c, dev, x, n, part: (1,), args=lambda c, x, n, part: (x,),
                  run=lambda c, kernel, stream, dev, x, n, part: ran.append((c.occupancy, part)))
    env.fake.best_occ = 1
    assert t.launch(("k",), "cpu", torch.zeros(4), 16) is None
    assert ran[-1] == (1, None)


def test_in_place_launch_searches_the_twin_on_search_inputs(env, monkeypatch):
    x = torch.zeros(4)
    made = []
    t = _declared(env, monkeypatch, "inplace", search_kernel=_k_twin,
                  search_inputs=lambda x, n, out: made.append(1) or (x, n, torch.empty_like(x)),
                  grid=lambda c, dev, x, n, out: (1,),
                  args=lambda c, x, n, out: (x, c.tile) if out is None else (x, out, c.tile))
    t.launch(("k",), "cpu", x, 16, None)
    assert env.fake.kernels == ["_k_twin"] * 3 and made == [1]
    name, args = env.launches[-1][2]._pyfunc.__name__, env.launches[-1][3]
    assert name == "_k" and args[0] is x and len(args) == 2       # in place, with the winner


def test_launch_miss_under_disable_autotune_builds_no_search(env, monkeypatch):
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    t = _declared(env, monkeypatch, "disabled",
                  search_inputs=lambda *a: pytest.fail("search inputs built"),
                  grid=lambda c, dev, x, n: (1,), args=lambda c, x, n: (x,))
    t.launch(("k",), "cpu", torch.zeros(4), 16)
    assert t.cache[("k",)][0].occupancy == 1 and env.fake.calls == 0


def test_a_long_search_says_so_without_tiletune_log(env, monkeypatch, caplog):
    monkeypatch.setattr(autotune, "LONG_SEARCH_SEC", 0.0)
    t = env.make()
    with caplog.at_level(logging.WARNING, logger="tiletune"):
        resolve(t, ("k", 5))
    (line,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert line.startswith(f"tuned {t.name} ['k', '5'] in ") and "'occupancy': 2" in line


def test_import_leaves_the_root_logger_alone():
    code = ("import logging; import tiletune; "
            "print(len(logging.getLogger().handlers), len(logging.getLogger('tiletune').handlers))")
    for env_value, expected in (("", "0 0"), ("1", "0 1")):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             env=dict(os.environ, TILETUNE_LOG=env_value), timeout=120)
        assert out.stdout.split() == expected.split(), out.stderr


def test_launch_refuses_cpu_tensors_with_a_clear_message(env, monkeypatch):
    t = _declared(env, monkeypatch, "cpu", grid=lambda c, dev, x, n: (1,),
                  args=lambda c, x, n: (x,))
    x = torch.zeros(4)
    with pytest.raises(ValueError, match=r"runs? on a CUDA GPU; got device index -1"):
        t.launch(("k",), x.get_device(), x, 16)
    assert env.fake.calls == 0 and not env.launches


# -- reliability of the miss path ------------------------------------------------------------

def test_precompile_timeouts_are_no_verdict_and_all_rejected_means_serial(env, monkeypatch):
    """A compile timeout in the loaded parallel precompile, or a compiler killed by a signal
    (out of memory among parallel compiles), does not drop the config; a compiler's own error
    does; if the precompile rejects every config, the search compiles them all itself."""
    monkeypatch.setattr(precompile, "enabled", lambda: True)
    verdicts = {0: ("CompilerTimeoutError", "over 60 s"), 1: ("TileTypeError", "too large")}
    monkeypatch.setattr(precompile, "precompile",
                        lambda items, arch, timeout: (dict(verdicts), {}))
    t = env.make()
    resolve(t, ("k", 1))
    rec = t.records[("k", 1)]
    assert [f["config"]["occupancy"] for f in rec.failures] == [2]       # only the verdict
    assert sorted(m["config"]["occupancy"] for m in rec.timings) == [1, 4]
    verdicts.update({0: ("CompilerExecutionError", "Return code -9\n"),
                     1: ("CompilerExecutionError", "Return code 1\nerror: too much smem")})
    resolve(t, ("k", 3))
    rec = t.records[("k", 3)]
    assert [f["config"]["occupancy"] for f in rec.failures] == [2]
    assert sorted(m["config"]["occupancy"] for m in rec.timings) == [1, 4]
    verdicts.update({0: ("TileTypeError", "x"), 2: ("TileTypeError", "y")})   # all rejected
    resolve(t, ("k", 2))
    assert len(t.records[("k", 2)].timings) == 3 and t.records[("k", 2)].failures == []


def test_a_key_whose_every_config_fails_is_not_searched_again(env, monkeypatch):
    env.fake.fail = {1, 2, 4}
    t = env.make()
    errors = []

    def work():
        try:
            resolve(t, ("bad",))
        except TuningFailedError as e:
            errors.append(e)
    threads = [threading.Thread(target=work) for _ in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert len(errors) == 8 and env.fake.calls == 1
    t.clear()                      # clear_cache() forgets failures too: the next call searches
    with pytest.raises(TuningFailedError):
        resolve(t, ("bad",))
    assert env.fake.calls == 2


def test_a_key_whose_every_config_fails_keeps_no_call_alive(env, monkeypatch):
    """The key's error is raised again at each call, as a new error: raising the one kept
    error again grew its traceback by every call's frames, which kept each call's tensors
    (and the search's buffers) alive for the process's life."""
    import gc
    import weakref
    env.fake.fail = {1, 2, 4}
    t = _declared(env, monkeypatch, "leak", grid=lambda c, dev, x, n: (1,),
                  args=lambda c, x, n: (x,))
    alive, errors = [], []
    for _ in range(3):
        x = torch.zeros(4)
        alive.append(weakref.ref(x))
        with pytest.raises(TuningFailedError) as e:
            t.launch(("k",), "cpu", x, 16)
        errors.append(str(e.value))
        del x, e
    gc.collect()
    assert [ref() for ref in alive] == [None] * 3
    assert env.fake.calls == 1 and len(set(errors)) == 1 and "boom" in errors[0]


@pytest.mark.parametrize("verdict", [("OutOfMemoryError", "CUDA out of memory"),
                                     ("CompilerTimeoutError", "over 60 s"),
                                     ("CompilerExecutionError", "Return code -9")],
                         ids=["oom", "compile timeout", "compiler killed"])
def test_a_key_whose_every_failure_says_nothing_of_its_config_is_searched_again(
        env, monkeypatch, verdict):
    """Out of memory (the search's buffers on a full GPU), a compile that timed out or was
    killed: the call raises, and the next one searches again instead of raising the same error
    for the rest of the process."""
    env.fake.fail = {1, 2, 4}
    env.fake.error = lambda c: verdict
    t = env.make()
    with pytest.raises(TuningFailedError, match=verdict[0]):
        resolve(t, ("k",))
    env.fake.fail = set()
    resolve(t, ("k",))
    assert env.fake.calls == 2 and ("k",) in t.records
    env.fake.fail = {1, 2, 4}       # one failure of the config's own: that key stays failed
    env.fake.error = lambda c: ("RuntimeError", "boom") if c.occupancy == 1 else verdict
    for _ in range(2):
        with pytest.raises(TuningFailedError):
            resolve(t, ("other",))
    assert env.fake.calls == 3


def test_searches_on_different_gpus_run_at_once(env):
    env.fake.delay = 0.4
    t = env.make()
    t0 = time.perf_counter()
    threads = [threading.Thread(target=lambda d=d: t.tune(("k", d), d, search())) for d in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert env.fake.calls == 2 and time.perf_counter() - t0 < 0.75


def test_searches_on_different_gpus_at_once_each_compile_under_the_timeout(env, monkeypatch):
    """cuTile's compile timeout is one setting of the process: a search on one GPU that ends
    while another GPU's search still compiles leaves it the timeout, and once both ended the
    setting is what it was before them."""
    from cuda.tile._cext import default_tile_context
    monkeypatch.setattr(default_tile_context.config, "compiler_timeout_sec", None)
    t = env.make()
    fake, seen = env.fake, []
    first_in, second_in, first_done = threading.Event(), threading.Event(), threading.Event()

    def search_on_two_gpus(*a, **kw):
        if threading.current_thread().name == "gpu0":
            first_in.set()
            second_in.wait(5)
        else:
            second_in.set()
            first_done.wait(5)           # the other search has ended
            seen.append(default_tile_context.config.compiler_timeout_sec)
        return fake(*a, **kw)
    monkeypatch.setattr(timing, "search_kernels", search_on_two_gpus)

    def gpu0():
        t.tune(("k", 0), 0, search())
        first_done.set()
    threads = [threading.Thread(target=gpu0, name="gpu0"),
               threading.Thread(target=lambda: t.tune(("k", 1), 1, search()), name="gpu1")]
    threads[0].start()
    first_in.wait(5)
    threads[1].start()
    for th in threads:
        th.join(10)
    assert seen == [autotune.COMPILE_TIMEOUT_SEC] and fake.calls == 2
    assert default_tile_context.config.compiler_timeout_sec is None


def _tuple_space(arch, n):
    for occ in (1, 2):
        yield SimpleNamespace(tiles=(8, n), dtype=torch.float16, occupancy=occ)


def test_tuple_and_dtype_config_values_round_trip_through_the_store(env):
    t = env.make(configs=_tuple_space)
    cfg, _ = resolve(t, ("k",))
    t.clear()
    cfg2, _ = resolve(t, ("k",))
    assert env.fake.calls == 1 and cfg2 is not None and t.records[("k",)].source == "store"
    assert cfg2.tiles == (8, 16) and cfg2.dtype is torch.float16
    assert not [f for f in os.listdir(env.path) if f.endswith(".tmp")]


_KERNEL_MODULE = """
import enum
class Mode(enum.Enum):
    ZERO = "zero"
SCALE = {scale}
PAD = Mode.ZERO
def helper(x):
    return x * SCALE + {helper}
def kernel(x):
    return helper(x) if PAD else (lambda y: inner(y))(x)
def inner(y):
    return y - 1
def host(x):
    return kernel(x) + {host}
"""


def _code_of(tmp_path, name, **edits):
    import importlib.util
    values = {"scale": 2, "helper": 1, "host": 0, **edits}
    path = tmp_path / f"{name}.py"
    path.write_text(_KERNEL_MODULE.format(**values))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return precompile.kernel_code(module.kernel)


def test_fingerprint_follows_the_kernel_code_and_nothing_else(tmp_path):
    base = _code_of(tmp_path, "k0")
    assert any(b"def inner" in p for p in base)        # reached through a lambda
    assert b"PAD=<Mode.ZERO: 'zero'>" in base and b"SCALE=2" in base
    assert _code_of(tmp_path, "k1", host=5) == base     # host code: winners stay valid
    assert _code_of(tmp_path, "k2", helper=3) != base   # a helper's source
    assert _code_of(tmp_path, "k3", scale=4) != base    # a constant a helper reads
    code = {}
    exec("def made(x):\n    return helper(x)\n", {"helper": autotune.bucket}, code)
    parts = precompile.kernel_code(code["made"])          # no source file: its code object
    assert parts and all(isinstance(p, bytes) for p in parts)
    from tiletune.ops import rms_norm_rope, rotary
    parts = precompile.kernel_code(rms_norm_rope.rms_norm_rope_fwd._pyfunc)
    helpers = [f for f in vars(rotary).values() if inspect.isfunction(f)
               and f.__module__ == rotary.__name__ and inspect.getsource(f).encode() in parts]
    assert helpers                                      # helpers from ops/rotary.py count


_HELPERS_MODULE = """
import cuda.tile as ct
LIMIT = {limit}
def clamp(x):
    return x * {clamp}
"""

_USER_KERNEL_MODULE = """
import cuda.tile as ct
import {helpers} as helpers
SCALE = {scale}
def inner(x):
    return x * {inner}
@ct.function
def tile_helper(x):
    return inner(x) + SCALE
def kernel(x):
    return helpers.clamp(tile_helper(x)) + helpers.LIMIT + ct.bid(0)
"""


def _user_code_of(tmp_path, monkeypatch, tag, **edits):
    """kernel_code of a kernel that reaches code through a @ct.function helper and through
    attributes of a module of its own (`helpers.clamp`, `helpers.LIMIT`)."""
    import importlib
    values = {"scale": 2, "inner": 3, "limit": 7, "clamp": 5, **edits}
    helpers = f"helpers_{tag}"
    (tmp_path / f"{helpers}.py").write_text(_HELPERS_MODULE.format(**values))
    (tmp_path / f"user_{tag}.py").write_text(
        _USER_KERNEL_MODULE.format(helpers=helpers, **values))
    monkeypatch.syspath_prepend(str(tmp_path))
    return precompile.kernel_code(importlib.import_module(f"user_{tag}").kernel)


def test_fingerprint_follows_tile_functions_and_the_programs_own_modules(tmp_path, monkeypatch):
    """A @ct.function helper's own globals and the functions and constants a kernel reads as
    attributes of a module of the program count (they were left out: an edit there kept the
    old winners); cuTile's own functions (`ct.bid`) do not."""
    base = _user_code_of(tmp_path, monkeypatch, "a")
    assert any(b"def inner" in p for p in base) and b"SCALE=2" in base
    assert any(b"def clamp" in p for p in base) and b"helpers.LIMIT=7" in base
    assert not any(b"def bid" in p for p in base)
    assert _user_code_of(tmp_path, monkeypatch, "f") == base       # the same code, elsewhere
    for tag, edit in (("b", dict(scale=4)), ("c", dict(inner=6)), ("d", dict(limit=8)),
                      ("e", dict(clamp=9))):
        assert _user_code_of(tmp_path, monkeypatch, tag, **edit) != base, edit


def test_fingerprint_follows_only_attributes_read_from_a_module_of_the_program(tmp_path,
                                                                           monkeypatch):
    """`ct.load` reads `load` from cuTile: a module of the program that the kernel's module
    happens to bind to the global name `load` (`from tiletune import store` beside `ct.store`)
    is not followed (its state, a frozenset's hash order among it, made the fingerprint differ
    between processes, and the ranks of a job disagree)."""
    import importlib
    (tmp_path / "helpers_g.py").write_text("def bid():\n    return 0\n")
    (tmp_path / "user_g.py").write_text(
        "import cuda.tile as ct\nimport helpers_g as load\n"
        "def kernel(x):\n    return ct.load(x) + ct.bid(0)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    parts = precompile.kernel_code(importlib.import_module("user_g").kernel)
    assert not any(b"def bid" in p for p in parts)


def test_fingerprints_are_the_same_in_every_process():
    """No address or path in the store key: a fresh process must find the winners."""
    code = ("import hashlib, importlib, pkgutil, tiletune.ops as P\n"
            "from tiletune import precompile\n"
            "h = hashlib.sha256()\n"
            "for m in sorted(i.name for i in pkgutil.iter_modules(P.__path__)):\n"
            "    mod = importlib.import_module('tiletune.ops.' + m)\n"
            "    for n in sorted(vars(mod)):\n"
            "        f = getattr(getattr(mod, n), '_pyfunc', None)\n"
            "        if f is not None:\n"
            "            h.update(b''.join(precompile.kernel_code(f)))\n"
            "print(h.hexdigest())")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True, env={**os.environ, "PYTHONHASHSEED": str(seed)}).stdout
            for seed in (1, 2)]
    assert runs[0] == runs[1] and len(runs[0].strip()) == 64


def test_disable_autotune_launches_once_per_call(env, monkeypatch):
    """Nsight Compute under DISABLE_AUTOTUNE=1 must see only production launches."""
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    t = _declared(env, monkeypatch, "ncu", grid=lambda c, dev, x, n: (1,),
                  args=lambda c, x, n: (x,))
    for _ in range(3):
        t.launch(("k",), "cpu", torch.zeros(4), 16)
    assert len(env.launches) == 3


@pytest.mark.parametrize("value, taken", [("60s", "60.0"), ("1e7", "1000000.0")],
                         ids=["malformed", "past what a compile can wait"])
def test_a_malformed_compile_timeout_does_not_break_import(value, taken):
    """A value that is no number warns and takes the default; one past what subprocess.run
    can wait for a compile (its poll() takes a C int of milliseconds: every compile of every
    config raised OverflowError) warns and takes the most it can."""
    code = ("import subprocess, tiletune.autotune as a; print(a.COMPILE_TIMEOUT_SEC); "
            "subprocess.run(['true'], capture_output=True, timeout=a.COMPILE_TIMEOUT_SEC)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, TILETUNE_COMPILE_TIMEOUT_SEC=value), timeout=120)
    assert out.returncode == 0 and out.stdout.split() == [taken], out.stderr
    assert "TILETUNE_COMPILE_TIMEOUT_SEC" in out.stderr


def test_strides_past_int32_on_size_1_dims_are_made_small(env, monkeypatch):
    """cuTile refuses a stride past 2^31 - 1 elements (OverflowError). On a dim of size 1 (a[None]
    of a big matrix) any stride serves: the launch is retried with a small one, on the first
    call (search included) and on the fast path. A real dim's stride that large is a ValueError
    naming the kernel, and the store keeps its entry."""
    big = torch.empty(10).as_strided((1, 2, 5), (2**31 + 5, 5, 1))
    (fit,) = autotune.int32_strides("op", (big,))
    assert fit.stride() == (5, 5, 1) and fit.data_ptr() == big.data_ptr()
    assert autotune.int32_strides("op", (torch.zeros(2, 5), 3))[1] == 3
    huge = torch.empty(0, device="meta").as_strided((2, 5), (2**31, 1))
    with pytest.raises(ValueError, match=r"^op: .*2\^31 - 1"):
        autotune.int32_strides("op", (huge,))
    with pytest.raises(ValueError, match="op: the launch was refused"):
        autotune.int32_strides("op", (fit,), OverflowError("stride is too big"))

    launched = []

    def launch(stream, grid, kernel, args):
        if any(isinstance(a, torch.Tensor) and max(a.stride()) > 2**31 - 1 for a in args):
            raise OverflowError("stride is too big")
        launched.append(args)
    monkeypatch.setattr(ct, "launch", launch)
    t = _declared(env, monkeypatch, "int32", grid=lambda c, dev, x, n: (1,),
                  args=lambda c, x, n: (x, c.occupancy))
    t.launch(("k",), "cpu", big, 5)
    assert env.fake.calls == 1 and launched[-1][0].stride() == (5, 5, 1)
    launched.clear()
    t.launch(("k",), "cpu", big, 5)
    assert len(launched) == 1 and launched[0][0].stride() == (5, 5, 1)
    t.clear()                                       # a stored winner and a real overflow
    bad = torch.empty(10).as_strided((2, 5), (0, 1))
    monkeypatch.setattr(ct, "launch", lambda *a: (_ for _ in ()).throw(OverflowError("x")))
    with pytest.raises(ValueError, match="the launch was refused"):
        t.launch(("k",), "cpu", bad, 5)
    assert len(store.entries(t.name)[t.name]) == 1


def test_search_final_round_and_launch_share_each_configs_kernel_object(env, monkeypatch):
    """Each kernel object has its own JIT cache: one per config and device means one trace per
    config and device, whichever stage launches it first."""
    import cuda.tile._cext
    seen = []

    def benchmark(stream, grid, kernel, args, flush_l2):    # the search, stopped at launch
        seen.append(kernel)
        raise RuntimeError("no GPU here")
    monkeypatch.setattr(cuda.tile._cext, "_benchmark", benchmark)
    t = env.make()
    cfgs = list(_space("sm_90", n=16))
    with pytest.raises(ValueError, match="No valid config"):
        REAL_SEARCH(cfgs, None, lambda c: (1,), t._search_kernels(0), lambda c: ())
    shared = [t._with_hints(t.search_kernel(c), c, 0) for c in cfgs]
    assert len(seen) == 3 and all(k is s for k, s in zip(seen, shared))
    assert len({id(k) for k in shared}) == 3
    assert all(t._with_hints(t.search_kernel(c), c, 1) is not s for c, s in zip(cfgs, shared))
    cfg, kernel = resolve(t, ("k", 2))                  # the fake search, the final round
    assert kernel is t._with_hints(t.base_kernel(cfg), cfg, 0)
    assert env.launches and {id(a[2]) for a in env.launches} <= {id(k) for k in shared}


# -- the final round's and the timing's failures -------------------------------------------------

def test_finalists_whose_runs_all_raised_do_not_win(env):
    """Every finalist's run raised in the final round (a kernel only the run launches did not
    build): none of them wins on its search time. The fastest config outside the round wins;
    where every timed config was in the round, the key fails with each config's error."""
    env.fake.best_occ = 4          # search: occ 4 10 us, occ 2 12 us, occ 1 13 us
    refused = RuntimeError("sum kernel refused")
    env.final.times = {0: refused, 1: refused}         # the finalists: occ 4 and the default
    t = env.make()
    s = Search(shape=dict(n=16), grid_fn=lambda c: (1,), args_fn=lambda c: (),
               run_fn=lambda c, kernel: None)
    cfg, _ = t.tune(("k", 40), 0, s)
    rec = t.records[("k", 40)]
    assert cfg.occupancy == 2 and rec.best_us == 12.0
    assert sorted(f["config"]["occupancy"] for f in rec.failures) == [1, 4]
    env.fake.fail, env.fake.best_occ = {4}, 2      # search: occ 2 10 us, occ 1 11 us; 4 failed
    with pytest.raises(TuningFailedError) as e:
        t.tune(("k", 41), 0, s)
    assert sorted(f[0]["occupancy"] for f in e.value.failures) == [1, 2, 4]
    calls = env.fake.calls
    with pytest.raises(TuningFailedError):          # no new search for a key that failed
        t.tune(("k", 41), 0, s)
    assert env.fake.calls == calls and store.load(t.name, t.store_key(("k", 41), 0, list(
        _space("sm_90", n=16)))) is None


def test_finalists_out_of_memory_in_the_final_round_keep_the_anchor(env):
    """Out of memory says nothing about the configs: as when the round as a whole fails, the
    search's fastest config stands."""
    oom = torch.cuda.OutOfMemoryError("CUDA out of memory")
    env.final.times = {0: oom, 1: oom}
    t = env.make()
    cfg, _ = t.tune(("k", 42), 0, search())
    assert cfg.occupancy == 2 and t.records[("k", 42)].best_us == 10.0


@pytest.mark.parametrize("regime", [dict(preheat_ms=0), dict(preheat_ms=1.0),
                                    dict(block_ms=1.0, preheat_ms=0)])
def test_a_candidate_that_raises_after_its_warm_up_leaves_the_others_timed(clock, regime):
    """A run that raises after the warm-up (its run allocates and the memory ran out once the
    flush buffer took its share): that candidate maps to its error, the others keep their
    times, instead of the whole timing raising (a search then failed every config with it)."""
    runs = []

    def flaky():
        runs.append(1)
        if len(runs) > 2:
            raise RuntimeError("CUDA out of memory")
        clock.run("flaky", 5.0)

    cands = [("flaky", flaky, None), ("steady", lambda: clock.run("steady", 20.0), None)]
    us = timing.time_interleaved(cands, warmup=2, **regime)
    assert isinstance(us["flaky"], RuntimeError) and us["steady"] == pytest.approx(20.0)
    assert len(runs) == 3                           # not run again once it raised


def test_a_gpu_older_than_cutile_compiles_for_is_refused_naming_the_op(env, monkeypatch):
    """Volta and Turing: one clear error on the miss, before any search or store read, also
    under DISABLE_AUTOTUNE (whose launch would fail in the compiler), instead of every config
    failing to compile."""
    from tiletune import device
    monkeypatch.setattr(device, "arch", lambda d=None: "sm_75")
    t = env.make()
    refusal = (rf"{t.name}: cuTile kernels need a GPU of compute capability 8.0 or newer; "
               rf"device 0 \(Fake H200\) is sm_75")
    with pytest.raises(ValueError, match=refusal):
        t.tune(("k", 50), 0, search())
    assert env.fake.calls == 0 and t.searches == 0 and env.launches == []
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    with pytest.raises(ValueError, match=refusal):
        t.tune(("k", 50), 0, search())
    monkeypatch.setattr(device, "arch", lambda d=None: "sm_80")
    assert t.tune(("k", 51), 0, search())[0].occupancy == 1      # Ampere: the default


def test_every_config_failing_to_compile_shows_what_the_compiler_said(env, monkeypatch):
    """A compiler error's first line is "Return code 1"; what tileiras said follows it. The
    error of a search whose every config failed to compile gives the compiler's lines, each
    distinct message in full and a repeat by its first line, and keeps each full message."""
    from cuda.tile._exception import CompilerExecutionError, Loc
    said = {1: "error: 'cuda_tile.mma' op needs 288 KiB of shared memory, 227 KiB available",
            2: "error: 'cuda_tile.mma' op needs 288 KiB of shared memory, 227 KiB available",
            4: "error: 'cuda_tile.load' op tile of 4096 elements exceeds the register budget"}

    env.fake.error = lambda c: ("CompilerExecutionError", str(CompilerExecutionError(
        1, said[c.occupancy], Loc.unknown(), "-O3", "13.4.92")))
    env.fake.fail = {1, 2, 4}
    t = env.make()
    with pytest.raises(TuningFailedError) as e:
        resolve(t, ("k",))
    text = str(e.value)
    assert text.count(said[1]) == 1 and text.count(said[4]) == 1
    assert text.count("CompilerExecutionError: Return code 1") == 3
    assert [m for _, _, m in e.value.failures] == [
        f"Return code 1\n{said[o]}\nUnknown location" for o in (1, 2, 4)]


def test_a_stand_in_made_under_a_fake_tensor_mode_is_not_kept():
    """A call traced under a fake-tensor mode (make_fx, a FakeTensorMode memory estimator) gets
    a fake stand-in; the next real call of that device and size class gets a real one, not the
    fake kept from the trace (which its launch could not take)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    stand_ins = autotune.StandIns(lambda like, m: like.new_empty(m, dtype=torch.float32))
    with FakeTensorMode() as mode:
        fake = stand_ins.get(mode.from_tensor(torch.empty(6)), 0, 6)
    assert type(fake) is not torch.Tensor
    real = stand_ins.get(torch.empty(6), 0, 6)
    assert type(real) is torch.Tensor and real.shape == (5,)
    assert stand_ins.get(torch.empty(7), 0, 7) is real          # kept: the same size class


def test_a_first_launch_whose_search_failed_for_the_moment_runs_the_default(env, monkeypatch):
    """A first launch whose search failed with nothing of its configs' own (out of memory for
    the search's buffers on a full GPU): the step goes on with the default config, which then
    serves the key for the process (warned, nothing stored, no search at every call); configs
    that failed on their own still fail the call."""
    x = torch.zeros(4)
    t = _declared(env, monkeypatch, "for_now", grid=lambda c, dev, x, n: (1,),
                  args=lambda c, x, n: (x, c.occupancy))
    env.fake.fail = {1, 2, 4}
    env.fake.error = lambda c: ("OutOfMemoryError", "CUDA out of memory")
    with pytest.warns(UserWarning, match="failed for the moment .OutOfMemoryError.; the default"):
        t.launch(("k",), "cpu", x, 16)
    cfgs = t.config_list("sm_90", dict(n=16))
    record = t.records[("k",)]
    assert record.source == "default" and record.config == autotune.config_dict(cfgs[0])
    assert [f["error"] for f in record.failures] == ["OutOfMemoryError"] * 3
    assert env.launches[-1][3] == (x, cfgs[0].occupancy)
    t.launch(("k",), "cpu", x, 16)
    assert env.fake.calls == 1 and env.launches[-1][3] == (x, cfgs[0].occupancy)
    assert store.load(t.name, t.store_key(("k",), 0, cfgs)) is None
    with autotune.searches_must_decide():        # `tune` and `bench`: their output is winners
        with pytest.raises(TuningFailedError, match="OutOfMemoryError"):
            t.launch(("k2",), "cpu", x, 16)
    assert ("k2",) not in t.cache
    env.fake.error = lambda c: ("RuntimeError", "boom")
    with pytest.raises(TuningFailedError, match="boom"):
        t.launch(("other",), "cpu", x, 16)


def test_a_failed_key_gives_a_few_distinct_messages_in_full():
    """Compiler messages that differ in a number (each config's shared memory) are all distinct:
    the first FULL_MESSAGES are given in full, the rest by their first line; `.failures` keeps
    every message whole."""
    failures = [({"tile": t}, "CompilerExecutionError", f"Return code 1\nsmem {t} KB too large")
                for t in range(5)]
    text = str(TuningFailedError("op", ("k",), failures))
    assert [f"smem {t} KB" in text for t in range(5)] == [True] * 3 + [False] * 2
    assert text.count("(the rest in .failures)") == 2
    assert TuningFailedError("op", ("k",), failures).failures == failures


@pytest.mark.parametrize("default_us, picked", [
    (8.0 * (1 + autotune.KEEP_DEFAULT_MARGIN), 1),   # within the margin: the default stays
    (8.0 * (1 + autotune.KEEP_DEFAULT_MARGIN) + 0.01, 4),    # past it: the fastest wins
])
def test_the_default_keeps_its_place_within_the_final_rounds_margin(env, default_us, picked):
    env.fake.best_occ = 4          # search: occ 4 10 us, occ 2 12 us, occ 1 (the default) 13 us
    env.final.times = {0: 8.0, 1: default_us}
    t = env.make()
    cfg, _ = resolve(t, ("k", 21))
    assert env.final.calls == [[0, 1]]
    assert cfg.occupancy == picked
    rec = t.records[("k", 21)]
    assert rec.config["occupancy"] == picked
    assert rec.best_us == (default_us if picked == 1 else 8.0)
    assert [f["config"]["occupancy"] for f in rec.final] == [4, 1]   # the round as timed


# -- the search's sampling -----------------------------------------------------------------------

def _sampling(monkeypatch, configs):
    """REAL_SEARCH over configs {name: (mean us, spread us)} with a stand-in benchmark: each run
    takes mean + uniform noise of that spread (seeded); returns (result, samples per name)."""
    import random

    import cuda.tile._cext
    rng, runs = random.Random(7), {}

    def benchmark(stream, grid, kernel, args, flush_l2):
        assert flush_l2 and stream == "stream" and grid == (1,) and args == ("args", kernel)
        runs[kernel] = runs.get(kernel, 0) + 1
        mean, spread, *fails_at = configs[kernel]
        if mean is None or fails_at and runs[kernel] >= fails_at[0]:
            raise RuntimeError(f"{kernel} refused")
        return mean + spread * (rng.random() - 0.5)
    monkeypatch.setattr(cuda.tile._cext, "_benchmark", benchmark)
    result = REAL_SEARCH(list(configs), "stream", lambda c: (1,), lambda c: c,
                         lambda c: ("args", c))
    return result, {m.config: m.num_samples for m in result.successes}, runs


def test_the_search_samples_a_clearly_slower_config_no_further(monkeypatch):
    """Slow configs that settle in their first batch do not count among the leaders (cuTile's
    search counted them, then sampled every noisy config to its 5 s budget): the five fastest
    settle, and a noisy config whose interval stays above the slowest of them takes one batch."""
    fast = {f"fast{i}": (10000.0 + 100 * i, 400.0) for i in range(5)}
    slow = {f"slow{i}": (30000.0 + 10 * i, 1.0) for i in range(3)}       # settle at once
    noisy = {f"noisy{i}": (14000.0 + 500 * i, 600.0) for i in range(4)}  # far behind, unsettled
    result, samples, runs = _sampling(monkeypatch, {**fast, **slow, **noisy})
    assert result.best.config == "fast0" and not result.failures
    assert all(samples[n] == timing.SEARCH_BATCH for n in (*slow, *noisy)), samples
    assert all(runs[n] == timing.SEARCH_WARMUP + timing.SEARCH_BATCH for n in noisy)
    for m in result.successes:
        if m.config in fast:         # settled: within 1% or at the sampling budget
            assert m.error_margin_us <= 0.01 * m.mean_us or \
                m.mean_us * m.num_samples >= timing.SEARCH_MAX_SAMPLING_US, m
            assert abs(m.mean_us - fast[m.config][0]) < 150


def test_the_search_samples_a_close_config_until_it_is_settled_or_out(monkeypatch):
    """A sixth config whose interval reaches below the slowest leader samples on; a noisy
    leader stops at the sampling budget."""
    configs = {f"lead{i}": (5000.0 + i, 10.0) for i in range(5)}
    configs["close"] = (5006.0, 1000.0)
    configs["noisy lead"] = (4990.0, 4990.0)
    result, samples, _ = _sampling(monkeypatch, configs)
    assert samples["close"] > timing.SEARCH_BATCH
    noisy = next(m for m in result.successes if m.config == "noisy lead")
    assert noisy.error_margin_us > 0.01 * noisy.mean_us          # never settled: the budget
    assert noisy.mean_us * (noisy.num_samples - timing.SEARCH_BATCH) < \
        timing.SEARCH_MAX_SAMPLING_US <= noisy.mean_us * noisy.num_samples


def test_the_search_reports_each_failed_config_and_raises_when_all_fail(monkeypatch):
    result, samples, _ = _sampling(monkeypatch, {"ok": (5.0, 0.1), "bad": (None, 0)})
    assert result.best.config == "ok" and set(samples) == {"ok"}
    assert [(c, t) for c, t, _ in result.failures] == [("bad", RuntimeError)]
    with pytest.raises(timing.NoValidConfig,
                       match="No valid config.*\n.*\nRuntimeError: bad refused") as e:
        _sampling(monkeypatch, {"bad": (None, 0), "worse": (None, 0)})
    assert [(c, t, m) for c, t, m in e.value.failures] == [
        ("bad", RuntimeError, "bad refused"), ("worse", RuntimeError, "worse refused")]


def test_configs_timed_whole_are_sampled_as_kernels_are(monkeypatch):
    """search_runs (configs whose run is timed whole, attention's backward plans): one run a
    sample, with the kernels' sampling: a config far behind takes its warm-up and one batch,
    the leaders settle, a run that raises is a failure; NoValidConfig when every run raises."""
    import random
    rng, runs = random.Random(3), {}
    means = {**{n: 3000.0 + 30 * i for i, n in enumerate("abcde")}, "far": 9000.0,
             "bad": None}

    def time_one(fn):
        name = fn()
        runs[name] = runs.get(name, 0) + 1
        if means[name] is None:
            raise RuntimeError("run refused")
        return means[name] + 400 * (rng.random() - 0.5)
    monkeypatch.setattr(timing, "_time_one", time_one)
    result = timing.search_runs([(n, lambda n=n: n) for n in means])
    samples = {m.config: m for m in result.successes}
    assert result.best.config == "a" and set(samples) == {*"abcde", "far"}
    assert [(c, t) for c, t, _ in result.failures] == [("bad", RuntimeError)]
    assert runs["far"] == timing.SEARCH_WARMUP + timing.SEARCH_BATCH and runs["bad"] == 1
    for name in "abcde":
        m = samples[name]
        assert m.error_margin_us <= 0.01 * m.mean_us and abs(m.mean_us - means[name]) < 60
    with pytest.raises(timing.NoValidConfig, match="run refused"):
        timing.search_runs([("bad", lambda: "bad")])


def test_when_every_config_fails_the_engine_keeps_the_searchs_errors(env, monkeypatch):
    """The search records every config's error, each from its own samples."""
    import cuda.tile._cext
    t = env.make()
    occupancy = {id(t._with_hints(t.search_kernel(c), c, 0)): c.occupancy
                 for c in _space("sm_90", n=16)}

    def benchmark(stream, grid, kernel, args, flush_l2):
        raise RuntimeError(f"refused at occupancy {occupancy[id(kernel)]}")
    monkeypatch.setattr(cuda.tile._cext, "_benchmark", benchmark)
    monkeypatch.setattr(timing, "search_kernels", REAL_SEARCH)
    with pytest.raises(TuningFailedError) as e:
        resolve(t, ("k", 16))
    assert env.launches == []              # no config launched again for its error
    assert sorted(msg for _, _, msg in e.value.failures) == [
        f"refused at occupancy {o}" for o in (1, 2, 4)]


def test_a_config_failing_while_sampled_leaves_the_leaders(monkeypatch):
    """A leader that raises in a later batch is a failure, sampled no more; the next fastest
    takes its place among the leaders and settles."""
    configs = {f"lead{i}": (1000.0 + i, 100.0) for i in range(5)}
    configs["lead0"] = (990.0, 100.0, 12)           # its 12th run raises (the 4th sample)
    configs["sixth"] = (1010.0, 100.0)
    configs["far"] = (5000.0, 1.0)
    result, samples, runs = _sampling(monkeypatch, configs)
    assert [c for c, _, _ in result.failures] == ["lead0"] and "lead0" not in samples
    assert runs["lead0"] == 12
    sixth = next(m for m in result.successes if m.config == "sixth")
    assert sixth.num_samples > timing.SEARCH_BATCH and sixth.error_margin_us <= 0.01 * sixth.mean_us
    with pytest.raises(ValueError, match="empty"):
        REAL_SEARCH([], "stream", lambda c: (1,), lambda c: c, lambda c: ())
