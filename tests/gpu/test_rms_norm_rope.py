"""Fused per-head RMSNorm + RoPE against a float64 reference (norm, then HF rotate_half)."""
import pytest
import torch

from tiletune.ops import rms_norm_rope as F
from tiletune.ops.rms_norm_rope import rms_norm_rope

from .conftest import (assert_each_cta_loops, assert_rows_close, disable_autotune, each_config,
                       poison_allocator)
from .test_rope import TOL, make, reference as rope_reference, rel


def reference(q, k, wq, wk, cos, sin, pos, R_, eps):
    def norm(x, w):
        x = x.double()
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.double()
    return rope_reference(norm(q, wq), norm(k, wk), cos, sin, pos, R_)


def assert_matches(got, want, tol):
    """Outputs and q/k gradients per row (one head at one position, over D: a whole-tensor norm
    hides one wrong row or tile among thousands); the weight gradients, one row each, whole.
    (No element-wise rounding check: the normalization rounds in float32 before the rotation's
    differences, which cancel, so a correct float32 kernel is not one rounding from float64.)"""
    for g, w, name in zip(got, want, ("q", "k", "q_weight", "k_weight")):
        if g.dim() > 1:
            assert_rows_close(g, w, tol, name)
        else:
            assert rel(g, w) < tol, name


CASES = [(2, 32, 8, 123, 128, 128, False), (3, 7, 1, 51, 80, 40, True)]
# Each case x dtype with the default config; tuned (forward and backward searches of 10 configs,
# 40-100 s of compiling on the GPU machine) on the small case.
RUNS = ([(c, dt, True) for c in CASES for dt in (torch.float32, torch.bfloat16)] +
        [(CASES[1], torch.float16, True), (CASES[1], torch.float32, False)])


def check(case, dt, eps=1e-6, x_scale=1.0):
    """Forward and the four gradients against the reference; outputs and gradients come from
    an allocator filled with NaN (poison_allocator), so anything left unwritten fails.
    x_scale: q and k multiplied by it (small inputs make eps matter)."""
    B, Hq, Hk, S, D, R_, with_pos = case
    q, k, cos, sin = make(B, Hq, Hk, S, D, R_, dt, rows=S + 3)
    if x_scale != 1:
        q, k = q * x_scale, k * x_scale         # (HF-layout strides kept)
    wq = torch.rand(D, device="cuda", dtype=dt) + 0.5
    wk = torch.rand(D, device="cuda", dtype=dt) + 0.5
    pos = torch.randint(0, S + 3, (B, S), device="cuda") if with_pos else None
    leaves = [t.detach().requires_grad_() for t in (q, k, wq, wk)]
    poison_allocator(torch)
    qo, ko = rms_norm_rope(*leaves, cos, sin, eps=eps, position_ids=pos)
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, wq, wk)]
    rq, rk = reference(*ref_leaves, cos, sin, pos, R_, eps)
    assert_matches((qo, ko), (rq, rk), TOL[dt])
    dq, dk = torch.randn_like(qo), torch.randn_like(ko)
    poison_allocator(torch)
    got = torch.autograd.grad((qo, ko), leaves, (dq, dk))
    want = torch.autograd.grad((rq, rk), ref_leaves, (dq.double(), dk.double()))
    assert_matches(got, want, 2 * TOL[dt])


@pytest.mark.parametrize("case,dt,disable", RUNS,
                         ids=[f"{c}-{dt}-{'DISABLE_AUTOTUNE' if d else 'tuned'}" for c, dt, d in RUNS])
def test_forward_backward(fresh, monkeypatch, case, dt, disable):
    if disable:
        disable_autotune(monkeypatch)
    check(case, dt)


# Every config of the forward and of the backward (the other on its default) on grids where a
# persistent CTA makes many trips of its position loop: tileiras 13.4 built TMA loops of other
# kernels that went wrong only there (references/hardware-constraints.md).
MANY_TRIPS = [(4, 32, 8, 4096, 128, 128, False), (2, 7, 1, 3001, 80, 40, True)]


@pytest.mark.parametrize("kernel", ["fwd", "bwd"])
@pytest.mark.parametrize("case", MANY_TRIPS, ids=str)
def test_every_config_is_correct(fresh, monkeypatch, case, kernel):
    tuner = F._fwd if kernel == "fwd" else F._bwd
    B, Hq, Hk, S, D, R_, _ = case
    space = F.fused_configs("sm_90", Hq + Hk, R_, backward=kernel == "bwd")
    for cfg in each_config(monkeypatch, tuner, list(space)):
        check(case, torch.bfloat16)
        assert [c for c, _ in tuner.cache.values()] == [cfg], vars(cfg)
        if cfg.persistent:
            assert_each_cta_loops(B * S, cfg)


@pytest.mark.parametrize("wdt", [torch.float32, torch.float16], ids=str)
def test_weight_dtype_differs(fresh, monkeypatch, wdt):
    """bf16 q and k with weights in another dtype (float32 master weights, say): outputs in
    q's dtype, weight gradients in the weights'."""
    disable_autotune(monkeypatch)
    B, Hq, Hk, S, D, R_, _ = CASES[1]
    q, k, cos, sin = make(B, Hq, Hk, S, D, R_, torch.bfloat16)
    wq = torch.rand(D, device="cuda", dtype=wdt) + 0.5
    wk = torch.rand(D, device="cuda", dtype=wdt) + 0.5
    leaves = [t.detach().requires_grad_() for t in (q, k, wq, wk)]
    qo, ko = rms_norm_rope(*leaves, cos, sin)
    assert qo.dtype == ko.dtype == torch.bfloat16
    ref_leaves = [t.detach().double().requires_grad_() for t in (q, k, wq, wk)]
    rq, rk = reference(*ref_leaves, cos, sin, None, R_, 1e-6)
    assert_matches((qo, ko), (rq, rk), TOL[torch.bfloat16])
    dq, dk = torch.randn_like(qo), torch.randn_like(ko)
    got = torch.autograd.grad((qo, ko), leaves, (dq, dk))
    want = torch.autograd.grad((rq, rk), ref_leaves, (dq.double(), dk.double()))
    assert got[2].dtype == got[3].dtype == wdt
    assert_matches(got, want, 2 * TOL[torch.bfloat16])


def test_torch_compile_fullgraph(fresh):
    """The TrainableOp's custom ops: forward and backward (weights included) as in eager."""
    q, k, cos, sin = make(2, 8, 2, 64, 128, 64, torch.bfloat16)
    wq = torch.rand(128, device="cuda", dtype=torch.bfloat16) + 0.5
    wk = torch.rand(128, device="cuda", dtype=torch.bfloat16) + 0.5
    leaves = [t.detach().requires_grad_() for t in (q, k, wq, wk)]

    def f(q, k, wq, wk):
        return rms_norm_rope(q * 1, k * 1, wq, wk, cos, sin)

    def loss(qo, ko):       # in eager: Inductor would sum in another order
        return qo.float().square().sum() + ko.float().sum()
    eager = f(*leaves)
    ge = torch.autograd.grad(loss(*eager), leaves)
    out = torch.compile(f, fullgraph=True)(*leaves)
    gc = torch.autograd.grad(loss(*out), leaves)
    for a, b in zip(out, eager):
        torch.testing.assert_close(a, b)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b)


def test_errors_name_the_function():
    q, k, cos, sin = make(1, 8, 2, 16, 64, 64, torch.float32)
    w = torch.ones(64, device="cuda")
    with pytest.raises(ValueError, match="^rms_norm_rope: q must be a CUDA tensor"):
        rms_norm_rope(q.cpu(), k.cpu(), w.cpu(), w.cpu(), cos.cpu(), sin.cpu())
    with pytest.raises(ValueError, match="^rms_norm_rope: rotary width"):
        rms_norm_rope(q, k, w, w, cos, sin, rotary_dim=63)
    with pytest.raises(ValueError, match="^rms_norm_rope: position_ids range"):
        rms_norm_rope(q, k, w, w, cos, sin, position_ids=torch.full((1, 16), 16, device="cuda"))
    with pytest.raises(ValueError, match="^rms_norm_rope: q_weight must have shape"):
        rms_norm_rope(q, k, w[:32], w, cos, sin)


@pytest.mark.parametrize("case", CASES, ids=str)
def test_eps(fresh, monkeypatch, case):
    """A non-default eps, large beside mean(x^2) (float32 inputs scaled by 0.5: about 0.25),
    reaches the forward and the backward."""
    disable_autotune(monkeypatch)
    check(case, torch.float32, eps=0.5, x_scale=0.5)


@pytest.mark.parametrize("B,S", [(0, 16), (2, 0)])
@pytest.mark.parametrize("with_pos", [False, True])
def test_empty_input(fresh, monkeypatch, B, S, with_pos):
    """B * S == 0: empty outputs and input gradients, zero weight gradients (in the weights'
    dtype)."""
    disable_autotune(monkeypatch)
    q, k, cos, sin = make(B, 8, 2, S, 64, 64, torch.bfloat16, rows=S + 3)
    wq = torch.rand(64, device="cuda", dtype=torch.float32) + 0.5
    wk = torch.rand(64, device="cuda", dtype=torch.float32) + 0.5
    pos = torch.randint(0, S + 3, (B, S), device="cuda") if with_pos else None
    leaves = [t.detach().requires_grad_() for t in (q, k, wq, wk)]
    qo, ko = rms_norm_rope(*leaves, cos, sin, position_ids=pos)
    assert qo.shape == q.shape and ko.shape == k.shape and qo.dtype == torch.bfloat16
    dq, dk = torch.randn_like(qo), torch.randn_like(ko)
    poison_allocator(torch)                      # an unwritten weight gradient shows as NaN
    got = torch.autograd.grad((qo, ko), leaves, (dq, dk))
    assert got[0].shape == q.shape and got[1].shape == k.shape
    for g, w in zip(got[2:], (wq, wk)):
        assert g.shape == w.shape and g.dtype == w.dtype
        assert not g.count_nonzero()
