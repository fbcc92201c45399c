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
from tiletune.ops.rows import load_rows, num_row_tiles, store_rows
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


# The whole-row forward takes (M, N) rows or (B, S, N) arrays (ops/rows.py). (The backward
# takes (M, N) rows: in that form its best configs ran 1-3% faster on an H200,
# references/hardware-constraints.md.)


@ct.kernel
def rms_norm_fwd_rows(x, w, y, rstd, inv_n, eps,
                      TILE_M: ct.Constant[int], TILE_N: ct.Constant[int],
                      ALONG_S: ct.Constant[bool]):
    """Whole rows in one tile: x, y (M, N) or (B, S, N), w (N,), rstd (M,) f32. Grid-stride
    over row tiles."""
    wt = _weight(w, 0, TILE_N)
    for t in range(ct.bid(0), num_row_tiles(x, TILE_M, ALONG_S), ct.num_blocks(0)):
        xt = load_rows(x, t, 0, TILE_M, TILE_N, ALONG_S)
        r = ct.rsqrt(ct.sum(xt * xt, axis=1, keepdims=True) * inv_n + eps)  # [TILE_M, 1]
        store_rows(y, t, 0, xt * r * wt, TILE_M, TILE_N, ALONG_S)
        ct.store(rstd, (t,), ct.reshape(r, (TILE_M,)))


@ct.kernel
def rms_norm_fwd_chunked(x, w, y, rstd, inv_n, eps,
                         TILE_M: ct.Constant[int], TILE_N: ct.Constant[int],
                         ALONG_S: ct.Constant[bool]):
    """Rows too wide for one tile: two passes over TILE_N-wide chunks (the second hits L2).
    One (M, N) row at a time (TILE_M is 1 and ALONG_S False: parameters so both forward
    kernels take the same arguments)."""
    num_chunks = ct.cdiv(x.shape[1], TILE_N)
    for row in range(ct.bid(0), x.shape[0], ct.num_blocks(0)):
        acc = ct.zeros((1, TILE_N), ct.float32)
        for c in range(num_chunks):
            xt = _chunk(x, row, c, TILE_N)
            acc = acc + xt * xt
        r = ct.rsqrt(ct.sum(acc, axis=1, keepdims=True) * inv_n + eps)  # [1, 1]
        for c in range(num_chunks):
            yt = _chunk(x, row, c, TILE_N) * r * _weight(w, c, TILE_N)
            ct.store(y, (row, c), yt.astype(y.dtype))
        ct.store(rstd, (row,), ct.reshape(r, (1,)))


@ct.kernel
def rms_norm_bwd_rows(dy, x, w, rstd, dx, dw_partial, inv_n,
                      TILE_M: ct.Constant[int], TILE_N: ct.Constant[int]):
    """dx = r*g - x*r^3*mean(g*x) with g = dy*w; each CTA adds its rows' dy*x*r into one row of
    dw_partial (G, N) f32, summed over G afterwards. Whole rows in one tile."""
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
WARPS = (4, 8)            # tileiras 13.4 takes 4 or 8 worker warps


def _row_tiles(tile_n, elems=(4096, 8192, 16384)):
    """Rows per tile so a tile holds about `elems` elements (at least one row)."""
    return sorted({max(1, e // tile_n) for e in elems})


def fwd_configs(arch, n_cols):
    """Forward space for rows of `n_cols` elements, default first."""
    tile_n = next_pow2(n_cols)
    if tile_n <= MAX_ROW_TILE:
        default = SimpleNamespace(kind="rows", tile_m=max(1, 8192 // tile_n), tile_n=tile_n,
                                  occupancy=2, num_worker_warps=4, persistent=True)
        yield from product(default, tile_m=_row_tiles(tile_n), occupancy=(2, 4),
                           num_worker_warps=WARPS, persistent=(True, False))
    else:
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
# tunes it) and launches. Rows have unit stride. The forward takes M rows of N as (M, N) arrays
# (S 0) or as (B, S, N) ones (S given): where a config's row tiles do not fit S (S > 1 and not
# a multiple of tile_m) or its kernel takes (M, N) alone, their (M, N) views go to the kernel
# instead. The grid is the same either way: cdiv(M, tile_m) row tiles. The backward's rows are
# (M, N).

def _fwd_grid(c, dev, x, w, y, rstd, eps, M, N, S):
    tiles = cdiv(M, c.tile_m)
    return (persistent_ctas(tiles, dev, c.occupancy) if c.persistent else tiles,)


def _fwd_kernel(cfg):
    return rms_norm_fwd_rows if cfg.kind == "rows" else rms_norm_fwd_chunked


def _fwd_args(c, x, w, y, rstd, eps, M, N, S):
    if S and (c.kind != "rows" or S > 1 and S % c.tile_m):
        x, y, S = x.reshape(M, N), y.view(M, N), 0
    return (x, w, y, rstd, 1.0 / N, eps, c.tile_m, c.tile_n, S > 1)


def _bwd_space(dy, x, *rest):
    return dict(n_cols=x.shape[1])


def _bwd_work(dy, x, w, *rest):
    return Work(bytes=3 * dy.numel() * dy.element_size() + 2 * w.numel() * w.element_size())


# `default` is the hard-coded fallback if a generator ever yields nothing. Every launch key is
# (N, M, dtypes..., device); tuning buckets M.
_BY_ROWS = bucketed(1)
_fwd = Autotuner(
    "rms_norm_fwd", _fwd_kernel, fwd_configs,
    default=SimpleNamespace(kind="chunked", tile_m=1, tile_n=4096, occupancy=2, persistent=True),
    space=lambda x, w, y, rstd, eps, M, N, S: dict(n_cols=N), grid=_fwd_grid,
    args=_fwd_args, tune_key=_BY_ROWS,
    work=lambda x, w, y, rstd, eps, M, N, S: Work(bytes=2 * x.numel() * x.element_size()
                                                  + w.numel() * w.element_size() + 4 * M))


def _bwd_ctas(c, dev, dy, x, *rest):
    return persistent_ctas(cdiv(x.shape[0], c.tile_m), dev, c.occupancy)


_bwd = Autotuner(
    "rms_norm_bwd", rms_norm_bwd_rows, bwd_configs,
    default=SimpleNamespace(tile_m=1, tile_n=MAX_ROW_TILE, occupancy=2),
    space=_bwd_space, work=_bwd_work, tune_key=_BY_ROWS,
    scratch=lambda c, dev, dy, x, w, rstd, dx: ((_bwd_ctas(c, dev, dy, x), x.shape[1]),
                                                torch.float32),
    grid=lambda c, dev, dy, x, *rest: (_bwd_ctas(c, dev, dy, x),),
    args=lambda c, dy, x, w, rstd, dx, partial: (dy, x, w, rstd, dx, partial, 1.0 / x.shape[1],
                                                 c.tile_m, c.tile_n))

# Wide rows: a per-row coefficient, then column blocks writing dx and dweight partials.
_bwd_coef = Autotuner(
    "rms_norm_bwd_coef", rms_norm_bwd_row_coef, bwd_coef_configs,
    default=SimpleNamespace(tile_n=4096, occupancy=4), space=_bwd_space, tune_key=_BY_ROWS,
    grid=lambda c, dev, dy, x, *rest: (persistent_ctas(x.shape[0], dev, c.occupancy),),
    args=lambda c, dy, x, w, rstd, coef: (dy, x, w, rstd, coef, 1.0 / x.shape[1], c.tile_n))


def _cols_grid(c, dev, dy, x, *rest):
    """(column blocks, row groups): about SMs x occupancy CTAs in all."""
    col_blocks = cdiv(x.shape[1], c.tile_n)
    rows = min(cdiv(x.shape[0], c.tile_m), cdiv(sm_count(dev) * c.occupancy, col_blocks))
    return (col_blocks, max(1, rows))


_bwd_cols = Autotuner(
    "rms_norm_bwd_cols", rms_norm_bwd_cols, bwd_cols_configs,
    default=SimpleNamespace(tile_m=8, tile_n=512, occupancy=4), space=_bwd_space, work=_bwd_work,
    tune_key=_BY_ROWS,
    scratch=lambda c, dev, dy, x, *rest: ((_cols_grid(c, dev, dy, x)[1], x.shape[1]),
                                          torch.float32),
    grid=_cols_grid,
    args=lambda c, dy, x, w, rstd, coef, dx, partial: (dy, x, w, rstd, coef, dx, partial,
                                                       c.tile_m, c.tile_n))
TUNERS = (_fwd, _bwd, _bwd_coef, _bwd_cols)


def launch_fwd(x, w, y, rstd, eps, M, N, S=0):
    """y, rstd = rms_norm(x, w) over M rows of N: x and y (M, N), or (B, S, N) with S given;
    rstd (M,) or None: y alone. (The hot path of every call: the caller's sizes travel with
    the inputs so nothing here reads them again.)"""
    dev = x.get_device()
    if rstd is None:
        rstd = _NO_RSTD.get(x, dev, M)
    _fwd.launch((N, M, x.dtype, w.dtype, dev), dev, x, w, y, rstd, eps, M, N, S)


# A forward that no backward reads hands the kernels a stand-in for its (M,) rstd (the engine's
# StandIns: at most 16 floats, the same JIT signature), saving an allocation (1.7-2.4 us of host
# time, references/hardware-constraints.md).
_NO_RSTD = StandIns(lambda like, m: like.new_empty(m, dtype=torch.float32))


def launch_bwd(dy, x, w, rstd, dx, dw):
    """dx (M, N) and dw (N,) written in place (dw in its own dtype)."""
    M, N = x.shape
    dev = x.get_device()
    key = (N, M, x.dtype, dy.dtype, w.dtype, dev)
    if next_pow2(N) <= MAX_ROW_TILE:
        sum_rows(_bwd.launch(key, dev, dy, x, w, rstd, dx), dw)
        return
    coef = torch.empty(M, device=x.device, dtype=torch.float32)
    _bwd_coef.launch(key, dev, dy, x, w, rstd, coef)
    sum_rows(_bwd_cols.launch(key, dev, dy, x, w, rstd, coef, dx), dw)


# ---------------------------------------------------------------------------------------------
# Host side: validation, flattening to rows, int32-safe row chunks.

_MAX_CHUNK_ELEMS = INT32_MAX   # kernels index with int32: launch at most this many elements


def _check(x, weight, eps):
    """eps as a float; the errors name rms_norm and the argument."""
    validate.pair("rms_norm", "x", x, "weight", weight)
    N = x.shape[-1] if x.dim() >= 1 else 0
    if N == 0:
        raise ValueError("rms_norm: x must have a last dimension (the hidden size) of at "
                         f"least 1, got shape {tuple(x.shape)}")
    if N > _MAX_CHUNK_ELEMS:
        raise ValueError(f"rms_norm: x rows of {N} elements are not supported (at most "
                         f"{_MAX_CHUNK_ELEMS} = 2^31 - 1: the kernels index a row with int32)")
    if weight.dim() != 1 or weight.shape[0] != N:
        raise ValueError(f"rms_norm: weight must have shape ({N},) to match the last "
                         f"dim of x, got {tuple(weight.shape)}")
    return validate.eps("rms_norm", eps)


def _forward(x, weight, eps, keep_rstd=True):
    """(y, rstd): y like x, rstd float32 with one value per row (keep_rstd False: None)."""
    # y in x's shape, the kernel writing its rows (a view made here could not be changed in
    # place under autograd); new_empty with int sizes: the cheapest allocation
    # (strides read as stride()[i]: stride(i) costs more host time). 2-D and 3-D x reach the
    # launch without a view (1-2 us of host time each; _fwd_args makes one only for a config
    # whose row tiles do not fit S); other ranks as (M, N) rows.
    S = 0
    if x.dim() == 2:
        M, N = x.shape
        x2 = x if x.stride()[1] == 1 else x.contiguous()
        y = y_out = x.new_empty(M, N)
    elif x.dim() == 3 and x.numel() <= _MAX_CHUNK_ELEMS:
        B, S, N = x.shape
        M = B * S
        x2 = x if x.stride()[2] == 1 else x.contiguous()
        y = y_out = x.new_empty(B, S, N)
    else:
        N = x.shape[-1]
        x2 = x.reshape(-1, N)
        if x2.stride()[1] != 1:
            x2 = x2.contiguous()
        M = x2.shape[0]
        y_out = x.new_empty(*x.shape)
        y = y_out.view(M, N)
    rstd = x2.new_empty(M, dtype=torch.float32) if keep_rstd else None
    if M and N:
        w = weight if weight.stride()[0] == 1 else weight.contiguous()
        if M * N <= _MAX_CHUNK_ELEMS:
            launch_fwd(x2, w, y, rstd, eps, M, N, S)
        else:
            for s, e in row_chunks(M, N):
                launch_fwd(x2[s:e], w, y[s:e], None if rstd is None else rstd[s:e], eps,
                           e - s, N)
    return y_out, rstd


def _backward(dy, x, weight, rstd):
    """(dx, dw): dx like x, dw like weight."""
    two_d = x.dim() == 2
    N = x.shape[-1]
    x2 = x if two_d else x.reshape(-1, N)
    dy2 = dy if dy.dim() == 2 else dy.reshape(-1, N)
    if x2.stride()[1] != 1:
        x2 = x2.contiguous()
    if dy2.stride()[1] != 1:
        dy2 = dy2.contiguous()
    M = x2.shape[0]
    dx = x2.new_empty(M, N)
    if not (M and N):
        return dx.view(x.shape), torch.zeros_like(weight)
    w = weight if weight.stride()[0] == 1 else weight.contiguous()
    if M * N <= _MAX_CHUNK_ELEMS:
        dw = torch.empty_like(w)
        launch_bwd(dy2, x2, w, rstd, dx, dw)
        return (dx if two_d else dx.view(x.shape)), dw
    chunks = row_chunks(M, N)
    dw32 = torch.zeros(N, device=x.device, dtype=torch.float32)   # f32 sum over row chunks
    part = torch.empty(N, device=x.device, dtype=torch.float32)
    for s, e in chunks:
        launch_bwd(dy2[s:e], x2[s:e], w, rstd[s:e], dx[s:e], part)
        dw32 += part
    return dx.view(x.shape), dw32.to(weight.dtype)


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
    backward=lambda needs, dy, x, weight, rstd: _backward(dy, x, weight, rstd),
    backward_schema="(bool[] needs, Tensor dy, Tensor x, Tensor weight, Tensor rstd) "
                    "-> (Tensor, Tensor)",
    backward_fake=lambda needs, dy, x, weight, rstd: (
        torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)))


def rms_norm(x, weight, eps=1e-6):
    """RMSNorm over the last dim: `x / sqrt(mean(x**2, -1) + eps) * weight`.

    x: (..., N) float32/float16/bfloat16 CUDA tensor, any leading dims (flattened to rows), any
    N from 1 to 2^31 - 1 (rows up to 16384 wide are kept in one tile; wider rows are processed in
    chunks; wider than 2^31 - 1 raises ValueError).
    Non-contiguous x is accepted (copied once if its rows cannot be viewed).
    weight: (N,) float32/float16/bfloat16 on x's device; its dtype may differ from x's.
    Statistics in float32; returns a new tensor of x's shape and dtype. Differentiable in x and
    weight (dweight comes back in weight's dtype). Works under torch.compile(fullgraph=True).
    """
    return _rms_norm(x, weight, _check(x, weight, eps))
