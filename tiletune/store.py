"""Persistent store of tuned configs: one JSON file per op in TILETUNE_CACHE_DIR.

An entry's key is the op's key plus everything that makes a winner stale elsewhere: GPU name,
sm arch, cuda-tile version and a fingerprint of the config space (and kernel source). Writes are
read-merge-write under an exclusive file lock (`<op>.json.lock`), then temp file + rename, so
several processes can tune at once without losing entries. The written file's mode follows the
umask, like any file open() creates, so a group-shared folder (setgid, umask 002) stays shared.

A corrupt file (not JSON, or nested too deep to parse) or a foreign one is ignored with a warning
and rewritten on the next write. A file that exists but cannot be read (permission denied, I/O
error) is never overwritten: its entries are not used and saves to it are skipped, with one
warning per file. Temp files that a killed writer left behind (`.<op>.*.tmp`) are removed by
later saves once they are an hour old. Nothing here raises for I/O problems: the store is an
optimization.
"""
import contextlib
import fcntl
import json
import os
import secrets
import stat
import time
import warnings

from tiletune import env

FORMAT = "tiletune-store-1"
STALE_TMP_SEC = 3600.0      # a writer's temp file older than this is a killed writer's leftover


def cache_dir():
    """The store's folder, or None when TILETUNE_CACHE_DIR is off (off, 0, no, none, false,
    disable, or blank; case-insensitive). Unset: ~/.cache/tiletune."""
    d = os.environ.get("TILETUNE_CACHE_DIR")
    if d is None:
        return os.path.join(os.path.expanduser("~"), ".cache", "tiletune")
    if env.flag_off(d):
        return None
    return d


def _path(op):
    d = cache_dir()
    return None if d is None else os.path.join(d, f"{op}.json")


def _read(path):
    """The file's entries: {} when it is missing, corrupt or foreign (those two with a warning).
    Raises OSError when the file exists but cannot be read: the caller must not overwrite it."""
    try:
        with open(path, "rb") as f:
            data = json.load(f)
    except FileNotFoundError:
        return {}
    except (ValueError, RecursionError) as e:       # RecursionError: nested too deep to parse
        warnings.warn(f"tiletune: ignoring unreadable cache file {path} "
                      f"({type(e).__name__}: {str(e)[:200]}); it will be rewritten")
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT or \
            not isinstance(data.get("entries"), dict):
        warnings.warn(f"tiletune: ignoring cache file {path} (not a {FORMAT} file); "
                      "it will be rewritten")
        return {}
    return data["entries"]


def _unreadable(path, e):
    env.warn_once(("tiletune.store: unreadable", path),
                  f"tiletune: cannot read cache file {path} ({e}); its entries are not used "
                  "and it will not be overwritten: tuned configs are not saved there")


def load(op, key):
    """The stored entry (a dict) for this op and full key string, or None."""
    path = _path(op)
    if path is None:
        return None
    try:
        return _read(path).get(key)
    except OSError as e:
        _unreadable(path, e)
        return None


@contextlib.contextmanager
def _locked(path):
    """Hold the exclusive lock of `path` (an flock on `path`.lock). clear() removes lock files
    while holding them, so a lock taken on a file that is no longer at `path`.lock is dropped
    and the current one taken instead."""
    lock_path = path + ".lock"
    while True:
        try:
            fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
        except PermissionError:     # another user's lock file: flock needs no write access
            fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                current = os.path.samestat(os.fstat(fd), os.stat(lock_path))
            except FileNotFoundError:
                current = False
            if not current:
                continue                    # closing fd (finally below) drops the stale lock
            try:
                yield
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
            return
        finally:
            os.close(fd)


def _is_tmp(name, op=None):
    """Whether `name` is a writer's temp file (.<op>.<random>.tmp), of `op` if given."""
    if not (name.startswith(".") and name.endswith(".tmp")):
        return False
    stem, dot, rand = name[1:-4].rpartition(".")
    return bool(dot and stem and rand) and (op is None or stem == op)


def _create_tmp(folder, op):
    """(fd, path) of a new temp file for op's next version. Created like open() creates files,
    so its mode is 0o666 minus the umask (mkstemp would make it 0o600)."""
    for _ in range(100):
        tmp = os.path.join(folder, f".{op}.{secrets.token_hex(8)}.tmp")
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temp file name for {op} in {folder}")


def _write(path, op, data):
    fd, tmp = _create_tmp(os.path.dirname(path), op)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1, sort_keys=True)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.remove(tmp)
        raise


def _sweep(folder, op=None):
    """Remove the temp files (of `op`, or of every op) older than STALE_TMP_SEC: writers that
    were killed between creating and renaming them. Best effort, never raises."""
    try:
        names = os.listdir(folder)
        cutoff = time.time() - STALE_TMP_SEC
    except Exception:
        return
    for name in names:
        if not _is_tmp(name, op):
            continue
        p = os.path.join(folder, name)
        try:
            st = os.lstat(p)
            if stat.S_ISREG(st.st_mode) and st.st_mtime < cutoff:
                os.remove(p)
        except Exception:
            pass


def save(op, key, entry):
    """Add or replace one entry; never raises for I/O problems (the store is an optimization).
    Skipped, with one warning per file, when the op's file exists but cannot be read."""
    path = _path(op)
    if path is None:
        return
    folder = os.path.dirname(path)
    try:
        os.makedirs(folder, exist_ok=True)
        with _locked(path):
            try:
                entries = _read(path)
            except OSError as e:
                _unreadable(path, e)
                return
            entries[key] = entry
            _write(path, op, {"format": FORMAT, "entries": entries})
    except (OSError, ValueError, TypeError, RecursionError) as e:
        warnings.warn(f"tiletune: could not write cache file {path}: {type(e).__name__}: {e}")
    finally:
        _sweep(folder, op)


def _listdir(d):
    """The folder's names, or None (with one warning) when it cannot be listed."""
    try:
        return sorted(os.listdir(d))
    except FileNotFoundError:
        return []
    except OSError as e:
        env.warn_once(("tiletune.store: unlistable", d),
                      f"tiletune: cannot list the cache folder {d} ({e})")
        return None


def entries(op=None):
    """{op: {key: entry}} for every op in the store (or just `op`). A folder that cannot be
    listed is an empty store (one warning); a file that cannot be read is {} (one warning)."""
    d = cache_dir()
    if d is None or not os.path.isdir(d):
        return {}
    names = _listdir(d)
    if names is None:
        return {}
    out = {}
    for name in names:
        if name.endswith(".json") and (op is None or name == f"{op}.json"):
            path = os.path.join(d, name)
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    found = _read(path)
            except OSError as e:
                _unreadable(path, e)
                found = {}
            out[name[:-5]] = found
    return out


def clear(op=None):
    """Delete the store's files (all ops, or one). Returns the number of op files removed.

    Each op file is removed under the lock that save() takes, so a save running meanwhile
    either lands before the clear (and is cleared) or after it (and is kept whole). A folder
    that cannot be listed clears nothing (one warning); a file that cannot be removed is
    skipped with a warning."""
    d = cache_dir()
    if d is None or not os.path.isdir(d):
        return 0
    names = _listdir(d)
    if names is None:
        return 0
    ops = {name[:-len(suffix)] for name in names for suffix in (".json", ".json.lock")
           if name.endswith(suffix)}
    n = 0
    for o in sorted(ops):
        if op is not None and o != op:
            continue
        path = os.path.join(d, f"{o}.json")
        try:
            with _locked(path):
                try:
                    os.remove(path)
                    n += 1
                except FileNotFoundError:
                    pass
                os.remove(path + ".lock")
        except OSError as e:
            if os.path.lexists(path):        # else gone meanwhile (another clear): nothing lost
                warnings.warn(f"tiletune: could not remove cache file {path}: {e}")
    _sweep(d, op)
    return n
