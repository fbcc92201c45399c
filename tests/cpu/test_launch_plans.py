"""Every op's launch keys hold every size its grids depend on: each op runs, ct.launch stubbed
and every grid rechecked (tests/conftest.py), at two sizes that share a tuning key; the grids
differ, so a launch key that left out a size would fail here."""
import math

import pytest
import torch

from tiletune import autotune, device
from tiletune.ops import fmha as FM
from tiletune.ops import fp8_gemm as F8
from tiletune.ops import grouped_gemm as GG
from tiletune.ops import moe as MOE
from tiletune.ops import rms_norm as R
from tiletune.ops import rms_norm_rope as RR
from tiletune.ops import rope as RP
from tiletune.ops.rows import row_stride
from tiletune.ops import swiglu as SW
from tests.cpu.stand_ins import kernel_rows, resolve_misses_to_default

BF16 = torch.bfloat16


@pytest.fixture
def defaults(launches, monkeypatch):
    """A miss resolves to the shape's first (default) config with a stand-in kernel."""
    resolve_misses_to_default(monkeypatch, lambda tuner, dev: f"{tuner.name} kernel")
    monkeypatch.setitem(device._SM_COUNT, -1, 132)      # a CPU tensor's device index
    monkeypatch.setattr(F8, "device_arch", lambda dev: "sm_90")
    autotune.clear_cache()
    yield launches
    autotune.clear_cache()


def _rms_norm(n):
    x = torch.randn(n, 256, dtype=BF16)
    R.launch_fwd(x, torch.ones(256, dtype=BF16), torch.empty_like(x),
                 torch.empty(n), 1e-6, n, 256)


@pytest.mark.parametrize("n", [1024, 40000], ids=["one tile", "wide rows"])
def test_a_frozen_norm_weight_gets_no_gradient_and_no_column_sum(defaults, n):
    """LoRA-style training freezes the norm weights: the backward leaves the per-CTA weight
    partials unsummed (one launch less) and gives the weight no gradient."""
    x, w = torch.randn(4, n, dtype=BF16), torch.ones(n, dtype=BF16)
    _, rstd = R._forward(x, w, 1e-6)
    for need_w in (True, False):
        defaults.clear()
        dx, dw = R._backward(torch.randn_like(x), x, w, rstd, need_w)
        sums = [kernel for _, kernel, _ in defaults if kernel == "column_sum kernel"]
        assert (dw is not None) is need_w and len(sums) == need_w and dx.shape == x.shape
    q, k = torch.randn(1, 4, 5, 64, dtype=BF16), torch.randn(1, 2, 5, 64, dtype=BF16)
    cos = torch.randn(1, 5, 64, dtype=BF16)
    wn = torch.ones(64, dtype=BF16)
    *_, rq, rk = RR._forward(q, k, wn, wn, cos, cos, None, 64, 1e-6)
    for need_wq, need_wk in ((True, True), (False, True), (False, False)):
        defaults.clear()
        *_, dwq, dwk = RR._backward(q, k, q, k, wn, wn, cos, cos, None, rq, rk, 64, need_wq,
                                    need_wk)
        sums = [kernel for _, kernel, _ in defaults if kernel == "column_sum kernel"]
        assert ((dwq is not None), (dwk is not None)) == (need_wq, need_wk)
        assert len(sums) == need_wq + need_wk


def test_frozen_keys_and_values_launch_no_dkdv_kernel(defaults):
    """Cross-attention to a frozen encoder, frozen K/V: the backward launches the dQ kernel
    only (it writes delta, which dK/dV would read) and gives k and v no gradient."""
    q, kv = torch.randn(1, 4, 8, 64, dtype=BF16), torch.randn(1, 2, 8, 64, dtype=BF16)
    o, lse = torch.empty_like(q), torch.empty(1, 4, 8)
    for needs in ((True, True, True), (True, False, False), (False, False, True)):
        defaults.clear()
        dq, dk, dv = FM._backward(q, q, kv, kv, o, lse, True, 0, 0.125, needs)
        kernels = [kernel for _, kernel, _ in defaults]
        assert kernels[0] == "fmha_bwd_dq kernel" and dq.shape == q.shape
        assert (len(kernels) == 2) is (dk is not None) is (needs[1] or needs[2])
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    packed = torch.randn(8, 4, 64, dtype=BF16)
    defaults.clear()
    _, dk, dv = FM._varlen_backward(packed, packed, packed[:, :2], packed[:, :2], cu, cu, packed,
                                    torch.empty(1, 4, 8), 5, 5, True, 0.125, (True, False, False))
    assert dk is None and dv is None and len(defaults) == 1


def _rms_norm_wide_backward(n):
    """Its row-coefficient launch (the column launches' grids take scratch: computed per call)."""
    x, w = torch.randn(n, 40000, dtype=BF16), torch.ones(40000, dtype=BF16)
    R._bwd_coef.launch((40000, n, BF16, BF16, BF16, -1), -1, x, x, w, torch.ones(n),
                       torch.empty(n), n, 40000)


def _rope(b):
    s = 65 if b == 1 else 50                       # B * S = 65 and 100: one bucket
    q, k = torch.randn(b, 4, s, 64, dtype=BF16), torch.randn(b, 2, s, 64, dtype=BF16)
    cos = sin = torch.randn(b, s, 64, dtype=BF16)
    RP.launch(q, k, cos, sin, None, torch.empty_like(q), torch.empty_like(k), 64, False, True)
    RP.launch(q, k, cos, sin, None, None, None, 64, False, True)


def _rms_norm_rope(s):
    q, k = torch.randn(1, 4, s, 64, dtype=BF16), torch.randn(1, 2, s, 64, dtype=BF16)
    w, cos = torch.ones(64, dtype=BF16), torch.randn(1, s, 64, dtype=BF16)
    RR._forward(q, k, w, w, cos, cos, None, 64, 1e-6)


def _fmha(s):
    q = torch.randn(1, 4, s, 64, dtype=BF16)
    kv = torch.randn(1, 2, s, 64, dtype=BF16)
    lse = torch.empty(1, 4, s)
    FM.launch_fwd(q, kv, kv, torch.empty_like(q), lse, True, 0, 0.125)
    FM.launch_bwd(q, q, kv, kv, q, lse, torch.empty_like(q), torch.empty_like(kv),
                  torch.empty_like(kv), torch.empty(4, s), True, 0, 0.125)


def _grouped(t):
    x, w = torch.randn(t, 64, dtype=BF16), torch.randn(4, 64, 96, dtype=BF16)
    offs = torch.tensor([t // 4, t // 2, 3 * t // 4, t], dtype=torch.int32)
    GG.launch(x, w, offs, torch.empty(t, 96, dtype=BF16))
    GG.launch_k(x.t(), torch.randn(t, 96, dtype=BF16), offs, torch.empty(4, 64, 96, dtype=BF16))


def _fp8(m):
    e4m3 = torch.float8_e4m3fn
    a, b = torch.zeros(m, 256, dtype=e4m3), torch.zeros(96, 256, dtype=e4m3).t()
    c = torch.empty(m, 96, dtype=BF16)
    F8.launch("row", a, b, torch.ones(m), torch.ones(96), c, False)
    F8.launch("block", a, b, torch.ones(2, m).t(), torch.ones(2, 1).t(), c, False, 1, 128)
    for g in F8.GRANULARITIES:
        F8._quantize_raw(torch.randn(m, 256, dtype=BF16), g, e4m3)


def _swiglu(n):
    g = torch.randn(n, 256, dtype=BF16)
    SW.launch_fwd(g, g, torch.empty_like(g), SW.SILU, True, n, 256)
    SW.launch_bwd(g, g, g, torch.empty_like(g), torch.empty_like(g), SW.GELU_ERF, True, n, 256)


def _moe(t):
    x, idx = torch.randn(t, 256, dtype=BF16), torch.zeros(t, 4, dtype=torch.int32)
    w, xs = torch.ones(t, 4), torch.empty(4 * t, 256, dtype=BF16)
    MOE.launch_permute(x, idx, xs)
    MOE.launch_unpermute(xs, idx, w, x)
    MOE.launch_permute_bwd(xs, idx, x)
    MOE.launch_unpermute_bwd(x, idx, w, xs, xs, w)


# two sizes of one tuning key whose grids differ
OPS = {"rms_norm": (_rms_norm, 600, 1000), "rms_norm_wide_backward": (_rms_norm_wide_backward, 9, 12),
       "rope": (_rope, 1, 2), "rms_norm_rope": (_rms_norm_rope, 20, 30),
       "fmha": (_fmha, 600, 1000), "grouped_mm": (_grouped, 600, 1000), "fp8": (_fp8, 600, 1000),
       "swiglu": (_swiglu, 600, 1000), "moe": (_moe, 100, 120)}


@pytest.mark.parametrize("op", OPS)
def test_launch_keys_hold_every_size_of_the_grid(defaults, op):
    run, small, large = OPS[op]
    run(small)
    n = len(defaults)
    run(large)
    run(small)
    first, second, third = defaults[:n], defaults[n:2 * n], defaults[2 * n:]
    assert [g for g, _, _ in first] == [g for g, _, _ in third]
    assert [g for g, _, _ in first] != [g for g, _, _ in second]
    tuned = {name: len(t.cache) for name, t in autotune.tuners().items() if t.cache}
    assert tuned and all(v == 1 for v in tuned.values()), tuned    # one tuning key each


# (..., N) tensors whose leading dims merge into rows reach every RMSNorm and SwiGLU kernel as
# they are (the kernels view them as rows); others as (M, N) rows of the same memory where a view
# exists, else a copy.
MERGED = [(4, 64, 1024), (64, 1, 1024), (4, 65, 1024), (2, 3, 4, 128)]


@pytest.mark.parametrize("shape", MERGED, ids=str)
def test_rms_norm_hands_merged_rows_over_without_a_view(defaults, shape):
    x, w = torch.randn(shape, dtype=BF16), torch.ones(shape[-1], dtype=BF16)
    y, rstd = R._forward(x, w, 1e-6)
    dy = torch.randn_like(x)
    dx, _ = R._backward(dy, x, w, rstd)
    assert y.shape == dx.shape == shape and rstd.shape == (x.numel() // shape[-1],)
    (_, _, fwd), (_, _, bwd) = defaults[:2]
    for arrays, outputs in (((fwd[0], fwd[2]), (x, y)), ((bwd[0], bwd[1], bwd[4]), (dy, x, dx))):
        assert all(a is t for a, t in zip(arrays, outputs))


@pytest.mark.parametrize("shape", MERGED, ids=str)
def test_swiglu_hands_merged_rows_over_without_a_view(defaults, shape):
    g, u = torch.randn(shape, dtype=BF16), torch.randn(shape, dtype=BF16)
    out = SW._forward(g, u, SW.SILU)
    dy = torch.randn_like(g)
    dg, du = SW.backward(dy, g, u, SW.SILU)
    (_, _, fwd), (_, _, bwd) = defaults[:2]
    assert all(a is t for a, t in zip(fwd[:3], (g, u, out)))
    assert all(a is t for a, t in zip(bwd[:5], (dy, g, u, dg, du)))


def test_rows_that_do_not_merge_go_as_views_or_copies(defaults):
    """The batch and sequence dims swapped (a copy) and one position of a longer sequence (a
    view of the same memory) go as (M, N) rows, y with them."""
    w = torch.ones(1024, dtype=BF16)
    swapped = torch.randn(65, 4, 1024, dtype=BF16).transpose(0, 1)
    last = torch.randn(4, 9, 1024, dtype=BF16)[:, -1:]
    for x, same_memory in ((swapped, False), (last, True)):
        defaults.clear()
        R._forward(x, w, 1e-6)
        (_, _, fwd), = defaults
        assert fwd[0].shape == fwd[2].shape == (x.numel() // 1024, 1024)
        assert (fwd[0].data_ptr() == x.data_ptr()) is same_memory
    assert row_stride(swapped) == 0 and row_stride(last) == 0
    assert row_stride(torch.randn(2, 3, 4, 2 * 1024)[..., :1024]) == 2 * 1024
    assert row_stride(torch.randn(5, 1, 1024)) == 1024


def _layouts():
    """Tensors of 2-5 dims with size-1 dims, slices, permutations and expanded dims."""
    g = torch.Generator().manual_seed(0)
    for _ in range(400):
        nd = int(torch.randint(2, 6, (1,), generator=g))
        full = [int(torch.randint(1, 4, (1,), generator=g)) for _ in range(nd)]
        t = torch.arange(math.prod(full), dtype=torch.float32).reshape(full)
        t = t.permute(*torch.randperm(nd, generator=g).tolist())
        index = tuple(slice(0, int(torch.randint(1, n + 1, (1,), generator=g))) for n in t.shape)
        t = t[index]
        if torch.rand(1, generator=g) < 0.2:
            t = t.unsqueeze(int(torch.randint(0, nd, (1,), generator=g)))
        yield t


def test_row_stride_finds_rows_only_where_they_merge():
    """Where row_stride finds rows, the kernels' (M, N) view of them (rows spaced by the
    second-last stride) reads the tensor's elements in order; the cases the loop once missed
    (a size-1 dim between two dims whose strides do not chain) find none."""
    found = 0
    for t in _layouts():
        if row_stride(t):
            found += 1
            assert torch.equal(kernel_rows(t), t.reshape(-1, t.shape[-1])), (t.shape, t.stride())
    assert found > 100
    cache = torch.randn(2, 1, 7, 16)
    assert row_stride(cache[:, :, :3]) == 0
    assert row_stride(torch.randn(3, 2, 1, 16).permute(1, 2, 0, 3)) == 0
    assert row_stride(cache) == 16 and row_stride(cache[:1, :, :3]) == 16


def test_rms_norm_of_rows_that_do_not_merge_across_a_size_one_dim(defaults):
    """(B, 1, S, N) sliced from a longer buffer reaches both kernels as (M, N) rows."""
    x, w = torch.randn(2, 1, 7, 64, dtype=BF16)[:, :, :3], torch.ones(64, dtype=BF16)
    _, rstd = R._forward(x, w, 1e-6)
    R._backward(torch.randn_like(x), x, w, rstd)
    fwd = [args for _, kernel, args in defaults if kernel == "rms_norm_fwd kernel"]
    assert fwd and all(torch.equal(a[0], x.reshape(6, 64)) for a in fwd)
    for _, _, args in defaults:
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() > 2:
                assert row_stride(a) and torch.equal(kernel_rows(a), a.reshape(-1, a.shape[-1]))


def test_rms_norm_of_expanded_rows_chunks_by_the_outputs_span(defaults, monkeypatch):
    """An expanded x (row stride 0) spans one row, but y's rows are N apart: the forward's
    chunks are bounded by y's span (they were sized from x's stride 0, one launch for all)."""
    monkeypatch.setattr(R, "_MAX_SPAN", 40 * 64)
    x, w = torch.randn(1, 64, dtype=BF16).expand(90, 64), torch.ones(64, dtype=BF16)
    R._forward(x, w, 1e-6)
    fwd = [args for _, _, args in defaults if len(args) == 8]
    assert len(fwd) > 1 and sum(a[0].shape[0] for a in fwd) == 90
    for args in fwd:
        y = args[2]
        assert (y.shape[0] - 1) * y.stride(0) + 64 <= 40 * 64


def test_rms_norm_of_an_expanded_3d_x_reaches_the_kernels_as_2d_rows(defaults):
    """A (B, S, N) x expanded from one row (strides (0, 0, 1)) has no rows the kernels' own
    view may take (row_stride 0): the forward's 3-D fast path hands it over as (M, N) rows of
    row stride 0, as host_rows does, not as the 3-D tensor."""
    w = torch.ones(64, dtype=BF16)
    for x in (torch.randn(64, dtype=BF16).expand(3, 5, 64),
              torch.randn(1, 1, 64, dtype=BF16).expand(1, 7, 64)):
        defaults.clear()
        R._forward(x, w, 1e-6)
        (_, _, fwd), = defaults
        assert fwd[0].dim() == 2 and fwd[0].shape == (x.numel() // 64, 64)
        assert fwd[0].stride() == (0, 1) and fwd[0].data_ptr() == x.data_ptr()


def test_rms_norm_rows_past_int32_go_in_row_chunks_of_any_shape(defaults, monkeypatch):
    """(B, S, N) tensors reaching past the int32 bound (here made small) go as row chunks of
    (M, N) views, forward and backward, each within the bound."""
    monkeypatch.setattr(R, "_MAX_SPAN", 40 * 64)
    x, w = torch.randn(3, 30, 64, dtype=BF16), torch.ones(64, dtype=BF16)
    y, rstd = R._forward(x, w, 1e-6)
    R._backward(torch.randn_like(x), x, w, rstd)
    fwd = [args for _, _, args in defaults if len(args) == 8]
    bwd = [args for _, _, args in defaults if len(args) == 9]
    assert sum(a[0].shape[0] for a in fwd) == sum(a[1].shape[0] for a in bwd) == 90
    for args in fwd + bwd:
        for a in args:
            if isinstance(a, torch.Tensor) and a.dim() == 2 and a.shape[1] == 64:
                assert (a.shape[0] - 1) * a.stride(0) + 64 <= 40 * 64


def test_one_column_tensors_reach_the_kernels_with_unit_column_stride(defaults):
    """torch counts a one-column tensor contiguous whatever its column stride (contiguous()
    keeps `randn(1, M).t()` as it is); RMSNorm's and SwiGLU's kernels take the last stride as 1,
    so such inputs (x, the weight, gate, up, the upstream gradient) reach them as views with a
    column stride of 1, on the same memory."""
    col = torch.randn(1, 6, dtype=BF16).t()                 # (6, 1), strides (1, 6)
    w = torch.randn(1, 3, dtype=BF16)[:, 0]                 # (1,), stride (3,)
    assert col.is_contiguous() and col.contiguous().stride() == (1, 6) and w.stride() == (3,)
    _, rstd = R._forward(col, w, 1e-6)
    R._backward(col, col, w, rstd)
    SW._forward(col, col, SW.SILU)
    SW.backward(col, col, col, SW.SILU)
    arrays = [a for _, _, args in defaults for a in args
              if isinstance(a, torch.Tensor) and a.dim()]
    assert len(defaults) >= 4 and arrays
    assert all(a.stride()[-1] == 1 for a in arrays), [a.stride() for a in arrays]
    assert any(a.data_ptr() == col.data_ptr() for a in arrays)
