"""Bad input through the public functions on CUDA tensors: each refused with an error naming the
function and the argument, before any kernel runs (inputs left as they were). In-place RoPE on
aliased, overlapping or expanded q/k; matmul's `out` of another shape, dtype or device;
scaled_dot_product_attention with a CausalBias of other sizes; rms_norm rows over 2^31 - 1
elements; nested tensors to matmul and grouped_mm. And what must still work: in-place RoPE on
disjoint views of one fused buffer and on a plain leaf q beside a non-leaf k that requires grad;
rms_norm rows of 2^28 elements (chunks of fewer than 16 rows), and a backward past 2^31
elements in row chunks."""
import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right, causal_upper_left

from tiletune.ops.fmha import scaled_dot_product_attention
from tiletune.ops.grouped_gemm import grouped_mm
from tiletune.ops.matmul import matmul
from tiletune.ops.rms_norm import rms_norm
from tiletune.ops.rope import apply_rope

from .conftest import disable_autotune
from .test_rms_norm import TOL as RMS_TOL, assert_dx_rows_close, reference as rms_reference, \
    rel as rms_rel

B, H, S, D = 2, 4, 64, 64


def cos_sin(dt=torch.float32):
    ang = torch.rand(S, D, device="cuda", dtype=torch.float64) * 6.3
    return ang.cos().to(dt), ang.sin().to(dt)


def qk(dt=torch.float32):
    return (torch.randn(B, S, H, D, device="cuda", dtype=dt).transpose(1, 2),
            torch.randn(B, S, H, D, device="cuda", dtype=dt).transpose(1, 2))


# ---------------------------------------------------------------------------------------------
# apply_rope(inplace=True)

def test_rope_inplace_refuses_k_is_q(monkeypatch):
    disable_autotune(monkeypatch)
    q, _ = qk()
    cos, sin = cos_sin()
    before = q.clone()
    with pytest.raises(ValueError, match=r"apply_rope: .*k is q"):
        apply_rope(q, q, cos, sin, inplace=True)
    assert torch.equal(q, before)
    qo, ko = apply_rope(q, q, cos, sin)                   # out of place: q and k may alias
    torch.testing.assert_close(qo, ko)


def test_rope_inplace_refuses_overlapping_views(monkeypatch):
    disable_autotune(monkeypatch)
    buf = torch.randn(B, S, H + 1, D, device="cuda")
    q, k = buf[:, :, :H].transpose(1, 2), buf[:, :, 1:].transpose(1, 2)   # heads 1..H-1 shared
    cos, sin = cos_sin()
    before = buf.clone()
    with pytest.raises(ValueError, match=r"apply_rope: .*q and k overlap"):
        apply_rope(q, k, cos, sin, inplace=True)
    assert torch.equal(buf, before)
    apply_rope(q, k, cos, sin)                            # out of place: fine


@pytest.mark.parametrize("which", ["q", "k"])
def test_rope_inplace_refuses_expanded_inputs(monkeypatch, which):
    disable_autotune(monkeypatch)
    q, k = qk()
    one = torch.randn(B, 1, S, D, device="cuda").expand(B, H, S, D)      # stride-0 heads
    q, k = (one, k) if which == "q" else (q, one)
    cos, sin = cos_sin()
    with pytest.raises(ValueError, match=rf"apply_rope: inplace=True needs {which} whose"):
        apply_rope(q, k, cos, sin, inplace=True)
    apply_rope(q, k, cos, sin)                            # out of place: fine


def test_rope_inplace_on_disjoint_views_of_one_buffer(monkeypatch):
    """q and k columns of one fused qkv buffer rotate in place, as out of place."""
    disable_autotune(monkeypatch)
    qkv = torch.randn(B, S, 3, H, D, device="cuda", dtype=torch.bfloat16)
    q, k = qkv[:, :, 0].transpose(1, 2), qkv[:, :, 1].transpose(1, 2)
    cos, sin = cos_sin(torch.bfloat16)
    v = qkv[:, :, 2].clone()
    want_q, want_k = apply_rope(q, k, cos, sin)
    qo, ko = apply_rope(q, k, cos, sin, inplace=True)
    assert qo is q and ko is k
    torch.testing.assert_close(q, want_q)
    torch.testing.assert_close(k, want_k)
    assert torch.equal(qkv[:, :, 2], v)


def test_rope_inplace_leaf_rule_is_per_tensor(monkeypatch):
    """A plain leaf q (no grad) beside a non-leaf k that requires grad: rotated in place, and
    k's gradient reaches its leaf. A leaf that requires grad is refused, by name."""
    disable_autotune(monkeypatch)
    q, k = qk()
    cos, sin = cos_sin()
    k_leaf = k.detach().clone().requires_grad_()
    want_q, want_k = apply_rope(q, k_leaf, cos, sin)
    (want_g,) = torch.autograd.grad(want_k.square().sum(), (k_leaf,))
    qi, ki = q.clone(), k_leaf * 1
    qo, ko = apply_rope(qi, ki, cos, sin, inplace=True)
    assert qo is qi and ko is ki
    torch.testing.assert_close(qi, want_q.detach())
    torch.testing.assert_close(ki.detach(), want_k.detach())
    (g,) = torch.autograd.grad(ko.square().sum(), (k_leaf,))
    torch.testing.assert_close(g, want_g)
    for name in ("q", "k"):
        ql = q.clone().requires_grad_(name == "q")
        kl = k.clone().requires_grad_(name == "k")
        with pytest.raises(ValueError, match=rf"apply_rope: inplace=True on {name}, a leaf"):
            apply_rope(ql, kl, cos, sin, inplace=True)
        with torch.no_grad():                             # as torch: allowed without grad mode
            apply_rope(ql, kl, cos, sin, inplace=True)


# ---------------------------------------------------------------------------------------------
# matmul(out=...)

def test_matmul_out_is_checked(monkeypatch):
    disable_autotune(monkeypatch)
    a = torch.randn(64, 32, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(32, 48, device="cuda", dtype=torch.bfloat16)
    for shape in ((64, 1), (1, 48), (48,), (2, 64, 48)):  # each would broadcast in copy_
        out = torch.zeros(shape, device="cuda", dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=r"matmul: out has shape"):
            matmul(a, b, out=out)
        assert not out.any()
    with pytest.raises(TypeError, match=r"matmul: out dtype"):
        matmul(a, b, out=torch.empty(64, 48, device="cuda", dtype=torch.float32))
    with pytest.raises(ValueError, match=r"matmul: out is on cpu"):
        matmul(a, b, out=torch.empty(64, 48, dtype=torch.bfloat16))
    out = torch.empty(64, 48, device="cuda", dtype=torch.bfloat16)
    assert matmul(a, b, out=out) is out
    torch.testing.assert_close(out, (a.float() @ b.float()).bfloat16(), atol=0.1, rtol=0.02)
    a3, b3 = a.expand(3, 64, 32), b.expand(3, 32, 48)
    with pytest.raises(ValueError, match=r"matmul: out has shape"):
        matmul(a3, b3, out=out)


# ---------------------------------------------------------------------------------------------
# scaled_dot_product_attention(attn_mask=CausalBias)

@pytest.mark.parametrize("make", [causal_upper_left, causal_lower_right])
def test_sdpa_refuses_causal_bias_of_other_sizes(make):
    q = torch.randn(1, 2, 64, 64, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, 2, 128, 64, device="cuda", dtype=torch.bfloat16)
    for sq, sk in ((128, 64), (64, 64), (64, 256), (32, 128)):
        with pytest.raises(ValueError, match=r"scaled_dot_product_attention: attn_mask"):
            scaled_dot_product_attention(q, k, k, attn_mask=make(sq, sk))
    out = scaled_dot_product_attention(q, k, k, attn_mask=make(64, 128))
    want = F.scaled_dot_product_attention(q.float(), k.float(), k.float(),
                                          attn_mask=make(64, 128))
    torch.testing.assert_close(out.float(), want, atol=2e-2, rtol=2e-2)


# ---------------------------------------------------------------------------------------------
# rms_norm: rows wider than 2^31 - 1 elements are refused; rows of 2^28 are processed.

def test_rms_norm_refuses_rows_over_int32():
    for N in (2**31, 2**31 + 16):
        x = torch.zeros(1, device="cuda", dtype=torch.bfloat16).expand(2, N)   # nothing allocated
        w = torch.ones(1, device="cuda", dtype=torch.bfloat16).expand(N)
        with pytest.raises(ValueError, match=r"rms_norm: x rows of \d+ elements"):
            rms_norm(x, w)


def test_rms_norm_rows_of_2_28_elements(monkeypatch):
    """9 rows of 2^28 bf16 (2.4G elements: over int32) go in chunks of 7 rows and 2 rows."""
    N, M = 2**28, 9
    if torch.cuda.mem_get_info()[0] < 16 * 2**30:
        pytest.skip("needs 16 GiB of free GPU memory")
    disable_autotune(monkeypatch)
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(N, device="cuda", dtype=torch.bfloat16) + 0.5
    y = rms_norm(x, w)
    for r in (0, 6, 7, 8):                                # both sides of the chunk boundary
        xr = x[r].float()
        want = (xr * torch.rsqrt(xr.square().mean() + 1e-6) * w.float()).bfloat16()
        torch.testing.assert_close(y[r], want, atol=2e-2, rtol=2e-2)
        del xr, want


def test_rms_norm_backward_past_int32_rows(monkeypatch):
    """524289 rows of 4096 bf16 (2^31 + 4096 elements): the backward runs in row chunks too;
    every row of dx and dweight (summed over the chunks) against float64 autograd of
    test_rms_norm's reference, taken over slices of rows, with test_rms_norm's tolerances."""
    M, N, eps, step = 2**19 + 1, 4096, 1e-6, 2**15
    if torch.cuda.mem_get_info()[0] < 32 * 2**30:
        pytest.skip("needs 32 GiB of free GPU memory")
    disable_autotune(monkeypatch)
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16).requires_grad_()
    w = (torch.rand(N, device="cuda", dtype=torch.bfloat16) + 0.5).requires_grad_()
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    dx, dw = torch.autograd.grad(rms_norm(x, w, eps), (x, w), dy)
    tol = 2 * RMS_TOL[torch.bfloat16]
    want_dw = torch.zeros(N, device="cuda", dtype=torch.float64)
    for s in range(0, M, step):               # the chunk boundary (row M - 17) inside one slice
        rows = slice(s, s + step)
        x64, w64 = x.detach()[rows].double().requires_grad_(), w.detach().double().requires_grad_()
        gx, gw = torch.autograd.grad(rms_reference(x64, w64, eps), (x64, w64), dy[rows].double())
        assert_dx_rows_close(dx[rows], gx, x[rows], dy[rows], w, eps, tol)
        want_dw += gw
        del x64, gx
    assert rms_rel(dw, want_dw) < tol


def test_nested_tensors_are_refused_by_name():
    """CUDA nested (jagged) tensors, as matmul's and grouped_mm's operands: a TypeError naming
    the function and the argument, on the device the checks really run on."""
    jagged = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)],
                                        layout=torch.jagged, dtype=torch.bfloat16, device="cuda")
    a = torch.randn(2, 4, 8, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(2, 8, 6, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"^matmul: a is a nested tensor"):
        matmul(jagged, b)
    with pytest.raises(TypeError, match=r"^matmul: b is a nested tensor"):
        matmul(a, jagged.transpose(1, 2))
    with pytest.raises(TypeError, match=r"^grouped_mm: x is a nested tensor"):
        grouped_mm(jagged, b)
    with pytest.raises(TypeError, match=r"^grouped_mm: w is a nested tensor"):
        grouped_mm(a, jagged.transpose(1, 2))
