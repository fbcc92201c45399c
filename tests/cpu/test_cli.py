"""`python -m tiletune` on a CPU box against stand-in registries: argument checks fail before
any work starts, help and version, `cache show`, bench without a GPU, and bench's output (a line
per row as it finishes, then the tables and the summary) on a fake clock."""
import json
import os
from types import SimpleNamespace

import pytest
import torch

import tiletune
from tiletune import aot, autotune, bench, registry, store
from tiletune.__main__ import main

from tests.cpu.test_bench import FakeClock


@pytest.fixture
def ops(monkeypatch):
    """A stand-in registry of two ops without cases; tests add cases to its modules."""
    mods = {"alpha": SimpleNamespace(bench_cases=lambda full=False: [],
                                     compile_cases=lambda: []),
            "beta": SimpleNamespace(bench_cases=lambda full=False: [],
                                    compile_cases=lambda: [])}
    monkeypatch.setattr(registry, "ops", lambda: mods)
    return mods


@pytest.fixture
def compiles(monkeypatch):
    """aot stubbed: each op has 3 compile cases; records the compile_all calls."""
    calls = []
    monkeypatch.setattr(aot, "op_cases", lambda op: [object()] * 3)

    def compile_all(ops, archs, jobs=None):
        calls.append((list(ops), list(archs), jobs))
        return aot.CompileReport(ok=[(f"{op} {i} [{a}]", 0.5) for op in ops for i in range(3)
                                     for a in archs])
    monkeypatch.setattr(aot, "compile_all", compile_all)
    return calls


def _exit(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(argv)
    out = capsys.readouterr()
    return e.value.code, out.out, out.err


@pytest.mark.parametrize("arch", ["sm90", "banana", "sm_70", "sm_9", "sm_900"])
def test_compile_rejects_a_bad_arch_before_compiling(arch, ops, compiles, capsys):
    code, out, err = _exit(["compile", "--arch", "sm_90", "--arch", arch, "--arch", "nope"],
                           capsys)
    assert code == 2 and not compiles and not out
    assert err.count("error:") == 1 and f"'{arch}'" in err and "sm_<major><minor>" in err


@pytest.mark.parametrize("arch", ["sm_80", "sm_86", "sm_89", "sm_90", "sm_100", "sm_103",
                                  "sm_110", "sm_120", "sm_121"])
def test_compile_accepts_known_archs(arch, ops, compiles, capsys):
    assert main(["compile", "--arch", arch, "alpha"]) == 0
    assert compiles == [(["alpha"], [arch], compiles[0][2])]


@pytest.mark.parametrize("jobs", ["0", "-2"])
def test_compile_jobs_below_one_is_an_error(jobs, ops, compiles, capsys):
    code, out, err = _exit(["compile", "--jobs", jobs], capsys)
    assert code == 2 and not compiles
    assert err.count("error:") == 1 and "--jobs must be >= 1" in err


def test_compile_prints_the_real_process_count(ops, compiles, capsys):
    assert main(["compile", "--jobs", "64", "--arch", "sm_90", "--arch", "sm_100", "beta"]) == 0
    out = capsys.readouterr().out
    assert "compiling 3 kernel configs of beta for sm_90, sm_100 (6 compiles, 6 processes)" in out
    assert compiles == [(["beta"], ["sm_90", "sm_100"], 6)]
    assert "compiled 6/6" in out
    assert main(["compile", "--jobs", "1", "alpha"]) == 0
    assert "(3 compiles, 1 process)" in capsys.readouterr().out


def test_unknown_op_is_one_error_listing_the_known_ops(ops, compiles, capsys):
    code, out, err = _exit(["compile", "alpha", "gamma", "delta"], capsys)
    assert code == 2 and not compiles
    assert err.count("error:") == 1 and "gamma, delta" in err and "known: alpha, beta" in err


def test_version(capsys):
    code, out, err = _exit(["--version"], capsys)
    assert code == 0 and out.strip() == f"tiletune {tiletune.__version__}"


def test_help_lists_the_registered_ops(ops, capsys):
    code, out, _ = _exit(["--help"], capsys)
    assert code == 0 and "ops: alpha, beta" in out and "--version" in out
    code, out, _ = _exit(["bench", "--help"], capsys)
    assert code == 0 and "ops: alpha, beta" in out and "--full" in out


def test_help_says_why_the_registry_cannot_load(monkeypatch, capsys):
    def broken():
        raise ImportError("cannot import name 'fmha' from 'tiletune.cases'")
    monkeypatch.setattr(registry, "ops", broken)
    code, out, _ = _exit(["--help"], capsys)
    assert code == 0
    assert "ops: cannot load the registered ops (ImportError: cannot import name 'fmha'" in out


def test_cache_show_empty_and_off(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("TILETUNE_CACHE_DIR", str(tmp_path / "store"))
    assert main(["cache", "show"]) == 0
    assert capsys.readouterr().out.strip() == f"store at {tmp_path / 'store'} is empty"
    monkeypatch.setenv("TILETUNE_CACHE_DIR", "off")
    assert main(["cache", "show"]) == 0
    assert capsys.readouterr().out.strip() == "store is off (TILETUNE_CACHE_DIR=off)"


def test_cache_show_counts_per_op_then_entries(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("TILETUNE_CACHE_DIR", str(tmp_path))
    timing = {"config": {"tile": 64}, "mean_us": 9.5}
    for i in range(3):
        store.save("matmul", f"key{i}", {"config": {"tile": 64}, "best_us": 9.5,
                                         "timings": [timing], "failures": [], "search_s": 1.0})
    store.save("rope", "k", {"config": {"tile": 8}, "best_us": 2.0, "timings": [timing] * 2,
                             "failures": [], "search_s": 0.5})
    assert main(["cache", "show"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:4] == [f"store at {tmp_path}: 4 entries", "  matmul  3", "  rope    1", ""]
    assert lines[4] == "matmul: 3 entries" and "rope: 1 entry" in lines
    assert sum("configs timed" in line for line in lines) == 4
    assert main(["cache", "show", "-v"]) == 0
    assert capsys.readouterr().out.count(" us  {") == 5


def test_bench_without_a_gpu_compiles_and_names_ignored_flags(ops, compiles, monkeypatch,
                                                              capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["bench", "alpha", "--plot", "x.png", "--json", "r.json", "--match", "fwd",
                 "--skip-peer", "liger", "--full"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("No CUDA GPU here")
    assert out[1] == "--full, --json, --plot, --match, --skip-peer ignored: no GPU to benchmark"
    assert compiles == [(["alpha"], ["sm_90"], compiles[0][2])]
    assert not os.path.exists("r.json") and not os.path.exists("x.png")
    assert main(["bench"]) == 0                       # no flags given: no "ignored" line
    out = capsys.readouterr().out
    assert "ignored" not in out and compiles[-1][0] == ["alpha", "beta"]


@pytest.fixture
def clock(monkeypatch):
    c = FakeClock()
    monkeypatch.setattr(torch.cuda, "Event", c.event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    from tiletune import timing
    monkeypatch.setattr(timing, "_flush_l2", lambda: None)
    return c


def test_bench_prints_a_line_per_row_before_the_tables(ops, clock, monkeypatch, tmp_path,
                                                       capsys):
    monkeypatch.setenv("TILETUNE_CACHE_DIR", str(tmp_path / "store"))
    monkeypatch.delenv("DISABLE_AUTOTUNE", raising=False)

    def ours(us, fixed_us):
        return lambda: clock.run("ours", fixed_us if os.environ.get("DISABLE_AUTOTUNE") else us)

    def broken():
        raise RuntimeError("no kernel")

    def alpha_cases(full=False):
        sizes = (1024, 2048) if full else (1024,)
        return [bench.BenchCase("alpha", f"n{n}", "fwd", ours(20.0, 30.0),
                                {"peer": lambda: clock.run("peer", 25.0), "broken": broken},
                                bytes=4e6, ceiling=("copy", lambda: clock.run("copy", 16.0)))
                for n in sizes]
    ops["alpha"].bench_cases = alpha_cases
    ops["alpha"].bench_host = lambda: {"bare_launch": 3.0, "fast_path_over_bare": 1.25}
    ops["beta"].bench_cases = lambda full=False: [
        bench.BenchCase("beta", "m8", "fwd+bwd", ours(40.0, 40.0),
                        {"cublas": lambda: clock.run("cublas", 38.0)}, flops=8e6)]
    path = tmp_path / "out" / "bench.json"
    assert main(["bench", "--json", str(path), "--skip-peer", "nobody"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "device: Fake GPU, torch %s; headline rows (--full: every row)" \
        % torch.__version__
    row_a = ("alpha n1024 fwd: 20.00 us, 1.50x fixed, 1.25x peer, broken failed, 80% of copy; "
             "tuning ")
    assert out[1].startswith(row_a) and out[1].endswith(" s")
    assert out[2].startswith("beta m8 fwd+bwd: 40.00 us, 1.00x fixed, 0.95x cublas; tuning ")
    assert not any(line.startswith("host overhead") for line in out)     # --full only
    tables = out.index("alpha:")
    assert tables > 2 and out[tables + 1].split() == [
        "case", "mode", "tuned", "us", "fixed", "us", "vs", "fixed", "vs", "peer", "vs", "broken",
        "%", "of", "copy", "GB/s", "tuning", "s"]
    assert out[tables + 2].split()[:9] == ["n1024", "fwd", "20.00", "30.00", "1.50x", "1.25x",
                                           "failed", "80%", "200"]
    assert "beta:" in out[tables:] and "TFLOP/s" in out[out.index("beta:") + 1]
    assert "--skip-peer nobody: no row has that baseline (baselines: broken, cublas, peer)" in out
    n = sum(t.searches for t in autotune.tuners().values())
    assert f"store: {tmp_path / 'store'}; {n} search{'' if n == 1 else 'es'} ran in this " \
           "process" in out
    assert out[-1] == f"wrote {path}"
    data = json.loads(path.read_text())
    assert [r["case"] for r in data["rows"]] == ["n1024", "m8"] and data["full"] is False

    assert main(["bench", "alpha", "--full", "--json", str(path), "--match", "n2048"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in out if line.startswith("alpha n")] == \
        ["alpha n2048 fwd"]
    assert "host overhead alpha (us per call): bare_launch=3.00, fast_path_over_bare=1.25" in out
    assert json.loads(path.read_text())["full"] is True
    assert json.loads(path.read_text())["host_us"]["alpha"]["bare_launch"] == 3.0


def test_bench_says_when_no_headline_row_matches(ops, clock, tmp_path, capsys):
    ops["alpha"].bench_cases = lambda full=False: [
        bench.BenchCase("alpha", "n1", "fwd", lambda: clock.run("ours", 1.0), {})]
    assert main(["bench", "alpha", "--json", str(tmp_path / "b.json"), "--match", "zzz",
                 "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert "no row matched zzz (of 1 headline rows; --full has more)" in out
    assert "--plot ignored: no rows to plot" in out and not (tmp_path / "p.png").exists()
