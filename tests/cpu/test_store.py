"""The store's reliability (tiletune/store.py), env parsing (tiletune/env.py) and `cache show` on
hand-written store files: real files in a temp folder; faults the test machine cannot make for
real (EIO, or a permission error when the tests run as root) are injected at the one call that
meets them."""
import builtins
import errno
import fcntl
import json
import os
import threading
import time
import warnings

import pytest

from tiletune import env, precompile, store
from tiletune.__main__ import main

OP = "matmul"


@pytest.fixture
def folder(monkeypatch, tmp_path):
    d = tmp_path / "store"
    monkeypatch.setenv("TILETUNE_CACHE_DIR", str(d))
    monkeypatch.setattr(env, "_warned", set())      # "warn once" starts afresh in every test
    return d


def write_store(folder, entries, op=OP):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{op}.json").write_text(json.dumps({"format": store.FORMAT, "entries": entries}))


def stored(folder, op=OP):
    return json.loads((folder / f"{op}.json").read_text())["entries"]


def recorded(fn, *args):
    """(fn's result, the messages of every warning it raised)."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        result = fn(*args)
    return result, [str(w.message) for w in caught]


# 1. the written file's mode follows the umask

@pytest.mark.parametrize("umask", [0o002, 0o022, 0o077])
def test_saved_file_mode_follows_the_umask(folder, umask):
    old = os.umask(umask)
    try:
        store.save(OP, "k", {"config": {"tile": 64}})
        store.save(OP, "k2", {"config": {"tile": 32}})     # the rewrite too, not only the first
    finally:
        os.umask(old)
    mode = os.stat(folder / f"{OP}.json").st_mode & 0o777
    assert mode == 0o666 & ~umask, oct(mode)
    assert set(stored(folder)) == {"k", "k2"}


# 2. a file that exists but cannot be read is never overwritten

@pytest.mark.parametrize("code", [errno.EIO, errno.EACCES])
def test_a_store_file_that_cannot_be_read_is_never_overwritten(folder, monkeypatch, code):
    write_store(folder, {"theirs": {"config": {"tile": 128}}})
    before = (folder / f"{OP}.json").read_bytes()
    target = str(folder / f"{OP}.json")

    def failing_open(path, *args, **kw):
        if str(path) == target:
            raise OSError(code, os.strerror(code), str(path))
        return builtins.open(path, *args, **kw)
    monkeypatch.setattr(store, "open", failing_open, raising=False)

    _, warned = recorded(store.save, OP, "mine", {"config": {"tile": 64}})
    assert (folder / f"{OP}.json").read_bytes() == before
    assert len(warned) == 1 and "cannot read cache file" in warned[0] and "not be overwritten" \
        in warned[0]
    # once per file: later saves and loads of it stay quiet, and still write nothing
    result, warned = recorded(store.load, OP, "theirs")
    assert result is None and warned == []
    _, warned = recorded(store.save, OP, "mine", {"config": {"tile": 64}})
    assert warned == [] and (folder / f"{OP}.json").read_bytes() == before
    assert not [n for n in os.listdir(folder) if n.endswith(".tmp")]
    monkeypatch.undo()
    assert stored(folder) == {"theirs": {"config": {"tile": 128}}}


def test_deeply_nested_json_is_corrupt_content_not_a_crash(folder):
    folder.mkdir(parents=True)
    (folder / f"{OP}.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.warns(UserWarning, match="ignoring unreadable cache file"):
        assert store.load(OP, "k") is None
    assert store.entries() == {OP: {}}                 # quietly, as for any corrupt file
    with pytest.warns(UserWarning, match="ignoring"):
        store.save(OP, "k", {"config": {"tile": 64}})
    assert stored(folder) == {"k": {"config": {"tile": 64}}}        # replaced, like corrupt JSON


def test_a_failed_write_keeps_the_file_and_leaves_no_temp_file(folder):
    store.save(OP, "k", {"config": {"tile": 64}})
    with pytest.warns(UserWarning, match="could not write cache file"):
        store.save(OP, "bad", {"config": object()})        # not JSON: json.dump fails midway
    assert stored(folder) == {"k": {"config": {"tile": 64}}}
    assert not [n for n in os.listdir(folder) if n.endswith(".tmp")]


# 3. killed writers' temp files

def test_save_removes_temp_files_older_than_an_hour(folder):
    folder.mkdir(parents=True)
    old = time.time() - 2 * 3600
    for name in (f".{OP}.abc123.tmp", f".{OP}.fresh1.tmp", ".rope.abc123.tmp",
                 f".{OP}.sub.abc123.tmp"):
        (folder / name).write_text("{")
    for name in (f".{OP}.abc123.tmp", ".rope.abc123.tmp", f".{OP}.sub.abc123.tmp"):
        os.utime(folder / name, (old, old))
    store.save(OP, "k", {"config": {"tile": 64}})
    left = sorted(n for n in os.listdir(folder) if n.endswith(".tmp"))
    # the old one of this op goes; a fresh one (a live writer's), another op's and op
    # "matmul.sub"'s stay
    assert left == [f".{OP}.fresh1.tmp", f".{OP}.sub.abc123.tmp", ".rope.abc123.tmp"]
    assert stored(folder) == {"k": {"config": {"tile": 64}}}


# 4. entries() / clear() on a folder that cannot be listed; clear() against a save

def test_entries_and_clear_on_a_folder_that_cannot_be_listed_warn_once(folder, monkeypatch):
    store.save(OP, "k", {"config": {"tile": 64}})
    real_listdir, real_scandir = os.listdir, os.scandir

    def denied(real):
        def fn(path=".", *a):
            if os.fspath(path) == str(folder):
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real(path, *a)
        return fn
    monkeypatch.setattr(os, "listdir", denied(real_listdir))
    monkeypatch.setattr(os, "scandir", denied(real_scandir))
    found, warned_entries = recorded(store.entries)
    removed, warned_clear = recorded(store.clear)
    monkeypatch.undo()
    assert found == {} and removed == 0
    warned = warned_entries + warned_clear
    assert len(warned) == 1 and "cannot list the cache folder" in warned[0], warned
    assert stored(folder) == {"k": {"config": {"tile": 64}}}


def test_clear_waits_for_a_save_in_progress(folder, monkeypatch):
    store.save(OP, "old", {"config": {"tile": 8}})
    has_read, go_on = threading.Event(), threading.Event()
    real_read = store._read

    def slow_read(path):               # the save thread stops between its read and its write
        out = real_read(path)
        if threading.current_thread().name == "saver":
            has_read.set()
            go_on.wait(10)
        return out
    monkeypatch.setattr(store, "_read", slow_read)
    saver = threading.Thread(target=store.save, args=(OP, "new", {"config": {"tile": 16}}),
                             name="saver")
    saver.start()
    assert has_read.wait(10)
    cleared = []
    clearer = threading.Thread(target=lambda: cleared.append(store.clear()))
    clearer.start()
    time.sleep(0.3)
    blocked = clearer.is_alive()        # clear() must wait for the save's lock
    go_on.set()
    saver.join(10)
    clearer.join(10)
    assert blocked
    # the save landed whole, then the clear removed it: nothing resurrected, nothing half-done
    assert cleared == [1] and store.entries() == {}
    store.save(OP, "after", {"config": {"tile": 32}})
    assert stored(folder) == {"after": {"config": {"tile": 32}}}


def test_a_lock_file_removed_while_waited_on_is_not_trusted(folder):
    """clear() removes lock files under their lock: a waiter that then gets the removed file's
    lock must take the lock at the path instead, or two writers run at once."""
    folder.mkdir(parents=True)
    path = str(folder / f"{OP}.json")
    held, release, inside = threading.Event(), threading.Event(), threading.Event()

    def holder():
        with store._locked(path):
            held.set()
            release.wait(10)

    def waiter():
        with store._locked(path):
            inside.set()
    t1 = threading.Thread(target=holder)
    t1.start()
    assert held.wait(10)
    t2 = threading.Thread(target=waiter)
    t2.start()
    time.sleep(0.2)                      # t2 now waits on the lock file t1 holds
    os.remove(path + ".lock")            # what clear() does, holding the lock
    with open(path + ".lock", "a") as fresh:  # a new writer locks the file at the path
        fcntl.flock(fresh, fcntl.LOCK_EX)
        release.set()
        t1.join(10)
        entered_early = inside.wait(0.3)
        fcntl.flock(fresh, fcntl.LOCK_UN)
    t2.join(10)
    assert not entered_early and inside.is_set()


# 5. environment variables

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
    monkeypatch.setattr(os, "cpu_count", lambda: cpus)
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


def test_flags_and_a_folder_named_like_no_word():
    assert not env.flag_off(None) and not env.flag_off("nope") and not env.flag_off("/tmp/x")
    assert env.flag_on(" Yes ") and env.flag_on("1") and not env.flag_on(None)
    assert not env.flag_on("0") and not env.flag_on("no")


# 6. `cache show` on malformed entries

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
    write_store(folder, [1, 2], op="rope")                   # a foreign file: no entries
    assert main(["cache", "show", "-v"]) == 0
    out = capsys.readouterr().out
    assert f"store at {folder}: 5 entries" in out and f"{OP}: 5 entries" in out
    assert out.count("malformed entry skipped") == 2
    assert "malformed best_us skipped" in out and out.count("malformed timing skipped") == 3
    assert "malformed failure skipped" in out and 'FAILED {"tile": 32}: TileError: []' in out
    assert "malformed timings skipped" in out and "malformed failures skipped" in out
    assert '-> {"tile": 64}  2.00 us  (1 configs timed, 0 failed, search 0.5 s)' in out
    assert out.count('     3.00 us  {"tile": 16}') == 2
    assert main(["cache", "show"]) == 0
    out = capsys.readouterr().out
    assert out.count("malformed entry skipped") == 2 and "malformed timing skipped" not in out
