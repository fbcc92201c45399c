"""Inputs past 2^31 elements: RoPE, matmul and attention give the reference's result in the rows
that lie beyond element 2^31 (cuTile indexes such arrays with 64-bit integers). rms_norm's own
row chunks: tests/gpu/test_bad_input.py. Each test needs 8-18 GiB of GPU memory."""
import pytest
import torch
import torch.nn.functional as F

from tiletune.ops.fmha import fmha
from tiletune.ops.matmul import matmul
from tiletune.ops.rope import apply_rope

from .conftest import disable_autotune, rotate_half

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
