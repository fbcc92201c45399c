"""The bench's row logic on a fake clock: candidates timed in turns, fixed runs under
DISABLE_AUTOTUNE with the default kernels kept, a failing baseline reported and not fatal."""
import os

import pytest
import torch

from tiletune import bench, timing


class FakeClock:
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


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(torch.cuda, "Event", c.event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(timing, "_flush_l2", lambda: None)
    return c


def test_run_case_times_every_candidate_in_turns(clock):
    def ours():       # the fixed default is slower than the tuned config
        fixed = os.environ.get("DISABLE_AUTOTUNE") == "1"
        clock.run("fixed" if fixed else "tuned", 30.0 if fixed else 20.0)

    def broken():
        raise RuntimeError("no kernel")

    case = bench.BenchCase("op", "shape", "fwd", ours,
                           {"peer": lambda: clock.run("peer", 25.0), "broken": broken},
                           flops=2e6, ceiling=("copy", lambda: clock.run("copy", 10.0)),
                           ceiling_scale=2.0)
    row = bench.run_case(case)
    assert row["tuned_us"] == pytest.approx(20.0)
    assert row["fixed_us"] == pytest.approx(30.0)
    assert row["speedup_over_fixed"] == pytest.approx(1.5)
    assert row["vs_peer"] == pytest.approx(25.0 / 20.0)
    assert row["broken_error"] == "RuntimeError: no kernel"
    assert row["copy_us"] == pytest.approx(20.0) and row["frac_copy"] == pytest.approx(1.0)
    assert row["tuned_TFLOPs"] == pytest.approx(2e6 / 20.0 / 1e6)
    assert os.environ.get("DISABLE_AUTOTUNE") != "1"           # put back after the fixed runs
    # after warm-up, the candidates take turns in blocks of 10 runs, 5 rounds
    blocks = clock.trace[-200::10]
    assert blocks == ["tuned", "fixed", "peer", "copy"] * 5


def test_match_patterns():
    label = "b4 h32 s4096 d128 bf16 causal fwd+bwd"
    assert bench._matches(label, "d128 bf16 causal fwd")
    assert not bench._matches(label, "d128 bf16 causal fwd$")
    assert bench._matches("b4 h32 s4096 d128 bf16 fwd", "d128 bf16 fwd$")
