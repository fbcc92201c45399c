"""What CPU tests stand in for the GPU with, shared by the test modules that need it."""
import contextlib
import os
import threading
import time
import warnings

import torch

from tiletune import autotune, device, precompile


def resolve_misses_to_default(monkeypatch, kernel):
    """A miss resolves to the shape's first (default) config, with kernel(tuner, dev) as its
    stand-in kernel; no search, no store."""
    def resolve(self, key, dev, inputs, use_store=True):
        cfg = self.config_list("sm_90", self._space(*inputs))[0]
        return self.cache.setdefault(key, (cfg, kernel(self, dev)))
    monkeypatch.setattr(autotune.Autotuner, "_resolve", resolve)


def stand_in_gpu(monkeypatch, store_dir, gpu_name):
    """An sm_90 device named gpu_name on the current stream "stream", a fresh store in
    store_dir, autotuning on, no precompile workers (tests opt in). ct.launch, the search and
    the final round are each test's own."""
    monkeypatch.setenv("TILETUNE_CACHE_DIR", str(store_dir))
    monkeypatch.delenv("DISABLE_AUTOTUNE", raising=False)
    monkeypatch.setattr(device, "arch", lambda d=None: "sm_90")
    monkeypatch.setattr(device, "gpu_name", lambda d: gpu_name)
    monkeypatch.setattr(device, "uuid", lambda d: f"GPU-stand-in-{d}")
    monkeypatch.setattr(device, "current_stream", lambda dev: "stream")
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *a, **k: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(precompile, "enabled", lambda: False)


def kernel_rows(a):
    """An array as the kernels' `as_rows` (ops/rows.py) views it: (M, N) rows spaced by its
    second-last stride, whatever its leading dims. A 1-D array has no such view."""
    assert a.dim() >= 2, f"a {a.dim()}-D array reached a kernel that views its arrays as rows"
    N = a.shape[-1]
    M = a.numel() // N if N else 0
    return a.as_strided((M, N), (a.stride(-2), a.stride(-1)))


def fork(child, from_thread=False):
    """fork() (from a thread of its own where from_thread: as a DataLoader worker starts while
    the caller is busy); the child runs child() and exits with the int it returns (3 where it
    raises). Returns the child's pid."""
    pids = []

    def forker():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)   # (3.12: fork of threads)
            pid = os.fork()
        if pid == 0:
            code = 3
            try:
                code = child()
            finally:
                os._exit(code)
        pids.append(pid)
    if from_thread:
        th = threading.Thread(target=forker)
        th.start()
        th.join()
    else:
        forker()
    return pids[0]


def wait_child(pid, limit=20.0):
    """The child's exit code, or None where it ran past `limit` (then killed): a hang fails the
    test instead of the suite."""
    deadline = time.monotonic() + limit
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.02)
    if done[0] == 0:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        return None
    return os.waitstatus_to_exitcode(done[1])


class FakeClock:
    """torch.cuda.Event on a clock that only `run(label, us)` moves: a candidate's time is
    what it says it took; `trace` lists the runs in order."""

    def __init__(self):
        self.now_ms = 0.0
        self.trace = []

    def event(self, enable_timing=True):
        clock = self

        class Event:
            def record(self):
                self.t = clock.now_ms

            def elapsed_time(self, end):
                return end.t - self.t
        return Event()

    def run(self, label, us):
        self.trace.append(label)
        self.now_ms += us / 1e3
