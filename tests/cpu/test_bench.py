"""The bench's row logic on a fake clock: candidates timed in turns, fixed runs under
DISABLE_AUTOTUNE with the default kernels kept, a failing baseline reported and not fatal; a
row's progress line, the per-op tables and the plot."""
import contextlib
import os
import sys

import pytest
import torch

from tiletune import bench, timing

HOST_US_BEHIND = bench.host_us_behind


def test_a_row_whose_setup_ran_ours_first_reports_that_calls_time(clock):
    """A training-step row steps every model in its setup (for their memory), ours first, so
    its searches run there: the row's tuning time is that first step's, not that of the call
    run_case makes after it (its keys already tuned)."""
    def setup(case):
        case.ours = lambda: clock.run("tuned", 20.0)
        case.extra["first_call_s"] = 7.5

    case = bench.BenchCase("op", "step", "step", None, {}, setup=setup)
    row = bench.run_case(case)
    assert row["first_call_s"] == 7.5 and row["tuned_us"] == pytest.approx(20.0)


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
    assert row["copy_scale"] == 2.0                 # the copy itself ran 10 us
    assert row["tuned_TFLOPs"] == pytest.approx(2e6 / 20.0 / 1e6)
    assert os.environ.get("DISABLE_AUTOTUNE") != "1"           # put back after the fixed runs
    # after warm-up, the candidates take turns in blocks of 10 runs, 5 rounds, every other
    # round in reverse
    blocks = clock.trace[-200::10]
    turn = ["tuned", "fixed", "peer", "copy"]
    assert blocks == (turn + turn[::-1]) * 2 + turn


def _host_timed(clock, monkeypatch):
    """call(host_us, device_us) -> a call that costs the host and the device that much, with
    host_us_behind timing it on the host clock it advances."""
    host = {"s": 0.0}
    monkeypatch.setattr(bench.time, "perf_counter", lambda: host["s"])
    monkeypatch.setattr(bench, "host_us_behind", HOST_US_BEHIND)    # (the clock's stands in)

    def call(host_us, device_us):
        def f():
            host["s"] += host_us / 1e6
            clock.run("tuned", device_us)
        return f
    return call


def test_a_row_whose_call_costs_the_host_its_eager_time_is_marked_host_bound(clock,
                                                                             monkeypatch):
    """Each row gives the tuned call's host time, calls back to back; where it reaches
    HOST_BOUND of the eager time the row says its times read the host (a forward+backward step
    in a loaded process: its speedup over the fixed default is then the host's noise)."""
    call = _host_timed(clock, monkeypatch)
    row = bench.run_case(bench.BenchCase("op", "step", "fwd+bwd", call(90.0, 100.0), {}))
    assert row["host_us"] == pytest.approx(90.0) and row["host_bound"] is True
    assert "host-bound (90.00 us of host time a call)" in bench.progress_line(row)
    quick = bench.run_case(bench.BenchCase("op", "big", "fwd", call(10.0, 100.0), {}))
    assert quick["host_us"] == pytest.approx(10.0) and "host_bound" not in quick
    assert "host-bound" not in bench.progress_line(quick)
    cols = bench._columns([row, quick])
    cell = dict(cols)["host us"]
    assert cell(row) == "90.00 bound" and cell(quick) == "10.00"


def test_host_time_the_flush_hides_does_not_mark_a_row_host_bound(clock, monkeypatch):
    """A timed run's host work overlaps the 80 us L2 flush queued before it, so its eager time
    holds the host's only past the flush: 90 us of host time a call behind 100 us of kernels is
    not host-bound; 200 us is."""
    call = _host_timed(clock, monkeypatch)
    monkeypatch.setattr(timing, "_flush_l2", lambda: clock.run("flush", 80.0))
    hidden = bench.run_case(bench.BenchCase("op", "skinny", "fwd", call(90.0, 100.0), {}))
    assert hidden["flush_us"] == pytest.approx(80.0) and hidden["tuned_us"] == pytest.approx(100.0)
    assert hidden["host_us"] == pytest.approx(90.0) and "host_bound" not in hidden
    bound = bench.run_case(bench.BenchCase("op", "step", "fwd+bwd", call(200.0, 100.0), {}))
    assert bound["host_bound"] is True
    # each peer's host time too: a ratio against a host-bound peer compares host costs
    peers = {"slow_host": call(300.0, 100.0), "quick_host": call(50.0, 100.0)}
    row = bench.run_case(bench.BenchCase("op", "step", "fwd+bwd", call(10.0, 100.0), peers))
    assert row["slow_host_host_us"] == pytest.approx(300.0) and row["slow_host_host_bound"]
    assert row["quick_host_host_us"] == pytest.approx(50.0) and "quick_host_host_bound" not in row
    assert "1.00x slow_host (its host-bound)" in bench.progress_line(row)
    assert "1.00x quick_host;" in bench.progress_line(row)


def _heating(clock):
    """A kernel that runs 10 us until it has run 200 us back to back, then 20 us (its power
    limit), and a host-bound neighbour during whose gaps the card cools."""
    heat = {"us": 0.0}

    def hot():
        us = 10.0 if heat["us"] < 200.0 else 20.0
        heat["us"] += us
        clock.run("hot", us)

    def idle():
        heat["us"] = 0.0
        clock.run("idle", 50.0)
    return hot, idle


def test_sustained_blocks_time_a_kernel_at_the_speed_its_own_load_settles_at(clock):
    hot, idle = _heating(clock)
    cands = [("hot", hot, None), ("idle", idle, None)]
    assert timing.time_interleaved(cands)["hot"] == pytest.approx(10.0)   # blocks of 10 runs
    clock.trace.clear()
    us = timing.time_interleaved(cands, block_ms=1.0, preheat_ms=0)   # (counts the blocks' runs)
    assert us["hot"] == pytest.approx(20.0) and us["idle"] == pytest.approx(50.0)
    # each block: about 0.5 ms untimed, then 0.5 ms timed, at the run time estimated after the
    # warm-up (hot: 50 runs each; idle: 10, as 0.5 ms of 50 us runs is no more than `reps`)
    hot_runs = clock.trace.count("hot") - 5 - 1          # warm-up, the one estimating run
    idle_runs = clock.trace.count("idle") - 5 - 1
    assert 5 * 100 <= hot_runs <= 5 * 102 and 5 * 20 <= idle_runs <= 5 * 22


def test_a_preheat_keeps_the_first_candidate_off_boost_clocks(clock):
    """A card coming out of idle runs its first millisecond of work faster (a boost that fades
    as the power limit takes hold): two copies of one kernel time alike only when the candidates
    first run untimed past it."""
    work = {"us": 0.0}

    def kernel(label):
        def run():
            us = 5.0 + 5.0 * min(1.0, work["us"] / 1000.0)
            work["us"] += us
            clock.run(label, us)
        return run

    cands = [("first", kernel("first"), None), ("second", kernel("second"), None)]
    us = timing.time_interleaved(cands, rounds=2, reps=50, warmup=1, preheat_ms=0)
    assert abs(us["first"] / us["second"] - 1) > 0.1
    work["us"] = 0.0                                     # idle again
    us = timing.time_interleaved(cands, rounds=2, reps=50, warmup=1, preheat_ms=1.0)
    assert us["first"] == pytest.approx(10.0) and us["second"] == pytest.approx(10.0)


def test_a_sustained_row_says_so(clock):
    hot, idle = _heating(clock)
    case = bench.BenchCase("op", "shape", "fwd", hot, {"peer": idle})
    row = bench.run_case(case, sustained=True)
    assert row["timing"] == "sustained" and row["tuned_us"] == pytest.approx(20.0)
    assert "timing" not in bench.run_case(case)


@pytest.mark.parametrize("when", ["first call", "warm-up"])
def test_a_fixed_default_that_fails_is_reported_and_the_row_stands(clock, when):
    calls = []

    def ours():
        if os.environ.get("DISABLE_AUTOTUNE") == "1":
            calls.append(1)
            if when == "first call" or len(calls) > 1:
                raise RuntimeError("default config refused")
            clock.run("fixed", 30.0)
        else:
            clock.run("tuned", 20.0)

    case = bench.BenchCase("op", "shape", "fwd", ours, {"peer": lambda: clock.run("peer", 25.0)})
    row = bench.run_case(case)
    assert row["fixed_error"] == "RuntimeError: default config refused"
    assert "speedup_over_fixed" not in row and "fixed_us" not in row
    assert row["tuned_us"] == pytest.approx(20.0) and row["vs_peer"] == pytest.approx(1.25)
    assert bench._peers(row) == ["peer"] and "fixed failed" in bench.progress_line(row)
    assert os.environ.get("DISABLE_AUTOTUNE") != "1"


def test_bench_refuses_to_run_with_disable_autotune_set(monkeypatch, capsys):
    """Under DISABLE_AUTOTUNE=1 every tuned column would time the defaults: refused (exit 2);
    the host tables, which time defaults anyway, still run."""
    from tiletune.__main__ import main
    ran = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "main", lambda *a, **kw: ran.append(kw["host"]) or 0)
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    assert main(["bench", "rms_norm"]) == 2 and ran == []
    assert "DISABLE_AUTOTUNE=1 is set" in capsys.readouterr().err
    assert main(["bench", "rms_norm", "--host"]) == 0 and ran == [True]
    monkeypatch.delenv("DISABLE_AUTOTUNE")
    assert main(["bench", "rms_norm"]) == 0 and ran == [True, False]


def test_run_case_sets_up_lazy_rows_and_skips_peers_after(clock):
    """A row with `setup` builds its callables only when it runs; --skip-peer applies to the
    baselines the setup made, and the caller still learns every label offered."""
    def setup(case):
        case.ours = lambda: clock.run("tuned", 20.0)
        case.baselines = {"peer": lambda: clock.run("peer", 40.0),
                          "slow": lambda: clock.run("slow", 90.0)}
        case.extra["built"] = True

    case = bench.BenchCase("op", "model", "step", None, {}, setup=setup,
                           timing=dict(rounds=2, reps=3, warmup=1))
    seen = set()
    row = bench.run_case(case, skip_peers=("slow",), seen_peers=seen)
    assert row["vs_peer"] == pytest.approx(2.0) and "vs_slow" not in row
    assert row["built"] is True and seen == {"peer", "slow"}
    assert clock.trace[-2 * 3 * 3:].count("peer") == 2 * 3       # rounds x reps, as asked


def test_a_graph_row_times_each_candidate_replayed_from_its_cuda_graph(clock, monkeypatch):
    """BenchCase.graph: every candidate is also captured (the fixed one under its context) and
    its replays timed in turns; one that cannot be captured is reported, the row goes on."""
    capturing = []         # while a candidate is captured: where it puts its (name, graph us)

    def timed(name, eager_us, graph_us):
        if capturing:
            capturing[-1].append((name, graph_us))
        else:
            clock.run(name, eager_us)

    def ours():            # host-bound when called eagerly: the graph replays run faster
        fixed = os.environ.get("DISABLE_AUTOTUNE") == "1"
        timed("fixed" if fixed else "tuned", 70.0 if fixed else 60.0, 50.0 if fixed else 40.0)

    def uncapturable():
        if capturing:
            raise RuntimeError("not capturable")
        clock.run("nocap", 80.0)

    def fake_graphed(fn, context=None):
        capturing.append([])
        try:
            with (context or contextlib.nullcontext)():
                fn()
        finally:
            got = capturing.pop()
        (name, us), = got
        return lambda: clock.run(name + " graph", us)

    monkeypatch.setattr(bench, "graphed", fake_graphed)
    case = bench.BenchCase("op", "decode", "fwd", ours,
                           {"peer": lambda: timed("peer", 45.0, 44.0), "nocap": uncapturable},
                           graph=True, bytes=8e6)
    row = bench.run_case(case)
    assert row["tuned_us"] == pytest.approx(60.0) and row["vs_peer"] == pytest.approx(45 / 60)
    assert row["tuned_graph_us"] == pytest.approx(40.0)
    # rates of both times: the graph's is the kernels' without the host's
    assert row["tuned_GBps"] == pytest.approx(8e6 / 60.0 / 1e3)
    assert row["tuned_graph_GBps"] == pytest.approx(8e6 / 40.0 / 1e3)
    assert row["fixed_graph_us"] == pytest.approx(50.0)
    assert row["vs_fixed_graph"] == pytest.approx(50 / 40)
    assert row["vs_peer_graph"] == pytest.approx(44 / 40)
    assert row["nocap_graph_error"] == "RuntimeError: not capturable"
    assert row["vs_nocap"] == pytest.approx(80 / 60) and "vs_nocap_graph" not in row
    assert os.environ.get("DISABLE_AUTOTUNE") != "1"
    # the replays take turns in blocks, as the eager calls do
    turn = ["tuned graph", "fixed graph", "peer graph"]
    assert clock.trace[-150::10] == (turn + turn[::-1]) * 2 + turn
    line = bench.progress_line(row)
    assert "60.00 us, 1.17x fixed, 40.00 us from a CUDA graph, " in line
    assert "1.10x peer_graph" in line and "nocap_graph failed" in line
    header = [h for h, _ in bench._columns([row])]
    assert "graph us" in header and "vs peer_graph" in header and "vs fixed_graph" in header


def test_train_step_rows_are_full_only_and_lazy():
    pytest.importorskip("transformers")
    from tiletune.cases import train_step
    assert list(train_step.bench_cases(full=False)) == []
    rows = train_step.bench_cases(full=True)
    assert [r.mode for r in rows] == ["step", "step"]
    assert all(r.setup is not None and r.ours is None and not r.baselines for r in rows)


def test_train_step_puts_back_module_state():
    """What a peer's patch changed in a modeling module or transformers' registries is undone
    before another model's step, and put back before its own."""
    pytest.importorskip("transformers")
    import types

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from tiletune.cases import train_step
    module = types.ModuleType("modeling_fake")
    module.apply_rotary_pos_emb = original = object()
    clean = train_step._capture(module)
    module.apply_rotary_pos_emb = patched = object()
    module.added = 1
    ALL_ATTENTION_FUNCTIONS["fake_peer"] = patched
    state = train_step._capture(module)
    train_step._restore(module, clean)
    assert module.apply_rotary_pos_emb is original and not hasattr(module, "added")
    assert "fake_peer" not in ALL_ATTENTION_FUNCTIONS
    train_step._restore(module, state)
    assert module.apply_rotary_pos_emb is patched and module.added == 1
    assert ALL_ATTENTION_FUNCTIONS["fake_peer"] is patched
    train_step._restore(module, clean)


def test_host_tables_time_in_turns_and_keep_each_best_round(monkeypatch):
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    now, trace = [0.0], []

    def fake(label, us_per_round):
        rounds = iter(us_per_round)

        def fn():
            if len(trace) >= 40:               # past the warm-up (2 x 20 calls)
                now[0] += next(rounds) * 1e-6 if trace[-1:] != [label] else 0.0
            trace.append(label)
        return fn
    monkeypatch.setattr(bench.time, "perf_counter", lambda: now[0])
    # each round runs n = 1 call per callable; ours slow in its first round, torch steady
    us = bench.host_in_turns({"ours": fake("ours", [30.0, 10.0, 12.0]),
                              "torch": fake("torch", [8.0, 8.0, 8.0])}, n=1, rounds=3)
    assert trace[40:] == ["ours", "torch"] * 3                 # in turns, round by round
    assert us == {"ours": pytest.approx(10.0), "torch": pytest.approx(8.0)}


def test_host_against_torch_ratios_and_grad_step(monkeypatch):
    monkeypatch.setattr(bench, "host_in_turns",
                        lambda fns: {k: {"call": 20.0, "torch_call": 10.0, "step": 150.0,
                                         "torch_step": 120.0}[k] for k in fns})
    assert bench.host_against_torch(None, None) == {"call": 20.0, "torch_call": 10.0,
                                                    "call_over_torch": 2.0}
    h = bench.host_against_torch(*[lambda: None] * 4)
    assert h["step_over_torch"] == pytest.approx(1.25)
    x, w = bench.leaves(torch.randn(3, 4).t(), torch.randn(3))
    assert x.requires_grad and x.stride() == (1, 4) and x.grad_fn is None
    calls = []

    def f(a, b):
        calls.append(1)
        return a * 2, (a[0] * b).sum()
    step = bench.grad_step(f, (x, w))
    assert calls == []              # nothing runs (and so nothing tunes) before the first step
    gx, gw = step()
    assert gx.shape == x.shape and gw.shape == w.shape and x.grad is None
    assert calls == [1]             # one forward a step
    gx2, gw2 = step()
    assert calls == [1, 1] and torch.equal(gx2, gx) and torch.equal(gw2, gw)   # the same grads


def test_match_patterns():
    label = "b4 h32 s4096 d128 bf16 causal fwd+bwd"
    assert bench._matches(label, "d128 bf16 causal fwd")
    assert not bench._matches(label, "d128 bf16 causal fwd$")
    assert bench._matches("b4 h32 s4096 d128 bf16 fwd", "d128 bf16 fwd$")


ROWS = [{"op": "a", "case": "n1024 bf16", "mode": "fwd", "first_call_s": 1.5, "tuned_us": 20.0,
         "fixed_us": 30.0, "speedup_over_fixed": 1.5, "peer_us": 25.0, "vs_peer": 1.25,
         "broken_error": "RuntimeError: no kernel", "copy_us": 16.0, "frac_copy": 0.8},
        {"op": "b", "case": "m8", "mode": "fwd+bwd", "first_call_s": 0.25, "tuned_us": 40.0,
         "fixed_us": 40.0, "speedup_over_fixed": 1.0, "cublas_us": 38.0, "vs_cublas": 0.95,
         "tuned_TFLOPs": 0.2}]


def test_progress_line_and_tables(capsys):
    assert bench.progress_line(ROWS[0]) == (
        "a n1024 bf16 fwd: 20.00 us, 1.50x fixed, 1.25x peer, broken failed, 80% of copy; "
        "tuning 1.50 s")
    assert bench.progress_line(ROWS[1]) == (
        "b m8 fwd+bwd: 40.00 us, 1.00x fixed, 0.95x cublas; tuning 0.25 s")
    bench.print_table(ROWS)
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "a:" and out[3] == "" and out[4] == "b:"
    assert out[1] == ("  case        mode  tuned us  fixed us  vs fixed  vs peer  vs broken"
                      "  % of copy  tuning s")
    assert out[2].split() == ["n1024", "bf16", "fwd", "20.00", "30.00", "1.50x", "1.25x",
                              "failed", "80%", "1.50"]
    assert out[6].split() == ["m8", "fwd+bwd", "40.00", "40.00", "1.00x", "0.95x", "0.2", "0.25"]


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "bench.png"
    assert bench.plot(ROWS, str(path), title="Fake GPU")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_so_in_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    assert bench.plot(ROWS, str(tmp_path / "bench.png")) is False
    assert capsys.readouterr().out == \
        "--plot ignored: matplotlib is not installed (pip install matplotlib)\n"
    assert not (tmp_path / "bench.png").exists()


def test_the_cublas_loop_writes_each_gradient_once():
    """The grouped GEMM rows' cuBLAS loop under autograd: dx and dW are each assembled in one
    op (a cat, a stack), whatever the number of groups. Slicing x and indexing w per group made
    autograd fill a zero gradient of the whole x and the whole w for every group and add them
    up (E full-size passes over each), which the forward+backward rows timed as cuBLAS's."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from tiletune.cases import grouped_gemm

    class Outputs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.shapes = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.shapes += [tuple(o.shape) for o in (out if isinstance(out, (tuple, list))
                                                     else (out,)) if isinstance(o, torch.Tensor)]
            return out

    E, T, K, N = 4, 16, 8, 6
    counts = grouped_gemm.split(T, E, zipf=True)           # the last group empty
    x = torch.randn(T, K, dtype=torch.float64, requires_grad=True)
    w = torch.randn(E, N, K, dtype=torch.float64).transpose(-2, -1).detach().requires_grad_()
    dy = torch.randn(T, N, dtype=torch.float64)
    out = grouped_gemm._loop(x, w, counts)
    mode = Outputs()
    with mode:
        dx, dw = torch.autograd.grad(out, (x, w), dy)
    assert mode.shapes.count((T, K)) == 1 and mode.shapes.count((E, K, N)) == 1
    ends = torch.tensor(counts).cumsum(0).tolist()
    for g, (c, end) in enumerate(zip(counts, ends)):
        rows = slice(end - c, end)
        torch.testing.assert_close(out[rows], x[rows] @ w[g])
        torch.testing.assert_close(dx[rows], dy[rows] @ w[g].T)
        torch.testing.assert_close(dw[g], x[rows].T @ dy[rows])
    assert counts[-1] == 0 and not dw[-1].any()
    with torch.no_grad():                                   # the forward rows' path: out=
        torch.testing.assert_close(grouped_gemm._loop(x, w, counts), out)


def test_rope_peers_that_rotate_in_place_get_inputs_of_their_own(monkeypatch):
    """Liger's and TileGym's RoPE rotate q and k in place: each reads a copy of its own, so the
    other candidates read the inputs as drawn."""
    from cases import rope as case

    def inputs(B, Hq, Hk, S, D, dt):
        return (torch.randn(B, Hq, S, D), torch.randn(B, Hk, S, D), torch.randn(B, S, D),
                torch.randn(B, S, D))
    seen = {}

    def peer(name):
        def rotate(q, k, cos, sin):
            seen[name] = (q.data_ptr(), k.data_ptr())
            q.mul_(-1)
            k.mul_(-1)
        return rotate
    monkeypatch.setattr(case, "bench_inputs", inputs)
    monkeypatch.setattr(case, "SHAPES", ((1, 2, 1, 8, 4),))
    monkeypatch.setattr(case, "_peers", lambda: {n: peer(n) for n in ("torch", "liger",
                                                                       "tilegym")})
    row = case.bench_cases(full=False)[0]
    for name in ("liger", "tilegym", "torch"):
        row.baselines[name]()
    assert len({p for ptrs in seen.values() for p in ptrs}) == 6


def test_rope_copy_ceiling_covers_the_same_bytes_as_the_row(monkeypatch):
    """A RoPE row moves q and k (read and written) and reads every batch's cos/sin rows; its
    copy ceiling copies q and k alone, so the copy's time is scaled by the row's bytes over the
    copy's: `x copy` compares like bytes with like."""
    from cases import rope as case

    def inputs(B, Hq, Hk, S, D, dt):
        return (torch.randn(B, S, Hq, D, dtype=dt).transpose(1, 2),
                torch.randn(B, S, Hk, D, dtype=dt).transpose(1, 2),
                torch.randn(B, S, D, dtype=dt), torch.randn(B, S, D, dtype=dt))
    monkeypatch.setattr(case, "bench_inputs", inputs)
    monkeypatch.setattr(case, "SHAPES", ((2, 4, 2, 16, 8),))
    monkeypatch.setattr(case, "_peers", lambda: {})
    rows = case.bench_cases(full=False)
    element = 2                                                   # bf16
    qk = 2 * (2 * 4 * 16 * 8 + 2 * 2 * 16 * 8) * element         # q, k read and written
    cos_sin = 2 * 2 * 16 * 8 * element
    for row in rows:
        assert row.bytes == qk + cos_sin
        assert row.ceiling_scale * qk == pytest.approx(row.bytes)


def test_decode_rows_are_also_timed_from_cuda_graphs():
    from tiletune.cases import fmha
    decode = fmha._decode_cases(full=True)          # lazy rows: nothing allocated on the CPU
    assert len(decode) == len(fmha.DECODE_SHAPES) + 1 and all(c.graph for c in decode)


def test_bench_checks_its_output_paths_first_and_exits_1_when_a_row_failed(monkeypatch, tmp_path,
                                                                          capsys, clock):
    from tiletune import registry
    from tiletune.__main__ import main
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake GPU")
    monkeypatch.setattr(bench.precompile, "warm", lambda: None)
    blocker = tmp_path / "a file"
    blocker.write_text("")
    assert main(["bench", "rms_norm", "--json", str(blocker / "out.json")]) == 2
    assert "--json" in capsys.readouterr().err

    class Op:
        @staticmethod
        def bench_cases(full=False):
            def broken():
                raise RuntimeError("no kernel")
            return [bench.BenchCase("op", "fine", "fwd", lambda: clock.run("tuned", 20.0), {}),
                    bench.BenchCase("op", "broken", "fwd", broken, {})]
    monkeypatch.setattr(registry, "ops", lambda: {"op": Op})
    monkeypatch.setattr(bench.registry, "ops", lambda: {"op": Op})
    json_path = str(tmp_path / "out" / "bench.json")
    assert bench.main(["op"], json_path=json_path) == 1
    out = capsys.readouterr().out
    assert "op broken fwd: FAILED" in out and "exit status 1" in out
    assert os.path.exists(json_path)


def test_a_run_stopped_while_the_json_is_written_leaves_the_last_rows(monkeypatch, tmp_path,
                                                                      clock):
    """The JSON is written after every row so that a run stopped midway keeps its rows: a stop
    (Ctrl-C) while it is written leaves the previous file whole, and no temporary file."""
    import json

    class Op:
        @staticmethod
        def bench_cases(full=False):
            return [bench.BenchCase("op", f"n{i}", "fwd", lambda: clock.run("tuned", 20.0), {})
                    for i in range(2)]
    monkeypatch.setattr(bench.registry, "ops", lambda: {"op": Op})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake GPU")
    monkeypatch.setattr(bench.precompile, "warm", lambda: None)
    dump, writes = json.dump, []

    def stopped_on_the_second_write(obj, f, **kw):
        writes.append(1)
        if len(writes) == 2:
            f.write('{"device": "Fake')
            raise KeyboardInterrupt
        dump(obj, f, **kw)
    monkeypatch.setattr(bench.json, "dump", stopped_on_the_second_write)
    path = tmp_path / "bench.json"
    with pytest.raises(KeyboardInterrupt):
        bench.main(["op"], json_path=str(path))
    assert [r["case"] for r in json.loads(path.read_text())["rows"]] == ["n0"]
    assert os.listdir(tmp_path) == ["bench.json"]


def test_host_tables_name_an_op_that_has_none(monkeypatch, capsys):
    """`bench --host` of an op whose case module has no host table says so, rather than
    printing nothing for it."""
    class Op:
        @staticmethod
        def bench_host():
            return {"call": 2.0}
    monkeypatch.setattr(bench.registry, "ops", lambda: {"op": Op, "model": object()})
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda i=0: "Fake GPU")
    monkeypatch.setattr(bench.precompile, "warm", lambda: None)
    assert bench.main(["op", "model"], host=True, json_path=None) == 0
    out = capsys.readouterr().out.splitlines()
    assert "host overhead op (us per call): call=2.00" in out
    assert "model: no host table (its case module has no bench_host)" in out
