"""Host-side input checks of the ops that need no GPU: in-place RoPE's memory-overlap helpers
(against a brute-force enumeration of the bytes each view touches) and its leaf rule; matmul's
`out` check (the shared out= rules), its split-K scratch bound over the batch and the batch in
its key and space; the CausalBias size check of scaled_dot_product_attention; rms_norm's
int32-safe row chunks and its refusal of rows wider than 2^31 - 1 elements; the errors of
apply_rotary_pos_emb, which name it; moe_permute's num_experts of any integer type."""
import itertools
import random

import numpy as np
import pytest
import torch
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

from tiletune import validate
from tiletune.ops import fmha as FA
from tiletune.ops import grouped_gemm as GG
from tiletune.ops import matmul as MM
from tiletune.ops import moe as MO
from tiletune.ops import rms_norm as RN
from tiletune.ops import rope as RP
from tiletune.space import row_chunks
from tiletune.validate import overlaps, self_overlaps


# ---------------------------------------------------------------------------------------------
# RoPE in place: overlap helpers.

def touched(t):
    """Every byte address t's elements occupy (as a list: repeats kept)."""
    es = t.element_size()
    out = []
    for idx in itertools.product(*(range(n) for n in t.shape)):
        a = t.data_ptr() + es * sum(i * s for i, s in zip(idx, t.stride()))
        out.extend(range(a, a + es))
    return out


def test_same_tensor_overlaps():
    x = torch.zeros(4, 8)
    assert overlaps(x, x)
    assert overlaps(x, x.view(8, 4)) and overlaps(x, x.t())


def test_overlapping_slices_overlap():
    x = torch.zeros(4, 8)
    assert overlaps(x[:2], x[1:])
    assert overlaps(x[:, :5], x[:, 4:])
    assert overlaps(x[:, ::2], x[:, 2::4])                  # every 4th column is in both


def test_disjoint_slices_do_not_overlap():
    x = torch.zeros(4, 8)
    assert not overlaps(x[:2], x[2:])                       # disjoint byte ranges
    assert not overlaps(x[:, :4], x[:, 4:])                 # interleaved rows
    assert not overlaps(x[:, ::2], x[:, 1::2])              # interleaved columns
    assert not overlaps(x, torch.zeros(4, 8))               # other allocations
    assert not overlaps(x[:0], x) and not overlaps(x, x[:, 8:])   # empty views
    h = torch.zeros(64, dtype=torch.bfloat16)
    assert not overlaps(h[0::2], h[1::2])
    assert overlaps(h.view(torch.float32), h[1::2])         # a 4-byte element spans both


def test_fused_qkv_views_do_not_overlap():
    """The q and k views HF-style models take of one fused projection are disjoint."""
    B, S, H, D = 2, 16, 4, 8
    qkv = torch.zeros(B, S, 3, H, D)
    q, k = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2)
    assert not overlaps(q, k)
    assert overlaps(q, qkv[:, :, 0, 1:3].transpose(1, 2))
    Hq, Hk = 8, 2                                            # GQA: (B, S, (Hq + 2 Hk) D)
    fused = torch.zeros(B, S, (Hq + 2 * Hk) * D)
    q = fused[..., :Hq * D].view(B, S, Hq, D).transpose(1, 2)
    k = fused[..., Hq * D:(Hq + Hk) * D].view(B, S, Hk, D).transpose(1, 2)
    assert not overlaps(q, k)
    y = torch.zeros(B, 2, H, S, D)                          # (B, 2, H, S, D) halves
    assert not overlaps(y[:, 0], y[:, 1])


def test_expanded_dims_overlap_themselves():
    x = torch.zeros(4, 8)
    assert not self_overlaps(x) and not self_overlaps(x.t()) and not self_overlaps(x[:, ::2])
    assert self_overlaps(torch.zeros(1, 8).expand(4, 8))
    assert self_overlaps(torch.zeros(2, 1, 3, 8).expand(2, 4, 3, 8))
    assert not self_overlaps(torch.zeros(2, 1, 3, 8).expand(2, 1, 3, 8))   # size-1 stride 0
    assert self_overlaps(torch.zeros(10).as_strided((4, 4), (1, 2)))
    assert not self_overlaps(torch.zeros(0, 8).expand(0, 8))


def test_overlap_helpers_are_sound_on_random_views():
    """Never "disjoint" where the views share a byte, never "no internal overlap" where a view
    repeats one (conservative the other way only on odd as_strided interleavings)."""
    rng = random.Random(0)
    base = torch.zeros(4096, dtype=torch.float16)
    for _ in range(400):
        views = []
        for _ in range(2):
            dims = rng.randint(1, 3)
            shape = [rng.randint(1, 5) for _ in range(dims)]
            stride = [rng.choice((0, 1, 2, 3, 4, 8, 16, 40, 64)) for _ in range(dims)]
            views.append(base.as_strided(shape, stride, rng.randint(0, 200)))
        a, b = views
        ta, tb = touched(a), touched(b)
        if set(ta) & set(tb):
            assert overlaps(a, b) and overlaps(b, a)
        for v, t in ((a, ta), (b, tb)):
            if len(set(t)) < len(t):
                assert self_overlaps(v)


def test_inplace_check_names_the_argument():
    B, H, S, D = 2, 4, 8, 16
    q, k = torch.zeros(B, H, S, D), torch.zeros(B, H, S, D)
    validate.inplace("apply_rope", {"q": q, "k": k})
    with pytest.raises(ValueError, match=r"apply_rope: .*k is q"):
        validate.inplace("apply_rope", {"q": q, "k": q})
    buf = torch.zeros(B, S, H + 1, D)
    with pytest.raises(ValueError, match=r"apply_rope: .*q and k overlap"):
        validate.inplace("apply_rope", {"q": buf[:, :, :H].transpose(1, 2),
                                        "k": buf[:, :, 1:].transpose(1, 2)})
    with pytest.raises(ValueError, match=r"apply_rope: .*needs q whose elements"):
        validate.inplace("apply_rope", {"q": torch.zeros(B, 1, S, D).expand(B, H, S, D), "k": k})
    with pytest.raises(ValueError, match=r"apply_rope: .*needs k whose elements"):
        validate.inplace("apply_rope", {"q": q, "k": torch.zeros(1, H, S, D).expand(B, H, S, D)})
    qkv = torch.zeros(B, S, 3, H, D)                        # disjoint views of one buffer: fine
    validate.inplace("apply_rope", {"q": qkv[:, :, 0].transpose(1, 2),
                                    "k": qkv[:, :, 1].transpose(1, 2)})


def test_inplace_refuses_inference_tensors_outside_inference_mode():
    """torch refuses to write an inference tensor in place outside inference mode; so does the
    check (the kernel would write it without torch seeing); inside inference mode it passes."""
    with torch.inference_mode():
        q, k = torch.zeros(1, 2, 4, 8), torch.zeros(1, 2, 4, 8)
        validate.inplace("apply_rope", {"q": q, "k": k})
    with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
        k.mul_(2)                                           # what torch says
    with pytest.raises(ValueError, match=r"^apply_rope: inplace=True on k, an inference tensor"):
        validate.inplace("apply_rope", {"q": torch.zeros(1, 2, 4, 8), "k": k})
    with torch.no_grad(), pytest.raises(ValueError, match=r"inplace=True on q, an inference"):
        validate.inplace("apply_rope", {"q": q, "k": torch.zeros(1, 2, 4, 8)})


def test_inplace_leaf_rule_is_per_tensor():
    """Refused only for a leaf that requires grad (under grad mode), as torch does; a plain
    leaf q beside a non-leaf k that requires grad is fine."""
    B, H, S, D = 1, 2, 4, 8
    leaf = torch.zeros(B, H, S, D, requires_grad=True)
    plain, nonleaf = torch.zeros(B, H, S, D), leaf * 1
    validate.inplace("apply_rope", {"q": plain, "k": nonleaf})
    validate.inplace("apply_rope", {"q": nonleaf, "k": plain})
    with pytest.raises(ValueError, match=r"apply_rope: inplace=True on q, a leaf"):
        validate.inplace("apply_rope", {"q": leaf, "k": plain})
    with pytest.raises(ValueError, match=r"apply_rope: inplace=True on k, a leaf"):
        validate.inplace("apply_rope", {"q": plain, "k": torch.zeros(B, H, S, D, requires_grad=True)})
    with torch.no_grad():
        validate.inplace("apply_rope", {"q": leaf, "k": plain})
    # views of such a leaf (a parameter's halves): torch refuses writing them in place too
    param = torch.zeros(B, 2 * H, S, D, requires_grad=True)
    with pytest.raises(ValueError, match=r"apply_rope: inplace=True on q, a view of a leaf"):
        validate.inplace("apply_rope", {"q": param[:, :H], "k": param[:, H:]})


# ---------------------------------------------------------------------------------------------
# matmul: out, and the batch in split-K's bound, the space and the key.

def test_matmul_out_must_match_the_result():
    a, b = torch.zeros(3, 5, dtype=torch.bfloat16), torch.zeros(5, 7, dtype=torch.bfloat16)
    MM._check_out(a, b, torch.empty(3, 7, dtype=torch.bfloat16))
    for shape in ((3, 1), (1, 7), (7,), (1, 3, 7), (3, 8)):    # would broadcast, or not fit
        with pytest.raises(ValueError, match=r"matmul: out has shape"):
            MM._check_out(a, b, torch.empty(shape, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"matmul: out dtype"):
        MM._check_out(a, b, torch.empty(3, 7, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"matmul: out is on meta"):
        MM._check_out(a, b, torch.empty(3, 7, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(TypeError, match=r"matmul: out must be a torch.Tensor"):
        MM._check_out(a, b, [[0.0] * 7] * 3)
    a3, b3 = torch.zeros(2, 3, 5, dtype=torch.half), torch.zeros(2, 5, 7, dtype=torch.half)
    MM._check_out(a3, b3, torch.empty(2, 3, 7, dtype=torch.half))
    with pytest.raises(ValueError, match=r"matmul: out has shape"):
        MM._check_out(a3, b3, torch.empty(3, 7, dtype=torch.half))


def test_out_must_be_writable():
    """An out= tensor that torch cannot write in place, or whose elements share memory, is
    refused before any work, naming the op (matmul and grouped_mm copy into it; fp8_mm writes it
    directly and also refuses memory shared with its inputs)."""
    a, b = torch.zeros(3, 5, dtype=torch.bfloat16), torch.zeros(5, 7, dtype=torch.bfloat16)
    leaf = torch.empty(3, 7, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ValueError, match=r"matmul: out is a leaf tensor that requires grad"):
        MM._check_out(a, b, leaf)
    with torch.no_grad():             # as torch: a leaf may be written under no_grad
        MM._check_out(a, b, leaf)
    with pytest.raises(ValueError, match=r"matmul: out \(3, 7\) with strides \(0, 1\) has "
                                         r"elements that share memory"):
        MM._check_out(a, b, torch.empty(1, 7, dtype=torch.bfloat16).expand(3, 7))
    MM._check_out(a, b, torch.empty(7, 3, dtype=torch.bfloat16).t())    # any strides otherwise
    x = torch.empty(10, 4)
    with pytest.raises(ValueError, match=r"op: out overlaps x in memory"):
        validate.out("op", x[:, :2], (10, 2), torch.float32, x.device, inputs={"x": x[:, 1:]})
    validate.out("op", x[:, :2], (10, 2), torch.float32, x.device, inputs={"x": x[:, 2:]})
    # torch's copy_ refuses a view of such a leaf too (after the GEMM had run)
    big = torch.empty(4, 7, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ValueError, match=r"matmul: out is a view of a leaf tensor that requires"):
        MM._check_out(a, b, big[:3])
    # out sharing memory with an input the backward reads, while autograd records
    sq = torch.zeros(5, 5, dtype=torch.bfloat16)
    h = sq.clone().requires_grad_() * 1
    with pytest.raises(ValueError, match=r"matmul: out overlaps a in memory, which the backward"):
        MM._check_out(h, sq, h)
    with torch.no_grad():
        MM._check_out(h, sq, h)
    MM._check_out(sq, sq, sq)          # nothing requires grad: out may be an input
    xg, wg = torch.zeros(6, 5, dtype=torch.bfloat16), torch.zeros(2, 5, 5, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"grouped_mm: out overlaps x in memory, which the"):
        GG._check_out(xg, (6, 5), xg, wg.requires_grad_())


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_a_nested_out_is_refused_by_name(layout):
    """A nested (jagged or strided) out= tensor: a TypeError naming the op and out, not torch's
    "NestedTensorImpl doesn't support sizes" nor a shape of nested ints."""
    a, b = torch.zeros(3, 5, dtype=torch.bfloat16), torch.zeros(5, 7, dtype=torch.bfloat16)
    out = torch.nested.nested_tensor([torch.zeros(3, 7), torch.zeros(2, 7)],
                                     dtype=torch.bfloat16, layout=layout)
    with pytest.raises(TypeError, match=r"^matmul: out is a nested tensor"):
        MM._check_out(a, b, out)


def splits(*args, **kw):
    return [MM.split_of(c) for c in MM.matmul_configs(*args, **kw) if MM.split_of(c) > 1]


def test_split_k_bound_counts_the_batch():
    assert not splits("sm_90", 1024, 1024, 4096, z=64)    # would need split x 256 MiB
    assert splits("sm_90", 1024, 1024, 4096)              # z = 1: a few
    assert splits("sm_90", 16, 4096, 4096, z=1) == splits("sm_90", 16, 4096, 4096)
    assert splits("sm_90", 16, 4096, 4096)
    for z in (1, 2, 8, 64, 1024):
        for m, n, k in ((16, 4096, 4096), (1024, 1024, 4096), (128, 270, 2000)):
            for c in MM.matmul_configs("sm_90", m, n, k, z=z):
                if MM.split_of(c) > 1:
                    assert c.split * z * m * n * 4 <= MM.SPLITK_MAX_BYTES


def test_matmul_space_and_key_carry_the_batch(monkeypatch):
    """The space is the bucket's (power-of-two) largest Z, and the tuning key separates Z
    buckets, so a config tuned for a small batch (split-K allowed) is never reused for a large
    one."""
    def inputs(Z, M, N, K):
        return (torch.empty(Z, M, K, device="meta"), torch.empty(Z, K, N, device="meta"),
                torch.empty(Z, M, N, device="meta"))
    space = MM._matmul._space(*inputs(64, 1024, 1024, 4096))
    assert space == dict(m=1024, n=1024, k=4096, z=64)
    assert not splits("sm_90", **space)
    assert MM._matmul._space(*inputs(3, 100, 270, 2000))["z"] == 4
    keys = []
    monkeypatch.setattr(MM._matmul, "launch", lambda key, dev, *a: keys.append(key))
    for Z in (1, 2, 3, 64):
        MM.launch(*inputs(Z, 1024, 1024, 4096))
    assert [MM._matmul.tune_key(k)[3] for k in keys] == [1, 2, 4, 64]


# ---------------------------------------------------------------------------------------------
# scaled_dot_product_attention: CausalBias sizes.

def test_causal_bias_must_match_q_and_k():
    op = "scaled_dot_product_attention"
    for make in (causal_upper_left, causal_lower_right):
        FA.check_causal_bias(op, make(128, 256), 128, 256)
        for sq, sk in ((256, 128), (128, 255), (64, 256), (128, 512)):
            with pytest.raises(ValueError, match=rf"{op}: attn_mask is a CausalBias"):
                FA.check_causal_bias(op, make(128, 256), sq, sk)


# ---------------------------------------------------------------------------------------------
# rms_norm: row chunks of at most 2^31 - 1 elements, and rows wider than that refused.

LIMIT = 2**31 - 1


@pytest.mark.parametrize("M,N", [(1, 1), (4096, 4096), (2**20, 4096), (100000, 65536),
                                 (3, 2**27), (17, 2**27), (40, 2**27 + 1), (100, 2**28),
                                 (10, 2**30), (3, LIMIT), (5, 2**31 // 3)])
def test_row_chunks_hold_at_most_2_31_minus_1_elements(M, N):
    chunks = row_chunks(M, N)
    assert chunks[0][0] == 0 and chunks[-1][1] == M
    assert all(s < e for s, e in chunks)
    assert all(e == s2 for (_, e), (s2, _) in zip(chunks, chunks[1:]))   # contiguous, in order
    assert all((e - s) * N <= LIMIT for s, e in chunks)
    rows = chunks[0][1] - chunks[0][0]
    if len(chunks) > 1:
        fit = LIMIT // N
        assert rows == (fit // 16 * 16 if fit >= 16 else max(1, fit))


def test_row_chunks_of_wide_rows():
    assert row_chunks(100, 2**28) == tuple((s, min(s + 7, 100)) for s in range(0, 100, 7))
    assert row_chunks(10, 2**30) == tuple((s, s + 1) for s in range(10))
    assert row_chunks(64, 2**25) == ((0, 48), (48, 64))     # 63 fit: 48, a multiple of 16
    assert row_chunks(2, LIMIT) == ((0, 1), (1, 2))


def test_rms_norm_refuses_rows_over_2_31_minus_1(monkeypatch):
    """Refused in the input check (before any allocation); CUDA is stubbed out of the check."""
    monkeypatch.setattr(validate, "tensor", lambda op, name, t, **kw: t)
    for N in (LIMIT, 2**31, 2**33):
        x = torch.zeros(1, dtype=torch.bfloat16).expand(2, N)    # stride 0: nothing allocated
        w = torch.zeros(1, dtype=torch.bfloat16).expand(N)
        if N <= LIMIT:
            RN._check(x, w, 1e-6)
        else:
            with pytest.raises(ValueError, match=r"rms_norm: x rows of \d+ elements"):
                RN._check(x, w, 1e-6)


def test_rms_norm_refuses_an_empty_hidden_dim_and_rope_a_rotary_dim_that_is_no_int(
        monkeypatch):
    monkeypatch.setattr(validate, "tensor", lambda op, name, t, **kw: t)
    for shape in ((2, 3, 0), (4, 0), ()):
        with pytest.raises(ValueError, match=r"rms_norm: x must have a last dimension"):
            RN._check(torch.zeros(shape), torch.zeros(0), 1e-6)
    from tiletune.ops.rotary import prepare
    q, k = torch.zeros(1, 4, 8, 16), torch.zeros(1, 2, 8, 16)
    cos = sin = torch.zeros(8, 16)
    assert prepare("apply_rope", q, k, cos, sin, None, 8)[3] == 8
    assert prepare("apply_rope", q, k, cos, sin, None, np.int64(8))[3] == 8      # numpy's too
    assert validate.eps("rms_norm", np.float32(0.5)) == 0.5
    for bad in ("8", 8.0, True, torch.tensor(8)):
        with pytest.raises(TypeError, match="apply_rope: rotary_dim must be an int or None"):
            prepare("apply_rope", q, k, cos, sin, None, bad)


def test_out_checks_trace_under_torch_compile():
    """The memory checks read addresses, which torch.compile cannot trace: under compile they
    are skipped (the compiled ops write a fresh tensor, then copy), so out= keeps fullgraph."""
    def f(x, out):
        validate.out("op", out, (4, 4), torch.float32, x.device, inputs={"x": x})
        validate.out("op", out, (4, 4), torch.float32, x.device)
        return out.copy_(x * 2)
    x, out = torch.randn(4, 4), torch.empty(4, 4)
    assert torch.equal(torch.compile(f, fullgraph=True, backend="eager")(x, out), x * 2)


def test_an_inference_tensor_out_is_refused_where_a_kernel_writes_it():
    """torch refuses an in-place write to an inference tensor outside inference mode; a kernel
    writing `out` directly (fp8_mm) would not be stopped by it, so the check does it. Inside
    inference mode, and for ops that copy into out (torch's copy_ refuses for them), it passes."""
    x = torch.randn(4, 4)
    with torch.inference_mode():
        out = torch.empty(4, 4)
    with pytest.raises(ValueError, match="^op: out is an inference tensor, which cannot be "
                                         "written in place outside inference mode"):
        validate.out("op", out, (4, 4), torch.float32, x.device, inputs={"x": x})
    validate.out("op", out, (4, 4), torch.float32, x.device)
    with torch.inference_mode():
        validate.out("op", out, (4, 4), torch.float32, x.device, inputs={"x": x})


# ---------------------------------------------------------------------------------------------
# apply_rotary_pos_emb: the checks it shares with apply_rope name the function called.

@pytest.fixture
def cpu_as_cuda(monkeypatch):
    """CPU tensors pass the device checks as tensors of CUDA device 0, so that the checks after
    them run as they do on a GPU."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


def test_apply_rotary_pos_emb_names_itself_in_the_checks_it_shares_with_apply_rope(
        cpu_as_cuda):
    B, S, D = 2, 5, 8
    q, k = torch.randn(B, 4, S, D), torch.randn(B, 2, S, D)
    cos = sin = torch.randn(S, D)
    bad = [(TypeError, "q dtype torch.float64 is not supported", dict(q=q.double())),
           (TypeError, "k dtype torch.float16 differs from q dtype", dict(k=k.half())),
           (TypeError, "k must be a torch.Tensor, got NoneType", dict(k=None)),
           (ValueError, r"q heads \(4\) must be a positive multiple of k heads \(3\)",
            dict(k=torch.randn(B, 3, S, D))),
           (ValueError, "cos/sin have 4 rows, fewer than S=5", dict(cos=cos[:4], sin=sin[:4])),
           (ValueError, r"cos \(5, 8\) and sin \(5, 6\) differ", dict(sin=sin[:, :6])),
           (ValueError, r"cos/sin must be \(S, R\), \(1, S, R\), \(2, S, R\) or \(2, 1, S, R\), "
            r"got \(3, 1, 5, 8\)", dict(cos=cos.expand(3, 1, S, D), sin=sin.expand(3, 1, S, D))),
           (ValueError, r"position_ids range \[1, 5\] is outside the 5 rows of cos/sin",
            dict(position_ids=torch.arange(1, S + 1)))]
    for error, message, change in bad:
        args = {"q": q, "k": k, "cos": cos, "sin": sin, "position_ids": None, **change}
        with pytest.raises(error, match="^apply_rope: " + message):
            RP.apply_rope(args["q"], args["k"], args["cos"], args["sin"],
                          position_ids=args["position_ids"])
        with pytest.raises(error, match="^apply_rotary_pos_emb: " + message):
            RP.apply_rotary_pos_emb(**args)


# ---------------------------------------------------------------------------------------------
# moe_permute: num_experts of any integer type, as the other int arguments take it.

def test_moe_permute_takes_num_experts_of_any_integer_type(cpu_as_cuda, monkeypatch):
    experts = []
    monkeypatch.setattr(MO, "_permute", lambda x, ids, n: experts.append(n))
    x, ids = torch.randn(4, 16), torch.zeros(4, 2, dtype=torch.int64)
    for n in (3, np.int64(3), np.int32(3), np.uint8(3)):
        MO.moe_permute(x, ids, n)
    assert experts == [3] * 4 and all(type(n) is int for n in experts)
    for bad in (3.0, np.float32(3), True, np.bool_(True), torch.tensor(3), "3", None):
        with pytest.raises(TypeError, match="^moe_permute: num_experts must be an int, got"):
            MO.moe_permute(x, ids, bad)
    with pytest.raises(ValueError, match=r"^moe_permute: num_experts must be in \[1, 2\^31"):
        MO.moe_permute(x, ids, np.int64(0))
