import cuda.tile as ct
import pytest

from tiletune import device, store


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
