"""FMHA forward and backward on the GPU against a float64 reference of masked softmax attention on
random data (tolerances: a CPU emulation of the kernels' tile loops with the same casts gave
relative errors of ~2.5e-3 (bf16) and ~3e-4 (fp16) on such cases). Outputs and gradients are
compared per row over D (assert_close): a CPU emulation of a correct kernel (float32 softmax,
P and dS rounded to the input dtype before their products, delta from the stored O) read at most
about 0.45 of the tolerance on any row of these tests' shapes."""
import math
from types import SimpleNamespace

import pytest
import torch

from tiletune.cases import fmha as FC
from tiletune.ops import fmha as FM
from tiletune.ops.fmha import fmha, scaled_dot_product_attention

from .conftest import (assert_rows_close, disable_autotune, each_config, poison_allocator,
                       tuned_or_disabled)

TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}     # relative Frobenius error
BF, FP = torch.bfloat16, torch.float16


def rel(a, b):
    """Relative Frobenius error; the floor keeps exactly-zero references (e.g. the gradient of a
    row that sees one key) from turning rounding noise into a huge ratio."""
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values"
    return ((a - b).norm() / max(b.norm().item(), 1e-3 * math.sqrt(b.numel()))).item()


def assert_close(got, exp, tol, what):
    """got within tol of exp per row over D (a query row of o and dq, a key row of dk and dv):
    one query tile missing one key tile moves a whole-tensor norm by about 0.008 (against 0.01),
    its rows by 0.2-0.3. A reference that is zero up to rounding everywhere (dq and dk where
    every row sees one key) has no row scale: compared as a whole, with rel()'s floor."""
    exp = exp.detach().double()
    if exp.norm() <= 1e-3 * math.sqrt(exp.numel()):
        assert rel(got, exp) < tol, what
    else:
        assert_rows_close(got, exp, tol, what)


def make(B, hq, hkv, sq, sk, d, dt, hf_layout=True, seed=0):
    """Random q, k, v; hf_layout: (B, S, H, D) storage seen as (B, H, S, D), as HF passes them."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def t(h, s):
        if hf_layout:
            return torch.randn(B, s, h, d, device="cuda", dtype=dt, generator=g).transpose(1, 2)
        return torch.randn(B, h, s, d, device="cuda", dtype=dt, generator=g)
    return t(hq, sq), t(hkv, sk), t(hkv, sk)


def reference(q, k, v, causal, offset, scale, lse=False):
    """float64 softmax attention with explicit masking; rows with no visible key give 0. lse:
    also each row's log-sum-exp of its scores, (B, Hq, Sq) (0 where no key is visible)."""
    group = q.shape[1] // k.shape[1]
    q, k, v = q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(q.shape[2], device=q.device)[:, None]
        j = torch.arange(k.shape[2], device=q.device)[None, :]
        s = s.masked_fill(j > i + offset, float("-inf"))
    m = s.amax(-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    l = p.sum(-1, keepdim=True)
    l = torch.where(l > 0, l, torch.ones_like(l))
    if lse:
        return (p / l) @ v, (m + torch.log(l))[..., 0]
    return (p / l) @ v


def check(q, k, v, causal, offset=None, scale=None, fn=None, whole="", **kw):
    """Forward and dq/dk/dv of fn (default fmha) against the reference; outputs are allocated
    from an allocator filled with NaN, so anything left unwritten fails. whole: the inputs
    ("qkv") whose gradients are compared as a whole only (check_grads)."""
    dt = q.dtype
    offset = (k.shape[2] - q.shape[2] if causal else 0) if offset is None else offset
    sc = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    poison_allocator(torch)
    o = (fn or (lambda a, b, c: fmha(a, b, c, causal=causal, scale=scale, **kw)))(qg, kg, vg)
    assert o.shape == q.shape and o.dtype == dt
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, lse = reference(q64, k64, v64, causal, offset, sc, lse=True)
    assert_close(o, ref, TOL[dt], "o")
    with torch.no_grad():            # no backward to feed: the same kernel, no LSE rows kept
        poison_allocator(torch)
        o_inference = (fn or (lambda a, b, c: fmha(a, b, c, causal=causal, scale=scale, **kw)))(
            q, k, v)
    assert torch.equal(o_inference, o)
    return o, check_grads(o, ref, lse, (qg, kg, vg), (q64, k64, v64), whole)


def expected_grads(o, do, ref, lse, inputs64):
    """float64 gradients of `ref` (with its row LSEs `lse`) for dO `do`: the exact ones, and
    the ones a backward gives from the forward's stored `o`. Its dS = P (dP - delta) takes
    delta = rowsum(dO * o) from that o (FlashAttention's), so o's own error, checked per row on
    its own, reaches dq and dk rows through delta: up to 1.6e-2 of a row (bf16, rows that see
    17 keys) in an emulation of a correct kernel, 4e-3 without it. The two differ by
    P (delta_exact - delta_o) in dS: the gradient of the LSEs for dLSE = delta_exact - delta_o."""
    do64 = do.double()
    exact = torch.autograd.grad(ref, inputs64, do64, retain_graph=True)
    shift = ((ref.detach() - o.detach().double()) * do64).sum(-1)
    moved = torch.autograd.grad(lse, inputs64, shift, retain_graph=True, allow_unused=True)
    given_o = [e if m is None else e + m for e, m in zip(exact, moved)]
    return exact, given_o


def check_grads(o, ref, lse, inputs, inputs64, whole=""):
    """Gradients of o (into poisoned memory) against those of its float64 reference `ref` for
    the same random dO: as a whole against the exact ones, per row against the ones from o's
    delta (expected_grads) but for the inputs named in `whole` ("qkv"); returns ours."""
    do = torch.randn_like(o)
    poison_allocator(torch)
    grads = torch.autograd.grad(o, inputs, do)
    exact, given_o = expected_grads(o, do, ref, lse, inputs64)
    for name, got, exp, exp_o in zip("qkv", grads, exact, given_o):
        assert got.shape == exp.shape, name
        assert rel(got, exp) < TOL[o.dtype], f"d{name}"
        if name not in whole:
            assert_close(got, exp_o, TOL[o.dtype], f"d{name}")
    return grads


CASES = [  # B, Hq, Hkv, Sq, Sk, D, causal, dtype
    (1, 2, 2, 1, 1, 64, False, torch.bfloat16),
    (2, 4, 4, 17, 17, 128, True, torch.float16),
    (1, 16, 2, 1000, 4097, 128, True, torch.bfloat16),    # GQA 8:1, Sq < Sk, bottom-right
    (1, 4, 1, 4097, 1000, 64, True, torch.float16),       # MQA, Sq > Sk: 3097 rows see no key
    (1, 4, 1, 1000, 17, 128, False, torch.bfloat16),      # MQA, Sq != Sk, not causal
    (1, 2, 2, 4097, 4097, 128, False, torch.bfloat16),
    (2, 4, 4, 1, 4097, 128, True, torch.bfloat16),        # decode: the one row sees every key
    (2, 8, 1, 17, 1, 64, True, torch.float16),            # rows 0..15 see no key
    (1, 4, 4, 100, 77, 80, True, torch.bfloat16),         # D 80 (zero-padded to 128)
    (1, 2, 2, 300, 300, 256, True, torch.bfloat16),       # D 256
    (1, 2, 2, 64, 130, 32, False, torch.float16),         # D 32
]
DENSE = (FM._fwd, FM._dq, FM._dkdv)      # the tuners of Sq > 16 (decode has its own)
TUNED = {(1, 16, 2, 1000, 4097, 128, True, torch.bfloat16),
         (1, 4, 1, 1000, 17, 128, False, torch.bfloat16)}   # each search compiles every config


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("disable", [False, True], ids=["tuned", "DISABLE_AUTOTUNE"])
def test_forward_backward(fresh, monkeypatch, case, disable):
    tuned_or_disabled(monkeypatch, disable, case, TUNED)
    B, hq, hkv, sq, sk, d, causal, dt = case
    q, k, v = make(B, hq, hkv, sq, sk, d, dt, hf_layout=(sq + sk) % 2 == 0)
    o, (dq, dk, dv) = check(q, k, v, causal)
    if sq > 1:
        assert o.stride() == q.stride()         # laid out like q (HF views stay views)
    dead = min(max(sq - sk, 0), sq) if causal else 0
    if dead:                                    # rows that see no key: exactly 0, no NaN
        assert (o[:, :, :dead] == 0).all() and (dq[:, :, :dead] == 0).all()
    if disable:
        assert all(t.searches == 0 for t in FM.TUNERS)
    else:
        assert all(t.searches == 1 for t in DENSE)         # the TUNED cases: Sq > 16
        assert all(r.source == "search" for t in DENSE for r in t.records.values())


@pytest.mark.parametrize("plan", ["split", "fused"])
@pytest.mark.parametrize("dt,score", [(torch.float16, -20.0), (torch.bfloat16, -120.0)], ids=str)
def test_rows_of_far_negative_scores_give_finite_gradients(fresh, monkeypatch, dt, score, plan):
    """Every score of every row far below zero (LSE < -11 nats overflows fp16's dS, < -88 bf16's
    for a key past Sk) with Sk not a multiple of the key tile, not causal and top-left causal
    with Sq > Sk: dq is finite and matches float64 (keys past Sk are masked in the dQ
    kernel's P, and in the fused backward's, at D128 where it is offered)."""
    disable_autotune(monkeypatch)
    g = torch.Generator(device="cuda").manual_seed(3)
    d = 64
    if plan == "fused":
        d = 128
        fused = next(c for c in FM.dkdv_configs("sm_90", d) if getattr(c, "fused", False))
        monkeypatch.setattr(FM._dkdv, "configs", lambda *a, **kw: iter([fused]))
    # q.k / sqrt(d) about `score`, from q's first dim (score * sqrt(d)) against keys' first dim
    # 1 +- 5% (so each row's softmax is not flat and its LSE stays far below zero: about -15
    # nats in fp16, -100 in bf16). The keys' common part sits in that one dim at size 1, small
    # beside their N(0, 1) other dims: it cancels in dq = sum_j dS_j k_j (sum_j dS_j = 0), and
    # a larger one would bring back the input dtype's rounding of dS that much larger.
    q = 0.01 * torch.randn(2, 4, 64, d, device="cuda", generator=g)
    q[..., 0] = score * math.sqrt(d)
    k = torch.randn(2, 4, 100, d, device="cuda", generator=g)
    k[..., 0] = 1 + 0.05 * torch.randn(2, 4, 100, device="cuda", generator=g)
    q, k = q.to(dt), k.to(dt)
    v = torch.randn(2, 4, 100, d, device="cuda", generator=g).to(dt)
    # dk = scale * sum_i dS_ij q_i is about its dim 0 alone (q is 0.01 noise elsewhere): each of
    # its rows is in effect one sum over 64 queries that cancels, so a row reads the rounding
    # of one element (up to 7x the tolerance in an emulation of a correct kernel): as a whole.
    o, (dq, dk, dv) = check(q, k, v, False, whole="k")
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all()
    # SDPA's top-left causal diagonal with Sq > Sk: rows from Sk on see every key, so their
    # last visible key passes Sk and the causal mask alone would keep the keys past it
    q = torch.cat([q, q[:, :, :36]], dim=2)[:, :, :100]       # Sq 100 > Sk 77
    k, v = k[:, :, :77], v[:, :, :77]
    o, (dq, dk, dv) = check(q, k, v, True, offset=0, whole="k", fn=lambda a, b, c:
                            scaled_dot_product_attention(a, b, c, is_causal=True))
    assert torch.isfinite(dq).all() and torch.isfinite(dk).all()


def test_deterministic_algorithms_give_the_same_gradients_every_run(fresh):
    """Under torch.use_deterministic_algorithms the dK/dV search times the split plans alone
    (the fused entry adds into dQ in no fixed order) and three backwards agree bit for bit;
    the gradients match float64."""
    q, k, v = make(2, 8, 2, 384, 384, 128, torch.bfloat16)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        o, _ = check(q, k, v, True)
        do = torch.randn_like(o)
        runs = []
        for _ in range(3):
            qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
            runs.append(torch.autograd.grad(fmha(qg, kg, vg, causal=True), (qg, kg, vg), do))
    finally:
        torch.use_deterministic_algorithms(was)
    for other in runs[1:]:
        for name, a, b in zip(("dq", "dk", "dv"), runs[0], other):
            assert torch.equal(a, b), name
    (record,) = FM._dkdv.records.values()
    assert record.source == "search" and "deterministic" in record.key
    assert record.timings and not any(t["config"].get("fused") for t in record.timings)


def test_frozen_keys_and_values_get_no_gradient_and_q_the_right_one(fresh, monkeypatch):
    """Only q requires grad (cross-attention to a frozen encoder): no dK/dV launch, dq against
    float64; only k and v: all three kernels."""
    disable_autotune(monkeypatch)
    q, k, v = make(2, 8, 2, 300, 517, 64, torch.bfloat16)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref, lse = reference(q64, k64, v64, True, 517 - 300, 0.125, lse=True)
    tol = TOL[torch.bfloat16]
    qg = q.detach().requires_grad_()
    poison_allocator(torch)
    o = fmha(qg, k, v, causal=True)
    do = torch.randn_like(o)
    (dq,) = torch.autograd.grad(o, qg, do)
    exact, given_o = expected_grads(o, do, ref, lse, (q64,))
    assert rel(dq, exact[0]) < tol
    assert_close(dq, given_o[0], tol, "dq")
    assert FM._dq.records and not FM._dkdv.records       # (DISABLE_AUTOTUNE records each key)
    kg, vg = k.detach().requires_grad_(), v.detach().requires_grad_()
    o = fmha(q, kg, vg, causal=True)
    dk, dv = torch.autograd.grad(o, (kg, vg), do)
    exact, given_o = expected_grads(o, do, ref, lse, (k64, v64))
    for name, got, exp, exp_o in zip("kv", (dk, dv), exact, given_o):
        assert rel(got, exp) < tol, f"d{name}"
        assert_close(got, exp_o, tol, f"d{name}")


@pytest.mark.slow
@pytest.mark.parametrize("tuner,d,sq,sk,causal,dt", [
    ("fmha_fwd", 128, 200, 333, True, BF), ("fmha_fwd", 64, 333, 200, True, BF),
    ("fmha_bwd_dq", 128, 200, 333, True, BF), ("fmha_bwd_dkdv", 128, 200, 333, True, BF),
    ("fmha_bwd_dq", 64, 333, 200, True, BF), ("fmha_bwd_dkdv", 64, 200, 333, False, BF),
    # lengths the searches ran at: each CTA's loop over key (or query) tiles makes 32-129
    # trips (fewer under the causal mask), where the short cases make 2-14
    ("fmha_fwd", 128, 4097, 4033, False, BF), ("fmha_fwd", 64, 4033, 4097, True, BF),
    ("fmha_bwd_dq", 128, 4033, 4097, False, BF), ("fmha_bwd_dkdv", 128, 4097, 4033, True, BF),
    # fp16 builds its own kernels: each space once more, short, causal and not
    ("fmha_fwd", 128, 333, 200, False, FP), ("fmha_bwd_dq", 128, 200, 333, True, FP),
    ("fmha_bwd_dkdv", 128, 333, 200, False, FP)], ids=str)
def test_every_config_is_correct(fresh, monkeypatch, tuner, d, sq, sk, causal, dt):
    """Each sm_90 config of one kernel (the other two on their defaults), not only the ones
    searches picked: GQA 2:1, ragged lengths, causal bottom-right; at D 64 (its own spaces)
    also with Sq > Sk (the first 133 rows see no key)."""
    t = next(x for x in FM.TUNERS if x.name == tuner)
    q, k, v = make(1, 4, 2, sq, sk, d, dt)
    for _ in each_config(monkeypatch, t, list(t.configs("sm_90", d, sq, sk, causal=causal))):
        check(q, k, v, causal)


@pytest.mark.parametrize("case", [
    (1, 4, 2, 4097, 4097, 128, True, torch.bfloat16),     # 65 query tiles: the last pair's
    (1, 4, 2, 4097, 1000, 128, False, torch.bfloat16),    # second tile lies past Sq
    (2, 4, 1, 300, 300, 64, True, torch.float16),
    (1, 4, 4, 1000, 4097, 64, False, torch.float16),
    (1, 2, 2, 333, 333, 256, True, torch.bfloat16),
    (1, 4, 4, 4097, 1000, 128, True, torch.bfloat16),     # 3097 rows see no key
    (2, 4, 2, 1000, 4097, 128, True, torch.float16),      # causal bottom-right, Sq < Sk
], ids=str)
def test_pair_forward(fresh, monkeypatch, case):
    """The two-tile forward (heaviest pair first under a causal mask) against the reference:
    odd tile counts, causal and not, GQA/MQA, D64/128/256, rows that see no key."""
    B, hq, hkv, sq, sk, d, causal, dt = case
    q, k, v = make(B, hq, hkv, sq, sk, d, dt)
    td = FM.head_tile(d)
    pairs = [c for c in FM.fwd_configs("sm_90", td, sq, sk, causal=causal)
             if getattr(c, "pair", False)]
    forms = 2 if causal and td in FM.SPLIT_TDS else 1         # one loop, and two (split)
    assert len(pairs) == forms * len(FM.PAIR_ENTRIES[64 if td <= 64 else td])  # all fit here
    for _ in each_config(monkeypatch, FM._fwd, pairs):
        o, _grads = check(q, k, v, causal)
        dead = min(max(sq - sk, 0), sq) if causal else 0
        assert (o[:, :, :dead] == 0).all()


def test_backward_plans_search_each_kernel_once(fresh):
    """At D128 the dK/dV search times each plan's whole backward (split: the dQ kernel, searched
    on its miss from inside that search, then dK/dV; fused: one kernel between its prep and
    cast): each tuner searches once, the gradients match, and later calls search nothing and
    launch the winner's plan."""
    q, k, v = make(1, 4, 2, 1000, 1000, 128, torch.bfloat16)
    check(q, k, v, True)
    assert [t.searches for t in DENSE] == [1, 1, 1]
    assert any(getattr(c, "fused", False) for c in FM._dkdv.configs("sm_90", 128, 1024, 1024))
    q2, k2, v2 = make(1, 4, 2, 1000, 1000, 128, torch.bfloat16, seed=1)
    check(q2, k2, v2, True)
    assert [t.searches for t in DENSE] == [1, 1, 1]


def test_second_call_does_not_search(fresh):
    q, k, v = make(2, 8, 2, 300, 300, 64, torch.bfloat16)
    check(q, k, v, True)
    assert [t.searches for t in DENSE] == [1, 1, 1]
    check(q, k, v, True)                          # same shape
    q2, k2, v2 = make(2, 8, 2, 260, 290, 64, torch.bfloat16, seed=1)
    check(q2, k2, v2, True)                       # same buckets (512, 512)
    assert [t.searches for t in DENSE] == [1, 1, 1]


def test_scale_and_contiguous_layout(monkeypatch, fresh):
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    q, k, v = make(2, 6, 3, 129, 257, 64, torch.float16, hf_layout=False)
    check(q, k, v, False, scale=0.3)


def test_sdpa_wrapper_matches_torch_semantics(monkeypatch, fresh):
    """is_causal aligns top-left like torch; CausalBias lower-right aligns bottom-right."""
    from torch.nn.attention.bias import causal_lower_right, causal_upper_left
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    q, k, v = make(1, 8, 2, 200, 77, 64, torch.bfloat16)
    check(q, k, v, True, offset=0,
          fn=lambda a, b, c: scaled_dot_product_attention(a, b, c, is_causal=True, enable_gqa=True))
    check(q, k, v, True, offset=0, fn=lambda a, b, c: scaled_dot_product_attention(
        a, b, c, attn_mask=causal_upper_left(200, 77), enable_gqa=True))
    check(q, k, v, True, offset=77 - 200, fn=lambda a, b, c: scaled_dot_product_attention(
        a, b, c, attn_mask=causal_lower_right(200, 77), enable_gqa=True))
    q, k, v = make(2, 4, 4, 90, 90, 128, torch.float16)
    ours = scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.1)
    theirs = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                               is_causal=True, scale=0.1)
    assert_close(ours, theirs, TOL[torch.float16], "o")


def test_bad_input():
    q, k, v = make(1, 4, 2, 16, 16, 64, torch.bfloat16)
    with pytest.raises(ValueError, match="multiple"):
        fmha(q, k[:, :1].expand(1, 3, 16, 64), v[:, :1].expand(1, 3, 16, 64))
    with pytest.raises(ValueError, match="k batch"):
        fmha(q, torch.cat((k, k)), torch.cat((v, v)))
    with pytest.raises(ValueError, match="head_dim"):
        fmha(q, k[..., :32], v[..., :32])
    with pytest.raises(ValueError, match="v shape"):
        fmha(q, k, v[:, :, :8])
    with pytest.raises(ValueError, match="q must be 4-D"):
        fmha(q[0], k, v)
    with pytest.raises(ValueError, match="head_dim 512"):
        big = torch.randn(1, 2, 4, 512, device="cuda", dtype=torch.bfloat16)
        fmha(big, big, big)
    with pytest.raises(TypeError, match="k dtype"):
        fmha(q, k.half(), v)
    with pytest.raises(TypeError, match="v dtype"):
        fmha(q, k, v.half())
    with pytest.raises(TypeError, match="q dtype"):
        fmha(q.float(), k.float(), v.float())
    with pytest.raises(ValueError, match="k must be a CUDA tensor"):
        fmha(q, k.cpu(), v)
    with pytest.raises(ValueError, match="scale"):
        fmha(q, k, v, scale=-1.0)
    with pytest.raises(TypeError, match="scale"):
        fmha(q, k, v, scale="0.1")
    if torch.cuda.device_count() > 1:
        with pytest.raises(ValueError, match="v is on"):
            fmha(q, k, v.to("cuda:1"))
    with pytest.raises(ValueError, match="enable_gqa"):
        scaled_dot_product_attention(q, k, v)
    with pytest.raises(ValueError, match="dropout_p"):
        scaled_dot_product_attention(q, q, q, dropout_p=0.1)
    with pytest.raises(ValueError, match="attn_mask"):
        scaled_dot_product_attention(q, q, q, attn_mask=torch.ones(16, 16, device="cuda",
                                                                   dtype=torch.bool))


def test_empty_and_no_keys(monkeypatch, fresh):
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    q, k, v = make(1, 2, 2, 5, 0, 64, torch.bfloat16)
    qg = q.detach().requires_grad_()
    o = fmha(qg, k, v)
    assert o.shape == q.shape and (o == 0).all()
    (dq,) = torch.autograd.grad(o, (qg,), torch.randn_like(o))
    assert (dq == 0).all()
    q, k, v = make(1, 2, 2, 0, 7, 64, torch.bfloat16)
    assert fmha(q, k, v, causal=True).shape == q.shape


def test_torch_compile_fullgraph(monkeypatch, fresh):
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    q, k, v = make(2, 8, 2, 100, 100, 64, torch.bfloat16)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def f(q, k, v):
        return fmha(q * 1, k, v, causal=True)
    # Losses are summed in eager: Inductor sums in another order (not what this test checks).
    eager = f(qg, kg, vg)
    ge = torch.autograd.grad(eager.float().square().sum(), (qg, kg, vg))
    out = torch.compile(f, fullgraph=True)(qg, kg, vg)
    gc = torch.autograd.grad(out.float().square().sum(), (qg, kg, vg))
    torch.testing.assert_close(out, eager)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b)


def test_aot_signature_matches_jit():
    """The CI compile's signatures (cases.fmha.aot_params) equal what the JIT infers on the GPU."""
    from cuda.tile.compilation import CallingConvention, KernelSignature
    from tiletune.aot import signature
    for B, hq, hkv, sq, sk, d, dt in [(2, 8, 2, 4096, 4096, 128, torch.bfloat16),
                                      (1, 4, 4, 1000, 4097, 64, torch.float16),
                                      (2, 4, 1, 1, 333, 80, torch.bfloat16)]:
        q, k, v = make(B, hq, hkv, sq, sk, d, dt)
        o, do, dq = torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)
        dk, dv = torch.empty_like(k), torch.empty_like(v)
        lse, delta = FM._rows(B * hq, sq, like=q), FM._rows(B * hq, sq, like=q)   # as the op
        td = FM.head_tile(d)
        cu = FM._unread(q, q.get_device())
        args = {"fwd": (q, k, v, o, lse, cu, cu, 0.1, 0, 64, 64, td, True, False),
                "dq": (q, k, v, o, do, lse, delta, dq, cu, cu, 0.1, 0.1, 0, 64, 64, td, True,
                       False, False),
                "dkdv": FM._dkdv_args(SimpleNamespace(tm=64, tn=64), q, k, v, o, do, lse,
                                      delta, dq, dk, dv, cu, cu, 0.1, 0.1, 0, td, True, None,
                                      None)}
        kernels = {"fwd": FM.fmha_fwd_kernel, "dq": FM.fmha_bwd_dq_kernel,
                   "dkdv": FM.fmha_bwd_dkdv_kernel}
        for kind, a in args.items():
            jit = KernelSignature.from_kernel_args(kernels[kind], a,
                                                   CallingConvention.cutile_python_v2())
            mine = signature(FC.aot_params(kind, 64, 64, dt, B, hq, hkv, sq, sk, d, True))
            assert jit.parameters == mine.parameters, (kind, B, hq, hkv, sq, sk, d)
        for pair in FM.fwd_configs("sm_90", td, causal=True):     # the two-tile forward's
            if getattr(pair, "pair", False):
                jit = KernelSignature.from_kernel_args(
                    FM.fmha_fwd_pair_kernel, FM._fwd_args(pair, q, k, v, o, lse, cu, cu, 0.1, 0,
                                                          td, True, None),
                    CallingConvention.cutile_python_v2())
                mine = signature(FC._params("fwd", pair, dt, B, hq, hkv, sq, sk, d, True))
                assert jit.parameters == mine.parameters, (vars(pair), B, hq, hkv, sq, sk, d)
        # the fused backward (the dK/dV kernel adding into a float32 dQ allocated as the
        # engine's scratch) and its helpers
        dq32 = q.new_empty(*q.shape, dtype=torch.float32)
        for causal in (True, False):
            fused = SimpleNamespace(tm=64, tn=128, fused=True)
            jit = KernelSignature.from_kernel_args(
                FM.fmha_bwd_dkdv_kernel,
                FM._dkdv_args(fused, q, k, v, o, do, lse, delta, dq, dk, dv, cu, cu, 0.1, 0.1,
                              sk - sq, td, causal, None, dq32),
                CallingConvention.cutile_python_v2())
            mine = signature(FC._params("dkdv", fused, dt, B, hq, hkv, sq, sk, d, causal))
            assert jit.parameters == mine.parameters, ("fused", causal, B, hq, sq, sk, d)
        prep, cast = FC.fused_helper_params(dt, B, hq, sq, d)
        for kernel, a, params in [
                (FM.fmha_bwd_prep_kernel, (o, do, delta, dq32, FM.FUSED_PREP_TM, td), prep),
                (FM.fmha_bwd_cast_kernel, (dq32, dq, 0.1, FM.FUSED_PREP_TM, td), cast)]:
            jit = KernelSignature.from_kernel_args(kernel, a, CallingConvention.cutile_python_v2())
            assert jit.parameters == signature(params).parameters, (kernel, B, hq, sq, d)


def test_lse_stand_in_has_the_signature_of_the_rows():
    """A call that no backward reads hands the kernels a stand-in for its LSE2 rows: the JIT
    must specialize the kernels on it exactly as on the real rows (one compiled kernel)."""
    from cuda.tile.compilation import CallingConvention, KernelSignature
    for B, hq, sq in [(2, 8, 4096), (1, 1, 1), (1, 4, 1000), (2, 4, 1), (1, 1, 333), (3, 5, 20)]:
        q = torch.empty(B, hq, sq, 64, device="cuda", dtype=torch.bfloat16)
        dev = q.get_device()
        cu = FM._unread(q, dev)

        def params(rows):
            args = (q, q, q, q, rows, cu, cu, 0.1, 0, 64, 64, 64, True, False)
            return KernelSignature.from_kernel_args(FM.fmha_fwd_kernel, args,
                                                    CallingConvention.cutile_python_v2()).parameters
        real = FM._flat(FM._rows(B, hq, sq, like=q))
        assert params(FM._lse_rows(None, q, dev, B * hq, sq)) == params(real), (B, hq, sq)


def test_aot_signature_matches_jit_packed_and_decode():
    """Likewise for packed batches (cases.fmha.aot_params(packed=True)) and the decode family
    (cases.fmha.decode_params), built the way the ops build their arguments."""
    from cuda.tile.compilation import CallingConvention, KernelSignature
    from tiletune.aot import signature
    conv = CallingConvention.cutile_python_v2()
    dt, B, hq, hkv, tq, tk, d = torch.bfloat16, 3, 8, 2, 100, 4097, 64
    q = FM._packed(torch.randn(tq, hq, d, device="cuda", dtype=dt))
    k = FM._packed(torch.randn(tk, hkv, d, device="cuda", dtype=dt))
    lse, cu = FM._rows(hq, tq, like=q), torch.zeros(B + 1, dtype=torch.int32, device="cuda")
    a = (q, k, k, q, lse, cu, cu, 0.1, 0, 64, 64, 64, True, True)
    jit = KernelSignature.from_kernel_args(FM.fmha_fwd_kernel, a, conv)
    mine = signature(FC.aot_params("fwd", 64, 64, dt, B, hq, hkv, tq, tk, d, True, packed=True))
    assert jit.parameters == mine.parameters
    for B, hq, hkv, sq, sk, d, lengths in [(32, 32, 8, 1, 4096, 128, True),
                                           (2, 28, 4, 5, 333, 80, False)]:
        q, k, v = make(B, hq, hkv, sq, sk, d, dt)
        o, lse = torch.empty_like(q), FM._rows(B, hq, sq, like=q)
        used = torch.full((B,), sk, dtype=torch.int32, device="cuda") if lengths else \
            FM._unread(q, q.get_device())
        inputs = (q, k, v, used, o, FM._flat(lse), 0.1, 0, FM.head_tile(d), True, lengths)
        cfg = next(FM.decode_configs("sm_90", FM.head_tile(d), sq, sk, kv_heads=B * hkv,
                                     used=lengths, group=hq // hkv))
        assert cfg.splits > 1
        spec = FM._decode_scratch(cfg, 0, *inputs)
        buf = torch.empty(spec[0], dtype=spec[1], device="cuda")
        args = FM._decode_args(cfg, *inputs, buf)
        kernel, combine = FC.decode_params(cfg, dt, B, hq, hkv, sq, sk, d, True, lengths)
        jit = KernelSignature.from_kernel_args(FM.fmha_decode_kernel, args, conv)
        assert jit.parameters == signature(kernel).parameters, (B, hq, hkv, sq, sk, d)
        jit = KernelSignature.from_kernel_args(
            FM.COMBINE, (args[6], args[7], o, args[5], args[10], args[11],
                         *FM.combine_tiles(cfg.splits, sq, args[15])),
            conv)
        assert jit.parameters == signature(combine).parameters, (B, hq, hkv, sq, sk, d)
