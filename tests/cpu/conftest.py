import signal
import threading

import cuda.tile as ct
import pytest

from tiletune import device, store, timing


COMPILE_TESTS = ("test_every_config_compiles", "test_each_kernel_compiles_for_other_archs")
_compiling = []      # the test module whose compiles started


@pytest.hookimpl(trylast=True)       # after -k and --deselect have chosen the items
def pytest_collection_modifyitems(items):
    """The AOT compile tests run last, their compiles started now (test_aot_compile.py)."""
    compiling = [item for item in items if getattr(item, "originalname", None) in COMPILE_TESTS]
    if not compiling:
        return
    items[:] = [item for item in items if item not in compiling] + compiling
    _compiling.append(compiling[0].module)
    _compiling[0].start_compiles(
        [(item.originalname, item.callspec.params["op"]) for item in compiling])


def pytest_unconfigure(config):
    """Drop the compiles no test waited for (a run stopped early)."""
    for module in _compiling:
        module.stop_compiles()


@pytest.fixture(autouse=True)
def local_store_folders(monkeypatch, tmp_path_factory):
    """Every store folder reads as local: the CPU tests count the store's warnings, and a
    machine whose temp folder sits on a network filesystem would add one. The test of that
    warning names its own mount table."""
    table = tmp_path_factory.getbasetemp() / "mounts"
    if not table.exists():
        table.write_text("rootfs / ext4 rw 0 0\n")
    monkeypatch.setattr(store, "MOUNTS", str(table))


@pytest.fixture
def launches(monkeypatch):
    """ct.launch stubbed: each launch, which must be on the current stream, appends (grid,
    kernel, args); a 132-SM sm_90 device."""
    calls = []

    def launch(stream, grid, kernel, args):
        assert stream == "stream", "launched on another stream than the current one"
        calls.append((grid, kernel, args))
    monkeypatch.setattr(ct, "launch", launch)
    monkeypatch.setattr(device, "current_stream", lambda dev: "stream")
    monkeypatch.setattr(device, "sm_count", lambda dev: 132)
    monkeypatch.setattr(device, "arch", lambda dev=None: "sm_90")
    return calls


@pytest.fixture
def ctrl_c():
    """ctrl_c(seconds): a SIGINT to this process's main thread after that long, raised there as
    KeyboardInterrupt also where the tests run as a background job (which starts with SIGINT
    ignored, so Python installs no handler for it); a signal not yet sent when the test ends is
    dropped."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timers = []

    def after(seconds):
        timer = threading.Timer(seconds, signal.pthread_kill,
                                (threading.main_thread().ident, signal.SIGINT))
        timers.append(timer)
        timer.start()
    yield after
    for timer in timers:
        timer.cancel()
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def clock(monkeypatch):
    """Timing on a FakeClock (tests/cpu/stand_ins.py): events, synchronize and the L2 flush
    stood in for; a row's host time per call is 1 us (the real clock would time the fake
    calls: no row is host-bound unless a test makes it so)."""
    import torch
    from tests.cpu.stand_ins import FakeClock
    from tiletune import bench
    c = FakeClock()
    monkeypatch.setattr(torch.cuda, "Event", c.event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(timing, "_flush_l2", lambda: None)
    monkeypatch.setattr(timing, "_flush_times", {})
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(bench, "host_us_behind", lambda fn: 1.0)
    return c
