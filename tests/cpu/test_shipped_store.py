"""Shipped winners (read-only package data consulted where the user's store has no row) and
`python -m tiletune tune` on a stand-in GPU: the lookup on hand-written files, then through the
engine's real code with a stand-in search (tests/cpu/test_engine.py's), and the export format
read back by the lookup."""
import gzip
import json
import os
import re
import warnings
from types import SimpleNamespace

import pytest
import torch

from tiletune import autotune, device, env as tt_env, precompile, pretune, registry, store
from tiletune.__main__ import main
from tests.cpu import test_engine

env = test_engine.env        # the engine with a stand-in search, launch and final round

OP = "matmul"
SPACE = "space 0123456789abcdef"


def skey(i=0, dev=0, gpu="NVIDIA H100 80GB HBM3", arch="sm_90", ct="1.7.0", ti="13.4.92",
         space=SPACE):
    return (f"{4096 * (i + 1)} | 14336 | torch.bfloat16 | {dev} | {gpu} | {arch} | "
            f"cuda-tile {ct} | tileiras {ti} | {space}")


def entry(tile=64):
    return {"config": {"tile": tile}, "best_us": 9.5, "search_s": 1.0, "timings": [],
            "failures": [{"config": {"tile": 512}, "error": "TileCompilerError",
                          "message": "shared memory exceeds limit\n(232448 bytes)\n" * 40}]}


@pytest.fixture
def shipped(monkeypatch, tmp_path):
    """An empty store and an empty folder of shipped files (TILETUNE_SHIPPED points there)."""
    monkeypatch.setenv("TILETUNE_CACHE_DIR", str(tmp_path / "store"))
    folder = tmp_path / "shipped"
    folder.mkdir()
    monkeypatch.setenv("TILETUNE_SHIPPED", str(folder))
    monkeypatch.setattr(tt_env, "_warned", set())
    monkeypatch.setattr(store, "_used", {})
    return folder


def ship(folder, rows, name="h100.json"):
    path = folder / name
    store.write_shipped(str(path), rows, {"tiletune": "test"})
    return path


# -- the lookup --------------------------------------------------------------------------------

def test_a_shipped_winner_answers_where_the_store_has_no_row(shipped):
    ship(shipped, [(OP, skey(), entry(64))])
    got = store.load(OP, skey())
    assert got == entry(64) and isinstance(got, store.ShippedEntry)
    assert store.source_of(got) == "shipped" and store.used() == {(OP, skey()): "shipped"}
    assert store.load(OP, skey(1)) is None and store.load("rope", skey()) is None
    assert store.entries() == {}                    # nothing copied into the user's store


def test_the_users_own_row_wins(shipped):
    ship(shipped, [(OP, skey(), entry(64))])
    store.save(OP, skey(), entry(128))
    got = store.load(OP, skey())
    assert got["config"] == {"tile": 128} and store.source_of(got) == "store"
    store.delete(OP, skey())                        # back to the shipped one
    assert store.load(OP, skey())["config"] == {"tile": 64}


@pytest.mark.parametrize("stale", [dict(gpu="NVIDIA H200"), dict(gpu="NVIDIA H100 PCIe"),
                                   dict(arch="sm_100"), dict(ct="1.8.0"), dict(ti="13.5.0"),
                                   dict(space="space fedcba9876543210")])
def test_a_stale_shipped_row_is_never_found(shipped, stale):
    """Every part of the full key must match: GPU name, arch, cuda-tile, tileiras, config space
    and kernel code."""
    ship(shipped, [(OP, skey(**stale), entry())])
    assert store.load(OP, skey()) is None
    assert store.load(OP, skey(**stale)) is not None


def test_a_row_tuned_on_device_0_serves_every_device_index(shipped):
    """The device index (an op key's last part) names no property of the GPU: a winner tuned on
    device 0 serves the same key at index 3. A row of another index serves that index only, and
    a size differing is another key."""
    ship(shipped, [(OP, skey(dev=0), entry(64)), (OP, skey(1, dev=2), entry(32))])
    assert store.load(OP, skey(dev=3)) == entry(64)
    assert store.load(OP, skey(1, dev=2)) == entry(32)
    assert store.load(OP, skey(1, dev=3)) is None and store.load(OP, skey(1, dev=0)) is None
    assert store.load(OP, skey(2, dev=3)) is None
    # the part before the GPU name, where it is a number, of a key of the store key's shape
    assert store._any_device("a | 1 | b") is None
    assert store._any_device(skey(dev=7)) == store._any_device(skey(dev=0)) != skey(dev=0)
    assert store._any_device(skey(dev=7)) != store._any_device(skey(1, dev=7))


@pytest.mark.parametrize("value", ["off", "0", "no", "False", "disable"])
def test_tiletune_shipped_off_turns_them_off(shipped, monkeypatch, value):
    ship(shipped, [(OP, skey(), entry())])
    monkeypatch.setenv("TILETUNE_SHIPPED", value)
    assert store.shipped_source() is None and store.load(OP, skey()) is None
    assert store.shipped_files() == []


@pytest.mark.parametrize("value", [None, "", " ", "1", "on", "yes"])
def test_unset_or_on_reads_the_package_folder(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("TILETUNE_SHIPPED", raising=False)
    else:
        monkeypatch.setenv("TILETUNE_SHIPPED", value)
    assert store.shipped_source() == store.SHIPPED_DIR
    assert store.SHIPPED_DIR == os.path.join(os.path.dirname(store.__file__), "shipped")


@pytest.mark.parametrize("value", ["maybe", "/no/such/folder"])
def test_a_shipped_value_that_names_nothing_readable_says_so(monkeypatch, tmp_path, value):
    """Neither on, off nor a readable folder or file (a typo): no shipped winners, with a
    warning that says why, instead of silently none."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(store, "_folders", {})
    monkeypatch.setenv("TILETUNE_SHIPPED", value)
    with pytest.warns(UserWarning, match="TILETUNE_SHIPPED names .*not a readable folder or file"):
        assert store.shipped(OP, skey()) is None


def test_a_shipped_folder_without_shipped_files_says_so(monkeypatch, tmp_path):
    """An existing folder holding no shipped file (the parent of the one meant, say): a
    warning, not silently none."""
    monkeypatch.setattr(store, "_folders", {})
    (tmp_path / "notes.txt").write_text("not a shipped file")
    monkeypatch.setenv("TILETUNE_SHIPPED", str(tmp_path))
    with pytest.warns(UserWarning, match="names the folder .* which holds no shipped files"):
        assert store.shipped(OP, skey()) is None


def test_a_relative_shipped_path_is_one_path_whatever_the_cwd(shipped, monkeypatch, tmp_path):
    ship(shipped, [(OP, skey(), entry())])
    monkeypatch.chdir(shipped.parent)
    monkeypatch.setattr(store, "_folders", {})
    monkeypatch.setenv("TILETUNE_SHIPPED", shipped.name)
    assert store.shipped_source() == str(shipped)
    monkeypatch.chdir(tmp_path)
    assert store.shipped_source() == str(shipped) and store.load(OP, skey()) is not None


def test_the_package_folder_holds_only_well_formed_shipped_files(monkeypatch):
    monkeypatch.delenv("TILETUNE_SHIPPED", raising=False)
    paths = [p for p, _, _ in store._shipped_files(store.SHIPPED_DIR)]
    assert len(paths) >= 2                           # the H100 and H200 files, compressed
    for path in paths:
        header, rows = store.read_shipped(path)
        assert rows and all(store.key_facts(key) for _, key, _ in rows), path


def _space_of(op, parts):
    """The config generators' arguments of a shipped row, read from its tuning key (the store
    key's parts before the GPU name) as each op's `space` function derives them from its
    inputs. An op missing here fails the test below: add it when its rows ship."""
    n = [int(p) if p.lstrip("-").isdigit() else p for p in parts]
    if op == "rms_norm_fwd":                                       # (N, M, x dtype, w dtype..)
        return dict(n_cols=n[0], x_bytes=getattr(torch, parts[2][6:]).itemsize,
                    w_bytes=getattr(torch, parts[3][6:]).itemsize)
    if op in ("rms_norm_bwd", "rms_norm_bwd_coef", "rms_norm_bwd_cols",
              "swiglu_fwd", "swiglu_bwd", "column_sum"):
        return dict(n_cols=n[0])                                   # (N, ...)
    if op in ("rope", "rope_inplace"):                             # (Hq, Hk, D, rot, BS, ..)
        return dict(heads=n[0], rot=n[3], has_pos=parts[7] == "True")
    if op in ("rms_norm_rope_fwd", "rms_norm_rope_bwd"):           # (Hq, Hk, D, rot, ...)
        return dict(heads=n[0] + n[1], rot=n[3], backward=op == "rms_norm_rope_bwd")
    if op in ("matmul",):                                          # (M, N, K, Z, ...)
        return dict(m=n[0], n=n[1], k=n[2], z=n[3])
    if op in ("gated_mlp", "gated_mlp_dx"):                        # (M, N, K, ...)
        return dict(m=n[0], n=n[1], k=n[2])
    if op.startswith(("moe_permute", "moe_unpermute")):            # (H, top-k, ...)
        return dict(h=n[0], k=n[1])
    if op.startswith("fmha_") and op != "fmha_decode":             # (BH, Sq, Sk, D, diagonal..)
        from tiletune.ops import fmha
        return dict(td=fmha.head_tile(n[3]), sq=autotune.bucket(n[1]),
                    sk=autotune.bucket(n[2]), causal=parts[4] != "None",
                    packed=parts[4].startswith("packed"))
    if op == "fmha_decode":                     # (B*Hkv, Sq, Sk, D, diagonal, group, lengths..)
        from tiletune.ops import fmha
        return dict(td=fmha.head_tile(n[3]), sq=n[1], sk=autotune.bucket(n[2]),
                    kv_heads=autotune.bucket(n[0]), causal=parts[4] != "None",
                    used=parts[6] == "True", group=n[5])
    if op == "grouped_mm":                                         # (E, K, N, T, ...)
        return dict(t=autotune.bucket(n[3]), e=n[0], k=n[1], n=n[2])
    if op == "grouped_mm_k":                                       # (E, M, N, T, ...)
        return dict(t=autotune.bucket(n[3]), e=n[0], m=n[1], n=n[2])
    raise AssertionError(f"no space reader for shipped op {op}")


def test_every_shipped_row_is_found_by_the_current_code(monkeypatch):
    """A shipped row is looked up with its config space's and kernels' fingerprint, so an edit
    of a kernel, of a helper it calls, or of a space makes it stale: never found, the first call
    searches again. Every row of the package's files must still be found (its fingerprint is
    today's for the space its key names) and its winner must be a config of that space. When
    this fails, tune the rows again, re-key them by hand where the sm_90 machine code is the
    same, or drop them (tiletune/shipped/README.md)."""
    monkeypatch.delenv("TILETUNE_SHIPPED", raising=False)
    registry.ops()                       # imports every op module: each creates its tuners
    tuners = autotune.tuners()
    stale = []
    paths = [p for p, _, _ in store._shipped_files(store.SHIPPED_DIR)]
    assert paths
    for path in paths:
        name = os.path.basename(path)
        _, rows = store.read_shipped(path)
        for op, key, row in rows:
            parts = key.split(" | ")
            arch, fingerprint = parts[-4], parts[-1].split()[1]
            tuner = tuners[op]
            cfgs = tuner.config_list(arch, _space_of(op, parts[:-5]))
            winner = row["config"]
            if tuner._fingerprint(cfgs) != fingerprint or \
                    not any(autotune._as_json(autotune.config_dict(c)) == winner for c in cfgs):
                stale.append(f"{name}: {op} {key}")
    assert not stale, f"{len(stale)} stale shipped rows:\n" + "\n".join(stale[:20])


def test_a_single_file_can_be_named(shipped, monkeypatch):
    path = ship(shipped, [(OP, skey(), entry())], name="try.json")
    monkeypatch.setenv("TILETUNE_SHIPPED", str(path))
    assert store.load(OP, skey()) == entry()


def test_the_shipped_file_is_never_written(shipped):
    path = ship(shipped, [(OP, skey(), entry(64)), (OP, skey(1), entry(32))])
    before = (path.read_bytes(), os.stat(path).st_mtime_ns)
    store.load(OP, skey())
    store.save(OP, skey(), entry(128))
    store.delete(OP, skey(1))
    store.clear()
    store.prune(cuda_tile="9.9", tileiras="9.9", older_than_s=0.0)
    store.load(OP, skey(1))
    assert (path.read_bytes(), os.stat(path).st_mtime_ns) == before
    assert sorted(os.listdir(shipped)) == ["h100.json"]


def test_a_bad_shipped_file_is_left_out_with_one_warning(shipped):
    ship(shipped, [(OP, skey(), entry())], name="good.json")
    (shipped / "broken.json").write_text("{not json")
    (shipped / "foreign.json").write_text(json.dumps({"format": "other", "rows": []}))
    (shipped / "notes.txt").write_text("not read")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert store.load(OP, skey()) == entry()
        assert store.load(OP, skey(1)) is None
    messages = sorted(str(w.message) for w in caught)
    assert len(messages) == 2
    assert "broken.json" in messages[0] and "foreign.json" in messages[1]
    assert "not a tiletune-shipped-1 file" in messages[1]


def test_malformed_rows_are_skipped_and_a_changed_file_is_read_again(shipped):
    path = shipped / "h100.json"
    rows = [{"op": OP, "key": skey(), "entry": entry(64)}, {"op": OP, "key": 5, "entry": {}},
            {"op": OP, "key": skey(1), "entry": [1]}, "junk"]
    path.write_text(json.dumps({"format": store.SHIPPED_FORMAT, "rows": rows}))
    assert store.load(OP, skey()) == entry(64) and store.load(OP, skey(1)) is None
    ship(shipped, [(OP, skey(1), entry(16))])       # merged: the old row stays
    assert store.load(OP, skey(1)) == entry(16) and store.load(OP, skey()) == entry(64)


# -- the export format -------------------------------------------------------------------------

def test_export_merges_and_writes_one_row_a_line(shipped, tmp_path):
    path = tmp_path / "out" / "h100.json"
    assert store.write_shipped(str(path), [(OP, skey(), entry(64))]) == (1, 0)
    written, kept = store.write_shipped(
        str(path), [(OP, skey(), entry(128)), ("rope", skey(), entry(8))], {"x": 1})
    assert (written, kept) == (2, 0)                # the same key: replaced
    data = json.loads(path.read_text())
    assert data["format"] == store.SHIPPED_FORMAT and data["x"] == 1
    assert [(r["op"], r["entry"]["config"]) for r in data["rows"]] == [
        (OP, {"tile": 128}), ("rope", {"tile": 8})]
    assert path.read_text().count("\n  {") == 2      # one row a line
    assert store.write_shipped(str(path), [(OP, skey(1), entry())]) == (3, 2)
    bad = tmp_path / "notes.json"
    bad.write_text('{"a": 1}')
    with pytest.raises(ValueError, match="not a tiletune-shipped-1 file"):
        store.write_shipped(str(bad), [(OP, skey(), entry())])
    assert bad.read_text() == '{"a": 1}'


def test_an_export_keeps_two_decimals_of_every_number(shipped, tmp_path):
    """Times, rates and seconds to 0.01 (the digits past it are timer noise); integers, strings
    and the config as they are."""
    path = tmp_path / "out" / "h100.json"
    row = dict(entry(64), best_us=9.876543, rates={"tflop_per_s": 701.23456},
               timings=[{"config": {"tile": 64, "occupancy": 2}, "mean_us": 12.3456789,
                         "error_us": 0.0049, "samples": 5}])
    store.write_shipped(str(path), [(OP, skey(), row)])
    (_, key, got), = store.read_shipped(str(path))[1]
    assert key == skey() and got["config"] == {"tile": 64}
    assert got["best_us"] == 9.88 and got["rates"] == {"tflop_per_s": 701.23}
    assert got["timings"] == [{"config": {"tile": 64, "occupancy": 2}, "mean_us": 12.35,
                               "error_us": 0.0, "samples": 5}]
    assert got["failures"] == row["failures"]


def test_a_gz_export_is_compressed_reproducible_and_read_back(shipped, tmp_path, monkeypatch):
    """A path ending in .gz is written gzip-compressed, with no name or time in its header (the
    same rows give the same bytes), read back as the plain file would be, merged on a second
    export, and found by the lookup in a folder next to plain files."""
    plain, packed = tmp_path / "a" / "h100.json", tmp_path / "a" / "h200.json.gz"
    rows = [(OP, skey(), entry(64)), ("rope", skey(), entry(8))]
    store.write_shipped(str(plain), rows, {"x": 1})
    assert store.write_shipped(str(packed), rows, {"x": 1}) == (2, 0)
    data = packed.read_bytes()
    assert data[:2] == b"\x1f\x8b" and len(data) < plain.stat().st_size
    assert gzip.decompress(data) == plain.read_bytes()
    store.write_shipped(str(tmp_path / "b.json.gz"), rows, {"x": 1})
    assert (tmp_path / "b.json.gz").read_bytes() == data
    assert store.read_shipped(str(packed)) == store.read_shipped(str(plain))
    assert store.write_shipped(str(packed), [(OP, skey(1), entry())]) == (3, 2)
    assert len(store.read_shipped(str(packed))[1]) == 3
    assert [os.path.basename(p) for p, _, _ in store._shipped_files(str(tmp_path / "a"))] == [
        "h100.json", "h200.json.gz"]
    (tmp_path / "c.json.gz").write_text("{not gzip")
    with pytest.raises(ValueError, match="not a gzip file"):
        store.read_shipped(str(tmp_path / "c.json.gz"))


def test_exported_entries_keep_only_the_first_line_of_failure_messages():
    slim = pretune._slim(entry())
    assert slim["failures"][0]["message"] == "shared memory exceeds limit"
    assert slim["config"] == {"tile": 64} and entry()["failures"][0]["message"].count("\n") == 80


def test_a_compile_failure_ships_with_what_the_compiler_said():
    """A compiler error's first line is "Return code 1": the line after it ships too."""
    e = dict(entry(), failures=[{"config": {"tile": 8}, "error": "CompilerExecutionError",
                                 "message": "Return code 1\n\nerror: too many registers\nmore"}])
    assert pretune._slim(e)["failures"][0]["message"] == "Return code 1: error: too many registers"


def test_gpu_rows_are_this_gpus_and_softwares(shipped):
    store.save(OP, skey(), entry(1))
    store.save(OP, skey(1, dev=1), entry(2))
    store.save(OP, skey(2, gpu="NVIDIA H200"), entry(3))
    store.save(OP, skey(3, ct="1.6.0"), entry(4))
    store.save("rope", "not a store key", entry(5))
    rows = pretune.gpu_rows("NVIDIA H100 80GB HBM3", "sm_90", "1.7.0", "13.4.92")
    assert sorted(e["config"]["tile"] for _, _, e in rows) == [1, 2]


# -- through the engine ------------------------------------------------------------------------

def _store_key(t, key, n=16):
    return t.store_key(key, 0, t.config_list("sm_90", dict(n=n)))


def test_the_engine_launches_a_shipped_winner_without_searching(env, shipped):
    t = env.make()
    ship(shipped, [(t.name, _store_key(t, ("k", 1)), {"config": {"tile": 16, "occupancy": 4},
                                                      "best_us": 7.0})])
    cfg, kernel = test_engine.resolve(t, ("k", 1))
    rec = t.records[("k", 1)]
    assert cfg.occupancy == 4 and env.fake.calls == 0 and rec.source == "shipped"
    assert rec.best_us == 7.0 and kernel._compiler_options.occupancy == 4
    assert store.entries() == {}
    # the user's row overrides it; a shipped winner outside today's space is stale: search
    store.save(t.name, _store_key(t, ("k", 1)), {"config": {"tile": 16, "occupancy": 1}})
    t.clear()
    cfg, _ = test_engine.resolve(t, ("k", 1))
    assert cfg.occupancy == 1 and t.records[("k", 1)].source == "store" and env.fake.calls == 0
    ship(shipped, [(t.name, _store_key(t, ("k", 2)), {"config": {"tile": 16, "occupancy": 64}})])
    cfg, _ = test_engine.resolve(t, ("k", 2))
    assert env.fake.calls == 1 and t.records[("k", 2)].source == "search"


def test_the_engine_ignores_a_shipped_row_of_another_space(env, shipped):
    t = env.make()
    key = _store_key(t, ("k", 1)).rsplit(" | ", 1)[0] + " | space 0000000000000000"
    ship(shipped, [(t.name, key, {"config": {"tile": 16, "occupancy": 4}})])
    cfg, _ = test_engine.resolve(t, ("k", 1))
    assert env.fake.calls == 1 and cfg.occupancy == 2 and t.records[("k", 1)].source == "search"


def test_a_shipped_winner_that_fails_to_launch_is_searched_and_saved(env, shipped, monkeypatch):
    x = torch.zeros(4)
    monkeypatch.setattr(autotune, "_registry", dict(autotune._registry))   # dropped after
    t = autotune.Autotuner(f"failing_{id(env)}", test_engine._k, test_engine._space,
                           default=SimpleNamespace(tile=8, occupancy=1),
                           space=lambda x, n: dict(n=n), grid=lambda c, dev, x, n: (1,),
                           args=lambda c, x, n: (x, c.occupancy))
    path = ship(shipped, [(t.name, t.store_key(("k",), "cpu", t.config_list("sm_90", dict(n=32))),
                           {"config": {"tile": 32, "occupancy": 4}})])
    before = path.read_bytes()

    def launch(stream, grid, kernel, args):
        if args[1] == 4:
            raise RuntimeError("CUDA_ERROR_NO_BINARY_FOR_GPU")
        env.launches.append(args)
    monkeypatch.setattr(test_engine.ct, "launch", launch)
    t.launch(("k",), "cpu", x, 32)
    assert env.fake.calls == 1 and t.cache[("k",)][0].occupancy == 2
    (saved,) = store.entries(t.name)[t.name].values()
    assert saved["config"]["occupancy"] == 2 and path.read_bytes() == before
    t.clear()                                       # the next process: the user's row wins
    t.launch(("k",), "cpu", x, 32)
    assert env.fake.calls == 1 and t.records[("k",)].source == "store"


# -- `tune` on a stand-in GPU, and its export read back -----------------------------------------

@pytest.fixture
def gpu(env, shipped, monkeypatch):
    """`tune` with a stand-in GPU: building the model makes a stand-in; a step resolves two keys
    of a stand-in op per sequence length (one shared by every length). The shipped folder holds
    one file of no rows (an empty folder is warned about)."""
    ship(shipped, [], name="none.json")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(device, "gpu_name", lambda d: "Fake H200")
    t = env.make("tuned")
    built = []

    def build_model(spec, max_seq, dtype):
        built.append((spec.name, max_seq, dtype))
        return SimpleNamespace(spec=spec)

    def step(model, batch, seq, backward):
        test_engine.resolve(t, ("fwd", model.spec.hidden, batch * seq))
        test_engine.resolve(t, ("shared", model.spec.hidden))

    def generate(model, batch, seq, lengths):
        generated.append((seq, lengths))
        for n in lengths:
            test_engine.resolve(t, ("decode", batch, autotune.bucket(n)))
    generated = []
    monkeypatch.setattr(registry, "models", lambda: SimpleNamespace(
        build_model=build_model, model_step=step, model_generate=generate))
    return SimpleNamespace(tuner=t, built=built, store=shipped.parent / "store", env=env,
                           generated=generated)


def test_tune_prints_each_key_and_a_summary_and_saves_them(gpu, capsys):
    assert main(["tune", "--preset", "llama3.2-1b", "--seq", "1024", "2048"]) == 0
    out = capsys.readouterr().out.splitlines()
    db = gpu.store / store.DB_NAME
    assert out[0] == (f"tuning on Fake H200 (sm_90) at batch 1 x seq 1024, 2048, bf16, "
                      f"forward + backward; store: {db}")
    assert out[1] == "  " + pretune.PRESETS["llama3.2-1b"].describe()
    tuned = [line for line in out if line.startswith("tuned ")]
    name = gpu.tuner.name
    assert len(tuned) == 3 and all(f" {name} (" in line for line in tuned)
    assert any(re.fullmatch(rf"tuned   {name} \(fwd, 2048, 1024\) in \d+\.\ds: "
                            r"\{'tile': 16, 'occupancy': 2\} 10\.00 us \(3 configs, 0 failed\)",
                            line) for line in tuned), tuned
    assert "llama3.2-1b batch 1 x seq 2048: 1 new key in" in "\n".join(out)
    assert re.fullmatch(r"3 keys tuned in \d+\.\ds of search \(0 already in the store, "
                        rf"0 shipped\); \d+\.\ds in all; store: {re.escape(str(db))}", out[-1])
    assert gpu.built == [("llama3.2-1b", 2048, torch.bfloat16)]
    assert len(store.entries()[name]) == 3

    # a second process: every key is in the store, nothing searched
    autotune.clear_cache()
    gpu.env.fake.calls = 0
    assert main(["tune", "--preset", "llama3.2-1b", "--seq", "1024", "2048",
                 "--no-backward", "--dtype", "fp16"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert gpu.env.fake.calls == 0 and "forward only" in out[0]
    assert sum(line.startswith("store ") and "(in the store)" in line for line in out) == 3
    assert out[-1].startswith("0 keys tuned in 0.0s of search (3 already in the store, 0 shipped)")


def test_tune_steps_every_batch_and_sequence_length_on_one_model(gpu, capsys):
    assert main(["tune", "--preset", "llama3.2-1b", "--seq", "1024", "2048",
                 "--batch", "1", "8", "1"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("tuning on Fake H200 (sm_90) at batch 1, 8 x seq 1024, 2048, bf16")
    assert [line.split(":")[0] for line in out if "new key" in line] == [
        f"llama3.2-1b batch {b} x seq {s}" for b in (1, 8) for s in (1024, 2048)]
    assert gpu.built == [("llama3.2-1b", 2048, torch.bfloat16)]
    assert len(store.entries()[gpu.tuner.name]) == 5      # 4 token counts, 1 shared key


def test_tune_generate_steps_each_decode_bucket_after_each_prompt(gpu, capsys):
    assert main(["tune", "--preset", "llama3.2-1b", "--seq", "1000", "3000", "--no-backward",
                 "--generate", "3000"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("forward only, then generating 3000 tokens; store: "
                           f"{gpu.store / store.DB_NAME}")
    assert gpu.built == [("llama3.2-1b", 6000, torch.bfloat16)]     # positions up to seq + N
    assert gpu.generated == [(1000, [1001, 1025, 2049]), (3000, [3001, 4097])]
    lines = [line for line in out if "generating" in line and "new key" in line]
    assert lines[0].startswith("llama3.2-1b batch 1 x seq 1000, generating 3000 tokens "
                               "(decoding at cache lengths 1001, 1025, 2049): 3 new keys in")
    assert lines[1].startswith("llama3.2-1b batch 1 x seq 3000, generating 3000 tokens "
                               "(decoding at cache lengths 3001, 4097): 1 new key in")
    decode = {k for k in store.entries()[gpu.tuner.name] if "decode" in k}
    assert len(decode) == 4              # buckets 1024, 2048, 4096 and 8192, each once


def test_tune_starts_the_compile_workers_before_building_the_first_model(gpu, monkeypatch):
    models_built_at_warm = []
    monkeypatch.setattr(precompile, "warm",
                        lambda n=None: models_built_at_warm.append(len(gpu.built)))
    assert main(["tune", "--preset", "llama3.2-1b", "--seq", "1024"]) == 0
    assert models_built_at_warm == [0] and len(gpu.built) == 1


def test_tune_export_round_trips_into_the_shipped_lookup(gpu, monkeypatch, tmp_path, capsys):
    path = tmp_path / "export" / "fake-h200.json"
    assert main(["tune", "--preset", "qwen3-8b", "--seq", "4096", "--export", str(path)]) == 0
    out = capsys.readouterr().out
    assert f"exported 2 entries to {path} (2 rows in the file)" in out
    header, rows = store.read_shipped(str(path))
    assert header["format"] == store.SHIPPED_FORMAT and header["tiletune"]
    assert {store.key_facts(k)[0] for _, k, _ in rows} == {"Fake H200"}
    # another machine: a fresh store, these winners shipped
    monkeypatch.setenv("TILETUNE_CACHE_DIR", str(tmp_path / "other_store"))
    monkeypatch.setenv("TILETUNE_SHIPPED", str(path))
    autotune.clear_cache()
    gpu.env.fake.calls = 0
    assert main(["tune", "--preset", "qwen3-8b", "--seq", "4096"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert gpu.env.fake.calls == 0
    assert sum(line.startswith("shipped ") and "(a shipped winner)" in line for line in out) == 2
    assert "(0 already in the store, 2 shipped)" in out[-1]
    assert store.entries() == {}
    # --all: every row of this GPU and software in the store, merged into the file
    monkeypatch.setenv("TILETUNE_SHIPPED", "off")
    autotune.clear_cache()
    assert main(["tune", "--preset", "llama3-8b", "--seq", "128", "--export", str(path),
                 "--all"]) == 0
    assert f"exported 2 entries to {path} (3 rows in the file, 1 of them kept from it)" in \
        capsys.readouterr().out          # this store's two; ("shared", 4096) replaced
    assert len(store.read_shipped(str(path))[1]) == 3


def _job(monkeypatch, rank, world, other=None):
    """`tune` as rank `rank` of a job of `world`: the gather hands back this rank's part and,
    for the others, `other(mine)`."""
    monkeypatch.setattr(pretune, "start_job", lambda: (rank, world))
    monkeypatch.setattr(pretune, "end_job", lambda world: None)
    gathered = []

    def gather(mine, w):
        gathered.append(mine)
        return [mine if r == rank else other(mine) for r in range(w)]
    monkeypatch.setattr(pretune, "gather", gather)
    return gathered


def test_tune_in_a_job_steps_its_share_and_rank_0_reports_the_job(gpu, monkeypatch, tmp_path,
                                                                   capsys):
    """Under torchrun every rank steps the first (model, batch, sequence length) shape, then
    every world-th of the others; rank 0 prints the header and the job's summary and exports every
    rank's rows once; the others print their own keys only."""
    assert pretune.shares(5, 2) == [[0, 1, 3], [0, 2, 4]]
    assert pretune.shares(1, 3) == [[0], [0], [0]] and pretune.shares(3, 1) == [[0, 1, 2]]
    path = tmp_path / "job.json"
    seqs = ["--seq", "1024", "2048", "4096"]
    gathered = _job(monkeypatch, 0, 2, lambda mine: dict(
        mine, search=2, search_s=1.5, wall_s=99.0, rows=mine["rows"][:1]))
    steps = []
    runner = registry.models()
    counted = SimpleNamespace(build_model=runner.build_model, model_step=lambda m, b, seq, bw:
                              steps.append(seq) or runner.model_step(m, b, seq, bw))
    monkeypatch.setattr(registry, "models", lambda: counted)
    assert main(["tune", "--preset", "llama3.2-1b", *seqs, "--export", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("tuning on 2 x Fake H200 (sm_90) at batch 1 x seq 1024, 2048, 4096")
    assert steps == [1024, 2048]
    assert gpu.built == [("llama3.2-1b", 2048, torch.bfloat16)]
    assert [line for line in out if "new key" in line] == [
        line for line in out if line.startswith("[rank 0] llama3.2-1b batch 1 x seq ")]
    assert [line.split(" x seq ")[1].split(":")[0] for line in out if "new key" in line] == \
        ["1024", "2048"]
    mine = gathered[0]
    assert mine["failed"] is None and mine["search"] == 3 and len(mine["rows"]) == 3
    assert re.match(r"5 keys tuned in \d+\.\ds of search on 2 ranks \(0 already in the store, "
                    r"0 shipped\); 99\.0s in all", out[-2])
    assert out[-1].startswith(f"exported 3 entries to {path}")     # rank 1's row: one of these
    # rank 1: the first shape, then its share; no header, no summary, no export
    autotune.clear_cache()
    gpu.built.clear()
    steps.clear()
    _job(monkeypatch, 1, 2, lambda mine: dict(mine, rows=[]))
    assert main(["tune", "--preset", "llama3.2-1b", *seqs, "--export",
                 str(tmp_path / "rank1.json")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert steps == [1024, 4096]
    assert gpu.built == [("llama3.2-1b", 4096, torch.bfloat16)]
    assert out and all(line.startswith("[rank 1] ") for line in out)
    assert not (tmp_path / "rank1.json").exists()
    # a rank whose search failed: every rank still gathers, and the job exits 1
    _job(monkeypatch, 0, 2, lambda mine: dict(mine, failed="rank 1: every config failed"))
    assert main(["tune", "--preset", "llama3.2-1b", *seqs]) == 1
    # a rank whose step raises still reaches the gather, and says why
    autotune.clear_cache()
    gathered = _job(monkeypatch, 0, 2, lambda mine: dict(mine, failed=None))

    def broken(model, batch, seq, backward):
        raise RuntimeError("CUDA out of memory")
    monkeypatch.setattr(registry, "models", lambda: SimpleNamespace(
        build_model=lambda spec, max_seq, dtype: None, model_step=broken))
    assert main(["tune", "--preset", "llama3.2-1b", *seqs]) == 1
    assert gathered[0]["failed"] == "RuntimeError: CUDA out of memory"
    assert "[rank 0] RuntimeError: CUDA out of memory" in capsys.readouterr().err


def test_a_job_counts_a_key_as_searched_on_the_rank_that_decided_it():
    """Ranks that helped time a key record it too; the job's summary counts it once."""
    def rec(by):
        return autotune.TuningRecord("op", ("k", by), {}, "search", search_s=2.0,
                                     agreement={"rank": 0, "by": by})
    report = pretune.Report(records=[rec(0), rec(1), autotune.TuningRecord(
        "op", ("alone",), {}, "search", search_s=1.0)])
    assert report.count("search") == 2 and report.search_s() == 3.0


def test_start_job_joins_torchrun_and_sets_the_process_group(tmp_path):
    """Two processes with torchrun's environment over gloo: each gets its (rank, world), the
    job's process group is tiletune's, the gather sees both ranks in order."""
    import socket
    import subprocess
    import sys
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    code = ("from tiletune import distributed, pretune\n"
            "rank, world = pretune.start_job('gloo')\n"
            "print(rank, world, distributed.current().world_size,\n"
            "      pretune.gather(rank * 10, world))\n"
            "pretune.end_job(world)\n")
    procs = []
    for rank in (0, 1):
        env = dict(os.environ, WORLD_SIZE="2", RANK=str(rank), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, "-c", code], env=env, text=True,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert [o.strip().splitlines()[-1] for o in outs] == ["0 2 2 [0, 10]", "1 2 2 [0, 10]"]
    env = dict(os.environ)
    env.pop("WORLD_SIZE", None)
    one = subprocess.run([sys.executable, "-c", "from tiletune import pretune; "
                          "print(pretune.start_job(), pretune.gather(7, 1))"],
                         env=env, text=True, capture_output=True, timeout=120)
    assert one.stdout.strip() == "(0, 1) [7]", one.stderr


def test_start_job_gives_the_gather_hours_not_minutes(monkeypatch):
    """The job's one collective, the gather at the end, waits for the slowest rank's share:
    the process group start_job makes has a timeout of hours, not torch's 10 minutes."""
    import torch.distributed as dist
    from tiletune import distributed
    made = {}
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: made.update(kw))
    monkeypatch.setattr(distributed, "set_process_group", lambda: None)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    assert pretune.start_job("gloo") == (1, 2)
    assert made["timeout"] == pretune.JOB_GATHER_TIMEOUT and \
        pretune.JOB_GATHER_TIMEOUT.total_seconds() >= 3600


def test_start_job_names_a_torchrun_variable_it_cannot_read(monkeypatch):
    """WORLD_SIZE or LOCAL_RANK left blank or set to junk (by another launcher, a shell
    profile): blank is unset, anything else a ValueError naming the variable, where int()'s
    "invalid literal" named neither, before any process group is started."""
    import torch.distributed as dist
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **kw: pytest.fail("started"))
    for blank in ("", "  "):
        monkeypatch.setenv("WORLD_SIZE", blank)
        assert pretune.start_job("gloo") == (0, 1)
    for name, value in (("WORLD_SIZE", "two"), ("WORLD_SIZE", "-2"), ("LOCAL_RANK", "gpu0")):
        monkeypatch.setenv("WORLD_SIZE", "2")
        monkeypatch.setenv(name, value)
        monkeypatch.setattr(torch.cuda, "set_device", lambda i: pytest.fail("set a device"))
        with pytest.raises(ValueError, match=f"{name}='{value}' is not an integer >= 0"):
            pretune.start_job("nccl")
        monkeypatch.delenv("LOCAL_RANK", raising=False)


def test_tune_refuses_without_autotuning_or_a_store(gpu, monkeypatch, capsys):
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    assert main(["tune", "--preset", "llama3-8b"]) == 2
    assert "DISABLE_AUTOTUNE=1 is set" in capsys.readouterr().err
    monkeypatch.delenv("DISABLE_AUTOTUNE")
    monkeypatch.setenv("TILETUNE_CACHE_DIR", "off")
    assert main(["tune", "--preset", "llama3-8b"]) == 2
    assert "the store is off (TILETUNE_CACHE_DIR=off)" in capsys.readouterr().err
    assert gpu.built == []


def test_tune_export_to_a_foreign_file_fails_and_leaves_it(gpu, tmp_path, capsys):
    path = tmp_path / "mine.json"
    path.write_text("[]")
    assert main(["tune", "--preset", "llama3-8b", "--export", str(path)]) == 2
    err = capsys.readouterr().err
    assert f"cannot export to {path}: ValueError: not a tiletune-shipped-1 file" in err
    assert path.read_text() == "[]" and gpu.built == []           # refused before tuning
