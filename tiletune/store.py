"""Persistent store of tuned configs: one sqlite3 database, `<TILETUNE_CACHE_DIR>/store.sqlite3`.

An entry's key is the op's key plus everything that makes a winner stale elsewhere: GPU name,
sm arch, cuda-tile version and a fingerprint of the config space (and kernel source). Each
(op, key) is one row holding the entry as JSON text and the time it was saved; a save writes that
row only, in WAL mode (readers never wait for a writer) with a 10 s busy timeout, so several
processes can tune at once without losing entries. The database is created with os.open(...,
0o666), so its mode follows the umask like any file open() creates, and sqlite gives its -wal and
-shm files the database's mode: a group-shared folder (setgid, umask 002) stays shared.

When the database is first created, the entries of `<op>.json` files of the old one-file-per-op
format (tiletune-store-1) in the folder are imported (existing rows win) and each file is renamed
to `<op>.json.imported`.

Nothing here raises for I/O or database problems: the store is an optimization. A database that
cannot be opened or written (read-only folder, permission denied), or a file at its path that is
not a tiletune sqlite database (corrupt, foreign), is left as it is: loads return None and saves
are skipped, with one warning per path.
"""
import contextlib
import json
import os
import sqlite3
import threading
import time
import warnings

from tiletune import env

FORMAT = "tiletune-store-1"         # the old JSON files' format, imported once
DB_NAME = "store.sqlite3"
TABLE = "tiletune_entries"
SCHEMA = 1                          # PRAGMA user_version of a tiletune store
BUSY_TIMEOUT_S = 10.0

_lock = threading.RLock()           # guards _conns and every use of a cached connection
_conns = {}                         # path -> (pid, (st_dev, st_ino), sqlite3.Connection)


def cache_dir():
    """The store's folder, or None when TILETUNE_CACHE_DIR is off (off, 0, no, none, false,
    disable, or blank; case-insensitive). Unset: ~/.cache/tiletune."""
    d = os.environ.get("TILETUNE_CACHE_DIR")
    if d is None:
        return os.path.join(os.path.expanduser("~"), ".cache", "tiletune")
    if env.flag_off(d):
        return None
    return d


def db_path():
    """The database's path, or None when the store is off."""
    d = cache_dir()
    return None if d is None else os.path.join(d, DB_NAME)


def _trouble(path, e):
    env.warn_once(("tiletune.store", path),
                  f"tiletune: cannot use the cache database {path} ({type(e).__name__}: "
                  f"{str(e)[:200]}); tuned configs are neither read from nor saved there")


def _import_json(conn, folder):
    """Insert the entries of the folder's old `<op>.json` files (existing rows win). Returns the
    paths imported. A file that cannot be read or is not a tiletune-store-1 file is left alone
    with a warning."""
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return []
    done = []
    for name in names:
        if not name.endswith(".json") or name.startswith("."):
            continue
        path = os.path.join(folder, name)
        try:
            with open(path, "rb") as f:
                data = json.load(f)
            mtime = os.path.getmtime(path)
        except (OSError, ValueError, RecursionError) as e:
            warnings.warn(f"tiletune: not importing cache file {path} ({type(e).__name__})")
            continue
        if not isinstance(data, dict) or data.get("format") != FORMAT or \
                not isinstance(data.get("entries"), dict):
            warnings.warn(f"tiletune: not importing cache file {path} (not a {FORMAT} file)")
            continue
        rows = []
        for key, entry in data["entries"].items():
            saved = mtime
            if isinstance(entry, dict) and isinstance(entry.get("saved"), str):
                with contextlib.suppress(ValueError, OverflowError):
                    saved = time.mktime(time.strptime(entry["saved"], "%Y-%m-%dT%H:%M:%S"))
            try:
                rows.append((name[:-5], str(key), json.dumps(entry), saved))
            except (TypeError, ValueError, RecursionError):
                continue
        conn.executemany(f"INSERT OR IGNORE INTO {TABLE} (op, key, entry, saved) "
                         "VALUES (?, ?, ?, ?)", rows)
        done.append(path)
    return done


@contextlib.contextmanager
def _transaction(conn):
    """BEGIN IMMEDIATE (the write lock up front) ... COMMIT, or ROLLBACK on any error."""
    conn.execute("BEGIN IMMEDIATE")
    try:
        yield
        conn.execute("COMMIT")
    except BaseException:
        with contextlib.suppress(sqlite3.Error):
            conn.execute("ROLLBACK")
        raise


class _AlreadySetUp(Exception):
    """Another process created the table while this one waited for the lock."""


def _setup(conn, folder):
    """Create the table (importing old JSON files) in a new database; refuse a foreign one."""
    if conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA:
        return
    try:
        with _transaction(conn):
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            if version == SCHEMA:
                raise _AlreadySetUp
            if version != 0 or conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]:
                raise sqlite3.DatabaseError(f"not a tiletune store (user_version {version})")
            conn.execute(f"CREATE TABLE {TABLE} (op TEXT NOT NULL, key TEXT NOT NULL, "
                         "entry TEXT NOT NULL, saved REAL NOT NULL, PRIMARY KEY (op, key))")
            imported = _import_json(conn, folder)
            conn.execute(f"PRAGMA user_version = {SCHEMA}")
    except _AlreadySetUp:
        return
    for path in imported:
        with contextlib.suppress(OSError):
            os.replace(path, path + ".imported")


def _open(path):
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    if not os.path.exists(path):    # created by us so that its mode is 0o666 minus the umask
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666))
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                           check_same_thread=False)
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
            conn.execute("PRAGMA journal_mode = WAL")
        conn.execute("PRAGMA synchronous = NORMAL")
        _setup(conn, folder)
        st = os.stat(path)
    except BaseException:
        conn.close()
        raise
    return (os.getpid(), (st.st_dev, st.st_ino), conn)


@contextlib.contextmanager
def _db(path):
    """The cached connection to the database at `path` (opened, and created, on first use; a
    new one after a fork or when the file was replaced or removed), used under _lock. A
    connection that meets an error is closed and dropped."""
    with _lock:
        cached = _conns.get(path)
        if cached is not None:
            try:
                st = os.stat(path)
                ident = (st.st_dev, st.st_ino)
            except OSError:
                ident = None
            if cached[0] != os.getpid() or cached[1] != ident:
                _conns.pop(path)
                if cached[0] == os.getpid():
                    with contextlib.suppress(sqlite3.Error):
                        cached[2].close()
                cached = None
        if cached is None:
            cached = _conns[path] = _open(path)
        try:
            yield cached[2]
        except BaseException:
            if _conns.get(path) is cached:
                _conns.pop(path)
                with contextlib.suppress(sqlite3.Error):
                    cached[2].close()
            raise


def close():
    """Close this process's cached connections (they reopen on next use)."""
    with _lock:
        for pid, _, conn in _conns.values():
            if pid == os.getpid():
                with contextlib.suppress(sqlite3.Error):
                    conn.close()
        _conns.clear()


def load(op, key):
    """The stored entry for this op and full key string, or None."""
    path = db_path()
    if path is None:
        return None
    try:
        with _db(path) as conn:
            row = conn.execute(f"SELECT entry FROM {TABLE} WHERE op = ? AND key = ?",
                               (op, key)).fetchone()
    except (OSError, sqlite3.Error) as e:
        _trouble(path, e)
        return None
    if row is None:
        return None
    try:
        return json.loads(row[0])
    except (ValueError, TypeError, RecursionError):
        return None


def save(op, key, entry):
    """Add or replace one entry; never raises for I/O or database problems."""
    path = db_path()
    if path is None:
        return
    try:
        text = json.dumps(entry)
    except (TypeError, ValueError, RecursionError) as e:
        warnings.warn(f"tiletune: could not save a cache entry of {op}: {type(e).__name__}: {e}")
        return
    try:
        with _db(path) as conn:
            conn.execute(f"INSERT OR REPLACE INTO {TABLE} (op, key, entry, saved) "
                         "VALUES (?, ?, ?, ?)", (op, key, text, time.time()))
    except (OSError, sqlite3.Error) as e:
        _trouble(path, e)


def delete(op, key):
    """Remove one entry (a winner that no longer launches); never raises for I/O problems."""
    path = db_path()
    if path is None:
        return
    try:
        with _db(path) as conn:
            conn.execute(f"DELETE FROM {TABLE} WHERE op = ? AND key = ?", (op, key))
    except (OSError, sqlite3.Error) as e:
        _trouble(path, e)


def _usable(path):
    """Whether entries()/clear()/prune() should open the store: it is on and its folder exists."""
    return path is not None and os.path.isdir(os.path.dirname(path))


def _of_op(sql, op):
    """(sql, args) restricted to one op's rows, or all rows when op is None."""
    return (sql, ()) if op is None else (sql + " WHERE op = ?", (op,))


def entries(op=None):
    """{op: {key: entry}} for every op in the store (or just `op`). A database that cannot be
    used is an empty store (one warning); a row whose JSON does not parse is left out."""
    path = db_path()
    if not _usable(path):
        return {}
    sql, args = _of_op(f"SELECT op, key, entry FROM {TABLE}", op)
    try:
        with _db(path) as conn:
            rows = conn.execute(sql + " ORDER BY op, key", args).fetchall()
    except (OSError, sqlite3.Error) as e:
        _trouble(path, e)
        return {}
    out = {}
    for o, key, text in rows:
        try:
            out.setdefault(o, {})[key] = json.loads(text)
        except (ValueError, TypeError, RecursionError):
            continue
    return out


def clear(op=None):
    """Delete the store's entries (all ops, or one). Returns the number of entries removed."""
    path = db_path()
    if not _usable(path):
        return 0
    sql, args = _of_op(f"DELETE FROM {TABLE}", op)
    try:
        with _db(path) as conn:
            return conn.execute(sql, args).rowcount
    except (OSError, sqlite3.Error) as e:
        _trouble(path, e)
        return 0


def _part(key, prefix):
    """The value of the key's " | "-joined part that starts with `prefix`, or None."""
    for part in key.split(" | "):
        if part.startswith(prefix):
            return part[len(prefix):]
    return None


def prune(cuda_tile=None, tileiras=None, older_than_s=None):
    """Delete the entries whose key names another cuda-tile or tileiras version than the given
    ones (a None version is not checked; a key without that part is kept), and, if older_than_s
    is given, those saved more than that many seconds ago. Returns {op: entries removed}."""
    path = db_path()
    if not _usable(path):
        return {}
    cutoff = None if older_than_s is None else time.time() - older_than_s
    try:
        with _db(path) as conn, _transaction(conn):
            stale = []
            for op, key, saved in conn.execute(f"SELECT op, key, saved FROM {TABLE}"):
                ct_v, ti_v = _part(key, "cuda-tile "), _part(key, "tileiras ")
                if (cuda_tile is not None and ct_v is not None and ct_v != cuda_tile) or \
                        (tileiras is not None and ti_v is not None and ti_v != tileiras) or \
                        (cutoff is not None and saved < cutoff):
                    stale.append((op, key))
            conn.executemany(f"DELETE FROM {TABLE} WHERE op = ? AND key = ?", stale)
    except (OSError, sqlite3.Error) as e:
        _trouble(path, e)
        return {}
    out = {}
    for op, _ in stale:
        out[op] = out.get(op, 0) + 1
    return dict(sorted(out.items()))
