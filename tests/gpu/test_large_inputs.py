"""Inputs past 2^31 elements: RoPE, matmul and attention give the reference's result in the rows
that lie beyond element 2^31 (cuTile indexes such arrays with 64-bit integers); so do the
grouped weight gradient of a strided x whose offsets pass 2^31 while its size does not, the
grouped forward of a weight sliced likewise, and a packed attention batch whose later
sequences start past element 2^31. rms_norm's own row chunks: tests/gpu/test_bad_input.py.
Each test needs 8-18 GiB of GPU memory."""
import pytest
import torch
import torch.nn.functional as F

from tiletune.ops.fmha import fmha, fmha_varlen
from tiletune.ops.grouped_gemm import grouped_mm
from tiletune.ops.matmul import matmul
from tiletune.ops.rope import apply_rope

from .conftest import disable_autotune, poison_allocator, rotate_half
from .test_fmha import TOL, rel

INT32 = 2**31


def _free_gib():
    free, _ = torch.cuda.mem_get_info()
    return free / 2**30



@pytest.fixture(autouse=True)
def _room():
    yield
    torch.cuda.empty_cache()


def test_rope_past_2_31_elements(monkeypatch):
    if _free_gib() < 12:
        pytest.skip("needs 12 GiB of free GPU memory")
    disable_autotune(monkeypatch)
    S, H, D = 131075, 128, 128
    q = torch.empty(1, S, H, D, device="cuda", dtype=torch.bfloat16).normal_().transpose(1, 2)
    k = torch.randn(1, S, 1, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    assert q.numel() > INT32
    ang = torch.rand(S, D // 2, device="cuda") * 6.3
    cos, sin = torch.cat((ang, ang), -1).cos(), torch.cat((ang, ang), -1).sin()
    qo, ko = apply_rope(q, k, cos, sin)
    for rows in (slice(0, 4), slice(S - 4, S)):
        qs, c, s = q[:, :, rows].float(), cos[rows], sin[rows]
        torch.testing.assert_close(qo[:, :, rows].float(), qs * c + rotate_half(qs) * s,
                                   atol=2e-2, rtol=2e-2)
        ks = k[:, :, rows].float()
        torch.testing.assert_close(ko[:, :, rows].float(), ks * c + rotate_half(ks) * s,
                                   atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("which", ["a", "c"])
def test_matmul_past_2_31_elements(which, monkeypatch):
    """An A of more than 2^31 elements (tall, K 2048), or a C of more than 2^31."""
    if _free_gib() < 10:
        pytest.skip("needs 10 GiB of free GPU memory")
    disable_autotune(monkeypatch)
    M, K, N = ((2**20 + 17, 2048, 64) if which == "a" else (65541, 64, 32768))
    a = torch.empty(M, K, device="cuda", dtype=torch.bfloat16).normal_().div_(8)
    b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16) / 8
    assert (a.numel() if which == "a" else M * N) > INT32
    c = matmul(a, b)
    for rows in (slice(0, 64), slice(M - 300, M)):
        torch.testing.assert_close(c[rows].float(), a[rows].float() @ b.float(), atol=2e-2,
                                   rtol=2e-2)


def test_attention_past_2_31_elements(monkeypatch):
    if _free_gib() < 18:
        pytest.skip("needs 18 GiB of free GPU memory")
    disable_autotune(monkeypatch)
    B, S, D = 16385, 1024, 128
    q, k, v = (torch.empty(B, 1, S, D, device="cuda", dtype=torch.bfloat16).normal_()
               for _ in range(3))
    assert q.numel() > INT32
    o = fmha(q, k, v, causal=True)
    for batch in (slice(0, 2), slice(B - 2, B)):
        want = F.scaled_dot_product_attention(q[batch].float(), k[batch].float(),
                                              v[batch].float(), is_causal=True)
        torch.testing.assert_close(o[batch].float(), want, atol=2e-2, rtol=2e-2)


def test_grouped_weight_gradient_of_a_strided_x(monkeypatch):
    """x = h[:, :4096] of an (T, 8192) h: under 2^31 elements, but row 270000 starts past element
    2^31 of h. The K-grouped form (x^T dY per group) slices x at each group's first row."""
    if _free_gib() < 10:
        pytest.skip("needs 10 GiB of free GPU memory")
    disable_autotune(monkeypatch)
    T, K, N = 300000, 4096, 64
    h = torch.empty(T, 2 * K, device="cuda", dtype=torch.bfloat16).normal_()
    x = h[:, :K]
    assert x.numel() < INT32 < (T - 1) * x.stride(0)
    dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
    offs = torch.tensor([150000, 270000, T], device="cuda", dtype=torch.int32)
    dw = grouped_mm(x.t(), dy, offs)
    for g, rows in ((0, slice(0, 150000)), (2, slice(270000, T))):
        want = x[rows].t().float() @ dy[rows].float()
        torch.testing.assert_close(dw[g].float(), want, atol=0.5, rtol=2e-2)


def test_grouped_forward_of_a_sliced_weight_past_2_31_elements(monkeypatch):
    """w = W[:, :, :N] of an (E, K, 2N) W: under 2^31 elements, but its last groups lie past
    element 2^31 of W. The M-grouped kernel reads w[g] at g's offset."""
    if _free_gib() < 10:
        pytest.skip("needs 10 GiB of free GPU memory")
    disable_autotune(monkeypatch)
    E, K, N, rows = 8, 4096, 40000, 64
    W = torch.empty(E, K, 2 * N, device="cuda", dtype=torch.bfloat16).normal_().div_(K ** 0.5)
    w = W[:, :, :N]
    assert w.numel() < INT32 < (E - 1) * w.stride(0)
    x = torch.randn(E * rows, K, device="cuda", dtype=torch.bfloat16)
    offs = torch.arange(1, E + 1, device="cuda", dtype=torch.int32) * rows
    poison_allocator(torch)
    out = grouped_mm(x, w, offs)
    for g in (0, E - 2, E - 1):
        r = slice(g * rows, (g + 1) * rows)
        torch.testing.assert_close(out[r].float(), x[r].float() @ w[g].float(), atol=2e-2,
                                   rtol=2e-2)


def test_packed_attention_past_2_31_elements(monkeypatch):
    """fmha_varlen over 264 sequences of 1000 tokens, Hq 64 / Hkv 8, D 128: q holds 2.16e9
    elements, so the last sequences' rows start past element 2^31 (the kernels slice each
    sequence out of the packed tensors). Forward and backward of the first and last sequence."""
    if _free_gib() < 30:
        pytest.skip("needs 30 GiB of free GPU memory")
    disable_autotune(monkeypatch)
    L, B, Hq, Hkv, D = 1000, 264, 64, 8, 128
    T = L * B
    q = torch.empty(T, Hq, D, device="cuda", dtype=torch.bfloat16).normal_().requires_grad_()
    k, v = (torch.randn(T, Hkv, D, device="cuda", dtype=torch.bfloat16).requires_grad_()
            for _ in range(2))
    assert q.numel() > INT32 and (T - L) * q.stride(0) > INT32
    cu = torch.arange(0, T + 1, L, device="cuda", dtype=torch.int32)
    o = fmha_varlen(q, k, v, cu, cu, L, L, causal=True)
    do = torch.randn_like(o)
    o.backward(do)
    for rows in (slice(0, L), slice(T - L, T)):
        qs, ks, vs = (t.detach()[rows].float().transpose(0, 1).requires_grad_()
                      for t in (q, k, v))
        want = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, enable_gqa=True)
        want.backward(do[rows].float().transpose(0, 1))
        assert rel(o[rows], want.transpose(0, 1)) < TOL[torch.bfloat16]
        for got, ref in ((q.grad, qs.grad), (k.grad, ks.grad), (v.grad, vs.grad)):
            assert rel(got[rows], ref.transpose(0, 1)) < TOL[torch.bfloat16]
