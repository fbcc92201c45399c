"""Persistent store of tuned configs: one JSON file per op in TILETUNE_CACHE_DIR.

An entry's key is the op's key plus everything that makes a winner stale elsewhere: GPU name,
sm arch, cuda-tile version and a fingerprint of the config space (and kernel source). Writes are
read-merge-write under an exclusive file lock, then temp file + rename, so several processes can
tune at once without losing entries; a corrupt or foreign file is ignored with a warning and
rewritten on the next write.
"""
import contextlib
import fcntl
import json
import os
import tempfile
import warnings

FORMAT = "tiletune-store-1"


def cache_dir():
    """The store's folder, or None when TILETUNE_CACHE_DIR=off (or 0/none/empty)."""
    d = os.environ.get("TILETUNE_CACHE_DIR")
    if d is None:
        return os.path.join(os.path.expanduser("~"), ".cache", "tiletune")
    if d.strip().lower() in ("", "off", "0", "none", "false"):
        return None
    return d


def _path(op):
    d = cache_dir()
    return None if d is None else os.path.join(d, f"{op}.json")


def _read(path):
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        warnings.warn(f"tiletune: ignoring unreadable cache file {path} ({e}); it will be rewritten")
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT or \
            not isinstance(data.get("entries"), dict):
        warnings.warn(f"tiletune: ignoring cache file {path} (not a {FORMAT} file); "
                      "it will be rewritten")
        return {}
    return data["entries"]


def load(op, key):
    """The stored entry (a dict) for this op and full key string, or None."""
    path = _path(op)
    if path is None:
        return None
    return _read(path).get(key)


@contextlib.contextmanager
def _locked(path):
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def save(op, key, entry):
    """Add or replace one entry; never raises for I/O problems (the store is an optimization)."""
    path = _path(op)
    if path is None:
        return
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with _locked(path):
            entries = _read(path)
            entries[key] = entry
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), prefix=f".{op}.", suffix=".tmp")
            with os.fdopen(fd, "w") as f:
                json.dump({"format": FORMAT, "entries": entries}, f, indent=1, sort_keys=True)
            os.replace(tmp, path)
    except OSError as e:
        warnings.warn(f"tiletune: could not write cache file {path}: {e}")


def entries(op=None):
    """{op: {key: entry}} for every op in the store (or just `op`)."""
    d = cache_dir()
    if d is None or not os.path.isdir(d):
        return {}
    out = {}
    for name in sorted(os.listdir(d)):
        if name.endswith(".json") and (op is None or name == f"{op}.json"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                out[name[:-5]] = _read(os.path.join(d, name))
    return out


def clear(op=None):
    """Delete the store's files (all ops, or one). Returns the number of files removed."""
    d = cache_dir()
    if d is None or not os.path.isdir(d):
        return 0
    n = 0
    for name in os.listdir(d):
        if name.endswith((".json", ".json.lock")) and (op is None or name.startswith(f"{op}.json")):
            os.remove(os.path.join(d, name))
            n += name.endswith(".json")
    return n
