import pytest
import torch

import tiletune


def pytest_collection_modifyitems(items):
    for item in items:
        if "/gpu/" in str(item.fspath):
            item.add_marker(pytest.mark.gpu)


@pytest.fixture(autouse=True, scope="session")
def no_shipped_winners():
    """The GPU tests count searches: winners shipped with the package must not answer their
    keys (subprocesses inherit the setting)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TILETUNE_SHIPPED", "off")
        yield


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """Empty in-memory caches and an empty store for one test; autotuning on."""
    monkeypatch.setenv("TILETUNE_CACHE_DIR", str(tmp_path / "store"))
    monkeypatch.delenv("DISABLE_AUTOTUNE", raising=False)
    tiletune.clear_cache()
    yield tmp_path / "store"
    tiletune.clear_cache()


def disable_autotune(monkeypatch):
    """DISABLE_AUTOTUNE=1 for one test, and any search at all fails it."""
    from tiletune import timing
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    monkeypatch.setattr(timing, "search_kernels", lambda *a, **k: pytest.fail("search"))


def tuned_or_disabled(monkeypatch, disable, case, tuned):
    """DISABLE_AUTOTUNE=1 when `disable`; otherwise skip `case` unless it is in `tuned` (each
    search compiles the op's whole space, so only a few cases run tuned)."""
    if disable:
        disable_autotune(monkeypatch)
    elif case not in tuned:
        pytest.skip("tuned only for a few cases (every search compiles the whole space)")


def each_config(monkeypatch, tuner, space):
    """Yield each config of `space` with it installed as `tuner`'s only (default) config and the
    caches cleared, under DISABLE_AUTOTUNE (any search fails the test): the every-config tests'
    loop."""
    disable_autotune(monkeypatch)
    for cfg in space:
        monkeypatch.setattr(tuner, "configs", lambda *a, _c=cfg, **kw: iter([_c]))
        tiletune.clear_cache()
        yield cfg


def assert_each_cta_loops(tiles, cfg, trips=3):
    """A persistent grid over `tiles` at cfg's occupancy (in clusters of cfg.num_ctas CTAs)
    gives each CTA or cluster at least `trips` tiles: the every-config tests' shapes where a
    CTA's tile loop wraps (tileiras 13.4 built TMA loops that went wrong only there:
    references/hardware-constraints.md)."""
    from tiletune.device import persistent_ctas
    ctas = persistent_ctas(tiles, 0, cfg.occupancy, getattr(cfg, "num_ctas", 1))
    assert tiles >= trips * ctas, (tiles, ctas, vars(cfg))


def poison_allocator(torch):
    """Make the caching allocator hand out NaN-filled memory, so unwritten outputs show up.
    - Cached blocks go back to the driver first: the block a previous output freed (in an
      every-config loop, the previous config's correct result) would be the next one handed
      out.
    - All bits set is NaN in every float dtype (float32, bf16, fp16, e4m3, e5m2); a float32
      NaN's bytes read as 0.0 in half the elements of a 2-byte dtype.
    - One large block poisons the large pool (requests over 1 MiB); 1 MiB blocks poison the
      small pool that serves the rest (2 MiB segments)."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free = torch.cuda.mem_get_info()[0]
    n = min(free // 4, 1 << 28)          # up to 256 MiB, then released to the cache
    large = torch.full((n // 4,), -1, dtype=torch.int32, device="cuda")
    small = [torch.full(((1 << 20) // 4,), -1, dtype=torch.int32, device="cuda")
             for _ in range(64)]
    torch.cuda.synchronize()
    del large, small


def run_example_pair(folder):
    """Run assets/examples/<folder>/{fixed,autotuned}_launch.py; return their key=value lines."""
    import os
    import subprocess
    import sys
    ex = os.path.join(os.path.dirname(__file__), "..", "..", "assets", "examples", folder)
    res = {}
    # the autotuned example searches even where the suite runs under DISABLE_AUTOTUNE=1
    env = {k: v for k, v in os.environ.items() if k != "DISABLE_AUTOTUNE"}
    env["TILETUNE_CACHE_DIR"] = "off"
    for name in ("fixed", "autotuned"):
        o = subprocess.run([sys.executable, os.path.join(ex, f"{name}_launch.py")],
                           capture_output=True, text=True, timeout=600, env=env)
        assert o.returncode == 0, o.stderr[-2000:]
        res[name] = dict(line.split("=", 1) for line in o.stdout.splitlines() if "=" in line)
    return res["fixed"], res["autotuned"]


def assert_pair_agrees(fixed, tuned, rel=2e-3):
    """The example pair's outputs differ by at most about `rel` of their norm: their squared
    norms (`checksum`) within 2 rel, and their projections on one random vector (`projection`,
    which any wrong or misplaced value moves; the difference of two projections is a normal
    variable with the outputs' distance as its deviation) within 4 rel of the norm."""
    na, nb = float(fixed["checksum"]), float(tuned["checksum"])
    pa, pb = float(fixed["projection"]), float(tuned["projection"])
    assert abs(na - nb) <= 2 * rel * na, (fixed, tuned)
    assert abs(pa - pb) <= 4 * rel * na ** 0.5, (fixed, tuned)


def rotate_half(x):
    """HF's rotate_half: (-second half, first half) of the last dim."""
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


def assert_rows_close(out, ref, tol, what="output", row_scale=None):
    """Each row (the last dim) of `out` within `tol` of `ref`'s, relative to that row's norm or,
    for rows much smaller than the others, to the typical row's norm (a near-zero row is measured
    against the scale of its neighbours, not its own); `row_scale` (one value a row), where the
    errors scale with something other than the result (a difference of larger terms). A
    whole-tensor relative norm hides one wrong row or tile among thousands (one wrong row of
    20011 moves it by 0.007); per row, a wrong row reads about 1. NaN or inf anywhere fails."""
    o = out.detach().double().reshape(-1, out.shape[-1]) if out.dim() else out.double().view(1, 1)
    r = ref.detach().double().reshape(-1, o.shape[-1])
    assert o.shape == r.shape, (tuple(out.shape), tuple(ref.shape))
    if o.numel() == 0:
        return
    bad = ~torch.isfinite(o)
    assert not bad.any(), f"{what}: {int(bad.sum())} non-finite values, first at row " \
                          f"{int(bad.any(1).nonzero()[0])}"
    if row_scale is not None:
        scale = row_scale.detach().double().reshape(-1).clamp_min(1e-30)
    else:
        scale = r.norm(dim=1)
        scale = torch.maximum(scale, r.norm() / o.shape[0] ** 0.5 * 0.5)
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    err = (o - r).norm(dim=1) / scale
    worst = int(err.argmax())
    assert err[worst] < tol, f"{what}: row {worst} of {o.shape[0]} off by {err[worst]:.3g} " \
                             f"(tolerance {tol}); the median row {err.median():.3g}"


_MANTISSA_BITS = {torch.float32: 23, torch.float16: 10, torch.bfloat16: 7}


def assert_rounded_once(out, ref, max_off=0.01, what="output"):
    """`out` is `ref` (float64, exact) rounded once to out's dtype, to nearest: every element
    within one unit in the last place of the correctly rounded value, and at most `max_off` of
    them not equal to it (a float32 intermediate lands on the other side of a rounding boundary
    now and then). A kernel that truncates, or rounds twice through a narrower type, misses
    about half the elements, which the element-wise ops' relative tolerances let pass."""
    want = ref.detach().to(out.dtype)
    o, w = out.detach().double(), want.double()
    assert torch.isfinite(o).all(), f"{what}: non-finite values"
    tiny = torch.finfo(out.dtype).tiny
    ulp = torch.exp2(torch.floor(torch.log2(w.abs().clamp_min(tiny)))
                     - _MANTISSA_BITS[out.dtype])
    far = (o - w).abs() > ulp * 1.0001
    assert not far.any(), f"{what}: {int(far.sum())} elements more than one ulp from the " \
                          f"correctly rounded value, e.g. {o[far][0]:.6g} for {w[far][0]:.6g}"
    off = float((o != w).double().mean()) if o.numel() else 0.0
    assert off <= max_off, f"{what}: {off:.3%} of the elements differ from the correctly " \
                           f"rounded value (at most {max_off:.1%} for one rounding to nearest)"
