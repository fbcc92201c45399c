"""matmul on the GPU against a float32 reference on random data."""
import pytest
import torch

from tiletune.ops import matmul as MM
from tiletune.ops.matmul import matmul
from tiletune.space import cdiv

from .conftest import assert_each_cta_loops, disable_autotune, each_config, poison_allocator

# Relative Frobenius error against the float32 reference rounded to the output's dtype: what
# is left is float32 accumulation order, at most 1.6e-4 (bf16) and 5.6e-5 (fp16) for every
# config on an H200; a bf16 accumulator or one wrong element in 10^5 would pass the unrounded
# 1e-2 that output rounding alone forces.
TOL = {torch.bfloat16: 5e-4, torch.float16: 2e-4}


def rel(a, b):
    a, b = a.double(), b.to(a.dtype).double()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def operand(rows, cols, dt, transposed):
    """A (rows, cols) operand, row-major or as the transposed view of a (cols, rows) tensor."""
    if transposed:
        return torch.randn(cols, rows, device="cuda", dtype=dt).t()
    return torch.randn(rows, cols, device="cuda", dtype=dt)


SHAPES = [(1000, 1999, 777), (1, 4096, 4096), (4097, 33, 4095), (256, 256, 256), (64, 80, 48)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)],
                         ids=["NN", "TN", "NT", "TT"])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("disable", [False, True], ids=["tuned", "DISABLE_AUTOTUNE"])
def test_layouts_and_odd_sizes(fresh, monkeypatch, shape, ta, tb, dt, disable):
    if disable:
        disable_autotune(monkeypatch)
    elif shape != (1000, 1999, 777) or dt != torch.bfloat16:
        monkeypatch.setenv("DISABLE_AUTOTUNE", "1")   # one tuned case per layout keeps this quick
    M, N, K = shape
    a, b = operand(M, K, dt, ta), operand(K, N, dt, tb)
    poison_allocator(torch)
    c = matmul(a, b)
    assert c.shape == (M, N) and c.dtype == dt
    assert rel(c, a.float() @ b.float()) < TOL[dt]


@pytest.mark.parametrize("M,K", [(200, 333), (100, 333), (16, 2000)],
                         ids=["M200", "M100", "M16-K2000"])
def test_every_config_is_correct(fresh, monkeypatch, M, K):
    """Each config of the sm_90 space (not only the ones searches picked), on a ragged batched
    problem: tiles that overhang M, N and K, clusters, persistent grids, split-K (2, 4 and 8
    ways at K = 2000), every batch index written; and (M200, M16) on one product of it as 2-D
    operands, the kernels' other specialization."""
    a = torch.randn(3, M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(3, K, 270, device="cuda", dtype=torch.bfloat16).transpose(1, 2).contiguous() \
        .transpose(1, 2)                               # column-major B
    ref = a.float() @ b.float()
    for cfg in each_config(monkeypatch, MM._matmul, list(MM.matmul_configs("sm_90", M, 270, K))):
        poison_allocator(torch)                        # unwritten outputs / partials show as NaN
        assert rel(matmul(a, b), ref) < TOL[torch.bfloat16], vars(cfg)
        if M != 100:
            poison_allocator(torch)
            assert rel(matmul(a[1], b[1]), ref[1]) < TOL[torch.bfloat16], ("2-D", vars(cfg))


def test_persistent_configs_loop_over_many_tiles(fresh, monkeypatch):
    """Each persistent config of the sm_90 space where every CTA (or cluster) makes at least
    three trips of its tile loop, so the loads of a CTA's next tile overlap the one before
    (tileiras 13.4 built TMA loops of other kernels that went wrong only there:
    references/hardware-constraints.md); ragged in M and N, batched."""
    Z, M, N, K = 4, 2000, 1999, 1000
    a = torch.randn(Z, M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(Z, K, N, device="cuda", dtype=torch.bfloat16)
    ref = a.float() @ b.float()
    cfgs = [c for c in MM.matmul_configs("sm_90", M, N, K, Z) if c.persistent]
    assert cfgs
    for cfg in each_config(monkeypatch, MM._matmul, cfgs):
        poison_allocator(torch)
        assert rel(matmul(a, b), ref) < TOL[torch.bfloat16], vars(cfg)
        assert_each_cta_loops(Z * cdiv(M, cfg.tm) * cdiv(N, cfg.tn), cfg)


def test_two_d_and_batch_of_one_share_a_key(fresh):
    """A 2-D product and the same product as a batch of one take the same key (one search) and
    launch the kernels' 2-D and 3-D specializations of its winner; both orders."""
    for M, first_2d in ((300, True), (150, False)):
        a = torch.randn(M, 512, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(512, 384, device="cuda", dtype=torch.bfloat16)
        ref = a.float() @ b.float()
        calls = [(a, b), (a[None], b[None])]
        for x, y in calls if first_2d else calls[::-1]:
            poison_allocator(torch)
            c = matmul(x, y)
            assert c.shape == (*x.shape[:-1], 384)
            assert rel(c.reshape(M, 384), ref) < TOL[torch.bfloat16]
    assert len(MM._matmul.cache) == 2      # one search per M bucket


def test_batched_and_gradients(fresh, monkeypatch):
    # default configs: this test is about batching and gradients (tuned gradients, 2-D:
    # test_tuned_gradients)
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    a = torch.randn(3, 130, 70, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(3, 70, 90, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    c = matmul(a, b)
    ref_a, ref_b = a.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    ref = ref_a @ ref_b
    assert rel(c, ref) < TOL[torch.bfloat16]
    dc = torch.randn_like(c)
    ga, gb = torch.autograd.grad(c, (a, b), dc)
    ea, eb = torch.autograd.grad(ref, (ref_a, ref_b), dc.float())
    assert rel(ga, ea) < TOL[torch.bfloat16] and rel(gb, eb) < TOL[torch.bfloat16]


def test_tuned_gradients(fresh):
    """Tuned: the forward, dA (dC @ B^T, a transposed view) and dB (A^T @ dC) each search their
    own key once and give the float32 gradients; a second step searches nothing."""
    a = torch.randn(300, 500, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(200, 500, device="cuda", dtype=torch.bfloat16).t().requires_grad_()
    ref_a, ref_b = a.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    ref = ref_a @ ref_b
    for step in range(2):
        dc = torch.randn(300, 200, device="cuda", dtype=torch.bfloat16)
        poison_allocator(torch)
        c = matmul(a, b)
        ga, gb = torch.autograd.grad(c, (a, b), dc)
        ea, eb = torch.autograd.grad(ref, (ref_a, ref_b), dc.float(), retain_graph=True)
        assert rel(c, ref) < TOL[torch.bfloat16]
        assert rel(ga, ea) < TOL[torch.bfloat16] and rel(gb, eb) < TOL[torch.bfloat16]
        assert MM._matmul.searches == 3, step
    assert len(MM._matmul.records) == 3
    assert all(r.source == "search" for r in MM._matmul.records.values())


def test_batch_past_the_grid_cap(fresh, monkeypatch):
    """A batch of more than MAX_BATCH products (a grid's second axis) runs in launches of at most
    MAX_BATCH, every product written (outputs poisoned first), the last chunk ragged."""
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    Z = MM.MAX_BATCH + 7
    a = torch.randn(Z, 16, 24, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(Z, 24, 8, device="cuda", dtype=torch.bfloat16)
    poison_allocator(torch)
    c = matmul(a, b)
    assert c.shape == (Z, 16, 8)
    assert rel(c, a.float() @ b.float()) < TOL[torch.bfloat16]
    assert torch.isfinite(c[-7:].float()).all() and torch.isfinite(c[:7].float()).all()


def test_out_compile_and_one_sided_gradient(fresh, monkeypatch):
    """`out=` receives a copy; torch.compile(fullgraph=True) runs the custom op forward and
    backward; with only A requiring grad the backward runs dA alone (two keys: C and dA)."""
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    a = torch.randn(64, 80, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(80, 48, device="cuda", dtype=torch.bfloat16)
    ref = a.float() @ b.float()
    out = torch.empty(64, 48, device="cuda", dtype=torch.bfloat16)
    assert matmul(a, b, out=out) is out and rel(out, ref) < TOL[torch.bfloat16]
    a.requires_grad_()
    dc = torch.randn(64, 48, device="cuda", dtype=torch.bfloat16)
    (ga,) = torch.autograd.grad(matmul(a, b), (a,), dc)
    assert rel(ga, dc.float() @ b.float().t()) < TOL[torch.bfloat16]
    assert len(MM._matmul.records) == 2
    compiled = torch.compile(lambda a, b: matmul(a, b), fullgraph=True)
    c = compiled(a, b)
    (cg,) = torch.autograd.grad(c, (a,), dc)
    assert rel(c, ref) < TOL[torch.bfloat16] and rel(cg, ga) < 1e-6


def test_new_m_in_same_bucket_does_not_search(fresh):
    b = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    matmul(torch.randn(300, 512, device="cuda", dtype=torch.bfloat16), b)
    matmul(torch.randn(400, 512, device="cuda", dtype=torch.bfloat16), b)
    assert MM._matmul.searches == 1


def test_the_search_settles_its_leaders_and_no_config_past_them(fresh):
    """Through cuTile's benchmark primitive on the GPU: the five fastest configs of a search end
    settled (their 95% interval within 1% of the mean or 0.5 us, or at the sampling budget), and
    every other config is settled too or its interval lies above the fifth fastest mean; at
    4096^3 some configs are far enough behind to stop at their first batch."""
    from tiletune import timing
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    assert rel(matmul(a, b), a.float() @ b.float()) < TOL[torch.bfloat16]
    (rec,) = MM._matmul.records.values()
    ts = sorted(rec.timings, key=lambda t: t["mean_us"])
    assert len(ts) > timing.SEARCH_LEADERS

    def settled(t):
        return t["samples"] >= timing.SEARCH_BATCH and (
            t["error_us"] <= 0.01 * t["mean_us"] or t["error_us"] <= 0.5 or
            t["samples"] >= timing.SEARCH_MAX_SAMPLES or
            t["mean_us"] * t["samples"] >= timing.SEARCH_MAX_SAMPLING_US)
    cutoff = ts[timing.SEARCH_LEADERS - 1]["mean_us"]
    assert all(settled(t) for t in ts[:timing.SEARCH_LEADERS]), ts
    assert all(settled(t) or t["mean_us"] - t["error_us"] >= cutoff for t in ts), ts
    assert any(t["samples"] == timing.SEARCH_BATCH for t in ts[timing.SEARCH_LEADERS:]), ts


def test_bad_input():
    a = torch.randn(8, 16, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="inner dims"):
        matmul(a, torch.randn(15, 4, device="cuda", dtype=torch.bfloat16))
    with pytest.raises(TypeError, match="differ|is torch"):
        matmul(a, torch.randn(16, 4, device="cuda", dtype=torch.float16))
    with pytest.raises(TypeError, match="dtype"):
        matmul(a.float(), a.float().t())
    with pytest.raises(TypeError, match="dtype"):
        matmul(a.to(torch.int32), a.t().to(torch.int32))
    with pytest.raises(ValueError, match="CUDA"):
        matmul(a.cpu(), a.t())


def test_example_pair_runs_and_agrees():
    """assets/examples/02: same result; the autotuned launch is not slower (5% timing slack)."""
    from .conftest import assert_pair_agrees, run_example_pair
    fixed, tuned = run_example_pair("02_matmul_full_search")
    assert_pair_agrees(fixed, tuned)
    assert float(tuned["us"]) <= float(fixed["us"]) * 1.05, (fixed, tuned)
