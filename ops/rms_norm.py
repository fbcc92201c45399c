# RMSNorm: y = x / sqrt(mean(x^2) + eps) * w, statistics in float32.
#
# No `from __future__ import annotations` here: it would hide the ct.Constant annotations.
from types import SimpleNamespace

import cuda.tile as ct
import torch

from tiletune import validate
from tiletune.autotune import Autotuner, Search, Work, bucket, next_pow2
from tiletune.device import arch, current_stream, sm_count

ZERO = ct.PaddingMode.ZERO

# ---------------------------------------------------------------------------------------------
# Kernels. Tiles are powers of two; rows and columns past the array's end are zero-padded on
# load (so they add nothing to the sum of squares) and dropped on store.


@ct.kernel
def rms_norm_fwd_rows(x, w, y, rstd, inv_n, eps,
                      TILE_M: ct.Constant[int], TILE_N: ct.Constant[int]):
    """Whole rows in one tile: x, y (M, N), w (N,), rstd (M,) f32. Grid-stride over row tiles."""
    wt = ct.reshape(ct.load(w, (0,), (TILE_N,), padding_mode=ZERO).astype(ct.float32), (1, TILE_N))
    num_row_tiles = ct.cdiv(x.shape[0], TILE_M)
    for t in range(ct.bid(0), num_row_tiles, ct.num_blocks(0)):
        xt = ct.load(x, (t, 0), (TILE_M, TILE_N), padding_mode=ZERO).astype(ct.float32)
        r = ct.rsqrt(ct.sum(xt * xt, axis=1, keepdims=True) * inv_n + eps)  # [TILE_M, 1]
        ct.store(y, (t, 0), (xt * r * wt).astype(y.dtype))
        ct.store(rstd, (t,), ct.reshape(r, (TILE_M,)))


@ct.kernel
def rms_norm_fwd_chunked(x, w, y, rstd, inv_n, eps,
                         TILE_M: ct.Constant[int], TILE_N: ct.Constant[int]):
    """Rows too wide for one tile: two passes over TILE_N-wide chunks (the second hits L2).
    One row at a time (TILE_M is 1; it is a parameter so both forward kernels take the same
    arguments)."""
    num_chunks = ct.cdiv(x.shape[1], TILE_N)
    for row in range(ct.bid(0), x.shape[0], ct.num_blocks(0)):
        acc = ct.zeros((1, TILE_N), ct.float32)
        for c in range(num_chunks):
            xt = ct.load(x, (row, c), (1, TILE_N), padding_mode=ZERO).astype(ct.float32)
            acc = acc + xt * xt
        r = ct.rsqrt(ct.sum(acc, axis=1, keepdims=True) * inv_n + eps)  # [1, 1]
        for c in range(num_chunks):
            xt = ct.load(x, (row, c), (1, TILE_N), padding_mode=ZERO).astype(ct.float32)
            wt = ct.reshape(ct.load(w, (c,), (TILE_N,), padding_mode=ZERO).astype(ct.float32),
                            (1, TILE_N))
            ct.store(y, (row, c), (xt * r * wt).astype(y.dtype))
        ct.store(rstd, (row,), ct.reshape(r, (1,)))


@ct.kernel
def rms_norm_bwd_rows(dy, x, w, rstd, dx, dw_partial, inv_n,
                      TILE_M: ct.Constant[int], TILE_N: ct.Constant[int]):
    """dx = r*g - x*r^3*mean(g*x) with g = dy*w; each CTA adds its rows' dy*x*r into one row of
    dw_partial (G, N) f32, summed over G afterwards. Whole rows in one tile."""
    wt = ct.reshape(ct.load(w, (0,), (TILE_N,), padding_mode=ZERO).astype(ct.float32), (1, TILE_N))
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
            xt = ct.load(x, (row, c), (1, TILE_N), padding_mode=ZERO).astype(ct.float32)
            dyt = ct.load(dy, (row, c), (1, TILE_N), padding_mode=ZERO).astype(ct.float32)
            wt = ct.reshape(ct.load(w, (c,), (TILE_N,), padding_mode=ZERO).astype(ct.float32),
                            (1, TILE_N))
            acc = acc + dyt * wt * xt
        r = ct.load(rstd, (row,), (1,))
        ct.store(coef, (row,), ct.sum(acc, axis=1) * inv_n * (r * r * r))


@ct.kernel
def rms_norm_bwd_cols(dy, x, w, rstd, coef, dx, dw_partial,
                      TILE_M: ct.Constant[int], TILE_N: ct.Constant[int]):
    """Wide rows, step 2: grid (column blocks, row groups); dx = r*dy*w - x*coef, and each CTA's
    column block of sum(dy*x*r) over its rows goes to dw_partial[row group]."""
    col = ct.bid(0)
    wt = ct.reshape(ct.load(w, (col,), (TILE_N,), padding_mode=ZERO).astype(ct.float32),
                    (1, TILE_N))
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


@ct.kernel
def column_sum(partial, out, TILE_G: ct.Constant[int], TILE_N: ct.Constant[int]):
    """out[n] = sum_g partial[g, n] over float32 partials (G, N), cast to out's dtype: the
    dweight reduction and cast in one launch."""
    col = ct.bid(0)
    acc = ct.zeros((TILE_G, TILE_N), ct.float32)
    for g in range(ct.cdiv(partial.shape[0], TILE_G)):
        acc = acc + ct.load(partial, (g, col), (TILE_G, TILE_N), padding_mode=ZERO)
    ct.store(out, (col,), ct.sum(acc, axis=0).astype(out.dtype))


# ---------------------------------------------------------------------------------------------
# Configs. A config names the kernel variant, its tiles, and the hints (occupancy, worker warps).
# Grids are persistent: min(row tiles, SMs x occupancy) CTAs, each striding over row tiles.
# Measured on H200 (BENCHMARKS.md): occupancy >= 8 and tiles over 16K elements lose 3-6x
# (register spills); occupancy 1 never won a forward search; plain (non-TMA) loads and stores
# were 5-16% slower than TMA. So: 4K-16K-element tiles, occupancy 2-4 (1-4 backward), 4 or 8
# worker warps, persistent or one-CTA-per-tile grids.

MAX_ROW_TILE = 16384      # widest row (elements) kept whole in one tile; wider rows are chunked
WARPS = (4, 8)            # tileiras 13.4 takes 4 or 8 worker warps


def _space(default, **dims):
    """Default first, then the product of `dims` (dicts of name -> values), without repeats."""
    yield default
    seen = [default]
    names = list(dims)

    def rec(i, acc):
        if i == len(names):
            cfg = SimpleNamespace(**{**vars(default), **acc})
            if cfg not in seen:
                seen.append(cfg)
                yield cfg
            return
        for v in dims[names[i]]:
            yield from rec(i + 1, {**acc, names[i]: v})
    yield from rec(0, {})


def _row_tiles(tile_n, elems=(4096, 8192, 16384)):
    """Rows per tile so a tile holds about `elems` elements (at least one row)."""
    return sorted({max(1, e // tile_n) for e in elems})


def fwd_configs(arch, n_cols, tile_elems=(4096, 8192, 16384), occupancies=(2, 4), warps=WARPS):
    """Forward search space for rows of `n_cols` elements (default first). `persistent=False`
    launches one CTA per row tile instead of SMs x occupancy."""
    tile_n = next_pow2(n_cols)
    if tile_n <= MAX_ROW_TILE:
        default = SimpleNamespace(kind="rows", tile_m=max(1, 8192 // tile_n), tile_n=tile_n,
                                  occupancy=2, num_worker_warps=4, persistent=True)
        yield from _space(default, tile_m=_row_tiles(tile_n, tile_elems), occupancy=occupancies,
                          num_worker_warps=warps, persistent=(True, False))
    else:
        default = SimpleNamespace(kind="chunked", tile_m=1, tile_n=4096, occupancy=2,
                                  num_worker_warps=4, persistent=True)
        yield from _space(default, tile_n=(2048, 4096, 8192), occupancy=(2, 4),
                          num_worker_warps=warps, persistent=(True, False))


def bwd_configs(arch, n_cols, tile_elems=(4096, 8192, 16384), occupancies=(1, 2, 4), warps=WARPS):
    """Backward (whole-row kernel) search space; only for rows up to MAX_ROW_TILE."""
    tile_n = next_pow2(n_cols)
    default = SimpleNamespace(tile_m=max(1, 8192 // tile_n), tile_n=tile_n, occupancy=2,
                              num_worker_warps=4)
    yield from _space(default, tile_m=_row_tiles(tile_n, tile_elems), occupancy=occupancies,
                      num_worker_warps=warps)


def bwd_coef_configs(arch, n_cols):
    default = SimpleNamespace(tile_n=4096, occupancy=4, num_worker_warps=4)
    yield from _space(default, tile_n=(2048, 4096, 8192), occupancy=(2, 4, 8), num_worker_warps=WARPS)


def bwd_cols_configs(arch, n_cols):
    default = SimpleNamespace(tile_m=8, tile_n=512, occupancy=4, num_worker_warps=4)
    yield default
    for tm, tn in ((8, 512), (4, 1024), (16, 256), (8, 1024), (16, 512)):
        for occ in (2, 4, 8):
            for warps in WARPS:
                cfg = SimpleNamespace(tile_m=tm, tile_n=tn, occupancy=occ, num_worker_warps=warps)
                if cfg != default:
                    yield cfg


def column_sum_configs(arch, n_cols):
    default = SimpleNamespace(tile_g=16, tile_n=64, occupancy=4)
    yield from _space(default, tile_g=(16, 64), tile_n=(16, 32, 64, 128), occupancy=(4,))


def _fwd_kernel(cfg):
    return rms_norm_fwd_rows if cfg.kind == "rows" else rms_norm_fwd_chunked


# `default` is the hard-coded fallback if a generator ever yields nothing.
_fwd = Autotuner("rms_norm_fwd", _fwd_kernel, fwd_configs,
                 default=SimpleNamespace(kind="chunked", tile_m=1, tile_n=4096, occupancy=2,
                                         persistent=True))
_bwd = Autotuner("rms_norm_bwd", rms_norm_bwd_rows, bwd_configs,
                 default=SimpleNamespace(tile_m=1, tile_n=MAX_ROW_TILE, occupancy=2))
_bwd_coef = Autotuner("rms_norm_bwd_coef", rms_norm_bwd_row_coef, bwd_coef_configs,
                      default=SimpleNamespace(tile_n=4096, occupancy=4))
_bwd_cols = Autotuner("rms_norm_bwd_cols", rms_norm_bwd_cols, bwd_cols_configs,
                      default=SimpleNamespace(tile_m=8, tile_n=512, occupancy=4))
_column_sum = Autotuner("rms_norm_dw_sum", column_sum, column_sum_configs,
                        default=SimpleNamespace(tile_g=16, tile_n=64, occupancy=4))
TUNERS = (_fwd, _bwd, _bwd_coef, _bwd_cols, _column_sum)


# ---------------------------------------------------------------------------------------------
# Host launches (2-D, contiguous rows). Grids are persistent: each CTA strides over row tiles.

def _ctas(n_tiles, dev_index, occupancy):
    return max(1, min(n_tiles, sm_count(dev_index) * occupancy))


def _fwd_grid(cfg, M, dev):   # on the fast path: kept to one call level
    tiles = -(-M // cfg.tile_m)
    return (max(1, min(tiles, sm_count(dev) * cfg.occupancy)) if cfg.persistent else tiles,)


def launch_fwd(x, w, y, rstd, eps):
    """The fast path: key, one dict lookup, grid, launch (nothing else runs on a cache hit)."""
    M, N = x.shape
    dev = x.get_device()
    key = (N, 1 << (M - 1).bit_length(), x.dtype, w.dtype, dev)   # bucket(M), inlined: fast path
    cfg, kernel = _fwd.cache.get(key) or _fwd.tune(key, x, Search(
        shape=dict(n_cols=N), grid_fn=lambda c: _fwd_grid(c, M, dev),
        args_fn=lambda c: (x, w, y, rstd, 1.0 / N, eps, c.tile_m, c.tile_n),
        work=Work(bytes=2 * x.numel() * x.element_size() + w.numel() * w.element_size() + 4 * M)))
    ct.launch(current_stream(dev), _fwd_grid(cfg, M, dev), kernel,
              (x, w, y, rstd, 1.0 / N, eps, cfg.tile_m, cfg.tile_n))


def _bwd_work(dy, w):
    return Work(bytes=3 * dy.numel() * dy.element_size() + 2 * w.numel() * w.element_size())


def launch_column_sum(partial, out):
    """out (N,) = partial (G, N) summed over G, in out's dtype."""
    G, N = partial.shape
    dev = partial.get_device()
    key = (N, bucket(G), out.dtype, dev)

    def grid(c):
        return (-(-N // c.tile_n),)
    cfg, kernel = _column_sum.cache.get(key) or _column_sum.tune(key, partial, Search(
        shape=dict(n_cols=N), grid_fn=grid, args_fn=lambda c: (partial, out, c.tile_g, c.tile_n),
        work=Work(bytes=partial.numel() * 4 + out.numel() * out.element_size())))
    ct.launch(current_stream(dev), grid(cfg), kernel, (partial, out, cfg.tile_g, cfg.tile_n))


def launch_bwd(dy, x, w, rstd, dx, dw):
    """dx (M, N) and dw (N,) written in place (dw in its own dtype)."""
    M, N = x.shape
    dev = x.get_device()
    key = (N, bucket(M), x.dtype, dy.dtype, w.dtype, dev)
    if next_pow2(N) <= MAX_ROW_TILE:
        def grid(c):
            return (_ctas(-(-M // c.tile_m), dev, c.occupancy),)

        def args(c, partial):
            return (dy, x, w, rstd, dx, partial, 1.0 / N, c.tile_m, c.tile_n)

        def search():   # one scratch partial buffer per miss, sized for the largest grid
            cfgs = _bwd.config_list(arch(x), dict(n_cols=N))
            scratch = torch.empty((max(grid(c)[0] for c in cfgs), N), device=x.device,
                                  dtype=torch.float32)
            return Search(shape=dict(n_cols=N), grid_fn=grid,
                          args_fn=lambda c: args(c, scratch[:grid(c)[0]]), work=_bwd_work(dy, w))
        cfg, kernel = _bwd.cache.get(key) or _bwd.tune(key, x, search())
        g = grid(cfg)
        partial = torch.empty((g[0], N), device=x.device, dtype=torch.float32)
        ct.launch(current_stream(dev), g, kernel, args(cfg, partial))
        launch_column_sum(partial, dw)
        return

    # Wide rows: per-row coefficient, then column blocks (dx and dw partials).
    coef = torch.empty(M, device=x.device, dtype=torch.float32)
    ccfg, ckernel = _bwd_coef.cache.get(key) or _bwd_coef.tune(key, x, Search(
        shape=dict(n_cols=N), grid_fn=lambda c: (_ctas(M, dev, c.occupancy),),
        args_fn=lambda c: (dy, x, w, rstd, coef, 1.0 / N, c.tile_n)))
    ct.launch(current_stream(dev), (_ctas(M, dev, ccfg.occupancy),), ckernel,
              (dy, x, w, rstd, coef, 1.0 / N, ccfg.tile_n))

    def cols_grid(c):
        col_blocks = -(-N // c.tile_n)
        return (col_blocks, max(1, min(-(-M // c.tile_m), -(-sm_count(dev) * c.occupancy // col_blocks))))

    def search_cols():
        rows = max(cols_grid(c)[1] for c in _bwd_cols.config_list(arch(x), dict(n_cols=N)))
        scratch = torch.empty((rows, N), device=x.device, dtype=torch.float32)
        return Search(shape=dict(n_cols=N), grid_fn=cols_grid,
                      args_fn=lambda c: (dy, x, w, rstd, coef, dx, scratch[:cols_grid(c)[1]],
                                         c.tile_m, c.tile_n),
                      work=_bwd_work(dy, w))
    cfg, kernel = _bwd_cols.cache.get(key) or _bwd_cols.tune(key, x, search_cols())
    partial = torch.empty((cols_grid(cfg)[1], N), device=x.device, dtype=torch.float32)
    ct.launch(current_stream(dev), cols_grid(cfg), kernel,
              (dy, x, w, rstd, coef, dx, partial, cfg.tile_m, cfg.tile_n))
    launch_column_sum(partial, dw)


# ---------------------------------------------------------------------------------------------
# Wrapper: validation, flattening to rows, int32-safe row chunks.

_MAX_CHUNK_ELEMS = 2**31 - 1   # kernels index with int32: launch at most this many elements


def _row_chunks(M, N):
    if M * N <= _MAX_CHUNK_ELEMS:
        return ((0, M),)
    rows = max(16, (_MAX_CHUNK_ELEMS // N) // 16 * 16)   # multiple of 16 keeps views 16B-aligned
    return tuple((s, min(s + rows, M)) for s in range(0, M, rows))


def _check(x, weight, eps):
    validate.tensor("rms_norm", "x", x)
    validate.tensor("rms_norm", "weight", weight, device=x.device)
    if x.dim() < 1:
        raise ValueError("rms_norm: x must have at least one dimension (the hidden size)")
    if weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"rms_norm: weight must have shape ({x.shape[-1]},) to match the last "
                         f"dim of x, got {tuple(weight.shape)}")
    validate.eps("rms_norm", eps)


def _forward(x, weight, eps):
    """(y, rstd): y like x, rstd float32 with one value per row."""
    N = x.shape[-1]
    x2 = x.reshape(-1, N)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    M = x2.shape[0]
    y = torch.empty((M, N), device=x.device, dtype=x.dtype)
    rstd = torch.empty(M, device=x.device, dtype=torch.float32)
    if M and N:
        w = weight if weight.stride(0) == 1 else weight.contiguous()
        if M * N <= _MAX_CHUNK_ELEMS:
            launch_fwd(x2, w, y, rstd, float(eps))
        else:
            for s, e in _row_chunks(M, N):
                launch_fwd(x2[s:e], w, y[s:e], rstd[s:e], float(eps))
    return y.view(x.shape), rstd


def _backward(dy, x, weight, rstd):
    """(dx, dw): dx like x, dw like weight."""
    N = x.shape[-1]
    x2 = x.reshape(-1, N)
    dy2 = dy.reshape(-1, N)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    if dy2.stride(-1) != 1:
        dy2 = dy2.contiguous()
    M = x2.shape[0]
    dx = torch.empty((M, N), device=x.device, dtype=x.dtype)
    if not (M and N):
        return dx.view(x.shape), torch.zeros_like(weight)
    w = weight if weight.stride(0) == 1 else weight.contiguous()
    chunks = _row_chunks(M, N)
    if len(chunks) == 1:
        dw = torch.empty_like(w)
        launch_bwd(dy2, x2, w, rstd, dx, dw)
        return dx.view(x.shape), dw
    dw32 = torch.zeros(N, device=x.device, dtype=torch.float32)   # f32 sum over row chunks
    part = torch.empty(N, device=x.device, dtype=torch.float32)
    for s, e in chunks:
        launch_bwd(dy2[s:e], x2[s:e], w, rstd[s:e], dx[s:e], part)
        dw32 += part
    return dx.view(x.shape), dw32.to(weight.dtype)


# ---------------------------------------------------------------------------------------------
# Autograd: a plain Function for eager (least host overhead) and a torch.library custom op
# (with fake impls and the same backward) for torch.compile(fullgraph=True).

class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        y, rstd = _forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(dy, x, weight, rstd)
        return dx, dw, None


@torch.library.custom_op("tiletune::rms_norm_fwd", mutates_args=())
def _rms_norm_fwd_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(x, weight, eps)


@_rms_norm_fwd_op.register_fake
def _(x, weight, eps):
    rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
    return torch.empty_like(x, memory_format=torch.contiguous_format), x.new_empty(rows, dtype=torch.float32)


@torch.library.custom_op("tiletune::rms_norm_bwd", mutates_args=())
def _rms_norm_bwd_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                     rstd: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return _backward(dy, x, weight, rstd)


@_rms_norm_bwd_op.register_fake
def _(dy, x, weight, rstd):
    return torch.empty_like(x, memory_format=torch.contiguous_format), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])


def _op_backward(ctx, dy, _drstd):
    x, weight, rstd = ctx.saved_tensors
    dx, dw = _rms_norm_bwd_op(dy, x, weight, rstd)
    return dx, dw, None


_rms_norm_fwd_op.register_autograd(_op_backward, setup_context=_setup_context)


def rms_norm(x, weight, eps=1e-6):
    """RMSNorm over the last dim: `x / sqrt(mean(x**2, -1) + eps) * weight`.

    x: (..., N) float32/float16/bfloat16 CUDA tensor, any leading dims (flattened to rows), any
    N >= 1 (rows up to 16384 wide are kept in one tile; wider rows are processed in chunks).
    Non-contiguous x is accepted (copied once if its rows cannot be viewed).
    weight: (N,) float32/float16/bfloat16 on x's device; its dtype may differ from x's.
    Statistics in float32; returns a new tensor of x's shape and dtype. Differentiable in x and
    weight (dweight comes back in weight's dtype). Works under torch.compile(fullgraph=True).
    """
    _check(x, weight, eps)
    if torch.compiler.is_compiling():
        return _rms_norm_fwd_op(x, weight, float(eps))[0]
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return RMSNormFunction.apply(x, weight, float(eps))
    return _forward(x, weight, eps)[0]


# ---------------------------------------------------------------------------------------------
# Ahead-of-time compile cases (CI without a GPU, `python -m tiletune compile`): every config of
# every kernel, for row widths that reach each variant; aligned and ragged widths; other dtypes.

AOT_WIDTHS = (4096, 1001, 8192, 16384, 20000)


def aot_cases():
    from tiletune.aot import F32, CompileCase, jit_array
    f32 = torch.float32

    def fwd_params(cfg, M, N, xd, wd):
        x, w, y, r = (jit_array(xd, (M, N)), jit_array(wd, (N,)), jit_array(xd, (M, N)),
                      jit_array(f32, (M,)))
        return [x, w, y, r, F32, F32, cfg.tile_m, cfg.tile_n]

    M, G = 4096, 264
    for N in (4096, 1001):
        for cfg in column_sum_configs("sm_90", N):
            for od in (torch.bfloat16, f32):
                yield CompileCase("rms_norm", _column_sum.build(cfg),
                                  [jit_array(f32, (G, N)), jit_array(od, (N,)), cfg.tile_g, cfg.tile_n],
                                  f"rms_norm_dw_sum N={N} {od} {vars(cfg)}")
    for N in AOT_WIDTHS:
        for i, cfg in enumerate(fwd_configs("sm_90", N)):
            combos = [(torch.bfloat16, torch.bfloat16)]
            if i == 0:   # the default config also for the other dtype combinations
                combos += [(f32, f32), (torch.float16, torch.float16), (torch.bfloat16, f32)]
            for xd, wd in combos:
                yield CompileCase("rms_norm", _fwd.build(cfg), fwd_params(cfg, M, N, xd, wd),
                                  f"rms_norm_fwd N={N} {xd} w={wd} {vars(cfg)}")
        x, w, r = jit_array(torch.bfloat16, (M, N)), jit_array(torch.bfloat16, (N,)), jit_array(f32, (M,))
        if next_pow2(N) <= MAX_ROW_TILE:
            for cfg in bwd_configs("sm_90", N):
                yield CompileCase("rms_norm", _bwd.build(cfg),
                                  [x, x, w, r, x, jit_array(f32, (G, N)), F32, cfg.tile_m, cfg.tile_n],
                                  f"rms_norm_bwd N={N} {vars(cfg)}")
        else:
            for cfg in bwd_coef_configs("sm_90", N):
                yield CompileCase("rms_norm", _bwd_coef.build(cfg), [x, x, w, r, r, F32, cfg.tile_n],
                                  f"rms_norm_bwd_coef N={N} {vars(cfg)}")
            for cfg in bwd_cols_configs("sm_90", N):
                yield CompileCase("rms_norm", _bwd_cols.build(cfg),
                                  [x, x, w, r, r, x, jit_array(f32, (G, N)), cfg.tile_m, cfg.tile_n],
                                  f"rms_norm_bwd_cols N={N} {vars(cfg)}")


# ---------------------------------------------------------------------------------------------
# Benchmarks (python -m tiletune bench rms_norm).

BENCH_SHAPES = ((16384, 4096, torch.bfloat16), (4096, 8192, torch.bfloat16),
                (32768, 2048, torch.bfloat16), (8192, 5120, torch.float16),
                (2048, 32768, torch.bfloat16))


def _peer_fns(eps):
    peers = {}
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        peers["liger"] = lambda x, w: LigerRMSNormFunction.apply(x, w, eps)
    except Exception:
        pass
    try:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from tilegym.ops.cutile.rms_norm import rms_norm as tilegym_rms_norm
        peers["tilegym"] = lambda x, w: tilegym_rms_norm(x, None, w, eps)
    except Exception:
        pass
    return peers


def bench_cases():
    from tiletune.bench import BenchCase
    eps = 1e-6
    cases = []
    for M, N, dt in BENCH_SHAPES:
        x = torch.randn(M, N, device="cuda", dtype=dt)
        w = torch.rand(N, device="cuda", dtype=dt) + 0.5
        copy_out = torch.empty_like(x)
        torch_fn = lambda x, w, N=N: torch.nn.functional.rms_norm(x, (N,), w, eps)
        compiled = torch.compile(torch_fn)
        fns = {"torch": torch_fn, "torch_compile": compiled, **_peer_fns(eps)}
        name = f"{M}x{N} {str(dt).replace('torch.', '')}"
        nbytes = 2 * x.numel() * x.element_size()
        cases.append(BenchCase(
            "rms_norm", name, "fwd", lambda x=x, w=w: rms_norm(x, w, eps),
            {k: (lambda f=f, x=x, w=w: f(x, w)) for k, f in fns.items()},
            bytes=nbytes, ceiling=("copy", lambda x=x, o=copy_out: o.copy_(x))))

        xg = x.detach().clone().requires_grad_()
        wg = w.detach().clone().requires_grad_()
        dy = torch.randn_like(x)

        def train_step(f, xg=xg, wg=wg, dy=dy):   # grad(): no accumulation into .grad
            return lambda: torch.autograd.grad(f(xg, wg), (xg, wg), dy)
        cases.append(BenchCase(
            "rms_norm", name, "fwd+bwd", train_step(lambda a, b: rms_norm(a, b, eps)),
            {k: train_step(f) for k, f in fns.items()},
            bytes=2.5 * nbytes,   # fwd: read x, write y; bwd: read x and dy, write dx
            ceiling=("copy", lambda x=x, o=copy_out: o.copy_(x)), ceiling_scale=2.5))
    return cases


def bench_host():
    """Host microseconds per call at a tiny shape: bare ct.launch of the tuned kernel vs the
    engine's fast path (key, lookup, grid, launch) vs the whole op (validation, allocation)."""
    from tiletune.bench import host_us
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(1024, device="cuda", dtype=torch.bfloat16)
    y, rstd = torch.empty_like(x), torch.empty(64, device="cuda", dtype=torch.float32)
    launch_fwd(x, w, y, rstd, 1e-6)
    key = (1024, 64, x.dtype, w.dtype, x.get_device())
    cfg, kernel = _fwd.cache[key]
    grid, args = _fwd_grid(cfg, 64, 0), (x, w, y, rstd, 1.0 / 1024, 1e-6, cfg.tile_m, cfg.tile_n)
    stream = current_stream(0)
    out = {"bare_launch": host_us(lambda: ct.launch(stream, grid, kernel, args)),
           "engine_fast_path": host_us(lambda: launch_fwd(x, w, y, rstd, 1e-6)),
           "rms_norm_call": host_us(lambda: rms_norm(x, w)),
           "torch_rms_norm_call": host_us(lambda: torch.nn.functional.rms_norm(x, (1024,), w, 1e-6))}
    # One training step through autograd (forward + backward), host time per step.
    xg, wg = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    dy = torch.randn_like(x)
    steps = {"rms_norm": lambda a, b: rms_norm(a, b),
             "torch": lambda a, b: torch.nn.functional.rms_norm(a, (1024,), b, 1e-6),
             **_peer_fns(1e-6)}
    for name, f in steps.items():
        try:
            out[f"{name}_fwd_bwd_step"] = host_us(
                lambda f=f: torch.autograd.grad(f(xg, wg), (xg, wg), dy), n=500)
        except Exception as e:
            out[f"{name}_fwd_bwd_step"] = f"{type(e).__name__}: {e}"
    out["fast_path_over_bare"] = out["engine_fast_path"] / out["bare_launch"]
    return out
