"""Compile a search's configs in parallel before the search times them.

A search JIT-compiles its configs one after another, and cuTile holds one global lock
per process around every compile: a 28-config matmul search on ragged shapes spent 67-86 s of
its wall time compiling (H200 machine, 16 cores, measured). Before a search, the engine hands
each config's kernel and JIT signature (read off the search's real arguments) to worker
processes that compile them at once; every cubin lands in cuTile's on-disk cache
(`CUDA_TILE_CACHE_DIR`) and also comes back to the searching process, which hands it to that
config's kernel object (`hand_over`): its first launch with that signature then loads the cubin
instead of tracing the kernel again to find it in the disk cache (0.2-0.5 s a config).

Workers are plain subprocesses (`_WORKER_COMMAND`, which runs `_serve`) fed pickled jobs on
stdin: no multiprocessing, so nothing re-imports the user's main script, and no fork of a
process that holds a CUDA context. They import only the kernels' own modules and never touch the
GPU. They stay for the process's next search (starting one costs seconds of imports: 3.6-4.9 s
on 16-core H200 hosts) and exit after IDLE_EXIT_SEC without work or when the process ends; they
run at WORKER_NICENESS. Jobs go out one at a time to whichever worker is free. While started
workers import, threads of the searching process compile jobs: cuTile's compile lock is let go
while tileiras runs (`tileiras_outside_the_lock`), so their tracing takes turns and their
tileiras runs overlap; a process's first search mostly ends there before any worker is ready.
Configs whose kernel object compiled the signature already (a later key of the same signatures)
are left to its JIT cache.
`TILETUNE_COMPILE_JOBS` sets how many run at once (default: CPU count, at most 16); 0 or 1, or a
disabled cuTile disk cache, turns this off and the search compiles serially.

A config cuTile rejects here (a TileError: bad tile shape, compiler error, compile timeout) is
reported as that config's failure and not searched. Parallel compiles run slower each, so a
config near the compile timeout may time out here that would just pass serially; such tiles
are too slow to compile to belong in a space anyway.

`kernel_code` says what a kernel's code is (its source and that of every helper and constant it
reaches): a worker compiles only code whose digest matches the parent's, and the engine's store
keys winners by the same bytes.
"""
import atexit
import functools
import hashlib
import inspect
import logging
import marshal
import os
import pickle
import select
import signal
import struct
import subprocess
import sys
import threading
import time
import weakref

log = logging.getLogger("tiletune")

# A worker idle this long exits, so a training process does not keep compilers' memory after
# its searches; the pool never hands out one that is within a few seconds of that.
IDLE_EXIT_SEC = 120.0
_REUSE_MARGIN_SEC = 10.0
_START_SEC = 120.0        # a started worker not ready (its imports done) by then is dropped
# Workers yield the CPU to the searching process's own compiles while they import (matmul's
# first search: 2.7-2.9 s on H200 hosts against 4.3-4.8 s at the same priority) and to the
# training process they serve after that. The niceness comes before any import: `python -m`
# would import the tiletune package (torch) first. SIGTERM ends a worker through Python's exit,
# whose atexit handlers remove the temporary folder cuTile made at import (with the bytecode of
# every compile), which SIGKILL leaves behind.
WORKER_NICENESS = 10
# Once it is exiting (by the signal, or at the end of its input), the signal is ignored: arriving
# inside those atexit handlers, it would raise SystemExit there and leave the folder behind.
_WORKER_COMMAND = (sys.executable, "-c", "import os, signal, sys\n"
                   "def end(*_):\n"
                   "    signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
                   "    sys.exit(0)\n"
                   "signal.signal(signal.SIGTERM, end)\n"
                   f"os.nice({WORKER_NICENESS})\n"
                   "from tiletune.precompile import _serve\n"
                   "_serve(float(sys.argv[1]))\n"
                   "signal.signal(signal.SIGTERM, signal.SIG_IGN)")
_HANDED_KEPT = 4          # cubins a kernel object holds for signatures it has not launched yet


def jobs():
    """How many compile processes: TILETUNE_COMPILE_JOBS (below 0 counts as 0), by default the
    number of CPUs this process may run on (its affinity: taskset, a container's cpuset), at
    most 16. A value that is not an integer (e.g. auto) warns once and is the default."""
    from tiletune import env
    return max(env.integer("TILETUNE_COMPILE_JOBS", min(usable_cpus(), 16)), 0)


def usable_cpus():
    """The CPUs this process may run on (its affinity), which os.cpu_count() does not tell:
    in a container or a job step pinned to 8 of a host's 128 cores, it counts 128."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):       # (no sched_getaffinity off Linux)
        return os.cpu_count() or 1


def enabled():
    from cutile_cache._env import get_cache_dir_from_env
    return jobs() > 1 and get_cache_dir_from_env() is not None


def kernel_location(kernel):
    """(module, attribute) under which another process finds this very kernel, or None."""
    fn = kernel._pyfunc
    module = sys.modules.get(fn.__module__)
    if fn.__module__ == "__main__" or getattr(module, fn.__name__, None) is not kernel:
        return None
    return fn.__module__, fn.__name__


def _needs_v2(constraint):
    from cuda.tile.compilation import ArrayConstraint, ListConstraint, TupleConstraint
    if isinstance(constraint, ArrayConstraint):
        return any(c is not None for c in constraint.shape_constant)
    if isinstance(constraint, ListConstraint):
        return _needs_v2(constraint.element)
    return isinstance(constraint, TupleConstraint)


def launch_signature(params):
    """The KernelSignature `ct.launch` compiles for these parameter constraints. The calling
    convention is part of the bytecode and so of the disk-cache key: the launch uses
    cutile_python_v1 unless a parameter needs v2 (a constant dim size, a tuple or list), and a
    cubin compiled under the other convention is never found (every search compiled twice)."""
    from cuda.tile.compilation import CallingConvention, KernelSignature
    cc = (CallingConvention.cutile_python_v2() if any(_needs_v2(p) for p in params)
          else CallingConvention.cutile_python_v1())
    return KernelSignature(list(params), cc)


class Cubin:
    """A compiled kernel as a worker hands it back: the cubin and its kernel's symbol."""

    def __init__(self, symbol, data):
        self.symbol, self.data = symbol, data


@functools.lru_cache(maxsize=None)
def kernel_code(fn):
    """Bytes that change when the kernel's code changes: the source of the kernel and of every
    function it reaches through the names it uses (helpers and theirs, in any module; a
    @ct.function helper's wrapped function; attributes of the program's own modules, `_named`),
    and the values of the other globals those name (constants, enum members). Host code, the
    module's docstring and other kernels of the same module are left out, so an edit there keeps
    tuned winners; the source of a kernel or helper includes its own docstring and comments, so an
    edit of those makes its winners (shipped rows included) stale. A function without source
    (made by exec) gives its code object."""
    parts, seen, todo = [], set(), [fn]
    while todo:
        f = inspect.unwrap(todo.pop())        # a @ct.function helper: the function it wraps
        if f in seen:
            continue
        seen.add(f)
        try:
            parts.append(inspect.getsource(f).encode())
        except (OSError, TypeError):
            parts.append(marshal.dumps(f.__code__))
        for name, obj in _named(f.__code__, f.__globals__):
            obj = getattr(obj, "_pyfunc", obj)                  # a ct.kernel's function
            if inspect.isfunction(obj):
                todo.append(obj)
            else:
                text = repr(obj)                                 # an address is not the code
                parts.append(f"{name}={type(obj).__qualname__ if ' at 0x' in text else text}"
                             .encode())
    return tuple(parts)      # (cached per function: a kernel's code does not change in a process)


# Modules whose attributes a kernel's fingerprint leaves out: cuTile's own (its version is in
# the store's key), torch, numpy and the standard library.
_LIBRARIES = frozenset({"cuda", "torch", "numpy"}) | frozenset(sys.stdlib_module_names)


def _named(code, scope):
    """(name, object) for each global name `code` uses (nested code included) that `scope` (a
    function's globals) binds to what is not a module, in name order; then, for each attribute
    chain read from a module of the program's own (`helpers.scale`, `pkg.sub.fn`: a global
    module followed by the attributes read from it), the object it reaches, as
    `module.name`."""
    found = []
    for name in sorted(_code_names(code)):
        obj = scope.get(name, _named)
        if obj is not _named and not inspect.ismodule(obj):
            found.append((name, obj))
    for chain in sorted(_module_chains(code)):
        obj = scope.get(chain[0])
        for i, attr in enumerate(chain[1:], 1):
            if not inspect.ismodule(obj) or obj.__name__.partition(".")[0] in _LIBRARIES:
                break
            obj = vars(obj).get(attr, _named)
            if obj is not _named and not inspect.ismodule(obj):
                found.append((".".join(chain[:i + 1]), obj))
                break
    return found


_ATTRIBUTE_READS = frozenset({"LOAD_ATTR", "LOAD_METHOD"})


def _module_chains(code):
    """Attribute chains `code` reads from a global (nested code included): (global, attr, ...)
    for each LOAD_GLOBAL followed by attribute loads."""
    import dis
    chains, chain = set(), []
    for ins in dis.get_instructions(code):
        if chain and ins.opname in _ATTRIBUTE_READS:
            chain.append(ins.argval)
            continue
        if len(chain) > 1:
            chains.add(tuple(chain))
        chain = [ins.argval] if ins.opname == "LOAD_GLOBAL" else []
    if len(chain) > 1:
        chains.add(tuple(chain))
    for const in code.co_consts:
        if inspect.iscode(const):
            chains |= _module_chains(const)
    return chains


def _code_names(code):
    """The global and attribute names a code object uses, nested ones (lambdas) included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _code_names(const)
    return names


_digests = {}              # kernel function -> code_digest


def code_digest(kernel):
    """A digest of the kernel's code: the sources of it and of every helper it reaches (what
    the store's fingerprint hashes) and its own bytecode as imported. A worker compiles a job
    only if the code it imported has the parent's digest: another module of that name first on
    its path, or the kernel's file edited since the parent imported it, would otherwise hand
    the parent a cubin of other code. (The sources are read from disk, so a helper edited
    after the parent's first search is not told apart.)"""
    fn = kernel._pyfunc
    digest = _digests.get(fn)
    if digest is None:
        h = hashlib.sha256(b"".join(kernel_code(fn)))
        h.update(fn.__code__.co_code)
        digest = _digests[fn] = h.hexdigest()
    return digest


def compile_job(module, name, hints, params, calling_convention, digest, arch, timeout_sec):
    """Compile module.name with these hints for one signature (into the disk cache, as
    `export_kernel` does). Returns a Cubin, None (compiled, but it needs more than a cubin to
    load: library lifecycle providers), or (error type name, message, whether it is cuTile's
    verdict on the kernel rather than trouble here). `digest`: the parent's `code_digest` of
    the kernel; other code under that name is not compiled (no verdict: the parent compiles).
    Thread-safe: the timeout goes in a context of its own, not cuTile's global setting."""
    import dataclasses
    import importlib
    import cuda.tile as ct
    from cuda.tile._cext import TileContext, default_tile_context
    from cuda.tile._compile import compile_tile
    from cuda.tile.compilation import CallingConvention, KernelSignature
    try:
        kernel = getattr(importlib.import_module(module), name)
        if code_digest(kernel) != digest:
            return ("CodeMismatch", f"{module}.{name} here is not the code the caller "
                    "imported", False)
        kernel = kernel.replace_hints(**hints)
        sig = KernelSignature(list(params), CallingConvention.from_code(calling_convention))
        context = TileContext(config=dataclasses.replace(default_tile_context.config,
                                                         compiler_timeout_sec=timeout_sec))
        result = compile_tile(kernel._annotated_function, [sig], arch,
                              kernel._compiler_options, context)
    except Exception as e:
        return type(e).__name__, str(e), isinstance(e, ct.TileError)
    if result.library_lifecycle_providers or len(result.kernel_signatures) != 1:
        return None
    return Cubin(result.kernel_signatures[0].symbol, result.cubin)


_unlock_lock = threading.Lock()
_tileiras_unlocked = False


def tileiras_outside_the_lock():
    """Let cuTile's process-wide compile lock go while tileiras runs. cuTile holds the lock
    around a whole compile, but most of a compile is the tileiras process (on a 2-core CPU host,
    configs of RMSNorm, RoPE, matmul and FMHA: tracing 0.02-0.17 s, tileiras 0.11-1.1 s), which
    shares no state with the tracing: with the lock let go there, threads of one process trace
    one at a time and run their tileiras side by side. Everything else in a compile stays under
    the lock. cuTile's `compile_cubin` is looked up at call time, so it is wrapped in place
    (private cuTile names: any of them missing leaves compiles as they were). Returns whether
    compiles now overlap."""
    global _tileiras_unlocked
    with _unlock_lock:
        if not _tileiras_unlocked:
            try:
                from cuda.tile import _compile
                lock, run = _compile._compiler_lock, _compile.compile_cubin
                release, restore, owned = (lock._release_save, lock._acquire_restore,
                                           lock._is_owned)
            except (ImportError, AttributeError):
                return False

            def compile_cubin(*args, **kwargs):
                if not owned():
                    return run(*args, **kwargs)
                state = release()           # every level this thread holds, as Condition does
                try:
                    return run(*args, **kwargs)
                finally:
                    restore(state)

            compile_cubin.__wrapped__ = run
            _compile.compile_cubin = compile_cubin
            _tileiras_unlocked = True
    return True


class _JitRecord:
    """What tiletune knows of one kernel object's JIT cache: cubins handed to it for
    signatures it has not compiled yet, and the signatures it has compiled (its own cache then
    answers them: no compile, no precompile)."""

    def __init__(self):
        self.handed, self.compiled = [], []      # [(signature, arch, Cubin)], [(signature, arch)]


def track(kernel):
    """The kernel object's _JitRecord; its `_compile` (which cuTile calls on a JIT-cache miss)
    is wrapped once to keep it: a handed cubin is loaded instead of compiling, and every
    signature compiled either way is noted."""
    record = kernel.__dict__.get("_tiletune_jit")
    if record is None:
        record = kernel._tiletune_jit = _JitRecord()
        compile_itself = kernel._compile

        def _compile(signature, context, compute_capability=None):
            unnamed, arch = signature.with_symbol(None), _arch_name(compute_capability)
            for i, (s, a, c) in enumerate(record.handed):
                if a == arch and s == unnamed:
                    del record.handed[i]
                    record.compiled.append((unnamed, arch))
                    return c.data, c.symbol, None, ()
            built = compile_itself(signature, context, compute_capability)
            record.compiled.append((unnamed, arch))
            return built

        kernel._compile = _compile
    return record


def compiled_already(kernel, sig, arch):
    """Whether the kernel object has compiled `sig` for `arch` (its next launch with it
    compiles nothing)."""
    record = kernel.__dict__.get("_tiletune_jit")
    sig = sig.with_symbol(None)
    return record is not None and any(a == arch and s == sig for s, a in record.compiled)


def hand_over(kernel, sig, arch, cubin):
    """Let `kernel` (a ct.kernel object) load `cubin` when it is asked to compile `sig` for
    `arch`, once, instead of compiling. Any other signature or arch compiles as before."""
    handed = track(kernel).handed
    sig = sig.with_symbol(None)
    # A signature this object has compiled before never reaches _compile again (a later key
    # of the same op): keep one entry per signature, and only the latest few.
    handed[:] = [e for e in handed if not (e[1] == arch and e[0] == sig)][-(_HANDED_KEPT - 1):]
    handed.append((sig, arch, cubin))


def _arch_name(compute_capability):
    """The arch cuTile's own `_compile` would build for: "sm_90" for (9, 0); for None, what its
    get_compute_capability() answers."""
    if compute_capability is None:
        from cuda.tile._cext import get_compute_capability
        compute_capability = get_compute_capability()
    return "sm_%d%d" % tuple(compute_capability)


# ---------------------------------------------------------------------------------------------
# The pool. Messages both ways are one frame: an 8-byte length, then a pickle.

def _write_frame(f, obj):
    data = pickle.dumps(obj)
    f.write(struct.pack("<Q", len(data)) + data)
    f.flush()


def _read_exact(fd, n, deadline):
    """n bytes from fd, or None at end of file; TimeoutError past the deadline (None: none)."""
    parts, left = [], n
    while left:
        if deadline is not None:
            wait = deadline - time.monotonic()
            if wait <= 0 or not select.select([fd], [], [], wait)[0]:
                raise TimeoutError
        part = os.read(fd, min(left, 1 << 20))
        if not part:
            return None
        parts.append(part)
        left -= len(part)
    return b"".join(parts)


def _read_frame(fd, deadline=None):
    head = _read_exact(fd, 8, deadline)
    if head is None:
        return None
    body = _read_exact(fd, struct.unpack("<Q", head)[0], deadline)
    if body is None:
        raise EOFError("the worker closed its end mid-message")
    return pickle.loads(body)


class _Worker:
    """One compile process (`_WORKER_COMMAND`); it imports the compiler once and
    then compiles one job list per message until its input closes or it idles IDLE_EXIT_SEC.
    Its first message back says it is ready (`ready` once that has been read)."""

    def __init__(self, environ):
        self.compile_environ = _compile_environ(environ)
        # a process group of its own: kill() ends the compiler processes it started too
        self.proc = subprocess.Popen([*_WORKER_COMMAND, str(IDLE_EXIT_SEC)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     env=environ, start_new_session=True)
        self.last_used = time.monotonic()
        self.ready = False
        _workers.add(self)

    def fileno(self):
        return self.proc.stdout.fileno()

    def fresh(self, now, compile_environ):
        """Alive, not about to exit idle, and started with these compile settings (cuTile reads
        its cache folder once, at import)."""
        return (self.proc.poll() is None and compile_environ == self.compile_environ
                and now - self.last_used < IDLE_EXIT_SEC - _REUSE_MARGIN_SEC)

    def send(self, chunk, arch, timeout_sec):
        _write_frame(self.proc.stdin, (arch, timeout_sec, chunk))

    def receive(self, deadline):
        result = _read_frame(self.proc.stdout.fileno(), deadline)
        if result is None:
            raise EOFError("the worker exited")
        self.last_used = time.monotonic()
        return result

    def kill(self):
        """The worker and what it started (a tileiras run past its timeout would otherwise go on
        using a core)."""
        if self.proc.returncode is None:     # not reaped: its pid is still its group's id
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except OSError:           # already gone, or no process group to signal
                self.proc.kill()
        self.close()

    def close_pipes(self):
        for pipe in (self.proc.stdin, self.proc.stdout):
            try:
                pipe.close()
            except OSError:
                pass

    def close(self):
        """End of input: the worker exits; its pipes are closed here."""
        self.close_pipes()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _compile_environ(environ):
    """The variables a compile reads (cuTile's and the CUDA toolkit's settings, where caches,
    tools and modules are found); a change in any other (a training loop's own) keeps the
    workers."""
    return {k: v for k, v in environ.items()
            if k.startswith(("CUDA_TILE", "CUTILE", "TILEIRAS", "CUDA_"))
            or k in ("PATH", "HOME", "XDG_CACHE_HOME", "TMPDIR", "LD_LIBRARY_PATH", "PYTHONPATH")}


_idle = []
_idle_lock = threading.Lock()
_workers = weakref.WeakSet()     # every worker of this process, idle or at work


def _take(n):
    """n workers: idle ones first (no start-up), new ones for the rest."""
    environ = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    with _idle_lock:
        now = time.monotonic()
        fresh = [w for w in _idle if w.fresh(now, _compile_environ(environ))]
        stale = [w for w in _idle if w not in fresh]
        _idle[:] = fresh[n:]
        taken = fresh[:n]
    _end(stale)
    try:
        for _ in range(n - len(taken)):
            taken.append(_Worker(environ))
    except OSError as e:         # no process to start (fds, memory): fewer workers, maybe none
        log.warning("tiletune: could not start a precompile worker (%s); %d at work",
                    e.strerror or type(e).__name__, len(taken))
    return taken


def _give_back(workers):
    with _idle_lock:
        _idle.extend(workers)
        _schedule_reaper()


_reaper = None


def _schedule_reaper():
    """One timer at a time (under _idle_lock): the workers exit by themselves once idle, and
    are reaped then, not left as zombies until the next search."""
    global _reaper
    if _idle and (_reaper is None or not _reaper.is_alive()):
        _reaper = threading.Timer(IDLE_EXIT_SEC + _REUSE_MARGIN_SEC, _reap_exited)
        _reaper.daemon = True
        _reaper.start()


def _reap_exited():
    global _reaper
    with _idle_lock:
        exited = [w for w in _idle if w.proc.poll() is not None]
        _idle[:] = [w for w in _idle if w not in exited]
        _reaper = None
        _schedule_reaper()               # the workers still idle: looked at again later
    for w in exited:
        w.close()


def _end(workers, wait_sec=5.0):
    """End these workers all at once: their input closed and SIGTERM sent to each one's process
    group (a tileiras run it started ends with it), then the ones still there after `wait_sec`
    in all killed. (A closed input alone leaves one still importing to finish its imports first,
    seconds, and waiting for each in turn added up at the exit of a script that started them
    and ended early.)"""
    for w in workers:
        w.close_pipes()
        if w.proc.poll() is None:
            try:
                os.killpg(w.proc.pid, signal.SIGTERM)
            except OSError:
                w.proc.terminate()
    deadline = time.monotonic() + wait_sec
    for w in workers:
        try:
            w.proc.wait(timeout=max(deadline - time.monotonic(), 0))
        except subprocess.TimeoutExpired:
            w.kill()


@atexit.register
def _close_idle():
    with _idle_lock:
        workers, _idle[:] = list(_idle), []
    _end(workers)


def _forget_workers_in_child():
    """After a fork, in the child: the parent's workers are not the child's. Taking them would
    put its jobs and the parent's in one pipe (a result read by the wrong process: another
    config's cubin), and its copies of their pipes would keep them open after the parent
    closed them. Each copied pipe end is pointed at /dev/null before the workers are dropped
    (closing it would flush into the worker a frame the parent was writing, left in the copied
    buffer)."""
    global _idle_lock, _reaper
    workers = list(_workers)
    _workers.clear()
    _idle_lock, _reaper = threading.Lock(), None       # (another thread may have held it)
    try:
        null = os.open(os.devnull, os.O_RDWR)
    except OSError:                  # (no descriptor left) kept, never closed in this process
        _unusable_in_child.extend(workers)
        null = None
    if null is not None:
        for w in workers:
            for pipe in (w.proc.stdin, w.proc.stdout):
                try:
                    os.dup2(null, pipe.fileno())
                except (OSError, ValueError):           # (a pipe already closed)
                    pass
        os.close(null)
    _idle[:] = []


_unusable_in_child = []


os.register_at_fork(after_in_child=_forget_workers_in_child)


def warm(n=None):
    """Start the compile workers now (their imports run while the caller goes on), so the next
    search finds them ready."""
    if enabled():
        _give_back(_take(n or jobs()))


def _failed(worker, error):
    worker.kill()
    log.warning("tiletune: a precompile worker failed (%s); the search compiles its configs "
                "itself", type(error).__name__)


def _compile_here(next_job, results, arch, timeout_sec, compiled, workers_starting):
    """Compile jobs in this process until none is left or no worker is starting any more (then
    the workers take the rest: no more compiles at once than the pool has workers, for longer
    than the jobs in hand); their indices go to `compiled`. A job is taken once cuTile's lock is
    free (its tracing can start), so jobs do not queue behind it that a worker could take."""
    from cuda.tile._compile import _compiler_lock
    while True:
        with _compiler_lock:
            job = next_job() if workers_starting() else None
            if job is None:
                return
            i, *args = job
            results[i] = compile_job(*args, arch, timeout_sec)
        compiled.append(i)


def run_jobs(jobs_list, arch, timeout_sec, workers):
    """Compile [(index, module, name, hints, params, cc code)] in `workers` worker processes,
    one job at a time to whichever is free; while any of them is still starting, threads of
    this process compile jobs too, one for each starting worker (their tileiras runs overlap:
    `tileiras_outside_the_lock`). Returns {index: compile_job's result}; jobs whose worker
    failed are missing."""
    pool = _take(workers)
    if not pool:                 # the search compiles every config itself
        return {}
    todo, taking = list(reversed(jobs_list)), threading.Lock()

    def next_job():
        with taking:
            return todo.pop() if todo else None

    results, busy, done = {}, {}, []      # busy: worker -> deadline of its job or its start
    t0, compiled_here, ready_after = time.monotonic(), [], []
    starting = sum(not w.ready for w in pool)

    def give(w):
        job = next_job()
        if job is None:
            done.append(w)
            return
        try:
            w.send([job], arch, timeout_sec)
            busy[w] = time.monotonic() + timeout_sec + 60
        except Exception as e:       # worker trouble is not a verdict on the configs
            _failed(w, e)

    started = time.monotonic() + _START_SEC
    for w in pool:
        if w.ready:
            give(w)
        else:
            busy[w] = started
    threads, first = [], True
    try:
        while True:
            if not todo:                 # those still starting are not waited for
                for w in [w for w in busy if not w.ready]:
                    done.append(w)
                    del busy[w]
            if not busy:
                break
            wait = 0 if first else max(min(busy.values()) - time.monotonic(), 0)
            if any(t.is_alive() for t in threads):
                wait = min(wait, 0.05)   # to see the job list run out while workers start
            readable = select.select(list(busy), [], [], wait)[0]
            now = time.monotonic()
            for w in readable or [w for w, d in busy.items() if d <= now]:
                deadline = busy.pop(w)
                try:
                    if not readable:
                        raise TimeoutError
                    message = w.receive(deadline)
                except Exception as e:   # worker trouble is not a verdict on the configs
                    _failed(w, e)
                    continue
                if w.ready:
                    results.update(message)
                else:
                    ready_after.append(time.monotonic() - t0)
                w.ready = True
                give(w)
            if first and todo and not all(w.ready for w in busy):
                count = sum(not w.ready for w in busy) if tileiras_outside_the_lock() else 1
                for _ in range(min(count, len(todo))):
                    threads.append(threading.Thread(target=_compile_here, daemon=True, args=(
                        next_job, results, arch, timeout_sec, compiled_here,
                        lambda: not all(w.ready for w in pool))))
                    threads[-1].start()
            first = False
    except BaseException:        # (Ctrl-C) the jobs in flight go with their workers, and
        with taking:             # this process's threads take no further job
            todo.clear()
        _end([w for w in pool if w not in done])
        _give_back(done)
        raise
    for t in threads:
        t.join()
    _give_back(done)
    log.debug("compile jobs: %d of %d in this process; of %d workers, %d were starting, ready "
              "after %s s", len(compiled_here), len(jobs_list), len(pool), starting,
              " ".join(f"{t:.1f}" for t in ready_after))
    return results


def precompile(items, arch, timeout_sec):
    """items: [(bare kernel, hints dict, launch args, the kernel object that will launch)].
    Compiles them in parallel into the disk cache. Returns ({index: (error type, message)} for
    items the compiler rejected, {index: (signature, Cubin)} for the ones compiled); items that
    cannot be located or signed are left for the search to compile, and items whose kernel
    object has compiled the signature already are left to its JIT cache (a later key of the
    same signatures: tracing them again to find them in the disk cache took 0.05-0.1 s a
    config, one at a time where this process compiles)."""
    from cuda.tile.compilation import CallingConvention, KernelSignature
    v2 = CallingConvention.cutile_python_v2()       # reads every kind of argument
    t0 = time.perf_counter()
    work, sigs = [], {}
    for i, (kernel, hints, args, launching) in enumerate(items):
        where = kernel_location(kernel)
        if where is None:
            continue
        try:
            sig = launch_signature(KernelSignature.from_kernel_args(kernel, args, v2).parameters)
        except Exception:         # an argument the signature reader does not know: JIT decides
            continue
        if compiled_already(launching, sig, arch):
            continue
        sigs[i] = sig
        work.append((i, *where, hints, sig.parameters, sig.calling_convention.code,
                     code_digest(kernel)))
    if not work:
        return {}, {}
    results = run_jobs(work, arch, timeout_sec, min(jobs(), len(work)))
    rejected = {i: r[:2] for i, r in results.items() if isinstance(r, tuple) and r[2]}
    compiled = {i: (sigs[i], r) for i, r in results.items() if isinstance(r, Cubin)}
    log.info("precompiled %d of %d configs for %s in %.1fs (%d rejected)", len(results),
             len(items), arch, time.perf_counter() - t0, len(rejected))
    return rejected, compiled


def _warm_up_compiler():
    """cuTile's compile module, and what it finds out on a process's first compile and then
    keeps (the tileiras version, the bytecode versions it takes: tileiras runs of their own),
    loaded before the worker says it is ready: 0.2-0.3 s off its first job on a 2-core CPU
    host. Private cuTile functions, so any failure only leaves that to the first job."""
    try:
        from cuda.tile import _compile
        from cuda.tile._cext import default_tile_context
        _compile._get_compiler_version_string()
        _compile._tileiras_supports_remarks(default_tile_context.config.temp_dir)
    except Exception:
        pass


def _serve(idle_exit_sec):
    """The worker: compile each message's jobs and answer with their results."""
    result_pipe, sys.stdout = sys.stdout.buffer, sys.stderr   # stray prints must not corrupt it
    import cuda.tile.compilation  # noqa: F401  (the compiler loads before the first job)
    import torch  # noqa: F401
    _warm_up_compiler()
    _write_frame(result_pipe, "ready")
    fd = sys.stdin.buffer.fileno()
    while True:
        try:
            message = _read_frame(fd, time.monotonic() + idle_exit_sec)
        except TimeoutError:
            return
        if message is None:
            return
        arch, timeout_sec, chunk = message
        _write_frame(result_pipe, {i: compile_job(*job, arch, timeout_sec) for i, *job in chunk})
