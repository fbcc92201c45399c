import cuda.tile as ct
import pytest

from tiletune import device


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
