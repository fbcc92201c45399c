"""The host side of each op allocates its outputs: the shape, dtype and contiguity the kernels
write and the callers read. Run on CPU tensors with ct.launch stubbed (nothing is computed)."""
import pytest
import torch

from tiletune import autotune, device, validate
from tiletune.ops import fmha as FM
from tiletune.ops import fp8_gemm as F8
from tiletune.ops import gated_mlp as GM
from tiletune.ops import grouped_gemm as GG
from tiletune.ops import matmul as MM
from tiletune.ops import rms_norm as R
from tiletune.ops import swiglu as SW
from tests.cpu.stand_ins import resolve_misses_to_default

BF16, F32, E4M3 = torch.bfloat16, torch.float32, torch.float8_e4m3fn


@pytest.fixture
def host_only(launches, monkeypatch):
    resolve_misses_to_default(monkeypatch, lambda tuner, dev: f"{tuner.name} kernel")
    monkeypatch.setitem(device._SM_COUNT, -1, 132)      # a CPU tensor's device index
    monkeypatch.setattr(validate, "tensor", lambda op, name, t, **kw: t)
    monkeypatch.setattr(F8, "_check_arch", lambda *a: None)
    monkeypatch.setattr(F8, "device_arch", lambda dev: "sm_90")
    monkeypatch.setattr(R, "launch_bwd", lambda *a: None)   # its scratch needs a device index
    autotune.clear_cache()
    yield
    autotune.clear_cache()


def _outputs():
    x3 = torch.randn(3, 5, 64, dtype=BF16)
    w = torch.rand(64, dtype=BF16)
    g3 = torch.randn(2, 3, 128, dtype=BF16)
    a, b = torch.randn(64, 256, dtype=BF16), torch.randn(256, 128, dtype=BF16)
    xg = torch.randn(7, 64, dtype=BF16)
    wg = torch.randn(4, 128, 64, dtype=BF16).transpose(-2, -1)
    offs = torch.tensor([2, 4, 6, 7], dtype=torch.int32)
    wgate, wup = torch.randn(128, 64, dtype=BF16), torch.randn(128, 64, dtype=BF16)
    a8 = torch.randn(64, 256).to(E4M3)
    b8 = torch.randn(128, 256).to(E4M3).t()
    xq = torch.randn(64, 256, dtype=BF16)
    y, rstd = R._forward(x3, w, 1e-6)
    dx, _ = R._backward(torch.randn_like(x3), x3, w, rstd)
    dgate, dup = SW.backward(g3, g3, g3, "silu")
    gy, gate, up = GM._forward(torch.randn(2, 8, 64, dtype=BF16), wgate, wup, "silu", True)
    _, unsaved, _ = GM._forward(torch.randn(16, 64, dtype=BF16), wgate, wup, "silu", False)
    (pq, _), (pq_t, _) = F8.quantize_fp8_pair(xq)
    yield "rms_norm y", y, (3, 5, 64), BF16
    yield "rms_norm rstd", rstd, (15,), F32
    yield "rms_norm dx", dx, (3, 5, 64), BF16
    yield "rms_norm y, x transposed", R._forward(x3.transpose(0, 1), w, 1e-6)[0], (5, 3, 64), BF16
    yield "swiglu", SW._forward(g3, g3, "silu"), (2, 3, 128), BF16
    yield "swiglu dgate", dgate, (2, 3, 128), BF16
    yield "swiglu dup", dup, (2, 3, 128), BF16
    gate_half, up_half = torch.randn(2, 3, 256, dtype=BF16).chunk(2, -1)     # strided views
    yield "swiglu of chunk() halves", SW._forward(gate_half, up_half, "silu"), (2, 3, 128), BF16
    yield "matmul", MM.plain_matmul(a, b), (64, 128), BF16
    yield "matmul batched", MM.plain_matmul(a.expand(2, -1, -1), b.expand(2, -1, -1)), \
        (2, 64, 128), BF16
    yield "grouped_mm", GG._mgrouped(xg, wg, offs), (7, 128), BF16
    yield "grouped_mm K-grouped", GG._kgrouped(xg.t(), torch.randn(7, 32, dtype=BF16), offs), \
        (4, 64, 32), BF16
    yield "gated_mlp y", gy, (2, 8, 128), BF16
    yield "gated_mlp gate", gate, (16, 128), BF16
    yield "gated_mlp up", up, (16, 128), BF16
    yield "gated_mlp gate not saved", unsaved, (0,), BF16
    yield "fp8_mm", F8.fp8_mm(a8, b8, torch.rand(64, 1) + 0.5, torch.rand(1, 128) + 0.5), \
        (64, 128), BF16
    for granularity, scales in (("row", (64, 1)), ("tensor", ()), ("block1x128", (64, 2)),
                                ("block128x128", (1, 2))):
        q, s = F8.quantize_fp8(xq, granularity)
        yield f"quantize_fp8 {granularity}", q, (64, 256), E4M3
        yield f"quantize_fp8 {granularity} scales", s.contiguous(), scales, F32
    yield "quantize_fp8_pair q", pq, (64, 256), E4M3
    yield "quantize_fp8_pair q^T", pq_t, (256, 64), E4M3


def test_outputs_have_the_shape_dtype_and_layout_the_kernels_write(host_only):
    seen = 0
    for name, t, shape, dtype in _outputs():
        assert tuple(t.shape) == shape, (name, tuple(t.shape))
        assert t.dtype == dtype, (name, t.dtype)
        assert t.is_contiguous(), (name, t.stride())
        seen += 1
    assert seen == 27      # every output above was checked


def test_statistics_rows_are_padded_to_16_bytes(host_only):
    rows = FM._rows(2, 4, 1001, like=torch.empty(1, dtype=BF16))
    assert tuple(rows.shape) == (2, 4, 1001) and rows.dtype == F32
    assert rows.stride() == (4 * 1004, 1004, 1)


def test_outputs_a_caller_may_change_in_place_under_autograd(host_only):
    """A Function's output that is a view it made itself cannot be changed in place under
    autograd (`y.mul_(2)` raises): the ops allocate outputs in their final shape; in-place RoPE
    on views that need a gradient rotates out of place and copies back."""
    from tiletune.ops.gated_mlp import swiglu_linear
    from tiletune.ops.rms_norm import rms_norm
    from tiletune.ops.rope import apply_rope
    x3 = torch.randn(3, 5, 64, dtype=BF16, requires_grad=True)
    w = torch.rand(64, dtype=BF16, requires_grad=True)
    wgate = torch.randn(128, 64, dtype=BF16, requires_grad=True)
    wup = torch.randn(128, 64, dtype=BF16, requires_grad=True)
    for y in (rms_norm(x3, w), swiglu_linear(x3, wgate, wup), swiglu_linear(x3[0], wgate, wup)):
        assert y.requires_grad and not y._is_view()
        y.mul_(2)
    qkv = torch.randn(2, 7, 4 + 2 + 2, 16, dtype=BF16, requires_grad=True) * 1   # (B, S, H, D)
    q, k = qkv[:, :, :4].transpose(1, 2), qkv[:, :, 4:6].transpose(1, 2)       # HF's views
    cos = sin = torch.rand(7, 16, dtype=BF16)
    q_out, k_out = apply_rope(q, k, cos, sin, inplace=True)
    assert q_out is q and k_out is k
    (g,) = torch.autograd.grad((q_out.float().sum() + k_out.float().sum()), qkv)
    assert g.shape == qkv.shape


def test_rms_norm_without_a_backward_allocates_no_rstd(host_only, launches):
    """rms_norm's call that no gradient can reach hands the forward kernel a stand-in of a few
    floats per device instead of an (M,) rstd (its stores past the end are dropped); with a
    gradient, (M,)."""
    from tiletune.ops.rms_norm import rms_norm
    x, w = torch.randn(6, 64, dtype=BF16), torch.rand(64, dtype=BF16)
    y = rms_norm(x, w)
    assert y.shape == x.shape and y.dtype == BF16
    (_, _, args), = launches
    stand_in = R._NO_RSTD.get(x, -1, 6)
    assert args[3] is stand_in and stand_in.dtype == F32 and stand_in.numel() <= 16
    launches.clear()
    rms_norm(x.clone(), w)                            # the same buffer again
    assert launches[0][2][3] is stand_in
    launches.clear()
    rms_norm(x, w.clone().requires_grad_())
    assert launches[0][2][3].shape == (6,)


def test_the_rstd_stand_in_specializes_as_the_real_rstd():
    """The stand-in's JIT signature is the (M,) rstd's at every M, so the tuned kernel (the
    signature its search and the AOT cases compiled) serves calls without a backward too."""
    from tiletune.aot import jit_array
    like = torch.empty(1, dtype=BF16)
    for m in (1, 2, 3, 4, 5, 6, 8, 12, 15, 16, 17, 32, 33, 100, 1000, 1024, 4097):
        stand_in = R._NO_RSTD.get(like, -2, m)
        assert stand_in.numel() <= 16
        assert jit_array(F32, stand_in.shape, stand_in.stride()) == jit_array(F32, (m,)), m
    R._NO_RSTD.clear()


def test_packed_batch_without_keys_launches_nothing(host_only, launches):
    """max_seqlen_k 0 (every sequence without keys, whatever tokens k holds past them): zero
    output and gradients, and no launch (the dK/dV grid would have no key tile)."""
    q, k = torch.randn(6, 4, 16, dtype=BF16), torch.randn(3, 2, 16, dtype=BF16)
    cu_q, cu_k = torch.tensor([0, 2, 6], dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    o, lse = FM._varlen_forward(q, k, k, cu_q, cu_k, 4, 0, True, 0.25)
    dq, dk, dv = FM._varlen_backward(q, q, k, k, cu_q, cu_k, o, lse, 4, 0, True, 0.25)
    assert launches == []
    assert not (o.any() or dq.any() or dk.any() or dv.any()) and torch.isinf(lse).all()


@pytest.mark.parametrize("b, hq, hkv, s", [(1, 4, 2, 64), (2, 4, 4, 33), (1, 1, 1, 5),
                                           (2, 8, 1, 1), (1, 1, 1, 1)])
def test_fmha_without_a_backward_allocates_no_lse(host_only, launches, b, hq, hkv, s):
    """fmha's call that no gradient can reach hands the kernels a stand-in for its LSE2 rows
    (a few floats per device; the stores past its end are dropped); with a gradient, the real
    (B*Hq, Sq) rows."""
    q = torch.randn(b, hq, s, 64, dtype=BF16)
    kv = torch.randn(b, hkv, s, 64, dtype=BF16)
    o = FM.fmha(q, kv, kv, causal=True)
    assert o.shape == q.shape and o.dtype == BF16
    stand_in = FM._NO_LSE.get(q, -1, b * hq, s)
    assert stand_in.dtype == F32 and stand_in.numel() <= 16 * 16
    assert any(a is stand_in for a in launches[-1][2])          # the last launch writes lse
    launches.clear()
    FM.fmha(q, kv, kv.clone().requires_grad_(), causal=True)
    assert not any(a is stand_in for _, _, args in launches for a in args)
    assert any(isinstance(a, torch.Tensor) and a.dtype == F32 and a.shape == (b * hq, s)
               for _, _, args in launches for a in args)


def test_the_lse_stand_in_specializes_as_the_real_rows():
    """The JIT specializes an array on its size-1 dims, sizes that are multiples of 16 and
    strides' 16-byte alignment: the stand-in's signature must be the real rows' at every shape,
    so one compiled kernel (the AOT cases' signature) serves calls with and without a backward."""
    from tiletune.aot import jit_array
    like = torch.empty(1, dtype=BF16)
    for bh in (1, 2, 3, 4, 5, 12, 16, 32, 48, 100):
        for s in (1, 2, 3, 4, 5, 6, 7, 8, 12, 15, 16, 17, 20, 32, 33, 64, 100, 1000, 1024):
            for b, h in ((1, bh), (bh, 1)):
                real = FM._flat(FM._rows(b, h, s, like=like))
                stand_in = FM._lse_rows(None, like, -2, bh, s)
                assert jit_array(F32, stand_in.shape, stand_in.stride()) == \
                    jit_array(F32, real.shape, real.stride()), (b, h, s)
    FM._NO_LSE.clear()


def test_a_packed_forward_refuses_the_lse_stand_in(host_only, launches):
    """The packed kernels slice lse at each sequence's offsets (bounds read on the device): a
    stand-in of a few floats would be sliced past its end, so only dense launches take one."""
    q = torch.randn(1, 4, 6, 16, dtype=BF16)
    cu = torch.tensor([0, 2, 6], dtype=torch.int32)
    with pytest.raises(ValueError, match="lse"):
        FM.launch_fwd(q, q, q, torch.empty_like(q), None, False, 0, 0.25, (2, 4, 4), cu, cu)
    assert launches == []
