"""One rank of the CPU agreement test (tests/cpu/test_distributed.py): `python dist_worker.py RANK
WORLD FOLDER`. torch.distributed over gloo (a FileStore rendezvous in FOLDER), the engine's real
miss path with the GPU stood in for: the search's and the final round's times depend on the
rank, so ranks tuning alone would disagree. Runs every scenario in turn (barriers between them)
and writes what it saw to FOLDER/rank<RANK>.json."""
import contextlib
import datetime
import json
import logging
import os
import sys
import time
import traceback
from types import SimpleNamespace

import cuda.tile as ct
import cuda.tile.tune
import torch
import torch.distributed as dist

from tiletune import device, distributed, precompile, store, timing
from tiletune.autotune import Autotuner, Search, TuningFailedError

RANK, WORLD, FOLDER = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
OCCUPANCIES = (1, 2, 4, 8)


@ct.kernel
def _k(x, T: ct.Constant[int]):
    ct.store(x, (ct.bid(0),), ct.load(x, (ct.bid(0),), (T,)))


def _space(arch, n):
    for occ in OCCUPANCIES:
        yield SimpleNamespace(tile=n, occupancy=occ)


# what this rank timed: (tile, occupancy) per config given to the search
timed = []
saves = []
fail_all = set()          # tiles whose every config fails
delay = [0.0]             # seconds a search takes


def fake_search(space, stream, grid_fn, kernel, args_fn):
    time.sleep(delay[0])
    ok, bad = [], []
    for c in space:
        timed.append([c.tile, c.occupancy])
        if c.tile in fail_all:
            bad.append((c, RuntimeError, f"boom {c.occupancy}"))
            continue
        # rank 0's GPU favours occupancy 2, rank 1's occupancy 8: alone they would disagree
        best = 2 if RANK == 0 else 8
        us = 10.0 + abs(OCCUPANCIES.index(c.occupancy) - OCCUPANCIES.index(best)) * 0.2
        ok.append(cuda.tile.tune.Measurement(config=c, mean_us=us, num_samples=5,
                                             error_margin_us=0.1))
    if not ok:
        raise timing.NoValidConfig("No valid config found in search space.", bad)
    return cuda.tile.tune.TuningResult(best=ok[0], successes=ok, failures=bad)


def fake_final_round(candidates, **kw):
    # the finalists in turns: this rank's GPU prefers the last of them
    n = len(candidates)
    return {label: 10.0 - (label if RANK == 0 else n - 1 - label) * 0.01
            for label, _, _ in candidates}


def stand_ins():
    device.arch = lambda d=None: "sm_90"
    device.gpu_name = lambda d: "Fake H100"
    device.current_stream = lambda dev: "stream"
    torch.cuda.current_stream = lambda *a, **k: None
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.cuda.device = lambda d: contextlib.nullcontext()
    ct.launch = lambda *a, **k: None
    precompile.enabled = lambda: False
    timing.search_kernels = fake_search
    timing.time_interleaved = fake_final_round
    real_save = store.save

    def save(op, key, entry):
        saves.append([op, key])
        real_save(op, key, entry)
    store.save = save


def search(n):
    return Search(shape=dict(n=n), grid_fn=lambda c: (1,), args_fn=lambda c: ())


def resolve(t, n, dev=0):
    """Resolve key (n, dev) on device `dev`: (config, record as JSON, seconds)."""
    key = (n, dev)
    t0 = time.perf_counter()
    cfg, _ = t.cache.get(key) or t.tune(key, dev, search(n))
    return {"config": vars(cfg), "record": t.records[key].to_json(),
            "seconds": time.perf_counter() - t0}


def use_store(name):
    path = os.path.join(FOLDER, name)
    os.environ["TILETUNE_CACHE_DIR"] = path
    return path


def main():
    stand_ins()
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(FOLDER, 'rendezvous')}",
                            rank=RANK, world_size=WORLD, timeout=datetime.timedelta(seconds=60))
    out = {}
    log_lines = []

    class Lines(logging.Handler):
        def emit(self, record):
            log_lines.append(record.getMessage())
    logging.getLogger("tiletune").addHandler(Lines())
    t = Autotuner("dist_op", _k, _space, default=SimpleNamespace(tile=8, occupancy=1))

    # 1. the same keys in the same order (searches long enough that both ranks take part)
    use_store("shared")
    distributed.set_process_group()
    delay[0] = 0.3
    dist.barrier()
    out["same_order"] = [resolve(t, n) for n in (16, 32)]
    delay[0] = 0.0
    out["same_order_timed"] = list(timed)
    dist.barrier()

    # 2. a key only rank 1 meets, while rank 0 waits in a collective
    if RANK == 1:
        out["extra"] = resolve(t, 64)
    dist.barrier()

    # 3. two keys met in opposite orders
    del timed[:]
    order = (128, 256) if RANK == 0 else (256, 128)
    t0 = time.perf_counter()
    out["opposite"] = {n: resolve(t, n) for n in order}
    out["opposite_s"] = time.perf_counter() - t0
    out["opposite_timed"] = list(timed)
    dist.barrier()

    # 4. warm start: a store written by one process on device 0 serves rank r on device r
    use_store("warm")
    distributed.clear_process_group()
    if RANK == 0:
        resolve(t, 512, dev=0)
    dist.barrier()
    t.clear()
    distributed.set_process_group()
    del timed[:]
    out["warm"] = resolve(t, 512, dev=RANK)
    out["warm_timed"] = list(timed)
    dist.barrier()

    # 5. only rank 0's store holds the winner (a folder per node): it becomes the decision
    path = use_store(f"own{RANK}")
    if RANK == 0:
        cfgs = t.config_list("sm_90", dict(n=1024))
        entry = {"config": {"tile": 1024, "occupancy": 4}, "best_us": 1.0, "timings": [],
                 "failures": [], "final": [], "rates": {}, "search_s": 0.0}
        store.save(t.name, t.store_key((1024, 0), 0, cfgs), entry)
        out["own_store"] = resolve(t, 1024)
    dist.barrier()
    del timed[:]
    if RANK == 1:
        out["own_store"] = resolve(t, 1024, dev=1)
    out["own_store_rows"] = len(store.entries(t.name).get(t.name, {}))
    out["own_store_timed"] = list(timed)
    out["own_store_path"] = path
    dist.barrier()

    # 6. a rank took a chunk and stopped: the other waits `timeout`, then times it itself
    use_store("dead")
    distributed.set_process_group(timeout=2.0)
    name = t.agreement_name((2048, 0), 0, t.config_list("sm_90", dict(n=2048)))
    if RANK == 0:
        ag = distributed.current()
        ag.store.add(ag._namespace(name, False) + "/next", 1)     # chunk 0 taken, never timed
    dist.barrier()
    if RANK == 1:
        del log_lines[:]
        out["dead"] = resolve(t, 2048)
        out["dead_log"] = [line for line in log_lines if "waited" in line]
    dist.barrier()

    # 7. the same with on_timeout="raise"
    distributed.set_process_group(timeout=2.0, on_timeout="raise")
    name = t.agreement_name((4096, 0), 0, t.config_list("sm_90", dict(n=4096)))
    if RANK == 0:
        ag = distributed.current()
        ag.store.add(ag._namespace(name, False) + "/next", 1)
    dist.barrier()
    if RANK == 1:
        t0 = time.perf_counter()
        try:
            resolve(t, 4096)
            out["raise"] = "no error"
        except distributed.DistributedTuningError as e:
            out["raise"] = str(e)
        out["raise_s"] = time.perf_counter() - t0
    dist.barrier()

    # 8. replicate: every rank times every config, the finisher merges the means of the ranks
    # that started before it finished (a search long enough that both have)
    use_store("replicate")
    distributed.set_process_group(mode="replicate")
    del timed[:]
    delay[0] = 0.5
    out["replicate"] = resolve(t, 8192)
    delay[0] = 0.0
    out["replicate_timed"] = list(timed)
    dist.barrier()

    # 9. every config fails: every rank raises TuningFailedError
    distributed.set_process_group()
    fail_all.add(16384)
    try:
        resolve(t, 16384)
        out["all_fail"] = "no error"
    except TuningFailedError as e:
        out["all_fail"] = [list(f) for f in e.failures]
    dist.barrier()

    out["saves"] = saves
    out["searches"] = t.searches
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    try:
        result = main()
    except BaseException:
        result = {"error": traceback.format_exc()}
    with open(os.path.join(FOLDER, f"rank{RANK}.json"), "w") as f:
        json.dump(result, f, default=str)
