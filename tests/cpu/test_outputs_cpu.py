"""The host side of each op allocates its outputs: the shape, dtype and contiguity the kernels
write and the callers read. Run on CPU tensors with ct.launch stubbed (nothing is computed)."""
import itertools
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import ShapeEnv

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


# ---------------------------------------------------------------------------------------------
# The custom ops' fake implementations (what torch.compile traces) against the eager code they
# stand for, on unusual inputs: the same shape, dtype, device, storage offset and strides (of
# every dim longer than 1: what inductor asserts of a custom op's outputs), with static and with
# symbolic shapes; and the eager code writes no input and returns no alias (the schemas declare
# no mutation, and torch.compile may reuse an input's memory after the op).

def _layouts(shape, dtype=BF16):
    """(name, tensor of `shape`): contiguous, then the layouts callers hand in."""
    n = math.prod(shape)
    yield "contiguous", torch.randn(shape).to(dtype)
    if len(shape) >= 2:
        yield "transposed", torch.randn(shape[1], shape[0], *shape[2:]).to(dtype).transpose(0, 1)
        yield "reversed dims", torch.randn(shape[::-1]).to(dtype).permute(
            *range(len(shape) - 1, -1, -1))
    yield "stepped last dim", torch.randn(*shape[:-1], 2 * shape[-1]).to(dtype)[..., ::2]
    yield "storage offset", torch.randn(n + 3).to(dtype)[3:].view(shape)
    yield "expanded", torch.randn(1, *shape[1:]).to(dtype).expand(shape)


def _metadata(t):
    if t is None:
        return None
    size = [int(s) for s in t.shape]
    strides = tuple(int(s) for n, s in zip(size, t.stride()) if n > 1) if 0 not in size else ()
    return tuple(size), t.dtype, t.device, strides, int(t.storage_offset())


def _as_list(results):
    return [results] if results is None or isinstance(results, torch.Tensor) else list(results)


def _same_values(a, b):
    return torch.equal(a.float(), b.float()) if a.is_floating_point() else torch.equal(a, b)


def _fake_vs_eager(op, args, symbolic):
    """What differs between op's eager results and its fake ones (static shapes, and where
    `symbolic` symbolic ones too), and between its inputs before and after the eager call."""
    inputs = [a for a in args if isinstance(a, torch.Tensor)]
    before = [(a._version, a.clone()) for a in inputs]
    eager = _as_list(op(*args))
    problems = []
    if any(a._version != v or not _same_values(a, c) for a, (v, c) in zip(inputs, before)):
        problems.append("an input was written")
    held = [a.untyped_storage().data_ptr() for a in inputs if a.numel()]
    ptrs = [t.untyped_storage().data_ptr() for t in eager if t is not None and t.numel()]
    if set(ptrs) & set(held) or len(set(ptrs)) != len(ptrs):
        problems.append("an output aliases an input or another output")
    want = [_metadata(t) for t in eager]
    modes = [("static", FakeTensorMode())]
    if symbolic:
        modes.append(("symbolic", FakeTensorMode(shape_env=ShapeEnv(), static_shapes=False)))
    for name, mode in modes:
        with mode:
            fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args]
            got = [_metadata(t) for t in _as_list(op(*fake_args))]
        if got != want:
            problems.append(f"{name} fake {got} != eager {want}")
    return problems


def _custom_op_cases():
    """(label, custom op, arguments as the autograd wrappers pass them)."""
    from tiletune.ops import moe as MO
    from tiletune.ops import rms_norm_rope as RR
    from tiletune.ops import rope as RP
    fwd = {op: op._fwd_op for op in (R._rms_norm, SW._glu, GM._op, MM._matmul_op,
                                      GG._grouped_op, GG._k_grouped_op, MO._permute_op,
                                      MO._unpermute_op, RP._rope_op, RR._rms_norm_rope,
                                      FM._fmha, FM._fmha_varlen)}
    bwd = {op: op._bwd_op for op in fwd}
    for shape in ((3, 5, 64), (2, 3, 4, 16), (0, 64), (1, 1, 8), (64,)):
        N, M = shape[-1], math.prod(shape[:-1])
        for name, x in _layouts(shape):
            for w in (torch.rand(N, dtype=BF16), torch.rand(2 * N)[::2]):
                yield f"rms_norm {shape} {name} {w.dtype}", fwd[R._rms_norm], (x, w, 1e-6)
            for needs in ([True, True], [True, False]):
                yield (f"rms_norm backward {shape} dy {name} {needs}", bwd[R._rms_norm],
                       (needs, x, torch.randn(shape, dtype=BF16), torch.rand(2 * N)[::2],
                        torch.rand(M)))
            yield f"swiglu {shape} {name}", fwd[SW._glu], (x, x, SW.SILU)
            yield (f"swiglu backward {shape} dy {name}", bwd[SW._glu],
                   ([True, True], x, torch.randn(shape, dtype=BF16), x, SW.SILU))
    w, w_col = torch.randn(128, 64, dtype=BF16), torch.randn(64, 128, dtype=BF16).t()
    for shape in ((3, 5, 64), (2, 0, 64), (64,)):
        M = math.prod(shape[:-1])
        for name, x in _layouts(shape):
            for save in (True, False):
                yield (f"gated_mlp {shape} {name} save={save}", fwd[GM._op],
                       (x, w_col, w, SW.SILU, save))
            gate = torch.randn(M, 128, dtype=BF16)
            dy = torch.randn(128, *shape[:-1], dtype=BF16).movedim(0, -1)
            for needs in ([True, True, True], [True, False, False], [False, True, False]):
                yield (f"gated_mlp backward {shape} dy {name} {needs}", bwd[GM._op],
                       (needs, dy, x, w, w, gate, gate, SW.SILU))
    for shapes in (((64, 32), (32, 16)), ((2, 8, 32), (2, 32, 16)), ((4, 0), (0, 16)),
                   ((1, 32), (32, 1))):
        for (na, a), (nb, b) in zip(_layouts(shapes[0]), _layouts(shapes[1])):
            yield f"matmul {shapes} {na} @ {nb}", fwd[MM._matmul_op], (a, b)
            dc = torch.randn(*shapes[0][:-1], shapes[1][-1], dtype=BF16)
            for needs in ([True, False], [False, True]):
                yield (f"matmul backward {shapes} {na} @ {nb} {needs}", bwd[MM._matmul_op],
                       (needs, dc.transpose(-2, -1).contiguous().transpose(-2, -1), a, b))
    offs = torch.tensor([2, 4, 6, 7], dtype=torch.int32)
    for (nx, x), (nw, w3) in zip(_layouts((7, 64)), _layouts((4, 64, 32))):
        yield f"grouped_mm {nx} @ {nw}", fwd[GG._grouped_op], (x, w3, offs)
        for needs, w_col in itertools.product(([True, True], [True, False], [False, True]),
                                              (True, False)):
            yield (f"grouped_mm backward {nx} @ {nw} {needs} w_col={w_col}", bwd[GG._grouped_op],
                   (needs, torch.randn(32, 7, dtype=BF16).t(), x, w3, offs, w_col))
    for (na, a), (nb, b) in zip(_layouts((16, 7)), _layouts((7, 32))):
        yield f"grouped_mm K-grouped {na} @ {nb}", fwd[GG._k_grouped_op], (a, b, offs)
        for needs in ([True, True], [True, False], [False, True]):
            yield (f"grouped_mm K-grouped backward {na} @ {nb} {needs}", bwd[GG._k_grouped_op],
                   (needs, torch.randn(4, 32, 16, dtype=BF16).transpose(-2, -1), a, b, offs))
    for T, k, H in ((7, 3, 20), (0, 2, 8), (5, 2, 0)):
        inverse = torch.randperm(T * k).to(torch.int32).view(T, k)
        for (nx, x), (nw, weights) in zip(_layouts((T, H)), _layouts((T, k), F32)):
            yield f"moe_permute {T, k, H} {nx}", fwd[MO._permute_op], (x, inverse)
            yield (f"moe_permute backward {T, k, H} {nx}", bwd[MO._permute_op],
                   ([True, False], torch.randn(T * k, H, dtype=BF16), inverse))
            ys = torch.randn(T * k, H, dtype=BF16)
            complete = nx != "transposed"     # (and an inverse with dropped slots)
            yield (f"moe_unpermute {T, k, H} {nw}", fwd[MO._unpermute_op],
                   (ys, inverse, weights, complete))
            for needs, kept in (([True, False, True, False], ys),
                                ([True, False, False, False], None),
                                ([False, False, True, False], ys)):
                yield (f"moe_unpermute backward {T, k, H} dout {nx} {needs}",
                       bwd[MO._unpermute_op], (needs, x, kept, inverse, weights, complete))
    for B, Hq, Hk, S, D in ((2, 4, 2, 5, 16), (1, 1, 1, 1, 8), (0, 4, 2, 5, 16)):
        for (nq, q), (nk, k) in zip(_layouts((B, Hq, S, D)), _layouts((B, Hk, S, D))):
            for rot in (D, D // 2):
                cos = torch.rand(S, rot).expand(B, -1, -1)
                yield (f"rope {B, Hq, Hk, S, D} {nq} rot={rot}", fwd[RP._rope_op],
                       (q, k, cos, cos, None, rot, True, False))
                yield (f"rope backward {B, Hq, Hk, S, D} {nq} rot={rot}", bwd[RP._rope_op],
                       ([True, True], q, k, cos, cos, None, rot, False))
                wq = torch.rand(D)
                yield (f"rms_norm_rope {B, Hq, Hk, S, D} {nq} rot={rot}", fwd[RR._rms_norm_rope],
                       (q, k, wq, wq, cos, cos, None, rot, 1e-6))
                for needs in ([True, True, True, True], [True, True, False, False])[rot < D:]:
                    yield (f"rms_norm_rope backward {B, Hq, Hk, S, D} {nq} {needs}",
                           bwd[RR._rms_norm_rope],
                           (needs, q, k, q, k, wq, wq, cos, cos, None, RR._rstd(q).fill_(1.0),
                            RR._rstd(k).fill_(1.0), rot))
    for B, Hq, Hk, Sq, Sk, D in ((1, 4, 2, 33, 17, 16), (1, 2, 1, 1, 40, 64),
                                 (1, 1, 1, 0, 5, 16), (1, 1, 1, 5, 0, 16)):
        for (nq, q), (nk, k) in zip(_layouts((B, Hq, Sq, D)), _layouts((B, Hk, Sk, D))):
            yield (f"fmha {B, Hq, Hk, Sq, Sk, D} {nq}, {nk}", fwd[FM._fmha],
                   (q, k, k, True, Sk - Sq, 0.25))
            for needs in ([True, True, True], [True, False, False]):
                yield (f"fmha backward {B, Hq, Hk, Sq, Sk, D} {nq}, {nk} {needs}", bwd[FM._fmha],
                       (needs, q, q, k, k, torch.randn(B, Hq, Sq, D, dtype=BF16),
                        FM._rows(B, Hq, Sq, like=q).fill_(1.0), True, Sk - Sq, 0.25))
    for Tq, Tk, H, Hk, D in ((6, 6, 4, 2, 16), (0, 3, 2, 1, 16), (5, 0, 2, 1, 16)):
        cu_q = torch.tensor([0, min(2, Tq), Tq], dtype=torch.int32)
        cu_k = torch.tensor([0, min(1, Tk), Tk], dtype=torch.int32)
        for (nq, q), (nk, k) in zip(_layouts((Tq, H, D)), _layouts((Tk, Hk, D))):
            yield (f"fmha_varlen {Tq, Tk, H, Hk, D} {nq}, {nk}", fwd[FM._fmha_varlen],
                   (q, k, k, cu_q, cu_k, 4, 2, True, 0.25))
            for needs in ([True, True, True], [True, False, False]):
                yield (f"fmha_varlen backward {Tq, Tk, H, Hk, D} {nq}, {nk} {needs}",
                       bwd[FM._fmha_varlen],
                       (needs, q, q, k, k, cu_q, cu_k, torch.randn(Tq, H, D, dtype=BF16),
                        FM._rows(1, H, Tq, like=q).fill_(1.0), 4, 2, True, 0.25))
    for M, K in ((64, 256), (0, 256), (130, 129)):
        for name, x in _layouts((M, K), F32):
            for granularity in ("tensor", "row", "block1x128", "block128x128"):
                yield (f"quantize_fp8 {M, K} {name} {granularity}", F8._quantize_op,
                       (x, granularity, E4M3))
            yield f"quantize_fp8_pair {M, K} {name}", F8._quantize_pair_op, (x.to(BF16), E4M3)
    for M, K, N in ((64, 256, 128), (5, 32, 7), (0, 32, 8), (8, 0, 4)):
        a = torch.randn(M, K).to(E4M3)
        for name, b in (("contiguous", torch.randn(K, N).to(E4M3)),
                        ("transposed", torch.randn(N, K).to(E4M3).t())):
            for out_dtype in (BF16, F32):
                yield (f"fp8_mm {M, K, N} b {name} {out_dtype}", F8._fp8_mm_op,
                       (a, b, torch.rand(M, 1) + 0.5, torch.rand(1, N) + 0.5, out_dtype, False))


def test_fake_implementations_match_the_eager_outputs(host_only):
    """Every custom op's fake against its eager implementation (ct.launch stubbed): a layout
    the fake gets wrong fails inductor's stride assertions on the GPU, or makes a compiled
    graph copy or misread the output."""
    problems, seen = [], set()
    for label, op, args in _custom_op_cases():
        # symbolic shapes (the fakes' size-dependent branches) once per shape: the first layout
        symbolic = "contiguous" in label
        problems += [f"{label}: {p}" for p in _fake_vs_eager(op, args, symbolic)]
        seen.add(op)
    assert not problems, "\n".join(problems)
    assert len(seen) == 27      # every custom op: 12 forward and backward pairs, 3 FP8 ops


def test_in_place_rope_under_torch_compile_writes_through_copies(host_only, launches):
    """The custom ops declare no mutation: under torch.compile, apply_rope(inplace=True) runs
    the out-of-place op and copies its results into q and k, which it returns (the custom op
    handed inplace=True would return its inputs, which torch refuses)."""
    from tiletune.ops.rope import apply_rope
    q, k = torch.randn(2, 4, 7, 16, dtype=BF16), torch.randn(2, 2, 7, 16, dtype=BF16)
    cos = torch.rand(7, 16)
    versions = q._version, k._version
    rope = torch.compile(lambda q, k, cos, sin: apply_rope(q, k, cos, sin, inplace=True),
                         backend="aot_eager", fullgraph=True)
    q_out, k_out = rope(q, k, cos, cos)
    assert q_out is q and k_out is k
    assert q._version > versions[0] and k._version > versions[1]
    assert [kernel for _, kernel, _ in launches] == ["rope kernel"]      # the out-of-place one


def test_calls_under_a_fake_tensor_mode_launch_nothing(host_only, launches):
    """Under a fake-tensor mode (make_fx, aot_function, a memory estimator) an eager call goes
    through the op's custom op, whose fake implementation gives the outputs: no kernel is
    launched on tensors without memory, and the host checks that read addresses (in-place
    RoPE's, out='s) or values (position_ids' range) are skipped, as under torch.compile."""
    from tiletune.ops.rope import apply_rope
    x, w = torch.randn(6, 64, dtype=BF16), torch.randn(64, dtype=BF16)
    q, k = torch.randn(2, 4, 5, 32, dtype=BF16), torch.randn(2, 2, 5, 32, dtype=BF16)
    cos, sin = torch.randn(7, 32), torch.randn(7, 32)
    a, b = torch.randn(16, 32, dtype=BF16), torch.randn(32, 8, dtype=BF16)
    with FakeTensorMode(allow_non_fake_inputs=True) as mode:
        fx, fw = mode.from_tensor(x), mode.from_tensor(w.requires_grad_())
        y = R.rms_norm(fx, fw)
        assert y.shape == x.shape and y.dtype == BF16 and y.requires_grad
        fq, fk = mode.from_tensor(q), mode.from_tensor(k)
        pos = mode.from_tensor(torch.tensor([[0, 6, 2, 3, 1]] * 2))
        qo, ko = apply_rope(fq, fk, mode.from_tensor(cos), mode.from_tensor(sin),
                            position_ids=pos, inplace=True)
        assert qo is fq and ko is fk
        out = mode.from_tensor(torch.empty(16, 8, dtype=BF16))
        assert MM.matmul(mode.from_tensor(a), mode.from_tensor(b), out=out) is out
        xq, scales = F8.quantize_fp8(mode.from_tensor(a), "row")
        assert xq.dtype == E4M3 and xq.shape == a.shape and scales.shape == (16, 1)
    assert not launches
