"""RoPE on the GPU against a float64 reference of HF's apply_rotary_pos_emb on random data."""
import pytest
import torch

from tiletune import timing
from tiletune.ops import rope as R
from tiletune.ops.rope import apply_rope, apply_rotary_pos_emb
from tiletune.space import next_pow2

from .conftest import (assert_pair_agrees, assert_rounded_once, assert_rows_close,
                       disable_autotune, each_config, poison_allocator, run_example_pair)

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def make(B, Hq, Hk, S, D, R_, dt, batched_cos=False, rows=None):
    q = torch.randn(B, S, Hq, D, device="cuda", dtype=dt).transpose(1, 2)   # HF layout: a view
    k = torch.randn(B, S, Hk, D, device="cuda", dtype=dt).transpose(1, 2)
    rows = rows or S
    ang = torch.rand(B if batched_cos else 1, rows, R_, device="cuda", dtype=torch.float64) * 6.3
    cos, sin = ang.cos().to(dt), ang.sin().to(dt)      # halves differ: a general cos/sin
    return q, k, cos, sin


def reference(q, k, cos, sin, pos, R_):
    cos, sin = cos.double(), sin.double()
    B, S = q.shape[0], q.shape[2]
    if pos is not None:
        idx = pos.expand(B, S)
        cos = torch.stack([cos[min(b, cos.shape[0] - 1)][idx[b]] for b in range(B)])
        sin = torch.stack([sin[min(b, sin.shape[0] - 1)][idx[b]] for b in range(B)])
    else:
        cos, sin = cos[:, :S].expand(B, S, R_), sin[:, :S].expand(B, S, R_)
    cos, sin = cos[:, None], sin[:, None]

    def rot(x):
        x = x.double()
        xr, xp = x[..., :R_], x[..., R_:]
        h = R_ // 2
        rh = torch.cat((-xr[..., h:], xr[..., :h]), -1)
        return torch.cat((xr * cos + rh * sin, xp), -1)
    return rot(q), rot(k)


def rel(a, b):
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm()).item()


def assert_rotated(got, want, dt, f32=True, what="output"):
    """Each row (one head at one position, over D) within TOL[dt] of the float64 reference
    `want` (a whole-tensor norm hides one wrong row or tile among thousands). f32: the rotation's
    arithmetic is float32 (compute_dtype's default), one rounding at the store; with 16-bit q and
    cos/sin of q's dtype every product is exact in float32, so a 16-bit result is `want` rounded
    once to nearest, checked element by element (a store that truncates misses it in about
    half the elements, math through 16-bit intermediates in a fifth; both pass TOL)."""
    assert_rows_close(got, want, TOL[dt], what)
    if f32 and dt != torch.float32:
        assert_rounded_once(got, want, what=what)


def assert_gradients_match(qo, ko, qg, kg, q, k, cos, sin, pos, R_, dt, f32=True, what=""):
    """The backward of (qo, ko) = rope(qg, kg) against float64 autograd of the reference (the
    backward is the rotation with the transposed sines: assert_rotated's contract alike)."""
    dq, dk = torch.randn_like(qo), torch.randn_like(ko)
    gq, gk = torch.autograd.grad((qo, ko), (qg, kg), (dq, dk))
    q64, k64 = q.double().requires_grad_(), k.double().requires_grad_()
    rq, rk = reference(q64, k64, cos, sin, pos, R_)
    eq, ek = torch.autograd.grad((rq, rk), (q64, k64), (dq.double(), dk.double()))
    assert_rotated(gq, eq, dt, f32, f"dq {what}")
    assert_rotated(gk, ek, dt, f32, f"dk {what}")


CASES = [  # B, Hq, Hk, S, D, R, position_ids, batched cos
    (2, 32, 8, 423, 128, 128, False, False),
    (1, 8, 1, 97, 64, 64, True, False),
    (3, 7, 1, 51, 80, 40, False, True),       # odd heads, D 80, partial rotary 0.5
    (2, 12, 4, 33, 80, 80, True, True),
]


DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# Every case x dtype with the default config; tuned (a forward and a backward search, ~12 s
# each) on two of them: test_every_config_is_correct covers what else a search may pick.
RUNS = ([(c, dt, True) for c in CASES for dt in DTYPES] +
        [(CASES[0], torch.bfloat16, False), (CASES[2], torch.float16, False)])


@pytest.mark.parametrize("case,dt,disable", RUNS,
                         ids=[f"{c}-{dt}-{'DISABLE_AUTOTUNE' if d else 'tuned'}" for c, dt, d in RUNS])
def test_forward_backward(fresh, monkeypatch, case, dt, disable):
    if disable:
        disable_autotune(monkeypatch)
    B, Hq, Hk, S, D, R_, with_pos, batched = case
    q, k, cos, sin = make(B, Hq, Hk, S, D, R_, dt, batched, rows=S + 5)
    pos = torch.randint(0, S + 5, (1, S), device="cuda") if with_pos else None
    qg, kg = q.detach().requires_grad_(), k.detach().requires_grad_()
    qo, ko = apply_rope(qg, kg, cos, sin, position_ids=pos)
    rq, rk = reference(q, k, cos, sin, pos, R_)
    assert_rotated(qo, rq, dt, what="q_embed")
    assert_rotated(ko, rk, dt, what="k_embed")
    assert qo.shape == q.shape and qo.stride() == q.stride()
    assert_gradients_match(qo, ko, qg, kg, q, k, cos, sin, pos, R_, dt)


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
@pytest.mark.parametrize("shape", [(2, 8, 2, 423, 80, 40), (1, 32, 8, 77, 128, 128),
                                   (4, 32, 8, 2047, 128, 128), (2, 64, 8, 301, 128, 128),
                                   (1, 128, 16, 97, 128, 128), (2, 40, 8, 301, 128, 128),
                                   (2, 4, 1, 423, 64, 64), (1, 4, 1, 512, 64, 64)], ids=str)
def test_every_config_is_correct(fresh, monkeypatch, shape, inplace):
    """Not only the winner: each config of the space (positions per tile over a ragged S,
    persistent grids; at 4 x 2047 positions each persistent CTA makes 7 or more trips of its
    loop, where tileiras 13.4 built TMA variants of this kernel that went wrong:
    references/hardware-constraints.md) rotates correctly. Whole tiles (no bounds checks) at
    the power-of-two head counts, and for positions tiles where S fills them (4 heads over 512
    positions, not over 423); bounds checked at 40 heads and at a half of 20."""
    B, Hq, Hk, S, D, R_ = shape
    q, k, cos, sin = make(B, Hq, Hk, S, D, R_, torch.bfloat16)
    rq, rk = reference(q, k, cos, sin, None, R_)
    tuner = R._rope_inplace if inplace else R._rope
    space = list(R.rope_tile_configs("sm_90", Hq, R_))
    per_position = next_pow2(Hq) * 2 * next_pow2(R_ // 2)      # q elements a position, padded
    # multi-position tiles at the first shape only; 8-warp entries at the last two
    assert (len({c.tile_s for c in space}) > 1) == (per_position <= R.MAX_MULTI_POSITION)
    assert any(getattr(c, "num_worker_warps", 4) == 8 for c in space) == \
        (per_position >= R.EIGHT_WARPS)
    for cfg in each_config(monkeypatch, tuner, space):
        qi, ki = q.clone(), k.clone()           # HF-layout strides kept by clone
        poison_allocator(torch)                 # out of place: unwritten outputs show as NaN
        qo, ko = apply_rope(qi, ki, cos, sin, inplace=inplace)
        assert_rotated(qo, rq, torch.bfloat16, what=f"q_embed {vars(cfg)}")
        assert_rotated(ko, rk, torch.bfloat16, what=f"k_embed {vars(cfg)}")


def hf_eager(q, k, cos, sin, R_, magnitude=False):
    """HF's apply_rotary_pos_emb as eager torch runs it on q/k/cos/sin of one 16-bit dtype:
    every product and sum rounded to that dtype. magnitude: |x1 c| + |x2 s| per element in
    float64 instead (the scale of each output's rounding errors)."""
    S = q.shape[2]
    c, s = cos[:, None, :S], sin[:, None, :S]
    if magnitude:
        q, k, c, s = q.double().abs(), k.double().abs(), c.double().abs(), s.double().abs()

    def rot(x):
        xr, xp = x[..., :R_], x[..., R_:]
        h = R_ // 2
        half = xr[..., h:] if magnitude else -xr[..., h:]
        return torch.cat((xr * c + torch.cat((half, xr[..., :h]), -1) * s, xp), -1)
    return rot(q), rot(k)


ROUNDED = [(CASES[0], torch.bfloat16, False, True), (CASES[2], torch.float16, True, True),
           (CASES[1], torch.bfloat16, True, False), (CASES[3], torch.bfloat16, False, False)]


@pytest.mark.parametrize("case,dt,inplace,disable", ROUNDED,
                         ids=[f"{c}-{dt}-{'inplace' if i else 'out'}-"
                              f"{'DISABLE_AUTOTUNE' if d else 'tuned'}" for c, dt, i, d in ROUNDED])
def test_compute_dtype_rounds_as_hf_eager(fresh, monkeypatch, case, dt, inplace, disable):
    """compute_dtype=q.dtype: forward and backward within the float64 reference's tolerance,
    and no further from it, element by element, than HF's eager code in that dtype plus one
    rounding of the products (another rounding order), in place and out of place."""
    if disable:
        disable_autotune(monkeypatch)
    B, Hq, Hk, S, D, R_, with_pos, batched = case
    q, k, cos, sin = make(B, Hq, Hk, S, D, R_, dt, batched)
    rq, rk = reference(q, k, cos, sin, None, R_)
    hq, hk = hf_eager(q, k, cos, sin, R_)
    mq, mk = hf_eager(q, k, cos, sin, R_, magnitude=True)
    if inplace:
        qo, ko = apply_rope(q.clone(), k.clone(), cos, sin, inplace=True, compute_dtype=dt)
    else:
        poison_allocator(torch)
        qo, ko = apply_rope(q, k, cos, sin, compute_dtype=dt)
    ulp = torch.finfo(dt).eps
    for ours, hf, ref, mag in ((qo, hq, rq, mq), (ko, hk, rk, mk)):
        assert_rows_close(ours, ref, TOL[dt])
        bound = (hf.double() - ref).abs() + ulp * mag
        assert ((ours.double() - ref).abs() <= bound).all()
    assert not torch.equal(qo, apply_rope(q, k, cos, sin)[0]) or dt == torch.float32
    qg, kg = q.detach().requires_grad_(), k.detach().requires_grad_()
    qo, ko = apply_rope(qg, kg, cos, sin, compute_dtype=dt)
    assert_gradients_match(qo, ko, qg, kg, q, k, cos, sin, None, R_, dt, f32=False)


def test_every_config_is_correct_with_bf16_math(fresh, monkeypatch):
    q, k, cos, sin = make(1, 32, 8, 77, 128, 128, torch.bfloat16)
    rq, rk = reference(q, k, cos, sin, None, 128)
    space = list(R.rope_tile_configs("sm_90", 32, 128))
    for cfg in each_config(monkeypatch, R._rope_inplace, space):
        qi, ki = q.clone(), k.clone()
        qo, ko = apply_rope(qi, ki, cos, sin, inplace=True, compute_dtype=torch.bfloat16)
        assert_rows_close(qo, rq, TOL[torch.bfloat16], f"q_embed {vars(cfg)}")
        assert_rows_close(ko, rk, TOL[torch.bfloat16], f"k_embed {vars(cfg)}")


def test_inplace_search_leaves_inputs_intact(fresh, monkeypatch):
    q, k, cos, sin = make(2, 32, 8, 300, 128, 128, torch.bfloat16)
    q, k = q.contiguous(), k.contiguous()
    q0, k0 = q.clone(), k.clone()
    real = timing.search_kernels
    seen = []

    def checked(*a, **kw):
        res = real(*a, **kw)
        seen.append(torch.equal(q, q0) and torch.equal(k, k0))   # untouched by every sample
        return res
    monkeypatch.setattr(timing, "search_kernels", checked)
    qo, ko = apply_rope(q, k, cos, sin, inplace=True)
    assert seen == [True] and qo is q and ko is k
    rq, rk = reference(q0, k0, cos, sin, None, 128)
    assert_rotated(q, rq, torch.bfloat16, what="q")
    assert_rotated(k, rk, torch.bfloat16, what="k")
    searches = R._rope_inplace.searches
    apply_rope(q, k, cos, sin, inplace=True)
    assert R._rope_inplace.searches == searches == 1


def test_second_call_does_not_search(fresh):
    q, k, cos, sin = make(2, 8, 2, 200, 64, 64, torch.float16)
    apply_rope(q, k, cos, sin)
    apply_rope(q, k, cos, sin)
    assert R._rope.searches == 1


def test_hf_functional_form(fresh):
    q, k, cos, sin = make(2, 8, 2, 64, 64, 64, torch.bfloat16)
    qo, ko = apply_rotary_pos_emb(q, k, cos.expand(2, -1, -1), sin.expand(2, -1, -1))
    rq, rk = reference(q, k, cos, sin, None, 64)
    # (bf16 q and cos: HF's promotion computes in bf16, not float32 with one rounding)
    assert_rows_close(qo, rq, TOL[torch.bfloat16], "q_embed")
    assert_rows_close(ko, rk, TOL[torch.bfloat16], "k_embed")


@pytest.mark.parametrize("layout", ["transposed", "every_other_column", "batch_expanded"])
@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
def test_cos_sin_tables_of_any_strides(fresh, monkeypatch, layout, inplace):
    """cos/sin as views whose column stride is not 1 (a transposed (R, S) table, every other
    column of a wider one) or a stride-0 batch: the same rotation as the contiguous table."""
    disable_autotune(monkeypatch)
    B, Hq, Hk, S, D = 2, 8, 2, 77, 128
    q, k, cos, sin = make(B, Hq, Hk, S, D, D, torch.bfloat16)
    if layout == "transposed":
        view = lambda t: t[0].t().contiguous().t()               # (S, R), strides (1, S)
    elif layout == "every_other_column":
        view = lambda t: torch.stack((t, -t), -1).flatten(-2)[..., ::2]
    else:
        view = lambda t: t.expand(B, S, D)
    cv, sv = view(cos), view(sin)
    assert cv.stride(-1) != 1 or cv.stride(0) == 0
    torch.testing.assert_close(cv.expand(B, S, D), cos.expand(B, S, D), rtol=0, atol=0)
    rq, rk = reference(q, k, cos, sin, None, D)
    qo, ko = apply_rope(q.clone(), k.clone(), cv, sv, inplace=inplace)
    assert_rotated(qo, rq, torch.bfloat16, what="q_embed")
    assert_rotated(ko, rk, torch.bfloat16, what="k_embed")


def test_bad_input():
    q, k, cos, sin = make(1, 8, 2, 16, 64, 64, torch.float32)
    with pytest.raises(ValueError, match="head_dim"):
        apply_rope(q, k[..., :32], cos, sin)
    with pytest.raises(ValueError, match="multiple"):
        apply_rope(q, torch.randn(1, 3, 16, 64, device="cuda"), cos, sin)
    with pytest.raises(ValueError, match="fewer than S"):
        apply_rope(q, k, cos[:, :8], sin[:, :8])
    with pytest.raises(ValueError, match="outside"):
        apply_rope(q, k, cos, sin, position_ids=torch.full((1, 16), 16, device="cuda"))
    with pytest.raises(ValueError, match="even"):
        apply_rope(q, k, cos, sin, rotary_dim=63)
    with pytest.raises(ValueError, match="CUDA"):
        apply_rope(q.cpu(), k, cos, sin)
    with pytest.raises(TypeError, match="dtype"):
        apply_rope(q.double(), k, cos, sin)
    with pytest.raises(ValueError, match="compute_dtype"):
        apply_rope(q.half(), k.half(), cos, sin, compute_dtype=torch.bfloat16)


def test_torch_compile_fullgraph(fresh):
    q, k, cos, sin = make(2, 8, 2, 64, 64, 64, torch.bfloat16)
    qg, kg = q.detach().requires_grad_(), k.detach().requires_grad_()

    def f(q, k):
        qo, ko = apply_rope(q * 1, k * 1, cos, sin)
        return qo.float().square().sum() + ko.float().sum()
    eager = f(qg, kg)
    ge = torch.autograd.grad(eager, (qg, kg))
    out = torch.compile(f, fullgraph=True)(qg, kg)
    gc = torch.autograd.grad(out, (qg, kg))
    torch.testing.assert_close(out, eager)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b)


def test_inplace_autograd_and_compile(fresh):
    """In place: the outputs are the inputs (marked dirty), gradients as out of place; under
    torch.compile(fullgraph=True) the out-of-place op runs and is copied back."""
    q, k, cos, sin = make(2, 8, 2, 64, 64, 64, torch.bfloat16)
    qg, kg = q.detach().requires_grad_(), k.detach().requires_grad_()

    def loss(qo, ko):
        return qo.float().square().sum() + ko.float().sum()
    qo, ko = apply_rope(qg, kg, cos, sin)
    want = torch.autograd.grad(loss(qo, ko), (qg, kg))
    qi, ki = qg * 1, kg * 1                     # not leaves: may be rotated in place
    qo2, ko2 = apply_rope(qi, ki, cos, sin, inplace=True)
    assert qo2 is qi and ko2 is ki
    assert_rows_close(qo2, qo, TOL[torch.bfloat16], "q in place")
    assert_rows_close(ko2, ko, TOL[torch.bfloat16], "k in place")
    got = torch.autograd.grad(loss(qo2, ko2), (qg, kg))
    for a, b in zip(got, want):
        assert_rows_close(a, b, TOL[torch.bfloat16], "gradient in place")

    def f(q, k):
        q, k = q.clone(), k.clone()
        apply_rope(q, k, cos, sin, inplace=True)
        return q, k
    cq, ck = torch.compile(f, fullgraph=True)(q, k)
    torch.testing.assert_close(cq, qo.detach())
    torch.testing.assert_close(ck, ko.detach())
    with pytest.raises(ValueError, match="leaf"):
        apply_rope(qg, kg, cos, sin, inplace=True)


def test_example_pair_runs_and_agrees():
    fixed, tuned = run_example_pair("03_rope_inplace_splitbuffer")
    assert_pair_agrees(fixed, tuned)
    assert float(tuned["us"]) <= 1.05 * float(fixed["us"])


@pytest.mark.parametrize("every", [False, True], ids=["default", "every_config"])
@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_inplace_position_ids_per_batch_row(fresh, monkeypatch, dt, every):
    """In place with (B, S) position_ids that differ from one batch row to the next (any rows
    of cos/sin, in range): each batch row rotates by its own positions, with the default config
    and with each config of the in-place space for positions (one position a tile; at 3 x 777
    positions each persistent CTA makes two or more trips of its loop). Partial rotary: the
    pass-through dims stay as they are."""
    B, Hq, Hk, S, D, R_ = 3, 8, 2, 777, 80, 40
    q, k, cos, sin = make(B, Hq, Hk, S, D, R_, dt, rows=S + 5)
    pos = torch.randint(0, S + 5, (B, S), device="cuda")
    assert not (pos == pos[:1]).all()
    rq, rk = reference(q, k, cos, sin, pos, R_)
    space = list(R.rope_tile_configs("sm_90", Hq, R_, has_pos=True))
    assert all(c.tile_s == 1 for c in space)
    if every:
        configs = each_config(monkeypatch, R._rope_inplace, space)
    else:
        disable_autotune(monkeypatch)
        configs = [space[0]]
    for cfg in configs:
        qi, ki = q.clone(), k.clone()           # HF-layout strides kept by clone
        qo, ko = apply_rope(qi, ki, cos, sin, position_ids=pos, inplace=True)
        assert qo is qi and ko is ki
        assert_rotated(qo, rq, dt, what=f"q {vars(cfg)}")
        assert_rotated(ko, rk, dt, what=f"k {vars(cfg)}")


def test_position_ids_written_between_calls(fresh):
    """position_ids' range is kept per tensor and version between calls: ids written in place
    after a first call rotate by their new values, a written id outside cos/sin is refused by
    name, and ids written where torch counts no version (.data) still reach the kernel as they
    are (only the range is kept, not the ids)."""
    B, Hq, Hk, S, D, R_ = 2, 32, 8, 301, 128, 128
    q, k, cos, sin = make(B, Hq, Hk, S, D, R_, torch.bfloat16, rows=S + 9)
    ids = torch.randint(0, S + 9, (B, S), device="cuda")
    for write in (None, lambda: ids.copy_(torch.randint(0, S + 9, (B, S), device="cuda")),
                  lambda: ids.data.copy_(torch.randint(0, S + 9, (B, S), device="cuda"))):
        if write is not None:
            write()
        rq, rk = reference(q, k, cos, sin, ids, R_)
        qo, ko = apply_rope(q, k, cos, sin, position_ids=ids)
        assert_rotated(qo, rq, torch.bfloat16, what="q_embed")
        assert_rotated(ko, rk, torch.bfloat16, what="k_embed")
    ids[1, 7] = S + 9
    with pytest.raises(ValueError, match=r"^apply_rope: position_ids range .* is outside"):
        apply_rope(q, k, cos, sin, position_ids=ids)


@pytest.mark.parametrize("shape,with_pos", [((2, 8, 2, 423, 80, 40), False),
                                            ((2, 8, 2, 423, 80, 40), True),
                                            ((4, 32, 8, 2047, 128, 128), False),
                                            ((2, 64, 8, 301, 128, 128), False),
                                            ((1, 128, 16, 97, 128, 128), True),
                                            ((2, 40, 8, 301, 128, 128), False)], ids=str)
def test_every_config_backward_is_correct(fresh, monkeypatch, shape, with_pos):
    """The out-of-place backward (the rotation with BACKWARD) under each config of the space,
    forward and gradients from poisoned memory (unwritten elements show as NaN); with (B, S)
    position_ids, the space for positions."""
    B, Hq, Hk, S, D, R_ = shape
    q, k, cos, sin = make(B, Hq, Hk, S, D, R_, torch.bfloat16, rows=S + 5)
    pos = torch.randint(0, S + 5, (B, S), device="cuda") if with_pos else None
    rq, rk = reference(q, k, cos, sin, pos, R_)
    space = list(R.rope_tile_configs("sm_90", Hq, R_, has_pos=with_pos))
    for cfg in each_config(monkeypatch, R._rope, space):
        qg, kg = q.detach().requires_grad_(), k.detach().requires_grad_()
        poison_allocator(torch)
        qo, ko = apply_rope(qg, kg, cos, sin, position_ids=pos)
        assert_rotated(qo, rq, torch.bfloat16, what=f"q_embed {vars(cfg)}")
        assert_rotated(ko, rk, torch.bfloat16, what=f"k_embed {vars(cfg)}")
        poison_allocator(torch)
        assert_gradients_match(qo, ko, qg, kg, q, k, cos, sin, pos, R_, torch.bfloat16,
                               what=str(vars(cfg)))
