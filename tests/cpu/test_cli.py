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
    cases = {}
    monkeypatch.setattr(aot, "op_cases",
                        lambda op: cases.setdefault(op, [object() for _ in range(3)]))

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


def test_compile_runs_one_process_per_cpu_this_process_may_use(ops, compiles, monkeypatch,
                                                                capsys):
    """In a container or a job step pinned to 2 of a host's 64 cores, the default is 2
    processes (each imports the compiler and runs tileiras), not 64."""
    from tiletune import precompile
    monkeypatch.setattr(precompile.os, "sched_getaffinity", lambda pid: {4, 5}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert main(["compile"]) == 0
    assert "(6 compiles, 2 processes)" in capsys.readouterr().out
    assert compiles == [(["alpha", "beta"], ["sm_90"], 2)]


def _compile_slowly(case, arch):
    """A stand-in compile of 0.5 s that notes its start in the file the case names."""
    import time
    with open(case.log, "a") as f:
        f.write(f"{case.label}\n")
    time.sleep(0.5)
    return 0.5, 0


def test_ctrl_c_stops_the_compile_instead_of_running_every_queued_compile(ops, monkeypatch,
                                                                          tmp_path, ctrl_c):
    """Ctrl-C during `compile` (minutes of compiles queued in its process pool) ends it at once:
    the queued compiles are dropped and the running ones ended, where leaving the pool would
    wait for every one of them first."""
    import time
    log = tmp_path / "started"
    monkeypatch.setitem(aot._CASES, "alpha", [SimpleNamespace(label=f"case {i}", log=str(log))
                                              for i in range(40)])
    monkeypatch.setattr(aot, "compile_case", _compile_slowly)
    ctrl_c(1.0)
    t0 = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        main(["compile", "--jobs", "2", "alpha"])      # 40 compiles of 0.5 s: 10 s
    assert time.monotonic() - t0 < 4
    started = log.read_text().count("\n")
    time.sleep(1.0)
    assert log.read_text().count("\n") == started < 16


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


def test_tune_finds_its_model_runner_through_the_registry(monkeypatch):
    """`tune` builds transformers models through a registered case module (the transformers
    suite's builder); the engine names no suite."""
    import ast
    import tiletune
    from tiletune.suites import hf
    runner = registry.models()
    assert (runner.build_model, runner.model_step) == (hf.build_model, hf.model_step)
    engine = os.path.dirname(tiletune.__file__)
    for name in os.listdir(engine):
        if name.endswith(".py"):
            tree = ast.parse(open(os.path.join(engine, name)).read())
            for node in ast.walk(tree):
                modules = ([node.module or ""] if isinstance(node, ast.ImportFrom) else
                           [a.name for a in node.names] if isinstance(node, ast.Import) else [])
                for module in modules:
                    assert not module.startswith(("tiletune.suites", "tiletune.cases",
                                                  "tiletune.ops")), (name, module)
    monkeypatch.setattr(registry, "ops", lambda: {"alpha": object()})
    with pytest.raises(RuntimeError, match="no registered case module builds models"):
        registry.models()


def test_help_says_why_the_registry_cannot_load(monkeypatch, capsys):
    def broken():
        raise ImportError("cannot import name 'fmha' from 'tiletune.cases'")
    monkeypatch.setattr(registry, "ops", broken)
    code, out, _ = _exit(["--help"], capsys)
    assert code == 0
    assert "ops: cannot load the registered ops (ImportError: cannot import name 'fmha'" in out


def test_an_entry_point_that_names_no_dict_of_cases_is_named(monkeypatch, capsys):
    """A package registering its module (`mypkg.cases`) instead of the dict in it
    (`mypkg.cases:REGISTRY`): the error names the entry point, where `dict.update` said only
    "'module' object is not iterable"."""
    import types
    plugin = SimpleNamespace(name="mypkg", value="mypkg.cases",
                             load=lambda: types.ModuleType("mypkg.cases"))
    monkeypatch.setattr(registry, "entry_points", lambda group: [plugin])
    registry.ops.cache_clear()
    try:
        with pytest.raises(TypeError, match="entry point mypkg = mypkg.cases is a module, not "
                                            "a dict of op name -> case module"):
            registry.ops()
        code, out, _ = _exit(["--help"], capsys)
        assert code == 0 and "entry point mypkg = mypkg.cases is a module" in out
    finally:
        registry.ops.cache_clear()


def test_cache_show_empty_and_off(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("TILETUNE_CACHE_DIR", str(tmp_path / "store"))
    monkeypatch.setenv("TILETUNE_SHIPPED", str(tmp_path / "shipped"))
    (tmp_path / "shipped").mkdir()
    with pytest.warns(UserWarning, match="holds no shipped files"):
        assert main(["cache", "show"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        f"store at {tmp_path / 'store'} is empty",
        f"shipped winners: none at {tmp_path / 'shipped'}"]
    monkeypatch.setenv("TILETUNE_CACHE_DIR", "off")
    monkeypatch.setenv("TILETUNE_SHIPPED", "off")
    assert main(["cache", "show"]) == 0
    assert capsys.readouterr().out.splitlines() == [
        "store is off (TILETUNE_CACHE_DIR=off)", "shipped winners: off (TILETUNE_SHIPPED=off)"]


def test_cache_show_of_a_store_it_cannot_read_says_so_and_exits_1(monkeypatch, tmp_path,
                                                                  capsys):
    """A database that is not a tiletune store, or a store folder that is a file, is no empty
    store: `cache show` names the trouble and exits 1, as `cache clear` and `prune` do."""
    import sqlite3
    monkeypatch.setenv("TILETUNE_SHIPPED", "off")
    folder = tmp_path / "store"
    folder.mkdir()
    (folder / store.DB_NAME).write_bytes(b"not a database" * 100)
    monkeypatch.setenv("TILETUNE_CACHE_DIR", str(folder))
    assert main(["cache", "show"]) == 1
    out = capsys.readouterr()
    assert "empty" not in out.out
    assert out.err.startswith(f"cannot read the store at {folder}: DatabaseError:")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    with sqlite3.connect(foreign / store.DB_NAME) as conn:
        conn.execute("CREATE TABLE notes (text TEXT)")
    conn.close()
    monkeypatch.setenv("TILETUNE_CACHE_DIR", str(foreign))
    assert main(["cache", "show"]) == 1
    assert "not a tiletune store" in capsys.readouterr().err
    monkeypatch.setenv("TILETUNE_CACHE_DIR", str(folder / store.DB_NAME))
    assert main(["cache", "show"]) == 1
    assert capsys.readouterr().err.strip().endswith(": not a folder")
    for action, done in (("clear", "removed"), ("prune", "pruned")):    # (they read 0 entries)
        assert main(["cache", action]) == 1
        assert capsys.readouterr().out.strip().endswith(f": not a folder; nothing {done}")


def test_cache_show_counts_the_shipped_winners_apart(monkeypatch, tmp_path, capsys):
    from tiletune.__main__ import _installed_versions
    ct_v, ti_v = _installed_versions()
    monkeypatch.setenv("TILETUNE_CACHE_DIR", str(tmp_path / "store"))
    monkeypatch.setenv("TILETUNE_SHIPPED", str(tmp_path / "shipped"))

    def key(i, gpu="NVIDIA H100 80GB HBM3", ct=ct_v):
        return f"{i} | 0 | {gpu} | sm_90 | cuda-tile {ct} | tileiras {ti_v} | space 0123"
    e = {"config": {"tile": 64}, "best_us": 1.0, "timings": [], "failures": []}
    store.write_shipped(str(tmp_path / "shipped" / "h100.json"),
                        [("matmul", key(1), e), ("matmul", key(2), e), ("rope", key(1), e),
                         ("rope", key(3, ct="0.1"), e)])
    store.write_shipped(str(tmp_path / "shipped" / "h200.json"),
                        [("matmul", key(1, "NVIDIA H200"), e)])
    store.save("matmul", key(1), e)
    assert main(["cache", "show"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[:2] == [f"store at {tmp_path / 'store'}: 1 entry", "  matmul  1"]
    start = next(i for i, line in enumerate(lines) if line.startswith("shipped winners"))
    assert lines[start:] == [
        f"shipped winners (read-only; the store's own rows win) at {tmp_path / 'shipped'}: "
        f"5 entries in 2 files, 4 for the installed cuda-tile {ct_v} / tileiras {ti_v}",
        f"  h100.json: NVIDIA H100 80GB HBM3 sm_90 cuda-tile 0.1 tileiras {ti_v}: 1 entry",
        f"  h100.json: NVIDIA H100 80GB HBM3 sm_90 cuda-tile {ct_v} tileiras {ti_v}: 3 entries",
        f"  h200.json: NVIDIA H200 sm_90 cuda-tile {ct_v} tileiras {ti_v}: 1 entry",
        "  matmul  3", "  rope    2"]
    assert store.entries() == {"matmul": {key(1): e}}       # the shipped rows stay apart


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
                 "--skip-peer", "liger", "--full", "--graph", "--sustained"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("No CUDA GPU here")
    assert out[1] == ("--full, --json, --plot, --match, --skip-peer, --graph, --sustained "
                      "ignored: no GPU to benchmark")
    assert compiles == [(["alpha"], ["sm_90"], compiles[0][2])]
    assert not os.path.exists("r.json") and not os.path.exists("x.png")
    assert main(["bench"]) == 0                       # no flags given: no "ignored" line
    out = capsys.readouterr().out
    assert "ignored" not in out and compiles[-1][0] == ["alpha", "beta"]


@pytest.fixture
def clock(clock, monkeypatch):
    """The fake clock on a GPU the bench can name."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    return clock


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
        "%", "of", "copy", "GB/s", "host", "us", "tuning", "s"]
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

    # --host: the host tables alone; no op's rows are even set up
    ops["alpha"].bench_cases = lambda full=False: pytest.fail("rows set up under --host")
    ops["beta"].bench_cases = lambda full=False: pytest.fail("rows set up under --host")
    assert main(["bench", "--host", "--json", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "device: Fake GPU, torch %s; host tables only (--host)" % torch.__version__
    assert "host overhead alpha (us per call): bare_launch=3.00, fast_path_over_bare=1.25" in out
    assert not any(line.startswith(("alpha n", "beta m", "no row")) for line in out)
    data = json.loads(path.read_text())
    assert data["rows"] == [] and data["host_us"] == {"alpha": {"bare_launch": 3.0,
                                                                "fast_path_over_bare": 1.25}}


def test_bench_graph_times_every_row_from_cuda_graphs_too(ops, clock, monkeypatch, tmp_path,
                                                          capsys):
    """--graph: every row's candidates are also captured and replayed (a stand-in capture here:
    the replay runs the candidate at 3/4 of its eager time); without it only rows that ask."""
    monkeypatch.delenv("DISABLE_AUTOTUNE", raising=False)
    monkeypatch.setattr(bench, "graphed", lambda fn, context=None: lambda: clock.run(
        "graph", 0.75 * 20.0))
    ops["alpha"].bench_cases = lambda full=False: [
        bench.BenchCase("alpha", "n1", "fwd", lambda: clock.run("ours", 20.0),
                        {"peer": lambda: clock.run("peer", 25.0)})]
    ops["beta"].bench_cases = lambda full=False: [
        bench.BenchCase("beta", "m1", "fwd", lambda: clock.run("ours", 20.0), {}, graph=True)]
    path = tmp_path / "b.json"
    assert main(["bench", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert "tuned_graph_us" not in rows[0] and rows[1]["tuned_graph_us"] == pytest.approx(15.0)
    assert main(["bench", "--graph", "--json", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert all(r["tuned_graph_us"] == pytest.approx(15.0) for r in rows)
    assert rows[0]["vs_peer_graph"] == pytest.approx(1.0)
    assert "15.00 us from a CUDA graph" in capsys.readouterr().out


def test_bench_refuses_an_output_it_cannot_write_before_any_row(ops, clock, tmp_path, capsys):
    ran = []
    ops["alpha"].bench_cases = lambda full=False: ran.append(1) or []
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert main(["bench", "alpha", "--json", str(blocker / "b.json")]) == 2
    assert main(["bench", "alpha", "--json", str(tmp_path / "b.json"),
                 "--plot", str(blocker / "p.png")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"tiletune bench: --json {blocker / 'b.json'}: ")
    assert err[1].startswith(f"tiletune bench: --plot {blocker / 'p.png'}: ")
    assert all("is not a folder" in line for line in err) and ran == []


def test_bench_says_when_no_headline_row_matches(ops, clock, tmp_path, capsys):
    ops["alpha"].bench_cases = lambda full=False: [
        bench.BenchCase("alpha", "n1", "fwd", lambda: clock.run("ours", 1.0), {})]
    assert main(["bench", "alpha", "--json", str(tmp_path / "b.json"), "--match", "zzz",
                 "--plot", str(tmp_path / "p.png")]) == 0
    out = capsys.readouterr().out
    assert "no row matched zzz (of 1 headline rows; --full has more)" in out
    assert "--plot ignored: no rows to plot" in out and not (tmp_path / "p.png").exists()


# -- tune: presets and argument checks (tests/cpu/test_shipped_store.py runs it on a stand-in
# GPU) ------------------------------------------------------------------------------------------

def test_presets_parse_into_one_layer_configs():
    from tiletune import pretune
    from tiletune.suites import hf
    assert pretune.specs(["llama3-8b"]) == [pretune.ModelSpec(
        "llama", 4096, 14336, 32, 8, 128, name="llama3-8b")]
    moe = pretune.specs(["qwen3-30b-a3b"])[0]
    assert (moe.family, moe.experts, moe.top_k, moe.moe_intermediate, moe.kv_heads) == \
        ("qwen3_moe", 128, 8, 768, 4)
    assert [s.name for s in pretune.specs(["qwen3-8b", "mistral-7b", "qwen3-8b"])] == \
        ["qwen3-8b", "mistral-7b"]
    for name, spec in pretune.PRESETS.items():
        assert spec.problems() == [] and spec.name == name
        c = hf.model_config(spec, 8192)
        assert c.model_type == spec.family and c.num_hidden_layers == 1
        assert (c.hidden_size, c.intermediate_size, c.num_attention_heads,
                c.num_key_value_heads, c.head_dim) == (spec.hidden, spec.intermediate,
                                                       spec.heads, spec.kv_heads, spec.head_dim)
        assert c.vocab_size == hf.VOCAB and c.max_position_embeddings == 8192
    assert hf.model_config(pretune.PRESETS["mistral-7b"], 4096).sliding_window is None


def test_a_preset_with_changes_and_a_custom_model():
    from tiletune import pretune
    (s,) = pretune.specs(["llama3-8b"], hidden=2048, kv_heads=4)
    assert (s.hidden, s.kv_heads, s.intermediate, s.name) == \
        (2048, 4, 14336, "llama3-8b (modified)")
    (s,) = pretune.specs(["qwen3-30b-a3b"], model="qwen3")      # dense: the experts go
    assert s.family == "qwen3" and s.experts is None
    (s,) = pretune.specs(None, model="qwen2", hidden=896, intermediate=4864, heads=14)
    assert (s.kv_heads, s.head_dim, s.name) == (14, 64, "custom")
    (s,) = pretune.specs(None, model=pretune.family("Qwen3-MoE"), hidden=1024,
                         intermediate=3072, heads=16, kv_heads=8, head_dim=128, experts=64,
                         top_k=4, moe_intermediate=512)
    assert s.family == "qwen3_moe" and s.describe().endswith("64 experts of 512, top-4")


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe"])
def test_each_familys_one_layer_model_builds_from_its_config(family):
    """A tiny model of each family builds on the CPU from model_config, with one decoder layer
    of the family's own classes (the MoE layer sparse)."""
    from transformers import AutoModelForCausalLM
    from tiletune import pretune
    from tiletune.suites import hf
    moe = dict(experts=4, top_k=2, moe_intermediate=16) if family == "qwen3_moe" else {}
    spec = pretune.ModelSpec(family, 64, 96, 4, 2, 16, **moe)
    model = AutoModelForCausalLM.from_config(hf.model_config(spec, 32))
    layers = model.model.layers
    assert len(layers) == 1 and model.config.vocab_size == hf.VOCAB
    assert ("Sparse" in type(layers[0].mlp).__name__) == (family == "qwen3_moe")
    ids = torch.randint(0, hf.VOCAB, (1, 8))
    assert model(input_ids=ids, labels=ids, use_cache=False).loss.isfinite()


def test_decode_lengths_step_once_per_decode_key():
    """`tune --generate`'s decoding steps: the first new token, then the first cache length of
    each later power-of-two bucket (the decode keys' tuning key), up to seq + new tokens."""
    from tiletune import autotune, pretune
    assert pretune.decode_lengths(1000, 3000) == [1001, 1025, 2049]
    assert pretune.decode_lengths(1000, 25) == [1001, 1025]
    assert pretune.decode_lengths(1000, 24) == [1001]
    assert pretune.decode_lengths(1023, 1) == [1024]
    assert pretune.decode_lengths(1024, 1) == [1025]
    assert pretune.decode_lengths(1024, 31744) == [1025, 2049, 4097, 8193, 16385]
    assert pretune.decode_lengths(4096, 0) == []
    for seq, new in ((1, 5000), (777, 9000), (2048, 2048), (3, 1)):
        lengths = pretune.decode_lengths(seq, new)
        every = {autotune.bucket(n) for n in range(seq + 1, seq + new + 1)}
        assert [autotune.bucket(n) for n in lengths] == sorted(every)   # one step a bucket
        assert all(seq < n <= seq + new for n in lengths)


def test_tune_generate_needs_a_count_of_at_least_one(capsys):
    for bad in ("0", "-3", "x"):
        with pytest.raises(SystemExit) as e:
            main(["tune", "--preset", "llama3-8b", "--generate", bad])
        assert e.value.code == 2 and "--generate: not an integer >= 1" in capsys.readouterr().err


def test_tune_without_a_gpu_exits_2_and_says_why(monkeypatch, tmp_path, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setenv("TILETUNE_CACHE_DIR", str(tmp_path / "store"))
    path = tmp_path / "out.json"
    assert main(["tune", "--preset", "llama3-8b", "--seq", "1024", "2048",
                 "--export", str(path)]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.startswith("tiletune tune: no CUDA GPU here")
    assert "nothing was tuned" in out.err
    assert not path.exists() and not (tmp_path / "store").exists()


def test_tune_checks_that_the_store_and_the_export_can_be_written_first(monkeypatch, tmp_path,
                                                                       capsys):
    from tiletune import pretune
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pretune, "start_job", lambda: pytest.fail("tuning started"))
    blocker = tmp_path / "a file"
    blocker.write_text("")
    monkeypatch.setenv("TILETUNE_CACHE_DIR", str(blocker / "store"))
    assert main(["tune", "--preset", "llama3-8b", "--seq", "1024"]) == 2
    assert "cannot be written" in capsys.readouterr().err
    monkeypatch.setenv("TILETUNE_CACHE_DIR", str(tmp_path / "store"))
    assert main(["tune", "--preset", "llama3-8b", "--seq", "1024",
                 "--export", str(blocker / "out.json")]) == 2
    assert "cannot export to" in capsys.readouterr().err
    from tiletune.env import unwritable
    assert unwritable(str(tmp_path / "new" / "deeper" / "store.sqlite3")) == ""
    assert "is not a folder" in unwritable(str(blocker / "store.sqlite3"))
    assert unwritable(str(tmp_path)) == "a folder, not a file"      # bench --json somedir


def test_tune_refuses_a_store_or_export_file_in_a_folder_it_cannot_write(monkeypatch, tmp_path,
                                                                         capsys):
    """A writable file in a folder this user cannot write cannot be saved to: the store's
    database needs its -wal and -shm files beside it, and an export replaces its file through
    a temporary one beside it. Both are refused before the run, not after it."""
    from tiletune import env, pretune
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(pretune, "start_job", lambda: pytest.fail("tuning started"))
    locked = tmp_path / "locked"
    locked.mkdir()
    (locked / store.DB_NAME).write_bytes(b"")
    store.write_shipped(str(locked / "out.json"), [])
    real_access = os.access         # (root may write anywhere: the folder's refusal is made here)
    monkeypatch.setattr(os, "access", lambda p, mode, **kw: False if os.fspath(p) == str(locked)
                        else real_access(p, mode, **kw))
    assert env.unwritable(str(locked / "out.json")) == f"{locked} is not writable"
    monkeypatch.setenv("TILETUNE_CACHE_DIR", str(locked))
    assert main(["tune", "--preset", "llama3-8b", "--seq", "1024"]) == 2
    assert f"cannot be written ({locked} is not writable)" in capsys.readouterr().err
    monkeypatch.setenv("TILETUNE_CACHE_DIR", str(tmp_path / "store"))
    assert main(["tune", "--preset", "llama3-8b", "--seq", "1024",
                 "--export", str(locked / "out.json")]) == 2
    assert f"cannot export to {locked / 'out.json'} ({locked} is not writable)" in \
        capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    ([], "give --preset NAME (llama3-8b, llama3.2-1b, qwen3-8b, qwen3-30b-a3b, mistral-7b) or "
         "--model FAMILY"),
    (["--preset", "llama4"], "argument --preset: invalid choice: 'llama4'"),
    (["--model", "llama", "--hidden", "4096"], "--model llama needs --intermediate, --heads"),
    (["--model", "gpt2", "--hidden", "64", "--intermediate", "96", "--heads", "4"],
     "model 'gpt2' is not supported; supported: llama, mistral, qwen2, qwen3, qwen3_moe"),
    (["--model", "llama", "--hidden", "100", "--intermediate", "96", "--heads", "3"],
     "--hidden 100 is not a multiple of --heads 3: give --head-dim"),
    (["--preset", "llama3-8b", "--kv-heads", "5"],
     "--heads 32 is not a multiple of --kv-heads 5"),
    (["--preset", "llama3-8b", "--head-dim", "127"],
     "head dim 127 is odd: rotary position embeddings rotate pairs of dims"),
    (["--model", "qwen3", "--hidden", "60", "--intermediate", "96", "--heads", "4"],
     "head dim 15 is odd: rotary position embeddings rotate pairs of dims"),
    (["--preset", "llama3-8b", "--experts", "8"],
     "--experts, --top-k and --moe-intermediate are for qwen3_moe models (this one is llama)"),
    (["--preset", "llama3-8b", "--model", "qwen3_moe", "--experts", "8"],
     "a qwen3_moe model needs --top-k, --moe-intermediate"),
    (["--preset", "qwen3-30b-a3b", "--top-k", "200"], "--top-k 200 is more than --experts 128"),
    (["--preset", "llama3-8b", "qwen3-8b", "--hidden", "1024"],
     "--hidden cannot change several presets at once: give one --preset to change it"),
    (["--preset", "llama3-8b", "--all"], "--all goes with --export PATH"),
    (["--preset", "llama3-8b", "--seq", "0"], "argument --seq: not an integer >= 1: '0'"),
    (["--preset", "llama3-8b", "--batch", "two"], "argument --batch: not an integer >= 1: 'two'"),
    (["--preset", "llama3-8b", "--dtype", "fp32"], "argument --dtype: invalid choice: 'fp32'"),
])
def test_tune_argument_errors_are_one_clear_line_before_any_work(argv, message, monkeypatch,
                                                                  capsys):
    monkeypatch.setattr(torch.cuda, "is_available",
                        lambda: pytest.fail("checked the GPU before the arguments"))
    code, out, err = _exit(["tune", *argv], capsys)
    assert code == 2 and not out and err.count("error:") == 1
    assert message in err, err


def test_tune_flags_given_twice_add_up(monkeypatch):
    """`--seq 1024 --seq 2048` tunes both lengths (as compile's --arch repeats), where the
    second flag used to replace the first and half the shapes went untuned without a word."""
    import tiletune.__main__ as cli
    seen = []
    monkeypatch.setattr(cli, "cmd_tune", lambda args: seen.append(args) or 0)
    assert main(["tune", "--preset", "llama3-8b", "--preset", "qwen3-8b", "mistral-7b",
                 "--seq", "1024", "--seq", "2048", "4096", "--batch", "1", "--batch", "8"]) == 0
    args = seen[-1]
    assert [s.name for s in args.specs] == ["llama3-8b", "qwen3-8b", "mistral-7b"]
    assert (args.seq, args.batch) == ([1024, 2048, 4096], [1, 8])
    assert main(["tune", "--preset", "llama3-8b"]) == 0
    assert (seen[-1].seq, seen[-1].batch) == ([4096], [1])          # the defaults, alone
    assert main(["tune", "--preset", "llama3-8b", "--seq", "1024"]) == 0
    assert seen[-1].seq == [1024]


def test_tune_help_lists_the_presets(capsys):
    code, out, _ = _exit(["tune", "--help"], capsys)
    assert code == 0 and "--export PATH" in out and "--no-backward" in out
    from tiletune import pretune
    for spec in pretune.PRESETS.values():
        assert "  " + spec.describe() in out
    code, out, _ = _exit(["--help"], capsys)
    assert "{bench,compile,cache,tune}" in out


def test_tune_exits_1_when_winners_could_not_be_saved(monkeypatch, tmp_path, capsys):
    """A store that passed the writability check but fails its saves (a corrupt or foreign
    file, a lock held elsewhere): tune says how many winners were lost and exits 1, instead
    of 0 with nothing saved or exported."""
    import contextlib
    import sqlite3

    from tiletune import device, pretune, store
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("TILETUNE_CACHE_DIR", str(tmp_path / "store"))
    monkeypatch.setattr(pretune, "start_job", lambda: (0, 1))
    monkeypatch.setattr(pretune, "end_job", lambda world: None)
    monkeypatch.setattr(device, "gpu_name", lambda dev: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(device, "arch", lambda *a: "sm_90")

    @contextlib.contextmanager
    def broken(path):
        raise sqlite3.OperationalError("database disk image is malformed")
        yield

    def run(*args, **kwargs):
        monkeypatch.setattr(store, "_db", broken)
        for i in range(2):
            store.save("op", f"key {i}", {"cfg": i})
        return pretune.Report()
    monkeypatch.setattr(pretune, "run", run)
    out = tmp_path / "out.json"
    with pytest.warns(UserWarning, match="cannot use the cache database"):
        assert main(["tune", "--preset", "llama3-8b", "--seq", "1024",
                     "--export", str(out)]) == 1
    err = capsys.readouterr().err
    assert "tiletune tune: 2 winners could not be saved to the store at" in err
    assert "nothing was exported" in err and not out.exists()


def test_a_failed_compile_reports_what_the_compiler_said(ops, monkeypatch, capsys):
    """tileiras's message comes after the error's first line ("Return code 1"): the report
    and `compile` print it, and `compile` exits 1."""
    from cuda.tile._exception import Loc, TileCompilerExecutionError

    def compile_case(case, arch):
        if case.label == "big":
            raise TileCompilerExecutionError(
                1, "error: shared memory of 262144 bytes exceeds the 232448 bytes of sm_90",
                Loc.unknown(), "-O3", "13.4")
        return 0.5, 0
    monkeypatch.setitem(aot._CASES, "alpha", [SimpleNamespace(label="small"),
                                              SimpleNamespace(label="big")])
    monkeypatch.setattr(aot, "compile_case", compile_case)
    assert main(["compile", "--jobs", "1", "alpha"]) == 1
    out = capsys.readouterr().out
    assert "FAILED big [sm_90]: CompilerExecutionError: Return code 1" in out
    assert "shared memory of 262144 bytes exceeds" in out and "compiled 1/2" in out
    report = aot.compile_all(["alpha"], ["sm_100"], jobs=1)
    assert [label for label, _ in report.ok] == ["small [sm_100]"]
    (label, err), = report.failed
    assert label == "big [sm_100]" and "exceeds the 232448 bytes" in err


@pytest.mark.parametrize("kwargs,error,message", [
    (dict(ops="alpha"), TypeError, "compile_all: ops must be a list of names"),
    (dict(archs="sm_90"), TypeError, "compile_all: archs must be a list of names"),
    (dict(ops=["alpha", "gamma"]), ValueError, "compile_all: unknown op 'gamma' in ops; known: "
                                               "alpha, beta"),
    (dict(archs=["sm_90", "sm90", "hopper"]), ValueError, "compile_all: archs 'sm90', 'hopper' "
                                                          "are not of the form sm_<major><minor>"),
    (dict(jobs=0), ValueError, "compile_all: jobs must be an int >= 1"),
    (dict(jobs=-2), ValueError, "compile_all: jobs must be an int >= 1"),
    (dict(jobs=2.5), ValueError, "compile_all: jobs must be an int >= 1"),
    (dict(select=lambda op, i, case: case.label == "nope"), ValueError,
     "compile_all: select picked none of the 2 compile cases of alpha"),
])
def test_compile_all_refuses_bad_arguments_before_compiling(kwargs, error, message, ops,
                                                            monkeypatch):
    """A str for a list (compiled for the archs 's', 'm', '_', ...), an unknown op (a bare
    KeyError), a misspelt arch, jobs below 1, a select that picks nothing (an empty report that
    reads as success): one clear error, before any compile."""
    compiled = []
    monkeypatch.setitem(aot._CASES, "alpha", [SimpleNamespace(label="a"),
                                              SimpleNamespace(label="b")])
    monkeypatch.setattr(aot, "compile_case", lambda case, arch: compiled.append(arch) or (0.1, 0))
    args = dict(dict(ops=["alpha"], archs=["sm_90"], jobs=1), **kwargs)
    with pytest.raises(error, match=message.replace("(", r"\(")):
        aot.compile_all(**args)
    assert compiled == []
    assert len(aot.compile_all(["alpha", "alpha"], ["sm_90", "sm_90"], jobs=1).ok) == 2


def test_tune_deterministic_steps_under_that_mode_and_restores_it(monkeypatch, tmp_path, capsys):
    """--deterministic: the steps run under torch.use_deterministic_algorithms(True) (where
    attention's backward has keys of its own) with cuBLAS's workspace setting, and the mode
    is as it was afterwards; without the flag the steps run as the caller left it."""
    from tiletune import device, pretune
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setenv("TILETUNE_CACHE_DIR", str(tmp_path / "store"))
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    monkeypatch.setattr(pretune, "start_job", lambda: (0, 1))
    monkeypatch.setattr(pretune, "end_job", lambda world: None)
    monkeypatch.setattr(device, "gpu_name", lambda dev: "NVIDIA H100 80GB HBM3")
    monkeypatch.setattr(device, "arch", lambda *a: "sm_90")
    modes = []

    def run(*args, **kwargs):
        modes.append((torch.are_deterministic_algorithms_enabled(),
                      os.environ.get("CUBLAS_WORKSPACE_CONFIG")))
        return pretune.Report()
    monkeypatch.setattr(pretune, "run", run)
    assert main(["tune", "--preset", "llama3-8b", "--seq", "1024", "--deterministic"]) == 0
    assert "under deterministic algorithms" in capsys.readouterr().out
    assert main(["tune", "--preset", "llama3-8b", "--seq", "1024"]) == 0
    assert modes == [(True, ":4096:8"), (False, ":4096:8")]
    assert not torch.are_deterministic_algorithms_enabled()
