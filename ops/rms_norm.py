# RMSNorm: y = x / sqrt(mean(x^2) + eps) * w, statistics in float32.
#
# No `from __future__ import annotations` here: it would hide the ct.Constant annotations.
from types import SimpleNamespace

import cuda.tile as ct
import torch

from tiletune import validate
from tiletune.autotune import Autotuner, StandIns, Work, bucketed
from tiletune.device import persistent_ctas, sm_count
from tiletune.ops.partials import sum_rows
from tiletune.ops.rows import as_rows, host_rows, unit_last_stride
from tiletune.space import INT32_MAX, cdiv, next_pow2, product, row_chunks
from tiletune.torch_op import TrainableOp

ZERO = ct.PaddingMode.ZERO

# ---------------------------------------------------------------------------------------------
# Kernels. Tiles are powers of two; rows and columns past the array's end are zero-padded on
# load (so they add nothing to the sum of squares) and dropped on store.


def _chunk(a, row, c, TILE_N):
    """Chunk c of one row of a (M, N): a [1, TILE_N] float32 tile, zero past N."""
    return ct.load(a, (row, c), (1, TILE_N), padding_mode=ZERO).astype(ct.float32)


def _weight(w, c, TILE_N):
    """Chunk c of the weight (N,): a [1, TILE_N] float32 tile, zero past N."""
    return ct.reshape(ct.load(w, (c,), (TILE_N,), padding_mode=ZERO).astype(ct.float32),
                      (1, TILE_N))


# Every kernel takes x, y, dy and dx as (M, N) rows or as (..., N) tensors whose leading dims
# merge into rows (ops/rows.py), viewed as rows in the kernel.


@ct.kernel
def rms_norm_fwd_rows(x, w, y, rstd, inv_n, eps,
                      TILE_M: ct.Constant[int], TILE_N: ct.Constant[int]):
    """Whole rows in one tile: x, y (M, N) rows, w (N,), rstd (M,) f32. Grid-stride over row
    tiles."""
    x = as_rows(x)
    y = as_rows(y)
    wt = _weight(w, 0, TILE_N)
    for t in range(ct.bid(0), ct.cdiv(x.shape[0], TILE_M), ct.num_blocks(0)):
        xt = ct.load(x, (t, 0), (TILE_M, TILE_N), padding_mode=ZERO).astype(ct.float32)
        r = ct.rsqrt(ct.sum(xt * xt, axis=1, keepdims=True) * inv_n + eps)  # [TILE_M, 1]
        ct.store(y, (t, 0), (xt * r * wt).astype(y.dtype))
        ct.store(rstd, (t,), ct.reshape(r, (TILE_M,)))


@ct.kernel
def rms_norm_fwd_chunked(x, w, y, rstd, inv_n, eps,
                         TILE_M: ct.Constant[int], TILE_N: ct.Constant[int]):
    """Rows too wide for one tile: two passes over TILE_N-wide chunks, the second in reverse
    so it starts on the chunks the first pass left most recently in L2. One row at a time
    (TILE_M is 1: a parameter so both forward kernels take the same arguments)."""
    x = as_rows(x)
    y = as_rows(y)
    num_chunks = ct.cdiv(x.shape[1], TILE_N)
    for row in range(ct.bid(0), x.shape[0], ct.num_blocks(0)):
        acc = ct.zeros((1, TILE_N), ct.float32)
        for c in range(num_chunks):
            xt = _chunk(x, row, c, TILE_N)
            acc = acc + xt * xt
        r = ct.rsqrt(ct.sum(acc, axis=1, keepdims=True) * inv_n + eps)  # [1, 1]
        for i in range(num_chunks):
            c = num_chunks - 1 - i
            yt = _chunk(x, row, c, TILE_N) * r * _weight(w, c, TILE_N)
            ct.store(y, (row, c), yt.astype(y.dtype))
        ct.store(rstd, (row,), ct.reshape(r, (1,)))


@ct.kernel
def rms_norm_fwd_wide(x, w, y, rstd, inv_n, eps,
                      TILE_M: ct.Constant[int], TILE_N: ct.Constant[int]):
    """16-bit rows (and weight) too wide for rms_norm_fwd_rows but within WIDE_ROW_TILE: the
    row is read once and held in its own dtype (a float32 copy would spill) and the weight is
    read again for each row (from L2), so nothing is read from memory twice. One row at a
    time."""
    x = as_rows(x)
    y = as_rows(y)
    for row in range(ct.bid(0), x.shape[0], ct.num_blocks(0)):
        xt = ct.load(x, (row, 0), (1, TILE_N), padding_mode=ZERO)
        xf = xt.astype(ct.float32)
        r = ct.rsqrt(ct.sum(xf * xf, axis=1, keepdims=True) * inv_n + eps)  # [1, 1]
        wt = ct.reshape(ct.load(w, (0,), (TILE_N,), padding_mode=ZERO), (1, TILE_N))
        ct.store(y, (row, 0), (xt.astype(ct.float32) * r * wt.astype(ct.float32))
                 .astype(y.dtype))
        ct.store(rstd, (row,), ct.reshape(r, (1,)))


@ct.kernel
def rms_norm_bwd_rows(dy, x, w, rstd, dx, dw_partial, inv_n,
                      TILE_M: ct.Constant[int], TILE_N: ct.Constant[int]):
    """dx = r*g - x*r^3*mean(g*x) with g = dy*w; each CTA adds its rows' dy*x*r into one row of
    dw_partial (G, N) f32, summed over G afterwards. Whole rows in one tile."""
    dy = as_rows(dy)
    x = as_rows(x)
    dx = as_rows(dx)
    wt = _weight(w, 0, TILE_N)
    dw_acc = ct.zeros((1, TILE_N), ct.float32)
    num_row_tiles = ct.cdiv(x.shape[0], TILE_M)
    for t in range(ct.bid(0), num_row_tiles, ct.num_blocks(0)):
        xt = ct.load(x, (t, 0), (TILE_M, TILE_N), padding_mode=ZERO).astype(ct.float32)
        dyt = ct.load(dy, (t, 0), (TILE_M, TILE_N), padding_mode=ZERO).astype(ct.float32)
        r = ct.reshape(ct.load(rstd, (t,), (TILE_M,), padding_mode=ZERO), (TILE_M, 1))
        g = dyt * wt
        c = ct.sum(g * xt, axis=1, keepdims=True) * inv_n * (r * r * r)
        ct.store(dx, (t, 0), (g * r - xt * c).astype(dx.dtype))
        dw_acc = dw_acc + ct.sum(dyt * xt * r, axis=0, keepdims=True)
    ct.store(dw_partial, (ct.bid(0), 0), dw_acc)


@ct.kernel
def rms_norm_bwd_row_coef(dy, x, w, rstd, coef, inv_n, TILE_N: ct.Constant[int]):
    """Wide rows, step 1: coef[r] = rstd^3 * mean(dy*w*x) per row."""
    dy = as_rows(dy)
    x = as_rows(x)
    num_chunks = ct.cdiv(x.shape[1], TILE_N)
    for row in range(ct.bid(0), x.shape[0], ct.num_blocks(0)):
        acc = ct.zeros((1, TILE_N), ct.float32)
        for c in range(num_chunks):
            acc = acc + _chunk(dy, row, c, TILE_N) * _weight(w, c, TILE_N) * _chunk(x, row, c,
                                                                                  TILE_N)
        r = ct.load(rstd, (row,), (1,))
        ct.store(coef, (row,), ct.sum(acc, axis=1) * inv_n * (r * r * r))


@ct.kernel
def rms_norm_bwd_cols(dy, x, w, rstd, coef, dx, dw_partial,
                      TILE_M: ct.Constant[int], TILE_N: ct.Constant[int]):
    """Wide rows, step 2: grid (column blocks, row groups); dx = r*dy*w - x*coef, and each CTA's
    column block of sum(dy*x*r) over its rows goes to dw_partial[row group]."""
    dy = as_rows(dy)
    x = as_rows(x)
    dx = as_rows(dx)
    col = ct.bid(0)
    wt = _weight(w, col, TILE_N)
    dw_acc = ct.zeros((1, TILE_N), ct.float32)
    num_row_tiles = ct.cdiv(x.shape[0], TILE_M)
    for t in range(ct.bid(1), num_row_tiles, ct.num_blocks(1)):
        xt = ct.load(x, (t, col), (TILE_M, TILE_N), padding_mode=ZERO).astype(ct.float32)
        dyt = ct.load(dy, (t, col), (TILE_M, TILE_N), padding_mode=ZERO).astype(ct.float32)
        r = ct.reshape(ct.load(rstd, (t,), (TILE_M,), padding_mode=ZERO), (TILE_M, 1))
        k = ct.reshape(ct.load(coef, (t,), (TILE_M,), padding_mode=ZERO), (TILE_M, 1))
        ct.store(dx, (t, col), (dyt * wt * r - xt * k).astype(dx.dtype))
        dw_acc = dw_acc + ct.sum(dyt * xt * r, axis=0, keepdims=True)
    ct.store(dw_partial, (ct.bid(1), col), dw_acc)


# ---------------------------------------------------------------------------------------------
# Configs: kernel variant, tiles, occupancy, worker warps, grid shape. Measured on an H200
# (references/parameter-space-design.md): tiles over 16K elements lose 3-6x (register spills);
# forward occupancy 6-8 lost at every shape measured, spill-free or not (0.18-0.88 of copy
# bandwidth); occupancy 1 never won a forward search; plain loads and stores were 5-16% slower
# than TMA. So: 4K-16K-element tiles, occupancy 2-4 (1-4 backward), 4 or 8 worker warps,
# persistent (SMs x occupancy CTAs striding over row tiles) or one CTA per row tile.

MAX_ROW_TILE = 16384      # widest row (elements) kept whole in one tile; wider rows are chunked
WIDE_ROW_TILE = 32768     # widest 16-bit row the forward also reads once (8 warps, occupancy 1)
WARPS = (4, 8)            # tileiras 13.4 takes 4 or 8 worker warps


def _row_tiles(tile_n, elems=(4096, 8192, 16384)):
    """Rows per tile so a tile holds about `elems` elements (at least one row)."""
    return sorted({max(1, e // tile_n) for e in elems})


def fwd_configs(arch, n_cols, x_bytes=2, w_bytes=2):
    """Forward space for rows of `n_cols` elements, x's of `x_bytes` and the weight's of
    `w_bytes` each, default first."""
    tile_n = next_pow2(n_cols)
    if tile_n <= MAX_ROW_TILE:
        default = SimpleNamespace(kind="rows", tile_m=max(1, 8192 // tile_n), tile_n=tile_n,
                                  occupancy=2, num_worker_warps=4, persistent=True)
        yield from product(default, tile_m=_row_tiles(tile_n), occupancy=(2, 4),
                           num_worker_warps=WARPS, persistent=(True, False))
    else:
        if tile_n <= WIDE_ROW_TILE and x_bytes == w_bytes == 2:
            # the default here: 1.34-1.42x the chunked default on an H100 (2048x32768 and
            # 4096x24576). At 4 warps or occupancy 2, or with a float32 x or weight, the row
            # spills (sm_90); one CTA per row ran 1.26-1.45x slower than the persistent grid.
            yield SimpleNamespace(kind="wide", tile_m=1, tile_n=tile_n, occupancy=1,
                                  num_worker_warps=8, persistent=True)
        default = SimpleNamespace(kind="chunked", tile_m=1, tile_n=4096, occupancy=2,
                                  num_worker_warps=4, persistent=True)
        yield from product(default, tile_n=(2048, 4096, 8192), occupancy=(2, 4),
                           num_worker_warps=WARPS, persistent=(True, False))


def bwd_configs(arch, n_cols):
    """Backward (whole-row kernel) space; only for rows up to MAX_ROW_TILE."""
    tile_n = next_pow2(n_cols)
    default = SimpleNamespace(tile_m=max(1, 8192 // tile_n), tile_n=tile_n, occupancy=2,
                              num_worker_warps=4)
    yield from product(default, tile_m=_row_tiles(tile_n), occupancy=(1, 2, 4),
                       num_worker_warps=WARPS)


def bwd_coef_configs(arch, n_cols):
    yield from product(SimpleNamespace(tile_n=4096, occupancy=4, num_worker_warps=4),
                       tile_n=(2048, 4096, 8192), occupancy=(2, 4, 8), num_worker_warps=WARPS)


def bwd_cols_configs(arch, n_cols):
    default = SimpleNamespace(tile_m=8, tile_n=512, occupancy=4, num_worker_warps=4)
    tiles = [dict(tile_m=tm, tile_n=tn) for tm, tn in ((8, 512), (4, 1024), (16, 256), (8, 1024),
                                                        (16, 512))]
    yield from product(default, tiles=tiles, occupancy=(2, 4, 8), num_worker_warps=WARPS)


# ---------------------------------------------------------------------------------------------
# Launches. Each tuner declares its grid and arguments once; the engine looks the config up (or
# tunes it) and launches. x, y, dy and dx hold M rows of N with unit stride: (M, N) arrays, or
# (..., N) ones whose leading dims merge into rows (the kernels view them as rows); M and N
# travel with them.

def _fwd_grid(c, dev, x, w, y, rstd, eps, M, N):
    tiles = cdiv(M, c.tile_m)
    return (persistent_ctas(tiles, dev, c.occupancy) if c.persistent else tiles,)


_FWD_KERNELS = {"rows": rms_norm_fwd_rows, "chunked": rms_norm_fwd_chunked,
                "wide": rms_norm_fwd_wide}


def _fwd_kernel(cfg):
    return _FWD_KERNELS[cfg.kind]


def _fwd_args(c, x, w, y, rstd, eps, M, N):
    return (x, w, y, rstd, 1.0 / N, eps, c.tile_m, c.tile_n)


def _bwd_space(dy, x, w, rstd, *rest):
    return dict(n_cols=rest[-1])


def _bwd_work(dy, x, w, *rest):
    return Work(bytes=3 * dy.numel() * dy.element_size() + 2 * w.numel() * w.element_size())


# `default` is the hard-coded fallback if a generator ever yields nothing. Every launch key is
# (N, M, dtypes..., device); tuning buckets M.
_BY_ROWS = bucketed(1)
_fwd = Autotuner(
    "rms_norm_fwd", _fwd_kernel, fwd_configs,
    default=SimpleNamespace(kind="chunked", tile_m=1, tile_n=4096, occupancy=2, persistent=True),
    space=lambda x, w, y, rstd, eps, M, N: dict(n_cols=N, x_bytes=x.element_size(),
                                                w_bytes=w.element_size()),
    grid=_fwd_grid,
    args=_fwd_args, tune_key=_BY_ROWS,
    work=lambda x, w, y, rstd, eps, M, N: Work(bytes=2 * x.numel() * x.element_size()
                                               + w.numel() * w.element_size() + 4 * M))


def _bwd_ctas(c, dev, M):
    return persistent_ctas(cdiv(M, c.tile_m), dev, c.occupancy)


_bwd = Autotuner(
    "rms_norm_bwd", rms_norm_bwd_rows, bwd_configs,
    default=SimpleNamespace(tile_m=1, tile_n=MAX_ROW_TILE, occupancy=2),
    space=_bwd_space, work=_bwd_work, tune_key=_BY_ROWS,
    scratch=lambda c, dev, dy, x, w, rstd, dx, M, N: ((_bwd_ctas(c, dev, M), N), torch.float32),
    grid=lambda c, dev, dy, x, w, rstd, dx, M, N, *partial: (_bwd_ctas(c, dev, M),),
    args=lambda c, dy, x, w, rstd, dx, M, N, partial: (dy, x, w, rstd, dx, partial, 1.0 / N,
                                                       c.tile_m, c.tile_n))

# Wide rows: a per-row coefficient, then column blocks writing dx and dweight partials.
_bwd_coef = Autotuner(
    "rms_norm_bwd_coef", rms_norm_bwd_row_coef, bwd_coef_configs,
    default=SimpleNamespace(tile_n=4096, occupancy=4), space=_bwd_space, tune_key=_BY_ROWS,
    grid=lambda c, dev, dy, x, w, rstd, coef, M, N: (persistent_ctas(M, dev, c.occupancy),),
    args=lambda c, dy, x, w, rstd, coef, M, N: (dy, x, w, rstd, coef, 1.0 / N, c.tile_n))


def _cols_grid(c, dev, dy, x, w, rstd, coef, dx, M, N, *partial):
    """(column blocks, row groups): about SMs x occupancy CTAs in all."""
    col_blocks = cdiv(N, c.tile_n)
    rows = min(cdiv(M, c.tile_m), cdiv(sm_count(dev) * c.occupancy, col_blocks))
    return (col_blocks, max(1, rows))


_bwd_cols = Autotuner(
    "rms_norm_bwd_cols", rms_norm_bwd_cols, bwd_cols_configs,
    default=SimpleNamespace(tile_m=8, tile_n=512, occupancy=4), space=_bwd_space, work=_bwd_work,
    tune_key=_BY_ROWS,
    scratch=lambda c, dev, *inputs: ((_cols_grid(c, dev, *inputs)[1], inputs[-1]),
                                     torch.float32),
    grid=_cols_grid,
    args=lambda c, dy, x, w, rstd, coef, dx, M, N, partial: (dy, x, w, rstd, coef, dx, partial,
                                                             c.tile_m, c.tile_n))
TUNERS = (_fwd, _bwd, _bwd_coef, _bwd_cols)


def launch_fwd(x, w, y, rstd, eps, M, N):
    """y, rstd = rms_norm(x, w) over M rows of N (x and y as the launches above take them);
    rstd (M,) or None: y alone. (The hot path of every call: the caller's sizes travel with
    the inputs so nothing here reads them again.)"""
    dev = x.get_device()
    if rstd is None:
        rstd = _NO_RSTD.get(x, dev, M)
    _fwd.launch((N, M, x.dtype, w.dtype, dev), dev, x, w, y, rstd, eps, M, N)


# A forward that no backward reads hands the kernels a stand-in for its (M,) rstd (the engine's
# StandIns: at most 16 floats, the same JIT signature), saving an allocation (1.7-2.4 us of host
# time, references/hardware-constraints.md).
_NO_RSTD = StandIns(lambda like, m: like.new_empty(m, dtype=torch.float32))


def launch_bwd(dy, x, w, rstd, dx, dw, M, N):
    """dx (as x) and dw (N,) written in place (dw in its own dtype; None: the per-CTA partials
    are left unsummed, for a weight that needs no gradient)."""
    dev = x.get_device()
    key = (N, M, x.dtype, dy.dtype, w.dtype, dev)
    if next_pow2(N) <= MAX_ROW_TILE:
        partial = _bwd.launch(key, dev, dy, x, w, rstd, dx, M, N)
    else:
        coef = x.new_empty(M, dtype=torch.float32)
        _bwd_coef.launch(key, dev, dy, x, w, rstd, coef, M, N)
        partial = _bwd_cols.launch(key, dev, dy, x, w, rstd, coef, dx, M, N)
    if dw is not None:
        sum_rows(partial, dw)


# ---------------------------------------------------------------------------------------------
# Host side: validation, flattening to rows, int32-safe row chunks.

_MAX_SPAN = INT32_MAX   # kernels index with int32: a launch reaches at most this many elements


def _check(x, weight, eps):
    """eps as a float; the errors name rms_norm and the argument."""
    validate.pair("rms_norm", "x", x, "weight", weight)
    N = x.shape[-1] if x.dim() >= 1 else 0
    if N == 0:
        raise ValueError("rms_norm: x must have a last dimension (the hidden size) of at "
                         f"least 1, got shape {tuple(x.shape)}")
    if N > _MAX_SPAN:
        raise ValueError(f"rms_norm: x rows of {N} elements are not supported (at most "
                         f"{_MAX_SPAN} = 2^31 - 1: the kernels index a row with int32)")
    if weight.dim() != 1 or weight.shape[0] != N:
        raise ValueError(f"rms_norm: weight must have shape ({N},) to match the last "
                         f"dim of x, got {tuple(weight.shape)}")
    return validate.eps("rms_norm", eps)


def _forward(x, weight, eps, keep_rstd=True):
    """(y, rstd): y like x, rstd float32 with one value per row (keep_rstd False: None)."""
    # y in x's shape and contiguous, so the kernel takes it as it is (a view made here could
    # not be changed in place under autograd); new_empty with int sizes: the cheapest
    # allocation.
    shape = x.shape
    N = shape[-1]
    strides = x.stride()
    nd = len(strides)
    # (M, N) rows and (B, S, N) that merge into rows written out (host_rows in two lines): the
    # hot paths, where calling host_rows cost 0.25-0.4 us more of a 3.6 us body (CPU host)
    if nd == 2 and strides[1] == 1:
        x2, M, stride = x, shape[0], strides[0]
    elif nd == 3 and strides[2] == 1 and strides[1] and (shape[0] == 1 or
                                                         strides[0] == shape[1] * strides[1]):
        x2, M, stride = x, shape[0] * shape[1], strides[1]
    else:
        x2, stride = host_rows(x, N)
        M = x.numel() // N
    y = x.new_empty(*shape)
    rstd = x.new_empty(M, dtype=torch.float32) if keep_rstd else None
    if M:
        w = weight if weight.stride()[0] == 1 else unit_last_stride(weight)
        if (M - 1) * (stride if stride > N else N) + N <= _MAX_SPAN:
            launch_fwd(x2, w, y if x2 is x else y.view(M, N), rstd, eps, M, N)
        else:
            x2, y2 = x2.reshape(M, N), y.view(M, N)
            # (the span of y, whose rows are N apart, bounds the chunks where x's rows are
            # closer: an expanded x has a row stride of 0)
            for s, e in row_chunks(M, N, max(stride, N), _MAX_SPAN):
                launch_fwd(x2[s:e], w, y2[s:e], None if rstd is None else rstd[s:e], eps,
                           e - s, N)
    return y, rstd


def _backward(dy, x, weight, rstd, need_w=True):
    """(dx, dw): dx like x, dw like weight (None where not need_w: a frozen weight)."""
    N = x.shape[-1]
    M = x.numel() // N
    x2, stride = host_rows(x, N)
    dy2, dy_stride = host_rows(dy, N)
    dx = x.new_empty(*x.shape)
    if not M:
        return dx, torch.zeros_like(weight) if need_w else None
    w = weight if weight.stride()[0] == 1 else unit_last_stride(weight)
    stride = max(stride, dy_stride, N)
    if (M - 1) * stride + N <= _MAX_SPAN:
        dw = torch.empty_like(w) if need_w else None
        launch_bwd(dy2, x2, w, rstd, dx if x2 is x else dx.view(M, N), dw, M, N)
        return dx, dw
    x2, dy2, dx2 = x2.reshape(M, N), dy2.reshape(M, N), dx.view(M, N)
    dw32 = torch.zeros(N, device=x.device, dtype=torch.float32)   # f32 sum over row chunks
    part = torch.empty(N, device=x.device, dtype=torch.float32) if need_w else None
    for s, e in row_chunks(M, N, stride, _MAX_SPAN):
        launch_bwd(dy2[s:e], x2[s:e], w, rstd[s:e], dx2[s:e], part, e - s, N)
        if need_w:
            dw32 += part
    return dx, dw32.to(weight.dtype) if need_w else None


# ---------------------------------------------------------------------------------------------
# Autograd, custom op and the public function.

_rms_norm = TrainableOp(
    "tiletune::rms_norm", forward=_forward,
    inference=lambda x, weight, eps: _forward(x, weight, eps, keep_rstd=False)[0],
    forward_schema="(Tensor x, Tensor weight, float eps) -> (Tensor, Tensor)",
    forward_fake=lambda x, weight, eps: (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        x.new_empty(x.numel() // x.shape[-1] if x.shape[-1] else 0, dtype=torch.float32)),
    save=lambda args, results: ((args[0], args[1], results[1]), ()),
    backward=lambda needs, dy, x, weight, rstd: _backward(dy, x, weight, rstd, needs[1]),
    backward_schema="(bool[] needs, Tensor dy, Tensor x, Tensor weight, Tensor rstd) "
                    "-> (Tensor, Tensor?)",
    backward_fake=lambda needs, dy, x, weight, rstd: (
        torch.empty_like(x, memory_format=torch.contiguous_format),
        torch.empty_like(weight) if needs[1] else None))


def rms_norm(x, weight, eps=1e-6):
    """RMSNorm over the last dim: `x / sqrt(mean(x**2, -1) + eps) * weight`.

    x: (..., N) float32/float16/bfloat16 CUDA tensor, any leading dims (flattened to rows), any
    N from 1 to 2^31 - 1 (rows up to 16384 wide are kept in one tile; wider rows are processed in
    chunks, or held whole where x and weight are 16-bit and the row is at most 32768 wide;
    wider than 2^31 - 1 raises ValueError).
    Non-contiguous x is accepted (copied once if its rows cannot be viewed).
    weight: (N,) float32/float16/bfloat16 on x's device; its dtype may differ from x's.
    Statistics in float32; returns a new tensor of x's shape and dtype. Differentiable in x and
    weight (dweight comes back in weight's dtype). Works under torch.compile(fullgraph=True).
    """
    return _rms_norm(x, weight, _check(x, weight, eps))
