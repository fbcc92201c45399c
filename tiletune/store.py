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

A store folder on a network filesystem (NFS, Lustre, GPFS, ...: read from /proc/mounts) gets one
warning: WAL keeps its index in shared memory, so every process using the database must run on
one host; a multi-node job wants a node-local folder per node.

Nothing here raises for I/O or database problems: the store is an optimization. A tiletune store
this user cannot write (a teammate's, a read-only image layer) is copied into memory at its first
use and read from there; saves are counted, not written. A database that cannot be opened (a
folder that cannot be created, permission denied), or a file at its path that is not a tiletune
sqlite database (corrupt, foreign), is left as it is: loads return None and saves are skipped,
with one warning per path. Each thread has its own connection.

Shipped winners: package data, `tiletune/shipped/*.json.gz` (format tiletune-shipped-1: rows
of op, full store key and entry, as `python -m tiletune tune --export` writes them; a `.gz` name
is gzip-compressed JSON, any other plain JSON), read-only.
`load` consults them only where the user's store has no row for the (op, key): the user's own
winners always win, and nothing ever writes the shipped files. The lookup takes the same full
key, so a shipped row of another GPU, arch, cuda-tile or tileiras version, or config space and
kernel code is never found. One relaxation: a row tuned on CUDA device 0 also serves the same
key on device N (the device index, the last part of every op's key, names no property of the
GPU; its name and arch are in the key).
TILETUNE_SHIPPED=off turns them off; TILETUNE_SHIPPED=<folder or shipped file> reads those
instead of the package's (to try an exported file before shipping it).
"""
import contextlib
import errno
import gzip
import json
import os
import re
import sqlite3
import stat
import tempfile
import threading
import time
import urllib.parse
import warnings
import weakref
import zlib

from tiletune import env

FORMAT = "tiletune-store-1"         # the old JSON files' format, imported once
DB_NAME = "store.sqlite3"
TABLE = "tiletune_entries"
SCHEMA = 1                          # PRAGMA user_version of a tiletune store
BUSY_TIMEOUT_S = 10.0

_local = threading.local()          # .conns: this thread's {path: _Connection}
_generation = 0                     # bumped by close(): every thread's connections reopen
_live = weakref.WeakSet()           # every cached connection of this process (tests count them)
# (op, full key) -> "store", "shipped" or "search": where this process's loads found a winner
# and which rows it saved (`used`; `tune --export` writes these rows).
_used = {}


_folders = {}


def cache_dir():
    """The store's folder, or None when TILETUNE_CACHE_DIR is off (off, 0, no, none, false,
    disable, or blank; case-insensitive). Unset or on (1, on, yes, true, enable):
    ~/.cache/tiletune, not a folder of that name in the working folder."""
    d = os.environ.get("TILETUNE_CACHE_DIR")
    if d is None or env.flag_on(d):
        home = os.path.expanduser("~")
        if not os.path.isabs(home) or os.environ.get("HOME") == "":    # ("" reads as "/")
            return _homeless_folder()
        return os.path.join(home, ".cache", "tiletune")
    if env.flag_off(d):
        return None
    # "~" expanded; a relative folder resolved against the working directory of its first
    # use, so that a later os.chdir does not move the store
    return _folders.setdefault(d, os.path.abspath(os.path.expanduser(d.strip())))


def _homeless_folder():
    """The default folder where "~" names no folder (no HOME and no passwd entry: a container
    run as an unknown uid; or HOME empty): $XDG_CACHE_HOME/tiletune where that is absolute,
    else a folder of this user's in the temporary folder (not "~" under the working folder),
    named in one warning."""
    folder = _folders.get("home")
    if folder is None:
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        if os.path.isabs(xdg):
            folder = os.path.join(xdg, "tiletune")
        else:
            uid = os.getuid() if hasattr(os, "getuid") else "user"
            folder = os.path.join(tempfile.gettempdir(), f"tiletune-{uid}")
            if not _own_folder(folder):     # another user's (or a link): one of this process's
                folder = tempfile.mkdtemp(prefix=f"tiletune-{uid}-")
        folder = _folders.setdefault("home", folder)
    env.warn_once(("tiletune.store.home", folder),
                  f"tiletune: no home folder (HOME is unset or empty): the store is at {folder}; "
                  "set TILETUNE_CACHE_DIR to choose its folder")
    return folder


def _own_folder(folder):
    """Whether `folder` is missing, or a real folder of this user's that others cannot write (a
    shared temporary folder lets anyone create it first)."""
    try:
        st = os.lstat(folder)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and (not hasattr(os, "getuid") or st.st_uid == os.getuid()) \
        and not st.st_mode & 0o022


def db_path():
    """The database's path, or None when the store is off."""
    d = cache_dir()
    return None if d is None else os.path.join(d, DB_NAME)


MOUNTS = "/proc/mounts"
# Filesystem types (as /proc/mounts names them) whose files other hosts can open too.
NETWORK_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "afs", "9p", "lustre", "gpfs", "beegfs",
    "ceph", "glusterfs", "fuse.glusterfs", "fuse.sshfs", "fuse.s3fs", "fuse.gcsfuse",
    "fuse.juicefs", "fuse.cephfs", "wekafs", "panfs", "pvfs2", "orangefs", "ocfs2", "gfs2",
    "davfs", "fuse.davfs2"})


def _unescape(field):
    """A /proc/mounts field with its octal escapes (space as \\040, ...) decoded."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def filesystem(folder):
    """The type of the filesystem that holds `folder` (the longest mount point of MOUNTS that
    contains its real path), or None where the mount table cannot be read."""
    try:
        with open(MOUNTS, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    real = os.path.realpath(folder)
    best, kind = None, None
    for line in lines:
        fields = line.split()
        if len(fields) < 3:
            continue
        point = _unescape(fields[1])
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        if inside and (best is None or len(point) >= len(best)):
            best, kind = point, fields[2]
    return kind


def _warn_if_shared(folder):
    kind = filesystem(folder)
    if kind in NETWORK_FILESYSTEMS:
        env.warn_once(("tiletune.store.network", folder),
                      f"tiletune: the cache folder {folder} is on a network filesystem ({kind}); "
                      "its sqlite database (WAL mode) must only be used by processes of one "
                      "host: on a multi-node job, set TILETUNE_CACHE_DIR to a node-local folder")


_LOCKED = {
    "read": "tuned configs were not read from it",
    "save": "a tuned config was not saved there (searched again in a later process)",
    "delete": "rows were not deleted from it",
}


class _ReadOnlyStore(sqlite3.OperationalError):
    """clear or prune of a store this process reads from memory (`_open_read_only`)."""


def _refuse_if_read_only(path):
    if path in _read_only:
        raise _ReadOnlyStore(f"{path} cannot be written by this user (its rows are read only)")


def _trouble(path, e, action):
    """One warning per store; where another process held it locked past the busy timeout, or
    this user cannot write it, one per action ("read", "save", "delete"), saying which failed
    (the others may still work)."""
    if isinstance(e, _ReadOnlyStore) or isinstance(e, sqlite3.OperationalError) and \
            "locked" in str(e):
        what, consequence = ("tiletune.store.locked", path, action), _LOCKED[action]
    else:
        what, consequence = ("tiletune.store", path), \
            "tuned configs are neither read from nor saved there"
    env.warn_once(what, f"tiletune: cannot use the cache database {path} ({type(e).__name__}: "
                        f"{str(e)[:200]}); {consequence}")


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


def _refuse_foreign(conn):
    """DatabaseError for a database that neither is a tiletune store nor is empty (read only:
    run before anything changes the file)."""
    version = conn.execute("PRAGMA user_version").fetchone()[0]
    if version != SCHEMA and (
            version != 0 or conn.execute("SELECT count(*) FROM sqlite_master").fetchone()[0]):
        raise sqlite3.DatabaseError(f"not a tiletune store (user_version {version})")
    return version


def _setup(conn, folder):
    """Create the table (importing old JSON files) in a new database; refuse a foreign one."""
    if conn.execute("PRAGMA user_version").fetchone()[0] == SCHEMA:
        return
    try:
        with _transaction(conn):
            if _refuse_foreign(conn) == SCHEMA:
                raise _AlreadySetUp
            conn.execute(f"CREATE TABLE {TABLE} (op TEXT NOT NULL, key TEXT NOT NULL, "
                         "entry TEXT NOT NULL, saved REAL NOT NULL, PRIMARY KEY (op, key))")
            imported = _import_json(conn, folder)
            conn.execute(f"PRAGMA user_version = {SCHEMA}")
    except _AlreadySetUp:
        return
    for path in imported:
        with contextlib.suppress(OSError):
            os.replace(path, path + ".imported")


def _to_wal(conn):
    """PRAGMA journal_mode = WAL. sqlite answers "database is locked" at once, without waiting
    the busy timeout, when another process switches the same new database at the same moment
    (every rank of a job opens the store at its first miss): retried for up to BUSY_TIMEOUT_S."""
    deadline = time.monotonic() + BUSY_TIMEOUT_S
    while True:
        try:
            conn.execute("PRAGMA journal_mode = WAL")
            return
        except sqlite3.OperationalError as e:
            if "locked" not in str(e) or time.monotonic() > deadline:
                raise
            time.sleep(0.005)


def _open(path):
    """(pid, file identity, connection) of the database at `path`, created where missing. A
    store this process cannot write (a teammate's file, a read-only folder or image layer) is
    read into memory once instead (`_open_read_only`), with one warning: its winners are read,
    new ones are not saved, and nothing is written beside it."""
    if os.path.isfile(path) and not os.access(path, os.W_OK):
        # (before sqlite opens it: it would fall back to reading it silently, and create -wal
        # and -shm files of this user's beside a file in a writable folder, which then lock
        # the owner's own saves out)
        return _open_read_only(path, PermissionError(f"{path} is not writable by this user"))
    try:
        return _open_writable(path)
    except (OSError, sqlite3.OperationalError) as e:
        if not os.path.isfile(path) or not _is_read_only_error(e):
            raise
        return _open_read_only(path, e)


_read_only = set()      # stores read into memory (their saves are counted, not written)


def _is_read_only_error(e):
    if isinstance(e, OSError):
        return isinstance(e, PermissionError) or e.errno == errno.EROFS
    text = str(e).lower()
    return "readonly" in text or "read-only" in text or "unable to open" in text


def _open_read_only(path, why):
    """An in-memory copy of the store (sqlite's backup of it, consistent in itself; one per
    thread, as connections are). Read through a connection that creates no files: `mode=ro` where
    a -wal file beside it may hold rows not yet in the file (its owner is running), else
    `immutable` (the file holds every row). A copy that fails (the owner rewrote the file as
    it was read) is taken again, up to 3 times."""
    uri = "file:" + urllib.parse.quote(os.path.abspath(path))
    tries = ["?mode=ro"] if os.path.exists(path + "-wal") else []
    tries += ["?mode=ro&immutable=1"] * 3
    for i, flags in enumerate(tries):
        src = sqlite3.connect(uri + flags, uri=True, timeout=BUSY_TIMEOUT_S,
                              isolation_level=None, check_same_thread=False)
        memory = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=False)
        try:
            version = src.execute("PRAGMA user_version").fetchone()[0]
            if version != SCHEMA:
                raise sqlite3.DatabaseError(f"{path} is not a tiletune store (schema "
                                            f"{version}, expected {SCHEMA})")
            src.backup(memory)
            break
        except BaseException as e:
            memory.close()
            if i == len(tries) - 1 or not isinstance(e, sqlite3.OperationalError) and \
                    not (isinstance(e, sqlite3.DatabaseError) and "malformed" in str(e)):
                raise
        finally:
            src.close()
    _read_only.add(path)
    env.warn_once(("tiletune.store.read_only", path),
                  f"tiletune: the store at {path} cannot be written ({type(why).__name__}: "
                  f"{str(why)[:120]}): its winners are read, new ones are not saved there")
    st = os.stat(path)
    return (os.getpid(), (st.st_dev, st.st_ino), memory)


def _open_writable(path):
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    _warn_if_shared(folder)
    if not os.path.exists(path):    # created by us so that its mode is 0o666 minus the umask
        os.close(os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666))
    conn = sqlite3.connect(path, timeout=BUSY_TIMEOUT_S, isolation_level=None,
                           check_same_thread=False)
    try:
        conn.execute(f"PRAGMA busy_timeout = {int(BUSY_TIMEOUT_S * 1000)}")
        if conn.execute("PRAGMA journal_mode").fetchone()[0].lower() != "wal":
            _refuse_foreign(conn)       # (switching to WAL would change a foreign file)
            _to_wal(conn)
        conn.execute("PRAGMA synchronous = NORMAL")
        _setup(conn, folder)
        st = os.stat(path)
    except BaseException:
        conn.close()
        raise
    return (os.getpid(), (st.st_dev, st.st_ino), conn)


class _Connection:
    """A thread's cached connection to one database. Kept in the thread's `threading.local`, so
    no other thread closes it while it is in use, and it is closed when its thread ends (the
    thread's locals go, this with them); one a forked parent opened is never closed here."""
    __slots__ = ("pid", "ident", "conn", "generation", "__weakref__")

    def __init__(self, pid, ident, conn):
        self.pid, self.ident, self.conn, self.generation = pid, ident, conn, _generation
        _live.add(self)

    def close(self):
        if self.pid == os.getpid():
            with contextlib.suppress(sqlite3.Error):
                self.conn.close()

    __del__ = close


def _file_ident(path):
    try:
        st = os.stat(path)
        return (st.st_dev, st.st_ino)
    except OSError:
        return None


@contextlib.contextmanager
def _db(path):
    """The calling thread's cached connection to the database at `path` (opened, and created,
    on first use; a new one after a fork, after `close()`, or when the file was replaced or
    removed). One per thread: a save waiting out the busy timeout on a lock another process
    holds stalls its own thread only, while the others read (WAL readers do not wait for a
    writer). A connection that meets an error is closed and dropped."""
    conns = getattr(_local, "conns", None)
    if conns is None:
        conns = _local.conns = {}
    cached = conns.get(path)
    if cached is not None and (cached.pid != os.getpid() or cached.generation != _generation
                               or cached.ident != _file_ident(path)):
        del conns[path]
        cached.close()
        cached = None
    if cached is None:
        cached = conns[path] = _Connection(*_open(path))
    try:
        yield cached.conn
    except BaseException:
        if conns.get(path) is cached:
            del conns[path]
        cached.close()
        raise


def close():
    """Close this thread's cached connections; every other thread's are closed and reopened at
    its next use of the store (closing them here could pull one from under a running query)."""
    global _generation
    _generation += 1
    for cached in getattr(_local, "conns", {}).values():
        cached.close()
    _local.conns = {}


def load(op, key):
    """The entry for this op and full key string: the user's store's row, else a shipped
    winner's (a `ShippedEntry`), else None."""
    entry = load_own(op, key)
    if entry is not None:
        _used[(op, key)] = "store"
        return entry
    entry = shipped(op, key)
    if entry is not None:
        _used[(op, key)] = SHIPPED
    return entry


def load_own(op, key):
    """The user's store's entry for this op and full key string, or None (shipped winners are
    not consulted)."""
    path = db_path()
    if path is None:
        return None
    try:
        with _db(path) as conn:
            row = conn.execute(f"SELECT entry FROM {TABLE} WHERE op = ? AND key = ?",
                               (op, key)).fetchone()
    except (OSError, sqlite3.Error) as e:
        _trouble(path, e, "read")
        return None
    if row is None:
        return None
    try:
        return json.loads(row[0])
    except (ValueError, TypeError, RecursionError):
        env.warn_once(("tiletune.store.entry", path, op),
                      f"tiletune: an unreadable {op} entry in the store at {path} is ignored "
                      "(it is searched again and replaced)")
        return None


_unsaved = 0      # saves that met an I/O or database error in this process


def unsaved():
    """How many saves met an I/O or database error in this process (warned once per store)."""
    return _unsaved


def save(op, key, entry):
    """Add or replace one entry; never raises for I/O or database problems (counted:
    `unsaved`)."""
    global _unsaved
    path = db_path()
    if path is None:
        return
    try:
        text = json.dumps(entry)
    except (TypeError, ValueError, RecursionError) as e:
        warnings.warn(f"tiletune: could not save a cache entry of {op}: {type(e).__name__}: {e}")
        return
    if path in _read_only:           # (its warning said so)
        _unsaved += 1
        return
    try:
        with _db(path) as conn:
            conn.execute(f"INSERT OR REPLACE INTO {TABLE} (op, key, entry, saved) "
                         "VALUES (?, ?, ?, ?)", (op, key, text, time.time()))
    except (OSError, sqlite3.Error) as e:
        _unsaved += 1
        _trouble(path, e, "save")
        return
    if path in _read_only:          # (found read-only at this save's open)
        _unsaved += 1
        return
    _used[(op, key)] = "search"


def delete(op, key):
    """Remove one entry (a winner that no longer launches); never raises for I/O problems.
    (A shipped winner is not removed: the search that follows saves a row that overrides it.)"""
    _used.pop((op, key), None)
    path = db_path()
    if path is None:
        return
    try:
        with _db(path) as conn:
            conn.execute(f"DELETE FROM {TABLE} WHERE op = ? AND key = ?", (op, key))
    except (OSError, sqlite3.Error) as e:
        _trouble(path, e, "delete")


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
        _trouble(path, e, "read")
        return {}
    out = {}
    for o, key, text in rows:
        try:
            out.setdefault(o, {})[key] = json.loads(text)
        except (ValueError, TypeError, RecursionError):
            continue
    return out


def clear(op=None, strict=False):
    """Delete the store's entries (all ops, or one). Returns the number of entries removed.
    A database that cannot be used: one warning and 0, or with `strict` its error raised (the
    CLI's `cache clear` reports it)."""
    path = db_path()
    if not _usable(path):
        return 0
    sql, args = _of_op(f"DELETE FROM {TABLE}", op)
    try:
        with _db(path) as conn:
            _refuse_if_read_only(path)
            return conn.execute(sql, args).rowcount
    except (OSError, sqlite3.Error) as e:
        if strict:
            raise
        _trouble(path, e, "delete")
        return 0


def _part(key, prefix):
    """The value of the key's " | "-joined part that starts with `prefix`, or None."""
    for part in key.split(" | "):
        if part.startswith(prefix):
            return part[len(prefix):]
    return None


def prune(cuda_tile=None, tileiras=None, older_than_s=None, gpus=None, strict=False):
    """Delete the entries whose key names another cuda-tile or tileiras version than the given
    ones (a None version is not checked; a key without that part is kept), if older_than_s is
    given those saved more than that many seconds ago, and if gpus (GPU names) is given those
    whose key names a GPU model not in it. Returns {op: entries removed}. A database that
    cannot be used: as `clear`."""
    path = db_path()
    if not _usable(path):
        return {}
    cutoff = None if older_than_s is None else time.time() - older_than_s
    try:
        with _db(path) as conn, _transaction(conn):
            _refuse_if_read_only(path)
            stale = []
            for op, key, saved in conn.execute(f"SELECT op, key, saved FROM {TABLE}"):
                ct_v, ti_v = _part(key, "cuda-tile "), _part(key, "tileiras ")
                facts = key_facts(key) if gpus is not None else None
                if (cuda_tile is not None and ct_v is not None and ct_v != cuda_tile) or \
                        (tileiras is not None and ti_v is not None and ti_v != tileiras) or \
                        (cutoff is not None and saved < cutoff) or \
                        (facts is not None and facts[0] not in gpus):
                    stale.append((op, key))
            conn.executemany(f"DELETE FROM {TABLE} WHERE op = ? AND key = ?", stale)
    except (OSError, sqlite3.Error) as e:
        if strict:
            raise
        _trouble(path, e, "delete")
        return {}
    out = {}
    for op, _ in stale:
        out[op] = out.get(op, 0) + 1
    return dict(sorted(out.items()))


def used():
    """{(op, full key): "store" | "shipped" | "search"}: the winners this process loaded (from
    the user's store or the shipped files) and the rows it saved after a search."""
    return dict(_used)


# ---------------------------------------------------------------------------------------------
# Shipped winners (read-only package data)

SHIPPED = "shipped"
SHIPPED_FORMAT = "tiletune-shipped-1"
SHIPPED_SUFFIXES = (".json", ".json.gz")   # plain or gzip-compressed JSON
SHIPPED_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "shipped")
# The parts every store key ends with (Autotuner.store_key): GPU name, arch, cuda-tile,
# tileiras, space fingerprint; the op's key before them ends with the CUDA device index.
_SUFFIX = 5

_shipped_cache = {}                 # source path -> (signature of its files, index, summaries)


class ShippedEntry(dict):
    """An entry that came from the shipped files (a plain dict otherwise)."""


def source_of(entry):
    """"shipped" for an entry `load` took from the shipped files, else "store"."""
    return SHIPPED if isinstance(entry, ShippedEntry) else "store"


def shipped_source():
    """The folder (or shipped file) shipped winners are read from, or None when TILETUNE_SHIPPED
    is off (off, 0, no, none, false, disable). Unset, blank or on (1, yes, true, ...): the
    package's `tiletune/shipped`."""
    value = os.environ.get("TILETUNE_SHIPPED")
    if value is None or not value.strip() or env.flag_on(value):
        return SHIPPED_DIR
    if env.flag_off(value):
        return None
    # a relative path resolved at its first use, as the store's folder (os.chdir moves neither)
    return _folders.setdefault(("shipped", value),
                               os.path.abspath(os.path.expanduser(value.strip())))


def _any_device(key):
    """The full key with its CUDA device index (the op key's last part, just before the GPU
    name) as "*", or None for a key not of the store key's shape."""
    parts = key.split(" | ")
    if len(parts) > _SUFFIX + 1 and parts[-_SUFFIX - 1].isdigit() and \
            parts[-3].startswith("cuda-tile ") and parts[-2].startswith("tileiras ") and \
            parts[-1].startswith("space "):
        parts[-_SUFFIX - 1] = "*"
        return " | ".join(parts)
    return None


def _shipped_files(source):
    """[(path, mtime_ns, size)] of the shipped files (`SHIPPED_SUFFIXES`) at `source` (a
    folder or one file), sorted."""
    if os.path.isfile(source):
        paths = [source]
    else:
        try:
            paths = [os.path.join(source, n) for n in sorted(os.listdir(source))
                     if n.endswith(SHIPPED_SUFFIXES) and not n.startswith(".")]
        except OSError as e:
            if source != SHIPPED_DIR:   # a TILETUNE_SHIPPED value that names nothing readable
                env.warn_once(("tiletune.shipped.source", source),
                              f"tiletune: TILETUNE_SHIPPED names {source}, which is not a "
                              f"readable folder or file ({type(e).__name__}): no shipped "
                              "winners are read (on, off, or a folder or shipped file)")
            return []
        if not paths and source != SHIPPED_DIR:     # (the parent of the folder meant, say)
            env.warn_once(("tiletune.shipped.source", source),
                          f"tiletune: TILETUNE_SHIPPED names the folder {source}, which holds "
                          f"no shipped files ({', '.join(SHIPPED_SUFFIXES)}): no shipped "
                          "winners are read")
    out = []
    for p in paths:
        try:
            st = os.stat(p)
        except OSError:
            continue
        out.append((p, st.st_mtime_ns, st.st_size))
    return out


def read_shipped(path):
    """(header, rows) of one shipped file: header is the file's top-level fields but rows; rows
    [(op, key, entry)] are its well-formed rows. Raises ValueError for a file that is not a
    tiletune-shipped-1 file (a `.gz` file that is not gzip included), OSError where it cannot
    be read."""
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
        try:
            data = json.load(f)
        except RecursionError as e:
            raise ValueError("nested too deep") from e
        except (gzip.BadGzipFile, EOFError, zlib.error) as e:
            raise ValueError(f"not a gzip file ({e})") from e
    if not isinstance(data, dict) or data.get("format") != SHIPPED_FORMAT or \
            not isinstance(data.get("rows"), list):
        raise ValueError(f"not a {SHIPPED_FORMAT} file")
    rows = []
    for row in data["rows"]:
        if isinstance(row, dict) and isinstance(row.get("op"), str) and \
                isinstance(row.get("key"), str) and isinstance(row.get("entry"), dict):
            rows.append((row["op"], row["key"], row["entry"]))
    return {k: v for k, v in data.items() if k != "rows"}, rows


def _shipped_index(source):
    """({op: {key: entry}}, [(file, header, rows)]) of the files at `source`; read again when a
    file changes. A row tuned on device 0 is also indexed under its key with the device index
    as "*" (see `shipped`). A file that cannot be read or is not a shipped file is left out
    with one warning; where two rows share a key, the first file (by name) wins."""
    files = _shipped_files(source)
    signature = tuple(files)
    cached = _shipped_cache.get(source)
    if cached is not None and cached[0] == signature:
        return cached[1], cached[2]
    index, summaries = {}, []
    for path, _, _ in files:
        try:
            header, rows = read_shipped(path)
        except (OSError, ValueError) as e:
            env.warn_once(("tiletune.shipped", path),
                          f"tiletune: not using the shipped winners in {path} "
                          f"({type(e).__name__}: {str(e)[:200]})")
            continue
        for op, key, entry in rows:
            keys = index.setdefault(op, {})
            keys.setdefault(key, entry)
            alias = _any_device(key)
            if alias is not None and key.split(" | ")[-_SUFFIX - 1] == "0":
                keys.setdefault(alias, entry)
        summaries.append((path, header, rows))
    _shipped_cache[source] = (signature, index, summaries)
    return index, summaries


def shipped(op, key):
    """The shipped winner for this op and full key as a `ShippedEntry`, or None (none, or
    TILETUNE_SHIPPED=off). A key on CUDA device N > 0 also finds the row of the same key tuned
    on device 0: the index names no property of the GPU (its name and arch are in the key)."""
    source = shipped_source()
    if source is None:
        return None
    keys = _shipped_index(source)[0].get(op, {})
    entry = keys.get(key)
    if entry is None:
        alias = _any_device(key)
        entry = None if alias is None else keys.get(alias)
    return None if entry is None else ShippedEntry(json.loads(json.dumps(entry)))


def shipped_files():
    """[(path, header, rows)] of the shipped files in use (empty when off or there are none)."""
    source = shipped_source()
    return [] if source is None else list(_shipped_index(source)[1])


def key_facts(key):
    """(GPU name, arch, cuda-tile version, tileiras version) a full store key names, or None
    for a key not of the store key's shape."""
    parts = key.split(" | ")
    if len(parts) <= _SUFFIX or not parts[-3].startswith("cuda-tile ") or \
            not parts[-2].startswith("tileiras ") or not parts[-1].startswith("space "):
        return None
    return parts[-5], parts[-4], parts[-3][len("cuda-tile "):], parts[-2][len("tileiras "):]


# Decimal places a shipped entry keeps of its numbers (microseconds, seconds, rates): CUDA
# event timings resolve about 0.5 us, so the digits past the second were noise, and more than
# half of a compressed file.
SHIPPED_DECIMALS = 2


def _rounded(value):
    if isinstance(value, float):
        return round(value, SHIPPED_DECIMALS)
    if isinstance(value, dict):
        return {k: _rounded(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


def write_shipped(path, rows, header=None):
    """Write rows [(op, key, entry)] to `path` as a shipped file (one row a line, sorted;
    gzip-compressed where `path` ends in .gz; the file is replaced at once; every number in an
    entry to SHIPPED_DECIMALS places, `_rounded`). Rows already in a
    shipped file at `path` are kept unless a new row has their op and key. Returns (rows
    written, rows kept from the file). Raises ValueError where `path` holds something else than
    a shipped file, OSError where it cannot be read or written."""
    new = {(op, key): entry for op, key, entry in rows}
    merged = {}
    if os.path.exists(path):
        merged = {(op, key): entry for op, key, entry in read_shipped(path)[1]}
    kept = sum(1 for k in merged if k not in new)
    merged.update(new)
    head = json.dumps({"format": SHIPPED_FORMAT, **(header or {})}, indent=1)
    lines = [json.dumps({"op": op, "key": key, "entry": _rounded(entry)}, sort_keys=True)
             for (op, key), entry in sorted(merged.items(), key=lambda r: r[0])]
    text = head[:-2] + ',\n "rows": [' + ",".join("\n  " + line for line in lines) + "\n ]\n}\n"
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        payload = text.encode()
        if path.endswith(".gz"):      # no name and no time in the header: same rows, same bytes
            payload = gzip.compress(payload, compresslevel=9, mtime=0)
        with open(tmp, "wb") as f:
            f.write(payload)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)
    return len(merged), kept
