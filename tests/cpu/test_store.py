"""The store's reliability (tiletune/store.py), env parsing (tiletune/env.py) and `cache show` on
hand-written store rows: a real sqlite database in a temp folder; faults the test machine cannot
make for real (a read-only folder when the tests run as root) are injected at the one call that
meets them."""
import json
import os
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import pytest

from tiletune import env, precompile, store
from tiletune.__main__ import main

from tests.cpu.stand_ins import fork, wait_child

OP = "matmul"
CT, TI = "1.7.0", "13.4.92"


@pytest.fixture
def folder(monkeypatch, tmp_path):
    d = tmp_path / "store"
    monkeypatch.setenv("TILETUNE_CACHE_DIR", str(d))
    monkeypatch.setattr(env, "_warned", set())      # "warn once" starts afresh in every test
    return d


def write_store(folder, entries, op=OP):
    for key, entry in entries.items():
        store.save(op, key, entry)


def stored(folder, op=OP):
    """The op's rows as the database file holds them (read with a connection of its own)."""
    with sqlite3.connect(folder / store.DB_NAME) as conn:
        rows = conn.execute(f"SELECT key, entry FROM {store.TABLE} WHERE op = ?", (op,))
        return {key: json.loads(text) for key, text in rows}


def recorded(fn, *args):
    """(fn's result, the messages of every warning it raised)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args)
    return result, [str(w.message) for w in caught]


def skey(i, ct=CT, ti=TI):
    return (f"({i}, 4096, 'torch.bfloat16') | NVIDIA H100 80GB HBM3 | sm_90 | cuda-tile {ct} | "
            f"tileiras {ti} | space 0123456789abcdef")


def realistic(i):
    """An entry like autotune saves: ~3.5 KB of JSON (20 timings, a failure)."""
    def cfg(j):
        return {"tile_m": 64 << (j % 3), "tile_n": 128, "tile_k": 32 << (j % 2),
                "occupancy": 1 + j % 4, "num_ctas": 1, "split_k": j % 3 + 1}
    return {"config": cfg(i), "best_us": 12.5 + i % 7, "search_s": 3.2, "rates": {"tflops": 512.3},
            "timings": [{"config": cfg(j), "mean_us": 10.0 + j * 0.731,
                         "median_us": 10.0 + j * 0.7} for j in range(20)],
            "final": [{"config": cfg(0), "median_us": 12.1}],
            "failures": [{"config": cfg(99), "error": "TileCompilerError",
                          "message": "shared memory exceeds limit (232448 bytes)\n" * 2}],
            "saved": "2026-11-26T10:00:00"}


# 1. the database's (and its -wal/-shm files') mode follows the umask

@pytest.mark.parametrize("umask", [0o002, 0o022, 0o077])
def test_database_files_mode_follows_the_umask(folder, umask):
    old = os.umask(umask)
    try:
        store.save(OP, "k", {"config": {"tile": 64}})
        store.save(OP, "k2", {"config": {"tile": 32}})
    finally:
        os.umask(old)
    db = folder / store.DB_NAME
    for path in (db, folder / (store.DB_NAME + "-wal"), folder / (store.DB_NAME + "-shm")):
        mode = os.stat(path).st_mode & 0o777        # -wal/-shm: open while our connection is
        assert mode == 0o666 & ~umask, (path, oct(mode))
    assert stored(folder) == {"k": {"config": {"tile": 64}}, "k2": {"config": {"tile": 32}}}


# 2. 10k entries: one lookup and one save stay in milliseconds

def test_ten_thousand_entries_load_and_save_in_milliseconds(folder):
    n = 10_000
    for i in range(n):
        store.save(OP, skey(i), realistic(i))
    assert len(json.dumps(realistic(0))) > 2000
    keys = [skey(i) for i in range(0, n, n // 20)][:20]
    loads, saves = [], []
    for i, key in enumerate(keys):
        t = time.perf_counter()
        entry = store.load(OP, key)
        loads.append(time.perf_counter() - t)
        assert entry == realistic(int(key[1:].split(",")[0]))
        t = time.perf_counter()
        store.save(OP, skey(n + i), realistic(n + i))
        saves.append(time.perf_counter() - t)
    load_ms, save_ms = statistics.median(loads) * 1e3, statistics.median(saves) * 1e3
    size_mb = os.path.getsize(folder / store.DB_NAME) / 1e6
    print(f"\n10k entries ({size_mb:.0f} MB): load {load_ms:.3f} ms, save {save_ms:.3f} ms "
          "(median of 20)")
    assert load_ms <= 4 * 5 and save_ms <= 4 * 20
    assert len(store.entries(OP)[OP]) == n + 20


# 3. several processes

_WRITER = """
import sys, time
from tiletune import store
t = time.perf_counter()
for i in range(200):
    store.save("shared", f"p{sys.argv[1]}-{i}", {"config": {"i": i}, "pad": "x" * 2000})
print(time.perf_counter() - t)
"""


def test_eight_processes_saving_200_entries_each_lose_nothing(folder):
    run_env = dict(os.environ, TILETUNE_CACHE_DIR=str(folder))
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(p)], env=run_env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for p in range(8)]
    outs = [p.communicate(timeout=300) for p in procs]
    assert all(p.returncode == 0 for p in procs) and not any(e for _, e in outs), outs
    print(f"\n8 processes x 200 saves: the slowest process saved for "
          f"{max(float(o) for o, _ in outs):.2f} s")
    got = stored(folder, "shared")
    assert set(got) == {f"p{p}-{i}" for p in range(8) for i in range(200)}


# 4. the old JSON files are imported once

def test_old_json_files_are_imported_once_and_kept(folder):
    folder.mkdir(parents=True)
    old = {"format": store.FORMAT, "entries": {"a": {"config": {"tile": 8}},
                                               "b": {"config": {"tile": 16}}}}
    (folder / f"{OP}.json").write_text(json.dumps(old))
    (folder / "rope.json").write_text(json.dumps({"format": store.FORMAT,
                                                  "entries": {"r": {"config": {"t": 1}}}}))
    (folder / "junk.json").write_text("[1, 2")
    result, warned = recorded(store.load, OP, "a")
    assert result == {"config": {"tile": 8}}
    assert len(warned) == 1 and "junk.json" in warned[0]         # a corrupt one is left alone
    assert store.entries() == {OP: old["entries"], "rope": {"r": {"config": {"t": 1}}}}
    names = sorted(os.listdir(folder))
    assert f"{OP}.json.imported" in names and "rope.json.imported" in names
    assert "junk.json" in names and f"{OP}.json" not in names
    assert json.loads((folder / f"{OP}.json.imported").read_text()) == old
    # a JSON file that appears later is not imported again, and rows saved since stay
    store.save(OP, "a", {"config": {"tile": 32}})
    (folder / f"{OP}.json").write_text(json.dumps(old))
    store.close()
    assert store.load(OP, "a") == {"config": {"tile": 32}} and (folder / f"{OP}.json").exists()


# 5. prune

def test_prune_removes_other_versions_and_old_rows(folder, monkeypatch, capsys):
    import importlib.metadata
    import cuda.tile as ct
    monkeypatch.setattr(importlib.metadata, "version", lambda name: TI)
    store.save(OP, skey(1, ct=ct.__version__), {"config": {}})           # current: kept
    store.save(OP, skey(2, ct="0.9.0"), {"config": {}})                  # old cuda-tile
    store.save(OP, skey(3, ct=ct.__version__, ti="12.0.1"), {"config": {}})   # old tileiras
    store.save("rope", skey(4, ct="0.9.0"), {"config": {}})
    store.save("rope", "no versions in this key", {"config": {}})       # cannot tell: kept
    store.save("rope", skey(5, ct=ct.__version__), {"config": {}})
    assert main(["cache", "prune"]) == 0
    out = capsys.readouterr().out
    assert f"{OP}: removed 2 entries" in out and "rope: removed 1 entry" in out
    assert "pruned 3 entries" in out
    assert store.entries() == {OP: {skey(1, ct=ct.__version__): {"config": {}}},
                               "rope": {"no versions in this key": {"config": {}},
                                        skey(5, ct=ct.__version__): {"config": {}}}}
    with sqlite3.connect(folder / store.DB_NAME) as conn:     # one row saved 40 days ago
        conn.execute(f"UPDATE {store.TABLE} SET saved = ? WHERE key = ?",
                     (time.time() - 40 * 86400, skey(5, ct=ct.__version__)))
    assert main(["cache", "prune", "--older-than", "30"]) == 0
    assert "rope: removed 1 entry" in capsys.readouterr().out
    assert set(store.entries()["rope"]) == {"no versions in this key"}
    with pytest.raises(SystemExit):
        main(["cache", "prune", "--older-than", "-1"])
    for action in ("clear", "show"):          # an option of prune only: refused, nothing cleared
        with pytest.raises(SystemExit):
            main(["cache", action, "--older-than", "30"])
    for action in ("clear", "prune"):         # -v: an option of show only
        with pytest.raises(SystemExit):
            main(["cache", action, "-v"])
    assert set(store.entries()["rope"]) == {"no versions in this key"}


def test_prune_without_a_known_compiler_version_keeps_every_tileiras_version(folder, monkeypatch,
                                                                             capsys):
    """Where no tileiras can be found ("unknown"), prune checks cuda-tile alone: pruning against
    "unknown" would delete every row a real compiler wrote (a login node sharing the store)."""
    import cuda.tile as ct
    from tiletune import autotune
    monkeypatch.setattr(autotune, "tileiras_version", lambda: "unknown")
    store.save(OP, skey(1, ct=ct.__version__), {"config": {}})
    store.save(OP, skey(2, ct="0.9.0"), {"config": {}})
    assert main(["cache", "prune"]) == 0
    out = capsys.readouterr().out
    assert "tileiras version unknown here" in out and "pruned 1 entry" in out
    assert list(store.entries()[OP]) == [skey(1, ct=ct.__version__)]


def test_clear_and_prune_that_cannot_write_the_store_say_so_and_fail(folder, monkeypatch,
                                                                      capsys):
    """A store another process holds locked past the busy timeout: `cache clear` and `cache
    prune` report it and exit 1 instead of printing that 0 entries were removed."""
    store.save(OP, skey(1, ct="0.9.0"), {"config": {}})
    monkeypatch.setattr(store, "BUSY_TIMEOUT_S", 0.05)
    store.close()
    holder = sqlite3.connect(folder / store.DB_NAME, isolation_level=None)
    holder.execute("BEGIN EXCLUSIVE")
    try:
        for action in ("clear", "prune"):
            assert main(["cache", action]) == 1
            assert f"cannot {action}" in capsys.readouterr().out
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert list(store.entries()[OP]) == [skey(1, ct="0.9.0")]
    assert main(["cache", "clear"]) == 0 and store.entries() == {}


def test_prune_other_gpus_keeps_the_models_this_machine_has(folder, monkeypatch, capsys):
    """--other-gpus deletes the rows keyed by GPU models no visible device has (a key without
    the store key's parts is kept); where no GPU is visible, or CUDA_VISIBLE_DEVICES may hide
    some, it refuses and deletes nothing."""
    import torch
    import cuda.tile as ct
    from tiletune import autotune, device
    monkeypatch.setattr(autotune, "tileiras_version", lambda: TI)
    h100 = skey(1, ct=ct.__version__)
    h200 = h100.replace("NVIDIA H100 80GB HBM3", "NVIDIA H200")
    for key in (h100, h200, "no versions in this key"):
        store.save(OP, key, {"config": {}})
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["cache", "prune", "--other-gpus"]) == 1
    assert "no GPU is visible here" in capsys.readouterr().out
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")        # may hide this machine's other models
    assert main(["cache", "prune", "--other-gpus"]) == 1
    assert "unset it for --other-gpus; nothing pruned" in capsys.readouterr().out
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert len(store.entries()[OP]) == 3
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(device, "gpu_name", lambda i: "NVIDIA H100 80GB HBM3")
    assert main(["cache", "prune"]) == 0                        # without the flag: kept
    assert len(store.entries()[OP]) == 3
    capsys.readouterr()
    assert main(["cache", "prune", "--other-gpus"]) == 0
    out = capsys.readouterr().out
    assert "pruned 1 entry" in out and "other than NVIDIA H100 80GB HBM3" in out
    assert set(store.entries()[OP]) == {h100, "no versions in this key"}
    with pytest.raises(SystemExit):
        main(["cache", "show", "--other-gpus"])


# 6. a database that cannot be used: one warning, no crash, nothing persisted

def test_a_read_only_folder_warns_once_and_runs_without_persisting(folder, monkeypatch):
    def refused(*a, **kw):
        raise sqlite3.OperationalError("attempt to write a readonly database")
    monkeypatch.setattr(sqlite3, "connect", refused)
    _, warned = recorded(store.save, OP, "k", {"config": {"tile": 64}})
    assert len(warned) == 1 and "cannot use the cache database" in warned[0], warned
    for fn, args, want in ((store.load, (OP, "k"), None), (store.save, (OP, "k", {}), None),
                           (store.entries, (), {}), (store.clear, (), 0)):
        assert recorded(fn, *args) == (want, [])                   # quiet after the first
    monkeypatch.undo()
    db = folder / store.DB_NAME
    assert not db.exists() or db.stat().st_size == 0           # nothing was written


def test_a_folder_on_a_network_filesystem_warns_once_and_the_store_works(folder, monkeypatch,
                                                                       tmp_path):
    """The mount table decides: the longest mount point holding the folder's real path, with
    /proc/mounts' octal escapes decoded. An NFS folder: one warning naming it and the fix; the
    store still saves and loads. A local one: no warning. No mount table: no warning."""
    folder = tmp_path / "shared home" / "store"
    monkeypatch.setenv("TILETUNE_CACHE_DIR", str(folder))
    parent = os.path.dirname(os.path.realpath(folder)).replace(" ", "\\040")
    assert "\\040" in parent
    mounts = tmp_path / "mounts"
    mounts.write_text("/dev/sda1 / ext4 rw 0 0\n"
                      f"server:/export {parent} nfs4 rw,relatime 0 0\n"
                      f"/dev/sdb1 {parent}/store-not-this-one xfs rw 0 0\n")
    monkeypatch.setattr(store, "MOUNTS", str(mounts))
    assert store.filesystem(str(folder)) == "nfs4"
    assert store.filesystem("/usr") == "ext4"
    _, warned = recorded(store.save, OP, "k", {"config": {"tile": 64}})
    assert len(warned) == 1 and "network filesystem (nfs4)" in warned[0] and str(folder) in \
        warned[0] and "TILETUNE_CACHE_DIR" in warned[0], warned
    store.close()
    assert recorded(store.load, OP, "k") == ({"config": {"tile": 64}}, [])    # once a folder
    mounts.write_text("/dev/sda1 / ext4 rw 0 0\n")
    monkeypatch.setattr(env, "_warned", set())
    store.close()
    assert recorded(store.load, OP, "k") == ({"config": {"tile": 64}}, [])
    monkeypatch.setattr(store, "MOUNTS", str(tmp_path / "no-such-file"))
    assert store.filesystem(str(folder)) is None
    store.close()
    assert recorded(store.load, OP, "k") == ({"config": {"tile": 64}}, [])


def test_a_save_waiting_on_another_process_lock_stalls_no_other_thread(folder, monkeypatch):
    """Another process holds the store's write lock: a save (another GPU's backward thread, say)
    waits out the busy timeout in its own thread, while this thread's loads go on at once (WAL
    readers do not wait for a writer); the save lands once the lock is released. A save that
    times out warns that it was not saved, not that the store cannot be read."""
    import threading
    store.save(OP, "k", {"config": {"tile": 64}})
    monkeypatch.setattr(store, "BUSY_TIMEOUT_S", 3.0)
    store.close()
    assert store.load(OP, "k") == {"config": {"tile": 64}}
    holder = sqlite3.connect(folder / store.DB_NAME, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    saver = threading.Thread(target=store.save, args=(OP, "k2", {"config": {"tile": 32}}))
    saver.start()
    time.sleep(0.3)                       # the saver is inside its busy wait now
    start = time.monotonic()
    loaded = [store.load(OP, "k") for _ in range(20)]
    took = time.monotonic() - start
    holder.execute("ROLLBACK")
    saver.join()
    assert loaded == [{"config": {"tile": 64}}] * 20 and took < 1.0, took
    assert stored(folder) == {"k": {"config": {"tile": 64}}, "k2": {"config": {"tile": 32}}}
    monkeypatch.setattr(store, "BUSY_TIMEOUT_S", 0.05)
    store.close()
    store.load(OP, "k")
    holder.execute("BEGIN IMMEDIATE")
    try:
        _, warned = recorded(store.save, OP, "k3", {"config": {}})
        result, warned2 = recorded(store.load, OP, "k")
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert len(warned) == 1 and "locked" in warned[0] and "was not saved there" in warned[0]
    assert result == {"config": {"tile": 64}} and warned2 == []


def test_threads_that_ended_keep_no_connection(folder):
    """Each thread reads through a connection of its own; those of threads that ended are
    closed when another is opened, so short-lived threads do not pile up file descriptors."""
    import threading
    store.close()
    store.save(OP, "k", {"config": {"tile": 64}})
    got = []
    for _ in range(30):
        t = threading.Thread(target=lambda: got.append(store.load(OP, "k")))
        t.start()
        t.join()
    assert got == [{"config": {"tile": 64}}] * 30
    import gc
    gc.collect()
    assert len(store._live) == 1, len(store._live)          # this thread's


def test_a_child_forked_while_another_thread_saves_uses_the_store(folder, monkeypatch):
    """fork() while another thread waits inside a save (another process holds the store's write
    lock): the child has no such thread, and nothing it needs was left held; it loads through
    a connection of its own (within 20 s; a hang there fails the test)."""
    import threading
    store.save(OP, "k", {"config": {"tile": 64}})
    monkeypatch.setattr(store, "BUSY_TIMEOUT_S", 3.0)
    store.close()
    holder = sqlite3.connect(folder / store.DB_NAME, isolation_level=None)
    holder.execute("BEGIN IMMEDIATE")
    saver = threading.Thread(target=store.save, args=(OP, "k2", {"config": {}}))
    saver.start()
    time.sleep(0.2)
    pid = fork(lambda: 0 if store.load(OP, "k") == {"config": {"tile": 64}} else 2)
    code = wait_child(pid)
    holder.execute("ROLLBACK")
    holder.close()
    saver.join()
    assert code == 0


def test_close_from_one_thread_leaves_the_others_queries_alone(folder):
    """close() while other threads read: it closes this thread's connection, and the others
    reopen theirs at their next use (closing theirs under a running query crashed the
    process)."""
    import threading
    write_store(folder, {f"k{i}": {"config": {"t": i}} for i in range(50)})
    stop, errors, reads = threading.Event(), [], []

    def reader():
        try:
            while not stop.is_set():
                reads.append(len(store.entries()[OP]))
        except Exception as e:              # noqa: BLE001 (reported below)
            errors.append(e)
    threads = [threading.Thread(target=reader) for _ in range(3)]
    for t in threads:
        t.start()
    for _ in range(200):
        store.close()
    stop.set()
    for t in threads:
        t.join()
    assert not errors and reads and set(reads) == {50}


def test_an_unwritable_database_warns_once(folder, monkeypatch):
    store.save(OP, "k", {"config": {"tile": 64}})
    monkeypatch.setattr(env, "_warned", set())
    real_open = os.open

    def denied(path, flags, *a):
        if os.fspath(path).startswith(str(folder)):
            raise PermissionError(13, "Permission denied", path)
        return real_open(path, flags, *a)
    store.close()
    (folder / store.DB_NAME).unlink()
    monkeypatch.setattr(os, "open", denied)           # a folder we may not create files in
    _, warned = recorded(store.save, OP, "k", {"config": {"tile": 1}})
    result, warned2 = recorded(store.load, OP, "k")
    assert result is None and len(warned + warned2) == 1 and "Permission denied" in warned[0]


def test_a_corrupt_database_warns_once_and_is_kept(folder):
    folder.mkdir(parents=True)
    junk = b"this is not a database, just bytes\n" * 200
    (folder / store.DB_NAME).write_bytes(junk)
    result, warned = recorded(store.load, OP, "k")
    assert result is None and len(warned) == 1 and "cannot use the cache database" in warned[0]
    assert recorded(store.save, OP, "k", {"config": {}}) == (None, [])
    assert recorded(store.entries) == ({}, []) and recorded(store.clear) == (0, [])
    assert (folder / store.DB_NAME).read_bytes() == junk


def test_a_foreign_sqlite_database_is_not_written(folder):
    folder.mkdir(parents=True)
    with sqlite3.connect(folder / store.DB_NAME) as conn:
        conn.execute("CREATE TABLE notes (text TEXT)")
    _, warned = recorded(store.save, OP, "k", {"config": {}})
    assert len(warned) == 1 and "not a tiletune store" in warned[0]
    with sqlite3.connect(folder / store.DB_NAME) as conn:
        assert [r[0] for r in conn.execute("SELECT name FROM sqlite_master")] == ["notes"]
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "delete"   # not switched
    assert sorted(p.name for p in folder.iterdir()) == [store.DB_NAME]


def test_an_entry_that_is_not_json_is_not_saved(folder):
    store.save(OP, "k", {"config": {"tile": 64}})
    with pytest.warns(UserWarning, match="could not save a cache entry"):
        store.save(OP, "bad", {"config": object()})
    assert stored(folder) == {"k": {"config": {"tile": 64}}}


def test_an_unreadable_entry_warns_once_and_reads_as_missing(folder):
    store.save(OP, "k", {"config": {"tile": 64}})
    with sqlite3.connect(folder / store.DB_NAME) as conn:
        conn.execute(f"UPDATE {store.TABLE} SET entry = '{{not json' WHERE key = 'k'")
    result, warned = recorded(store.load, OP, "k")
    assert result is None and len(warned) == 1 and "unreadable matmul entry" in warned[0]
    assert recorded(store.load, OP, "k") == (None, [])
    store.save(OP, "k", {"config": {"tile": 32}})                # a new search replaces it
    assert store.load(OP, "k") == {"config": {"tile": 32}}


def test_a_relative_or_home_folder_is_one_folder_whatever_the_cwd(monkeypatch, tmp_path):
    monkeypatch.setattr(store, "_folders", {})
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TILETUNE_CACHE_DIR", "~/tt")
    assert store.cache_dir() == str(tmp_path / "home" / "tt")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TILETUNE_CACHE_DIR", "rel/store")
    store.save(OP, "k", {"config": {"tile": 64}})
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert store.cache_dir() == str(tmp_path / "rel" / "store")
    assert store.load(OP, "k") == {"config": {"tile": 64}}


@pytest.mark.parametrize("home", [None, ""])
def test_without_a_home_folder_the_default_store_says_where(monkeypatch, tmp_path, home):
    """No HOME and no passwd entry ("~" does not expand), or HOME empty: the default folder was
    "~/.cache/tiletune" under the working folder (a folder named "~"), moving with os.chdir.
    Now it is $XDG_CACHE_HOME/tiletune where that is set, else one of this user's in the
    temporary folder, with a warning; the same after os.chdir."""
    monkeypatch.setattr(store, "_folders", {})
    monkeypatch.setattr(env, "_warned", set())
    monkeypatch.delenv("TILETUNE_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    if home is None:
        monkeypatch.setattr(os.path, "expanduser", lambda p: p)
    else:
        monkeypatch.setenv("HOME", home)
    monkeypatch.setattr(tempfile, "gettempdir", lambda: str(tmp_path / "tmp"))
    monkeypatch.chdir(tmp_path)
    expected = str(tmp_path / "tmp" / f"tiletune-{os.getuid()}")
    with pytest.warns(UserWarning, match="no home folder .* set TILETUNE_CACHE_DIR"):
        assert store.cache_dir() == expected
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert store.cache_dir() == expected
    monkeypatch.setattr(store, "_folders", {})
    os.makedirs(expected, exist_ok=True)
    os.chmod(expected, 0o777)           # a folder of that name others can write: not taken
    with pytest.warns(UserWarning, match="no home folder"):
        other = store.cache_dir()
    assert other != expected and os.path.basename(other).startswith(f"tiletune-{os.getuid()}-")
    assert os.stat(other).st_mode & 0o777 == 0o700
    monkeypatch.setattr(store, "_folders", {})
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    with pytest.warns(UserWarning, match="no home folder"):
        assert store.cache_dir() == str(tmp_path / "xdg" / "tiletune")


def test_a_removed_database_is_recreated(folder):
    store.save(OP, "k", {"config": {"tile": 64}})
    for name in os.listdir(folder):
        os.remove(folder / name)
    store.save(OP, "k2", {"config": {"tile": 32}})
    assert stored(folder) == {"k2": {"config": {"tile": 32}}}


# 7. environment variables

def test_env_number_takes_positive_numbers_and_warns_once_otherwise(folder, monkeypatch):
    name = "TILETUNE_TEST_NUMBER"
    monkeypatch.delenv(name, raising=False)
    assert recorded(env.number, name, 60.0) == (60.0, [])
    for value, want in (("90", 90.0), (" 2.5 ", 2.5), ("", 60.0)):
        monkeypatch.setenv(name, value)
        assert recorded(env.number, name, 60.0) == (want, [])
    for value in ("60s", "0", "-1", "nan", "inf", "sixty"):
        monkeypatch.setenv(name, value)
        result, warned = recorded(env.number, name, 60.0)
        assert result == 60.0 and len(warned) == 1 and repr(value) in warned[0], (value, warned)
        assert recorded(env.number, name, 60.0) == (60.0, [])        # once


def test_env_integer_takes_integers_and_warns_once_otherwise(folder, monkeypatch):
    name = "TILETUNE_TEST_INTEGER"
    for value, want in (("8", 8), (" 4 ", 4), ("0", 0), ("-3", -3), ("", 16)):
        monkeypatch.setenv(name, value)
        assert recorded(env.integer, name, 16) == (want, [])
    for value in ("auto", "4.0", "eight"):
        monkeypatch.setenv(name, value)
        result, warned = recorded(env.integer, name, 16)
        assert result == 16 and len(warned) == 1 and "'" + value + "'" in warned[0]
        assert recorded(env.integer, name, 16) == (16, [])
    monkeypatch.setenv(name, "-3")
    result, warned = recorded(env.integer, name, 16, 0)
    assert result == 16 and len(warned) == 1


@pytest.mark.parametrize("value,cpus,want", [("auto", 64, 16), ("auto", 6, 6), ("junk", None, 1),
                                             ("3", 64, 3), ("-2", 64, 0), (None, 64, 16)])
def test_compile_jobs_is_the_default_for_a_value_that_is_not_an_integer(folder, monkeypatch,
                                                                        value, cpus, want):
    if value is None:
        monkeypatch.delenv("TILETUNE_COMPILE_JOBS", raising=False)
    else:
        monkeypatch.setenv("TILETUNE_COMPILE_JOBS", value)
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)          # (where no affinity is known)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus or 0)),
                        raising=False)
    result, warned = recorded(precompile.jobs)
    assert result == want and len(warned) == (value in ("auto", "junk"))


@pytest.mark.parametrize("value", ["no", "NO", "off", "Off", "0", "none", "false", "False",
                                   "disable", " Disabled ", ""])
def test_every_off_spelling_turns_the_store_off(monkeypatch, tmp_path, value):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TILETUNE_CACHE_DIR", value)
    assert store.cache_dir() is None and env.flag_off(value)
    store.save(OP, "k", {"config": {}})
    assert store.load(OP, "k") is None and os.listdir(tmp_path) == []


@pytest.mark.parametrize("value", ["1", "on", "Yes", "true", " enable "])
def test_an_on_spelling_is_the_default_folder_not_one_of_that_name(monkeypatch, tmp_path, value):
    """TILETUNE_CACHE_DIR=1 (as DISABLE_AUTOTUNE=1 is written) is the store at its default
    place, as TILETUNE_SHIPPED=1 is, not a folder "1" in whatever folder the process runs in."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("TILETUNE_CACHE_DIR", value)
    assert store.cache_dir() == str(tmp_path / "home" / ".cache" / "tiletune")
    store.save(OP, "k", {"config": {}})
    assert store.load(OP, "k") == {"config": {}}
    assert os.listdir(tmp_path) == ["home"]


def test_flags_and_a_folder_named_like_no_word():
    assert not env.flag_off(None) and not env.flag_off("nope") and not env.flag_off("/tmp/x")
    assert env.flag_on(" Yes ") and env.flag_on("1") and not env.flag_on(None)
    assert not env.flag_on("0") and not env.flag_on("no")


# 8. `cache show` on malformed entries

def test_cache_show_prints_what_it_can_of_malformed_entries(folder, capsys):
    timing = {"config": {"tile": 16}, "mean_us": 3.0}
    write_store(folder, {
        "a_not_a_dict": 5,
        "b_a_list": [1, 2],
        "c_bad_parts": {"config": {"tile": 8}, "best_us": "fast", "search_s": [1],
                        "timings": [1, {"config": {"tile": 8}, "mean_us": "x"}, timing,
                                    {"mean_us": True}],
                        "failures": ["boom", {"config": {"tile": 32}, "error": "TileError",
                                              "message": 7}]},
        "d_not_lists": {"config": None, "best_us": 1.5, "timings": {"a": 1}, "failures": 3},
        "e_good": {"config": {"tile": 64}, "best_us": 2.0, "timings": [timing], "failures": [],
                   "search_s": 0.5},
    })
    assert main(["cache", "show", "-v"]) == 0
    out = capsys.readouterr().out
    assert f"store at {folder}: 5 entries" in out and f"{OP}: 5 entries" in out
    assert out.count("malformed entry skipped") == 2
    assert "malformed best_us skipped" in out and out.count("malformed timing skipped") == 3
    assert "malformed failure skipped" in out and 'FAILED {"tile": 32}: TileError: \n' in out
    assert "malformed timings skipped" in out and "malformed failures skipped" in out
    assert '-> {"tile": 64}  2.00 us  (1 configs timed, 0 failed, search 0.5 s)' in out
    assert out.count('     3.00 us  {"tile": 16}') == 2
    assert main(["cache", "show"]) == 0
    out = capsys.readouterr().out
    assert out.count("malformed entry skipped") == 2 and "malformed timing skipped" not in out


def test_cache_show_prints_a_compile_failures_message_lines(folder, capsys):
    """A compiler error's first line is "Return code 1"; `cache show -v` prints its lines."""
    write_store(folder, {"k": {"config": {"tile": 64}, "best_us": 2.0, "timings": [],
                               "failures": [{"config": {"tile": 8},
                                             "error": "CompilerExecutionError",
                                             "message": "Return code 1\nerror: too many registers"}],
                               "search_s": 0.5}})
    assert main(["cache", "show", "-v"]) == 0
    out = capsys.readouterr().out
    assert 'FAILED {"tile": 8}: CompilerExecutionError: Return code 1\n' in out
    assert "\n         error: too many registers\n" in out


# 9. several processes creating the store at once (every rank of a job at its first miss)

def test_switching_a_new_store_to_wal_waits_for_a_process_doing_the_same(folder, monkeypatch):
    """sqlite answers "database is locked" at once, without the busy timeout, to `PRAGMA
    journal_mode = WAL` while another process switches the same new database (seen with 2-4
    processes opening a new store at the same instant): the switch is retried, no warning."""
    real_connect = store.sqlite3.connect
    refusals = []

    class Switching:
        def __init__(self, conn):
            self._conn = conn

        def execute(self, sql, *args):
            if sql == "PRAGMA journal_mode = WAL" and len(refusals) < 3:
                refusals.append(sql)
                raise sqlite3.OperationalError("database is locked")
            return self._conn.execute(sql, *args)

        def __getattr__(self, name):
            return getattr(self._conn, name)

    with monkeypatch.context() as m:
        m.setattr(store.sqlite3, "connect", lambda *a, **k: Switching(real_connect(*a, **k)))
        (_, warned) = recorded(store.save, OP, skey(1), {"config": {"tile": 1}})
    assert len(refusals) == 3 and warned == []
    assert stored(folder) == {skey(1): {"config": {"tile": 1}}}


def test_tileiras_version_comes_from_the_compiler_without_the_pip_package(monkeypatch):
    """Store keys name the tileiras version; where the compiler is a CUDA toolkit's rather than
    the pip package's (found on PATH or under CUDA_HOME), the binary's own `--version` says it,
    so its keys match those of a pip install of the same version."""
    import importlib.metadata
    import os
    import re

    from cuda.tile import _compile

    from tiletune import autotune
    real, real_distribution = importlib.metadata.version, importlib.metadata.distribution
    binary = _compile._find_compiler_bin().path          # the pip package's, here
    expected = real("nvidia-cuda-tileiras")

    def no_pip_tileiras(lookup):
        def find(name):
            if name == "nvidia-cuda-tileiras":
                raise importlib.metadata.PackageNotFoundError(name)
            return lookup(name)
        return find
    monkeypatch.setattr(importlib.metadata, "version", no_pip_tileiras(real))
    monkeypatch.setattr(importlib.metadata, "distribution", no_pip_tileiras(real_distribution))
    monkeypatch.setenv("PATH", os.path.dirname(binary) + os.pathsep + os.environ["PATH"])
    for cached in (autotune.tileiras_version, _compile._find_compiler_bin):
        cached.cache_clear()
    try:
        found = autotune.tileiras_version()
        assert _compile._find_compiler_bin().path == binary     # now found on PATH
    finally:
        for cached in (autotune.tileiras_version, _compile._find_compiler_bin):
            cached.cache_clear()
    assert re.fullmatch(r"\d+\.\d+\.\d+", found) and found == expected


def test_tileiras_version_is_the_binarys_where_cutile_does_not_take_the_pip_package(
        monkeypatch, tmp_path):
    """cuTile compiles with a CUDA toolkit's tileiras where the pip compiler packages are
    incomplete or disagree, even with nvidia-cuda-tileiras installed: the key then names that
    binary's version, not the pip package's (whose rows were tuned with another compiler)."""
    import types

    from cuda.tile import _compile

    from tiletune import autotune
    fake = tmp_path / "tileiras"
    fake.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.9, V13.9.7'\n")
    fake.chmod(0o755)
    monkeypatch.setattr(_compile, "_find_compiler_bin", lambda: types.SimpleNamespace(
        path=str(fake)))
    autotune.tileiras_version.cache_clear()
    try:
        assert autotune.tileiras_version() == "13.9.7"
    finally:
        autotune.tileiras_version.cache_clear()


def test_a_store_read_into_memory_is_not_disturbed_by_its_owners_writes(folder, monkeypatch):
    """A store this user cannot write is copied into memory at its first use: the owner's later
    rewrites (rows replaced, checkpointed) change nothing this process reads (an `immutable`
    connection kept open read other keys' rows then), and no file is created beside it."""
    write_store(folder, {f"k{i}": {"config": {"t": i}} for i in range(200)})
    store.close()
    real_access = os.access
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if os.fspath(p).endswith(
        store.DB_NAME) and mode == os.W_OK else real_access(p, mode, **kw))
    assert recorded(store.load, OP, "k7")[0] == {"config": {"t": 7}}
    owner = sqlite3.connect(folder / store.DB_NAME, isolation_level=None)
    owner.execute(f"DELETE FROM {store.TABLE}")
    owner.executemany(f"INSERT INTO {store.TABLE} VALUES (?, ?, ?, 0)",
                      [(OP, f"k{i}", json.dumps({"config": {"t": -i}})) for i in range(400)])
    owner.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    owner.close()
    assert [store.load(OP, f"k{i}") for i in range(200)] == [{"config": {"t": i}} for i in
                                                              range(200)]
    assert store.load(OP, "k300") is None and store.save(OP, "k300", {}) is None
    assert store.unsaved() >= 1 and stored(folder)["k300"] == {"config": {"t": -300}}


_READ_ONLY_PROBE = """
import sys, warnings
sys.path.insert(0, sys.argv[1])
warnings.simplefilter("always")
from tiletune import store
print(store.load("op", "k"))
store.save("op", "k2", {"config": {"t": 2}})
print(store.unsaved(), store.load("op", "k"), store.load("op", "k2"))
try:
    store.clear(strict=True)
    print("cleared")
except store.sqlite3.Error as e:
    print("clear refused")
print(store.load("op", "k"))
"""


@pytest.mark.parametrize("folder_mode,file_mode", [(0o555, 0o444), (0o777, 0o444),
                                                   (0o1777, 0o644)])
def test_a_store_that_cannot_be_written_is_still_read(folder_mode, file_mode):
    """A tuned store this user cannot write (a team's folder or file, a read-only image layer)
    is read into memory: its winners are used, a new one is counted as unsaved, `clear` is
    refused, one warning says so (it was ignored: every key searched again), and nothing is
    written beside it, also where the folder is writable (sqlite's -wal and -shm files of
    the reader's then locked the owner's own saves out): the owner still saves. Run by another
    user where this one is root."""
    import pathlib
    import shutil
    import tempfile
    tmp_path = pathlib.Path(tempfile.mkdtemp())     # (pytest's folders are closed to others)
    try:
        _check_read_only_store(tmp_path, folder_mode, file_mode)
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)


def _check_read_only_store(tmp_path, folder_mode, file_mode):
    import shutil
    folder = tmp_path / "team"
    env_vars = dict(os.environ, TILETUNE_CACHE_DIR=str(folder))
    owner_save = [sys.executable, "-c", "import sys; from tiletune import store; "
                  "store.save('op', sys.argv[1], {'config': {'t': 1}}); store.close(); "
                  "sys.exit(store.unsaved())"]
    cwd = os.path.dirname(os.path.dirname(store.__file__))
    assert subprocess.run(owner_save + ["k"], env=env_vars, cwd=cwd).returncode == 0
    os.chmod(folder / store.DB_NAME, file_mode)
    os.chmod(folder, folder_mode)
    os.chmod(tmp_path, 0o755)
    command = [sys.executable, "-c", _READ_ONLY_PROBE,
               os.path.dirname(os.path.dirname(store.__file__))]
    if os.geteuid() == 0:          # root writes anywhere: the probe runs as nobody
        if shutil.which("setpriv") is None:
            pytest.skip("root, and no setpriv to run the probe as another user")
        command = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"] + command
        tried = subprocess.run(command[:4] + [sys.executable, "-c", "import tiletune"],
                               env=env_vars, capture_output=True)
        if tried.returncode:
            pytest.skip("no user but root can run this python here")
    try:
        run = subprocess.run(command, env=env_vars, capture_output=True, text=True, timeout=120)
        left = sorted(os.listdir(folder))
    finally:
        os.chmod(folder, 0o755)
    assert run.returncode == 0, run.stderr
    assert run.stdout.splitlines() == ["{'config': {'t': 1}}", "1 {'config': {'t': 1}} None",
                                       "clear refused", "{'config': {'t': 1}}"]
    assert run.stderr.count("tiletune: ") == 1 and "cannot be written" in run.stderr
    assert "its winners are read, new ones are not saved there" in run.stderr
    assert left == [store.DB_NAME]
    os.chmod(folder / store.DB_NAME, 0o644)
    assert subprocess.run(owner_save + ["k3"], env=env_vars, cwd=cwd).returncode == 0
