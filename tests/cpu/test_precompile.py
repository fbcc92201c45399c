"""Parallel precompile (tiletune/precompile.py) with the real compiler in real worker processes:
a compile lands in cuTile's disk cache, a kernel the compiler rejects comes back as a verdict."""
import pytest
import torch
from cutile_cache._cache import cache_entries

import tiletune
from tiletune import precompile
from tiletune.aot import F32, jit_array
from tiletune.ops import rms_norm as R


def fwd_params(tile_n):
    bf = torch.bfloat16
    return [jit_array(bf, (64, 4096)), jit_array(bf, (4096,)), jit_array(bf, (64, 4096)),
            jit_array(torch.float32, (64,)), F32, F32, 1, tile_n]


def cache_in(monkeypatch, path):
    """cuTile's disk cache in `path`, for the workers (which read the variable when they
    start) and for this process's own compiles (cuTile read it here at import)."""
    from cuda.tile._cext import default_tile_context
    monkeypatch.setenv("CUDA_TILE_CACHE_DIR", str(path))
    monkeypatch.setattr(default_tile_context.config, "cache_dir", str(path))


def test_kernel_location_finds_module_kernels_only():
    assert precompile.kernel_location(R.rms_norm_fwd_rows) == ("tiletune.ops.rms_norm",
                                                               "rms_norm_fwd_rows")
    assert precompile.kernel_location(R.rms_norm_fwd_rows.replace_hints(occupancy=2)) is None


def test_enabled_follows_jobs_and_disk_cache(monkeypatch):
    monkeypatch.setenv("TILETUNE_COMPILE_JOBS", "1")
    assert not precompile.enabled()
    monkeypatch.setenv("TILETUNE_COMPILE_JOBS", "4")
    monkeypatch.setenv("CUDA_TILE_CACHE_DIR", "off")
    assert not precompile.enabled()
    # the default: the CPUs this process may run on (taskset, cpusets), at most 16
    monkeypatch.delenv("TILETUNE_COMPILE_JOBS")
    monkeypatch.setattr(precompile.os, "sched_getaffinity", lambda pid: {3}, raising=False)
    assert precompile.jobs() == 1
    monkeypatch.setattr(precompile.os, "sched_getaffinity", lambda pid: set(range(64)),
                        raising=False)
    assert precompile.jobs() == 16


def test_a_worker_compiles_only_the_code_the_caller_imported(monkeypatch, tmp_path):
    """A job carries the digest of the caller's kernel code: a worker that imports other code
    under that name (another module first on its path, a source edited since) answers with no
    verdict, and the caller compiles the config itself."""
    cache_in(monkeypatch, tmp_path)
    job = (0, "tiletune.ops.rms_norm", "rms_norm_fwd_rows", {"occupancy": 2}, fwd_params(4096),
           "t2", "0" * 64)
    etype, msg, verdict = precompile.compile_job(*job[1:], "sm_90", 120)
    assert etype == "CodeMismatch" and not verdict and "rms_norm_fwd_rows" in msg
    digest = precompile.code_digest(R.rms_norm_fwd_rows)
    assert digest == precompile.code_digest(R.rms_norm_fwd_rows.replace_hints(occupancy=4))
    assert digest != precompile.code_digest(R.rms_norm_fwd_chunked)


def test_workers_fill_the_disk_cache_and_report_rejections(monkeypatch, tmp_path):
    cache_in(monkeypatch, tmp_path)
    job = lambda i, tile_n: (i, "tiletune.ops.rms_norm", "rms_norm_fwd_rows", {"occupancy": 2},
                             fwd_params(tile_n), "t2", precompile.code_digest(R.rms_norm_fwd_rows))
    res = precompile.run_jobs([job(0, 4096), job(1, 4095), job(2, 2048)], "sm_90", 120, 2)
    assert isinstance(res[0], precompile.Cubin) and isinstance(res[2], precompile.Cubin)
    assert res[0].data[:4] == b"\x7fELF" and res[0].symbol.startswith("rms_norm_fwd_rows")
    assert len(list(cache_entries(str(tmp_path)))) == 2       # the two cubins, in cuTile's cache
    etype, msg, verdict = res[1]          # not a power of two: the compiler's verdict
    assert verdict and "power of two" in msg, (etype, msg)


def ok(results):
    """The jobs that came back compiled."""
    return {i for i, r in results.items() if isinstance(r, precompile.Cubin)}


def _job(i, tile_n):
    return (i, "tiletune.ops.rms_norm", "rms_norm_fwd_rows", {"occupancy": 1}, fwd_params(tile_n),
            "t2", precompile.code_digest(R.rms_norm_fwd_rows))


def test_workers_stay_for_the_next_search_in_the_same_environment(monkeypatch, tmp_path):
    """The second call reuses the first call's processes (no start-up), also after a variable
    compiles do not read changed; after a compile setting changes (here cuTile's cache folder,
    which it reads once at import) new ones start."""
    first, second = tmp_path / "a", tmp_path / "b"
    cache_in(monkeypatch, first)
    assert ok(precompile.run_jobs([_job(0, 1024), _job(1, 512)], "sm_90", 120, 2)) == {0, 1}
    pids = {w.proc.pid for w in precompile._idle}
    assert ok(precompile.run_jobs([_job(0, 256), _job(1, 128)], "sm_90", 120, 2)) == {0, 1}
    assert len(pids) >= 2 and pids <= {w.proc.pid for w in precompile._idle}
    monkeypatch.setenv("SOME_TRAINING_FLAG", "1")     # not a compile setting: same workers
    assert ok(precompile.run_jobs([_job(0, 256)], "sm_90", 120, 1)) == {0}
    assert pids <= {w.proc.pid for w in precompile._idle}
    assert len(list(cache_entries(str(first)))) == 4
    cache_in(monkeypatch, second)
    assert ok(precompile.run_jobs([_job(0, 64)], "sm_90", 120, 1)) == {0}
    assert len(list(cache_entries(str(second)))) == 1
    assert not pids & {w.proc.pid for w in precompile._idle if w.compile_environ["CUDA_TILE_CACHE_DIR"]
                       == str(second)}


def test_started_workers_serve_the_next_search(monkeypatch, tmp_path):
    """tiletune.start_compile_workers starts them ahead (idle, ready): the next search takes those
    processes instead of starting its own. Where parallel compiles are off it starts none; a
    bad count is refused."""
    cache_in(monkeypatch, tmp_path)
    monkeypatch.setenv("TILETUNE_COMPILE_JOBS", "2")
    precompile._close_idle()
    tiletune.start_compile_workers()
    pids = {w.proc.pid for w in precompile._idle}
    assert len(pids) == 2
    assert ok(precompile.run_jobs([_job(0, 1024), _job(1, 512)], "sm_90", 120, 2)) == {0, 1}
    assert pids == {w.proc.pid for w in precompile._idle}
    precompile._close_idle()
    monkeypatch.setenv("TILETUNE_COMPILE_JOBS", "0")
    tiletune.start_compile_workers()
    assert not precompile._idle
    with pytest.raises(ValueError, match="start_compile_workers: n must be at least 1"):
        tiletune.start_compile_workers(0)
    with pytest.raises(TypeError, match="start_compile_workers: n must be an int"):
        tiletune.start_compile_workers("4")


def test_this_process_compiles_while_the_workers_start(monkeypatch, tmp_path):
    """A started worker takes seconds to import before its first job; meanwhile the searching
    process compiles jobs itself, and a search whose jobs are all done by then does not wait
    for it. Once ready, it serves the next search. Here the worker starts 5 s late."""
    import select
    import time
    cache_in(monkeypatch, tmp_path)
    precompile._close_idle()
    monkeypatch.setattr(precompile, "_WORKER_COMMAND",
                        ("sh", "-c", 'sleep 5; exec "$0" "$@"', *precompile._WORKER_COMMAND))
    t0 = time.monotonic()
    assert ok(precompile.run_jobs([_job(0, 1024), _job(1, 512)], "sm_90", 120, 1)) == {0, 1}
    assert time.monotonic() - t0 < 5
    (worker,) = precompile._idle
    assert not worker.ready and worker.proc.poll() is None
    assert select.select([worker], [], [], 60)[0]          # its imports done
    assert ok(precompile.run_jobs([_job(0, 256)], "sm_90", 120, 1)) == {0}
    assert worker.ready and precompile._idle == [worker]
    assert len(list(cache_entries(str(tmp_path)))) == 3
    import os                                  # it yields the CPU to this process
    assert os.getpriority(os.PRIO_PROCESS, worker.proc.pid) == min(
        os.getpriority(os.PRIO_PROCESS, 0) + precompile.WORKER_NICENESS, 19)
    precompile._close_idle()


def test_killing_a_worker_ends_the_processes_it_started(monkeypatch):
    """A worker is killed at its deadline (a compile past its timeout): the compiler process it
    started goes too, instead of running on and taking a core from the next compiles. (The
    worker here is a shell that starts a long child, as a compile starts tileiras.)"""
    import os
    import subprocess
    import time
    popen = subprocess.Popen
    monkeypatch.setattr(precompile.subprocess, "Popen", lambda cmd, **kw: popen(
        ["sh", "-c", "sleep 60 & echo $!; wait"], **kw))
    worker = precompile._Worker(dict(os.environ))
    assert os.getpgid(worker.proc.pid) == worker.proc.pid        # a process group of its own
    child = int(worker.proc.stdout.readline())
    worker.kill()
    for _ in range(100):                                          # gone within a second
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{child}/stat") as f:                    # a zombie until reaped
            if f.read().split()[2] == "Z":
                break
        time.sleep(0.01)
    else:
        raise AssertionError("the worker's child outlived it")
    assert worker.proc.poll() is not None


def test_workers_that_exit_idle_are_reaped_without_another_search(monkeypatch, tmp_path):
    """An idle worker exits after IDLE_EXIT_SEC; it is reaped then, not left a zombie until the
    process's next search."""
    import time
    cache_in(monkeypatch, tmp_path)
    precompile._close_idle()
    if precompile._reaper is not None:       # one scheduled by an earlier search, 130 s away
        precompile._reaper.cancel()
    monkeypatch.setattr(precompile, "_reaper", None)
    monkeypatch.setattr(precompile, "IDLE_EXIT_SEC", 1.0)
    monkeypatch.setattr(precompile, "_REUSE_MARGIN_SEC", 0.5)
    assert ok(precompile.run_jobs([_job(0, 64)], "sm_90", 120, 1)) == {0}
    (worker,) = precompile._idle
    for _ in range(100):
        if not precompile._idle:
            break
        time.sleep(0.1)
    assert precompile._idle == [] and worker.proc.returncode is not None     # exited, reaped


def test_a_dead_or_idle_worker_is_replaced(monkeypatch, tmp_path):
    cache_in(monkeypatch, tmp_path)
    precompile.run_jobs([_job(0, 64)], "sm_90", 120, 1)
    worker = precompile._idle[-1]
    worker.proc.kill()
    worker.proc.wait()
    for w in precompile._idle:                 # and the others look idle for too long
        w.last_used -= precompile.IDLE_EXIT_SEC
    assert ok(precompile.run_jobs([_job(0, 32)], "sm_90", 120, 1)) == {0}
    assert worker not in precompile._idle and len(precompile._idle) == 1


def test_workers_that_cannot_start_leave_the_search_to_compile(monkeypatch, tmp_path, caplog):
    """A worker process that cannot start (out of fds or memory) is no crash: the jobs go to
    the workers that did start, and with none the search compiles every config itself."""
    cache_in(monkeypatch, tmp_path)
    precompile._close_idle()

    def refused(environ):
        raise OSError(24, "Too many open files")
    monkeypatch.setattr(precompile, "_Worker", refused)
    assert precompile.run_jobs([_job(0, 64), _job(1, 32)], "sm_90", 120, 2) == {}
    assert "could not start a precompile worker (Too many open files); 0 at work" in caplog.text


def test_launch_signature_uses_the_launch_calling_convention():
    """ct.launch compiles under cutile_python_v1 unless a parameter needs v2 (a dim of constant
    size): the convention is in the disk-cache key, so the precompile must pick the same one."""
    plain = precompile.launch_signature(fwd_params(4096))
    assert plain.calling_convention.code == "t1"
    one_row = [jit_array(torch.bfloat16, (1, 4096))] + fwd_params(4096)[1:]
    assert precompile.launch_signature(one_row).calling_convention.code == "t2"


def test_every_size_1_dim_is_a_constant_whatever_its_stride():
    """As ct.launch compiles it (read under cutile_python_v2 on an H100): a (1,) buffer, the
    trailing dim of a (M, 1) column and the leading dim of a (1, N) row are constant 1, other
    dims are not; any such array makes the launch use v2."""
    assert jit_array(torch.float32, (1,)).shape_constant == (1,)
    assert jit_array(torch.int32, (1,)).shape_constant == (1,)
    assert jit_array(torch.float32, (7, 1)).shape_constant == (None, 1)
    assert jit_array(torch.float32, (1, 8)).shape_constant == (1, None)
    assert jit_array(torch.float32, (1, 8), (32, 1)).shape_constant == (1, None)
    assert jit_array(torch.float32, (4, 8)).shape_constant == (None, None)
    amax = [jit_array(torch.bfloat16, (64, 64)), jit_array(torch.int32, (1,))]
    assert precompile.launch_signature(amax).calling_convention.code == "t2"


def test_a_handed_cubin_is_loaded_once_for_its_signature_and_arch(monkeypatch):
    """hand_over: the kernel object's next compile of that signature for that arch returns the
    worker's cubin; another signature, another arch or a second compile goes to cuTile."""
    from cuda.tile.compilation import CallingConvention, KernelSignature
    kernel = R.rms_norm_fwd_rows.replace_hints(occupancy=1)
    asked = []
    kernel._compile = lambda sig, ctx, cc=None: asked.append((sig, cc)) or ("compiled",)
    sig = lambda n: KernelSignature(fwd_params(n), CallingConvention.cutile_python_v1())
    precompile.hand_over(kernel, sig(1024), "sm_90", precompile.Cubin("sym", b"cubin"))
    assert kernel._compile(sig(1024), None, (10, 0)) == ("compiled",)      # another arch
    assert kernel._compile(sig(2048), None, (9, 0)) == ("compiled",)       # another signature
    assert kernel._compile(sig(1024).with_symbol("x"), None, (9, 0)) == (b"cubin", "sym", None,
                                                                         ())
    assert kernel._compile(sig(1024), None, (9, 0)) == ("compiled",)       # handed once
    assert len(asked) == 3
    for n in (64, 128, 256, 512, 1024, 1024):     # one entry per signature, the latest few
        precompile.hand_over(kernel, sig(n), "sm_90", precompile.Cubin(str(n), b""))
    assert [c.symbol for _, _, c in kernel._tiletune_jit.handed] == ["128", "256", "512", "1024"]


def test_signatures_a_kernel_object_compiled_are_not_precompiled_again(monkeypatch):
    """A later key with the same signatures (another size, same alignment) finds them in the
    kernel objects' own JIT caches: the precompile leaves those configs out, whether their
    object compiled them itself or loaded a handed cubin."""
    from types import SimpleNamespace
    from cuda.tile.compilation import KernelSignature
    sent = []
    monkeypatch.setattr(precompile, "run_jobs", lambda work, *a: sent.append(
        [w[0] for w in work]) or {})
    monkeypatch.setattr(KernelSignature, "from_kernel_args", lambda kernel, args, cc: (
        SimpleNamespace(parameters=fwd_params(args))))        # what it reads off CUDA tensors
    bare = R.rms_norm_fwd_rows
    objects = [bare.replace_hints(occupancy=o) for o in (1, 2, 3)]
    for k in objects:
        k._compile = lambda sig, ctx, cc=None: ("compiled",)
        precompile.track(k)
    items = [(bare, {"occupancy": o}, 4096, k) for o, k in zip((1, 2, 3), objects)]
    sig = precompile.launch_signature(fwd_params(4096))
    precompile.hand_over(objects[0], sig, "sm_90", precompile.Cubin("sym", b"cubin"))
    objects[0]._compile(sig.with_symbol("a"), None, (9, 0))        # loads the handed cubin
    objects[1]._compile(sig.with_symbol("b"), None, (9, 0))        # compiles it itself
    objects[2]._compile(sig.with_symbol("c"), None, (10, 0))       # for another arch
    assert precompile.compiled_already(objects[0], sig, "sm_90")
    assert not precompile.compiled_already(objects[2], sig, "sm_90")
    precompile.precompile(items, "sm_90", 120)
    assert sent == [[2]]


def test_tileiras_runs_outside_cutiles_compile_lock(monkeypatch, tmp_path):
    """Where this process compiles in threads, cuTile's compile lock (held twice here, as
    `_compile_here` and cuTile's compile_tile take it) is free while tileiras runs, so another
    thread can trace meanwhile, and held again afterwards at the same depth."""
    import threading
    from cuda.tile import _compile
    from cuda.tile._compiler_options import CompilerOptions
    assert precompile.tileiras_outside_the_lock()
    lock, free_meanwhile = _compile._compiler_lock, []

    def another_thread_takes_the_lock():
        if lock.acquire(timeout=5):
            lock.release()
            free_meanwhile.append(True)

    class Tileiras:
        def run(self, args, flags, timeout_sec):
            t = threading.Thread(target=another_thread_takes_the_lock)
            t.start()
            t.join()
    monkeypatch.setattr(_compile, "_find_compiler_bin", Tileiras)
    with lock, lock:
        _compile.compile_cubin(str(tmp_path / "k.bytecode"), CompilerOptions(), "sm_90", 60)
        assert lock._is_owned()
    _compile.compile_cubin(str(tmp_path / "k.bytecode"), CompilerOptions(), "sm_90", 60)
    assert free_meanwhile == [True, True]


def test_this_process_stops_taking_jobs_once_every_worker_is_ready(monkeypatch):
    """The searching process's compile threads stand in for starting workers only: once every
    worker is ready they leave the remaining jobs to the workers, so no more compiles run at
    once than the pool has workers."""
    jobs = [(i, "module", "name") for i in range(4)]
    starting = iter([True, True, False])
    compiled, results, here = [], {}, []
    monkeypatch.setattr(precompile, "compile_job", lambda *args: compiled.append(args) or "ok")
    precompile._compile_here(lambda: jobs.pop(0) if jobs else None, results, "sm_90", 120, here,
                             lambda: next(starting))
    assert here == [0, 1] and results == {0: "ok", 1: "ok"} and len(jobs) == 2
    assert compiled == [("module", "name", "sm_90", 120)] * 2


def test_exit_ends_idle_workers_without_waiting_for_their_imports(monkeypatch):
    """At exit (`_close_idle`, registered with atexit) the idle workers end at once: they have
    no job. Workers still importing (here processes that read no input for a minute) do not
    hold up the exit of a script that started them and ended early."""
    import os
    import time
    precompile._close_idle()
    monkeypatch.setattr(precompile, "_WORKER_COMMAND", ("sleep", "60"))
    workers = [precompile._Worker(dict(os.environ)) for _ in range(2)]
    precompile._give_back(workers)
    t0 = time.monotonic()
    precompile._close_idle()
    assert time.monotonic() - t0 < 2
    assert not precompile._idle and all(w.proc.poll() is not None for w in workers)


def test_an_ended_worker_takes_the_compiler_it_started_with_it(monkeypatch, tmp_path):
    """A worker ended in the middle of a job (an interrupted search) ends the tileiras run it
    started too: both are in the worker's process group, which gets the signal."""
    import os
    import time
    precompile._close_idle()
    pid_file = tmp_path / "child"
    monkeypatch.setattr(precompile, "_WORKER_COMMAND", (
        "sh", "-c", f"sleep 60 & echo $! > {pid_file}; wait"))
    worker = precompile._Worker(dict(os.environ))
    deadline = time.monotonic() + 10
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline
        time.sleep(0.01)
    child = int(pid_file.read_text())
    precompile._end([worker])
    deadline = time.monotonic() + 5
    while True:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{child}/stat") as f:      # a zombie left for init to reap is gone
            if f.read().split(") ")[-1].startswith("Z"):
                break
        assert time.monotonic() < deadline, "the worker's child outlived it"
        time.sleep(0.02)


@pytest.mark.parametrize("state", ["importing", "ready"])
def test_ended_workers_leave_no_temporary_folder(state, monkeypatch, tmp_path):
    """A worker ended at exit, still importing or ready, exits through Python, whose atexit
    handlers remove the temporary folder cuTile made at its import (which holds the bytecode
    of its compiles): a SIGKILL leaves that folder behind."""
    import os
    import select
    import sys
    import time
    precompile._close_idle()
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    worker = precompile._Worker(dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path
                                                                            if p)))
    deadline = time.monotonic() + 60
    while not os.listdir(tmp_path):                 # cuTile imported: its folder is there
        assert time.monotonic() < deadline and worker.proc.poll() is None
        time.sleep(0.02)
    if state == "ready":
        assert select.select([worker], [], [], 60)[0]
    precompile._give_back([worker])
    t0 = time.monotonic()
    precompile._close_idle()
    assert time.monotonic() - t0 < 4 and worker.proc.returncode is not None
    assert os.listdir(tmp_path) == []


def test_a_forked_child_neither_takes_nor_keeps_the_parents_workers(monkeypatch):
    """A child forked after the workers started (a multiprocessing process per GPU, a data
    loader) does not take them for its own searches, whose jobs and results would cross the
    parent's in one pipe, and its copies of their pipes do not keep a worker alive once the
    parent closes its input. (The worker here is a process that ends at the end of its input.)"""
    import os
    import time
    precompile._close_idle()
    monkeypatch.setattr(precompile, "_WORKER_COMMAND", ("sh", "-c", "cat > /dev/null"))
    worker = precompile._Worker(dict(os.environ))
    precompile._give_back([worker])
    answer, tell = os.pipe()
    child = os.fork()
    if child == 0:                                   # the child: says what it holds, then waits
        try:
            os.write(tell, b"none" if not precompile._idle else b"some")
            time.sleep(10)
        finally:
            os._exit(0)
    try:
        os.close(tell)
        assert os.read(answer, 4) == b"none"
        assert precompile._idle == [worker]          # the parent's are the parent's
        worker.proc.stdin.close()
        assert worker.proc.wait(timeout=3) == 0
    finally:
        os.close(answer)
        os.kill(child, 9)
        os.waitpid(child, 0)
        precompile._close_idle()


def test_an_interrupted_search_ends_its_workers_and_compiles_no_further_job(monkeypatch,
                                                                            ctrl_c):
    """Ctrl-C during a search's precompile: the workers it had are ended (none is left to write
    a result nobody reads) and this process's compile threads take no further job. (The
    workers here never get ready, so the threads compile.)"""
    import time
    precompile._close_idle()
    monkeypatch.setattr(precompile, "_WORKER_COMMAND", ("sleep", "60"))
    made = []

    class Worker(precompile._Worker):
        def __init__(self, environ):
            super().__init__(environ)
            made.append(self)
    monkeypatch.setattr(precompile, "_Worker", Worker)
    compiled = []
    monkeypatch.setattr(precompile, "compile_job",
                        lambda *args: compiled.append(args) or time.sleep(0.2) or "ok")
    ctrl_c(0.5)
    with pytest.raises(KeyboardInterrupt):
        precompile.run_jobs([(i, "module", "name") for i in range(40)], "sm_90", 120, 2)
    assert len(made) == 2 and all(w.proc.poll() is not None for w in made)
    time.sleep(0.5)                    # the job a thread had in hand ends; none starts after it
    n = len(compiled)
    time.sleep(0.5)
    assert len(compiled) == n < 10 and not precompile._idle
