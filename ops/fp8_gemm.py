# FP8 GEMM with torch._scaled_mm's interface, and the quantizers that feed it.
#
#   out = (a * scale_a) @ (b * scale_b)      a (M, K), b (K, N) float8, float32 accumulation
#
# The scaling mode is read from the scales' shapes exactly as torch._scaled_mm reads them:
#   tensorwise  one float32 each (any shape with one element)
#   rowwise     scale_a (M, 1), scale_b (1, N)
#   block       with KB = cdiv(K, 128), MB = cdiv(M, 128), NB = cdiv(N, 128):
#               scale_a (M, KB) and scale_b (KB, NB)     1x128 activations x 128x128 weights
#               scale_a (M, KB) and scale_b (KB, N)      1x128 x 1x128
#               scale_a (MB, KB) and scale_b (KB, N)     128x128 x 1x128
# Tensorwise and rowwise share one kernel family: the fp8 ct.mma (QGMMA on sm_90) accumulates
# the whole K in float32 and the epilogue multiplies row and column scales (tensorwise scales
# are vectors of one). Block scaling promotes as DeepSeek-V3 does: each 128-K slice's
# product starts from a zero float32 tile and is added to the main accumulator times its
# scale_a * scale_b, so the tensor cores never sum more than 128 products. Keys with few output
# tiles (decode sizes) also search split-K in both families: float32 partials over whole K tiles
# (block: already promoted and scaled), then a second kernel sums them in a fixed order.
#
# cuTile's mma takes only equal operand dtypes (e4m3 x e5m2 is a TileTypeError), so a mixed pair
# is widened to float16 in registers (exact for both fp8 formats) and multiplied there.
#
# No `from __future__ import annotations` here: it would hide the ct.Constant annotations.
from types import SimpleNamespace

import cuda.tile as ct
import torch

from tiletune import validate
from tiletune.autotune import Autotuner, Work, bucket, bucketed
from tiletune.device import arch as device_arch
from tiletune.device import bind_context, major, persistent_ctas
from tiletune.ops.gemm_tiles import layout, output_tile, tile_count, tile_grid
from tiletune.ops.matmul import SUM_TILE, launch_splitk_sum, split_of, splitk_rows
from tiletune.space import cdiv, f32_row, next_pow2, product, table
from tiletune.torch_op import no_second_order, records_graph, refuse_transforms, tracing

ZERO = ct.PaddingMode.ZERO
# Scale math rounds to nearest even, as torch's float32 division does: RoundingMode.FULL is
# div.full.f32 (MUFU.RCP and a multiply, up to 2 ulp off; read in the sm_90 SASS), which would
# break the quantizers' bit-exact match with the torch reference.
RN = ct.RoundingMode.RN
BLOCK = 128                      # the K (and M/N) extent of one block scale
AMAX_EPS = 1e-12                 # an all-zero group still gets a finite, non-zero scale
FLT_MAX = 3.4028234663852886e38  # the largest finite float32
FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
IN_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
GRANULARITIES = ("tensor", "row", "block1x128", "block128x128")


# ---------------------------------------------------------------------------------------------
# GEMM kernels. a (M, K) row-major, b (K, N) either major, c (M, N) any strides; every tile
# load pads with zeros (ragged M, N, K), every store drops what falls outside c.

def _mma(at, bt, acc, FAST_ACC, WIDEN):
    """acc + at @ bt in float32; WIDEN: operands of different fp8 formats, multiplied as
    float16 (which holds both exactly)."""
    if WIDEN:
        acc = ct.mma(at.astype(ct.float16), bt.astype(ct.float16), acc)
    else:
        acc = ct.mma(at, bt, acc, use_fast_acc=FAST_ACC)
    return acc


def _load(a, index, shape, LATENCY):
    """A zero-padded tile load; LATENCY > 0: with that latency hint (0: none). In a K loop the
    hint sets how far ahead the compiler issues the load, for TMA the depth of its ring (sm_90:
    2-7 stages as the hint grows)."""
    if ct.static_eval(LATENCY > 0):
        return ct.load(a, index, shape, padding_mode=ZERO, latency=LATENCY)
    return ct.load(a, index, shape, padding_mode=ZERO)


def _operand_tiles(a, b, m, n, kk, TM, TN, TK, LATENCY):
    """a's (m, kk) and b's (kk, n) tiles, with the loads' latency hint (0: none)."""
    return _load(a, (m, kk), (TM, TK), LATENCY), _load(b, (kk, n), (TK, TN), LATENCY)


def _product(a, b, m, n, k_first, k_end, TM, TN, TK, FAST_ACC, WIDEN, LATENCY):
    """The unscaled float32 (a @ b)[m-tile, n-tile] over K tiles k_first..k_end."""
    acc = ct.zeros((TM, TN), ct.float32)
    for kk in range(k_first, k_end):
        at, bt = _operand_tiles(a, b, m, n, kk, TM, TN, TK, LATENCY)
        acc = _mma(at, bt, acc, FAST_ACC, WIDEN)
    return acc


def _scale(acc, sa, sb, m, n, TM, TN):
    """acc * the row scales * the column scales, float32, in the shapes the caller passed them
    (no views on the host): rowwise sa (M, 1) and sb (1, N) as torch._scaled_mm takes them, or
    (M,) and (N,); tensorwise one element each, 0-D, (1,) or (1, 1) (every index clamps to 0)."""
    return acc * _tile_scales(sa, m, TM, 0) * _tile_scales(sb, n, TN, 1)


def _tile_scales(s, t, T, axis):
    """Scales of tile t's T rows (axis 0: a (T, 1) tile) or columns (axis 1: (1, T)), from a
    0-D, 1-D or 2-D float32 array (indices past its end clamp to its last element)."""
    if s.ndim == 0:
        return ct.gather(s, ())
    count = s.shape[1] if axis == 1 and s.ndim == 2 else s.shape[0]
    idx = ct.minimum(t * T + ct.arange(T, dtype=ct.int32), count - 1)
    if s.ndim == 1:
        return ct.reshape(ct.gather(s, idx), (T, 1) if axis == 0 else (1, T))
    zero = ct.zeros((1, 1), ct.int32)
    if axis == 0:
        return ct.gather(s, (ct.reshape(idx, (T, 1)), zero))
    return ct.gather(s, (zero, ct.reshape(idx, (1, T))))


def _scaled_tile(a, b, sa, sb, m, n, TM, TN, TK, FAST_ACC, WIDEN, LATENCY):
    """(a @ b)[m-tile, n-tile], scaled."""
    acc = _product(a, b, m, n, 0, ct.cdiv(a.shape[1], TK), TM, TN, TK, FAST_ACC, WIDEN, LATENCY)
    return _scale(acc, sa, sb, m, n, TM, TN)


def _scaled_output(a, b, sa, sb, c, tile, TM, TN, TK, GROUP_M, FAST_ACC, WIDEN, LATENCY):
    m, n = output_tile(tile, a.shape[0], b.shape[1], TM, TN, GROUP_M)
    out = _scaled_tile(a, b, sa, sb, m, n, TM, TN, TK, FAST_ACC, WIDEN, LATENCY)
    ct.store(c, (m, n), out.astype(c.dtype))


@ct.kernel
def fp8_mm_kernel(a, b, sa, sb, c, TM: ct.Constant[int], TN: ct.Constant[int],
                  TK: ct.Constant[int], GROUP_M: ct.Constant[int], FAST_ACC: ct.Constant[bool],
                  WIDEN: ct.Constant[bool], LATENCY: ct.Constant[int],
                  PERSISTENT: ct.Constant[bool]):
    """Tensorwise / rowwise, output tiles in grouped order: one CTA per tile, grid (tiles,);
    PERSISTENT: SMs x occupancy CTAs, each walking the tiles. LATENCY: the operand loads'
    hint (0: none)."""
    if PERSISTENT:
        for t in range(ct.bid(0), tile_count(a.shape[0], b.shape[1], TM, TN), ct.num_blocks(0)):
            _scaled_output(a, b, sa, sb, c, t, TM, TN, TK, GROUP_M, FAST_ACC, WIDEN, LATENCY)
    else:
        _scaled_output(a, b, sa, sb, c, ct.bid(0), TM, TN, TK, GROUP_M, FAST_ACC, WIDEN,
                       LATENCY)


@ct.kernel
def fp8_mm_splitk_kernel(a, b, w, TM: ct.Constant[int], TN: ct.Constant[int],
                         TK: ct.Constant[int], GROUP_M: ct.Constant[int],
                         FAST_ACC: ct.Constant[bool], WIDEN: ct.Constant[bool],
                         LATENCY: ct.Constant[int], SPLIT: ct.Constant[int]):
    """Split-K partials for skinny keys (few output tiles): grid (tiles, SPLIT); CTA s sums its
    share of the K tiles, unscaled, into w[s] (float32, (SPLIT, M, N)). Each share is whole K
    tiles, so exact mode still promotes every TK products."""
    s = ct.bid(1)
    m, n = output_tile(ct.bid(0), a.shape[0], b.shape[1], TM, TN, GROUP_M)
    k_tiles = ct.cdiv(a.shape[1], TK)
    per = ct.cdiv(k_tiles, SPLIT)
    k_first = s * per
    acc = _product(a, b, m, n, k_first, min(k_first + per, k_tiles), TM, TN, TK, FAST_ACC,
                   WIDEN, LATENCY)
    ct.store(w, (s, m, n), ct.reshape(acc, (1, TM, TN)))


@ct.kernel
def fp8_splitk_sum_kernel(w, sa, sb, c, TM: ct.Constant[int], TN: ct.Constant[int],
                          SPLIT: ct.Constant[int]):
    """c = (the sum over s of w[s], in a fixed order) * the row and column scales, in c's
    dtype; grid (tiles,)."""
    num_n = ct.cdiv(c.shape[1], TN)
    m = ct.bid(0) // num_n
    n = ct.bid(0) - m * num_n
    acc = ct.zeros((TM, TN), ct.float32)
    for s in range(SPLIT):
        acc = acc + ct.reshape(ct.load(w, (s, m, n), (1, TM, TN), padding_mode=ZERO), (TM, TN))
    ct.store(c, (m, n), _scale(acc, sa, sb, m, n, TM, TN).astype(c.dtype))


def _block_scale(sa, sb, m, n, kb, a_rows, TM, TN, A_GROUP, B_GROUP, LATENCY):
    """The (TM, 1), (1, TN) or (TM, TN) float32 factor of 128-K block kb's product:
    sa[row // A_GROUP, kb] * sb[kb, col // B_GROUP]. Per-row (per-column) scales load as a
    (TM, 1) ((1, TN)) tile: TMA where their strides are 16-byte multiples, as quantize_fp8 lays
    them out (a gathered vector is copied to the accumulator's layout through shared memory by
    every thread holding it, which racecheck reports). With a latency hint (LATENCY > 0) they
    are plain loads, which the compiler then issues several blocks ahead; a TMA tile of scales
    goes through a single-buffered barrier pair."""
    tma = ct.static_eval(LATENCY == 0)
    if ct.static_eval(A_GROUP == 1):
        s = ct.load(sa, (m, kb), (TM, 1), padding_mode=ZERO, allow_tma=tma)
    else:
        s = ct.gather(sa, (a_rows, kb))[:, None]
    if ct.static_eval(B_GROUP == 1):
        s = s * ct.load(sb, (kb, n), (1, TN), padding_mode=ZERO, allow_tma=tma)
    elif ct.static_eval(B_GROUP >= TN):
        # the tile lies in one column block: one scale_b, one FMA per element
        s = s * ct.gather(sb, (kb, (n * TN) // B_GROUP))
    else:
        cols = n * TN + ct.arange(TN, dtype=ct.int32)
        s = s * ct.gather(sb, (kb, cols // B_GROUP))[None, :]
    return s


def _block_product(a, b, m, n, kb, TM, TN, FAST_ACC, WIDEN, LATENCY):
    """One 128-K block's product, from zero."""
    at, bt = _operand_tiles(a, b, m, n, kb, TM, TN, BLOCK, LATENCY)
    return _mma(at, bt, ct.zeros((TM, TN), ct.float32), FAST_ACC, WIDEN)


def _block_scaled_tile(a, b, sa, sb, m, n, TM, TN, A_GROUP, B_GROUP, FAST_ACC, WIDEN, OVERLAP,
                       LATENCY):
    """sum over 128-K blocks kb of (a @ b)[tile, kb] * sa[row // A_GROUP, kb] *
    sb[kb, col // B_GROUP], each block's product promoted to the float32 accumulator.
    A K not a multiple of 128 ends in a partial block (zero padding): no block is wholly
    outside a, so no load is out of bounds. OVERLAP: block kb + 1's product is issued before
    block kb's is scaled into the accumulator (one more float32 tile live); LATENCY: the loads'
    hint (0: none)."""
    a_rows = (m * TM + ct.arange(TM, dtype=ct.int32)) // A_GROUP
    acc = ct.zeros((TM, TN), ct.float32)
    blocks = ct.cdiv(a.shape[1], BLOCK)
    if ct.static_eval(OVERLAP):
        part = _block_product(a, b, m, n, 0, TM, TN, FAST_ACC, WIDEN, LATENCY)
        for kb in range(1, blocks):
            following = _block_product(a, b, m, n, kb, TM, TN, FAST_ACC, WIDEN, LATENCY)
            acc = acc + part * _block_scale(sa, sb, m, n, kb - 1, a_rows, TM, TN, A_GROUP,
                                            B_GROUP, LATENCY)
            part = following
        acc = acc + part * _block_scale(sa, sb, m, n, blocks - 1, a_rows, TM, TN, A_GROUP,
                                        B_GROUP, LATENCY)
    else:
        acc = _block_scaled_range(a, b, sa, sb, m, n, 0, blocks, TM, TN, A_GROUP, B_GROUP,
                                  FAST_ACC, WIDEN, LATENCY)
    return acc


def _block_scaled_range(a, b, sa, sb, m, n, kb_first, kb_end, TM, TN, A_GROUP, B_GROUP,
                        FAST_ACC, WIDEN, LATENCY):
    """The scaled sum of 128-K blocks kb_first..kb_end of the tile, one block at a time."""
    a_rows = (m * TM + ct.arange(TM, dtype=ct.int32)) // A_GROUP
    acc = ct.zeros((TM, TN), ct.float32)
    for kb in range(kb_first, kb_end):
        part = _block_product(a, b, m, n, kb, TM, TN, FAST_ACC, WIDEN, LATENCY)
        acc = acc + part * _block_scale(sa, sb, m, n, kb, a_rows, TM, TN, A_GROUP, B_GROUP,
                                        LATENCY)
    return acc


def _block_output(a, b, sa, sb, c, tile, TM, TN, GROUP_M, A_GROUP, B_GROUP, FAST_ACC, WIDEN,
                  OVERLAP, LATENCY):
    m, n = output_tile(tile, a.shape[0], b.shape[1], TM, TN, GROUP_M)
    acc = _block_scaled_tile(a, b, sa, sb, m, n, TM, TN, A_GROUP, B_GROUP, FAST_ACC, WIDEN,
                             OVERLAP, LATENCY)
    ct.store(c, (m, n), acc.astype(c.dtype))


@ct.kernel
def fp8_mm_block_kernel(a, b, sa, sb, c, TM: ct.Constant[int], TN: ct.Constant[int],
                        GROUP_M: ct.Constant[int], A_GROUP: ct.Constant[int],
                        B_GROUP: ct.Constant[int], FAST_ACC: ct.Constant[bool],
                        WIDEN: ct.Constant[bool], OVERLAP: ct.Constant[bool],
                        LATENCY: ct.Constant[int], PERSISTENT: ct.Constant[bool]):
    """Block scaling, grid and tile order as fp8_mm_kernel's. sa (M or cdiv(M, 128),
    cdiv(K, 128)) and sb (cdiv(K, 128), cdiv(N, 128) or N), any strides; A_GROUP / B_GROUP:
    rows / columns per scale (1 or 128)."""
    if PERSISTENT:
        for t in range(ct.bid(0), tile_count(a.shape[0], b.shape[1], TM, TN), ct.num_blocks(0)):
            _block_output(a, b, sa, sb, c, t, TM, TN, GROUP_M, A_GROUP, B_GROUP, FAST_ACC,
                          WIDEN, OVERLAP, LATENCY)
    else:
        _block_output(a, b, sa, sb, c, ct.bid(0), TM, TN, GROUP_M, A_GROUP, B_GROUP, FAST_ACC,
                      WIDEN, OVERLAP, LATENCY)


@ct.kernel
def fp8_mm_block_splitk_kernel(a, b, sa, sb, w, TM: ct.Constant[int], TN: ct.Constant[int],
                               GROUP_M: ct.Constant[int], A_GROUP: ct.Constant[int],
                               B_GROUP: ct.Constant[int], FAST_ACC: ct.Constant[bool],
                               WIDEN: ct.Constant[bool], LATENCY: ct.Constant[int],
                               SPLIT: ct.Constant[int]):
    """Block scaling's split-K partials: grid (tiles, SPLIT); CTA s sums its share of the
    128-K blocks, each promoted with its scales, into w[s] (float32, (SPLIT, M, N)); matmul's
    launch_splitk_sum adds the SPLIT partials in a fixed order."""
    s = ct.bid(1)
    m, n = output_tile(ct.bid(0), a.shape[0], b.shape[1], TM, TN, GROUP_M)
    blocks = ct.cdiv(a.shape[1], BLOCK)
    per = ct.cdiv(blocks, SPLIT)
    kb_first = s * per
    acc = _block_scaled_range(a, b, sa, sb, m, n, kb_first, min(kb_first + per, blocks), TM, TN,
                              A_GROUP, B_GROUP, FAST_ACC, WIDEN, LATENCY)
    ct.store(w, (s, m, n), ct.reshape(acc, (1, TM, TN)))


# ---------------------------------------------------------------------------------------------
# Quantizer kernels. x (M, K) bf16/fp16/fp32, any strides; q (M, K) float8. Each group's scale
# is max(amax, 1e-12) / fp8_max and q = clamp(x / scale, -fp8_max, fp8_max) cast with round to
# nearest even: the results of quantize_fp8_reference's float32 operations, NaN propagating as
# torch's amax and clamp propagate it (bit-exact against it).

def _fp8_scale(amax, fp8_max):
    return ct.truediv(ct.maximum(amax, AMAX_EPS, propagate_nan=True), fp8_max, rounding_mode=RN)


def _fp8_cast(xf, scale, fp8_max, dtype):
    """clamp(x / scale) cast to `dtype`, x / scale rounded as the IEEE division rounds it, from
    one reciprocal per scale: q = x * inv, the residual q * s - x (one FMA, exact), then
    q - residual * inv (one FMA), the division's own fast path with the reciprocal rounded to
    nearest. An IEEE division per element (reciprocal, Newton step, range check, slow-path
    branch: ten sm_90 instructions) left the quantizers issue-bound on an H200. Zeros keep x's
    sign through the residual's form (x = -0 gives -0). s is the scale capped at FLT_MAX, so an
    infinite scale gives 0 for finite x and NaN for an infinite one, as x / inf does.
    tests/gpu/test_fp8_gemm.py checks every pair of a 16-bit x and a scale of a 16-bit amax at
    or above it, and float32 x of every exponent, bit for bit against the reference."""
    inv = ct.truediv(1.0, scale, rounding_mode=RN)
    s = ct.minimum(scale, FLT_MAX, propagate_nan=True)
    q = xf * inv
    # cuTile fuses a multiply into the add or subtract that is its only use, trying the left
    # operand first: each product below stands on the left.
    residual = q * s - xf
    y = (-residual) * inv + q
    y = ct.minimum(ct.maximum(y, -fp8_max, propagate_nan=True), fp8_max, propagate_nan=True)
    return y.astype(dtype)


def _abs_max(t, axis):
    return ct.max(ct.abs(t), axis, keepdims=True, propagate_nan=True)


@ct.kernel
def quantize_rows_kernel(x, q, s, fp8_max, TR: ct.Constant[int], TC: ct.Constant[int],
                         ONE_PASS: ct.Constant[bool]):
    """Rowwise: s (M, 1). Each CTA strides over tiles of TR rows (a persistent grid, so loads
    of the next tile overlap this one's math); ONE_PASS: the row fits one TC-wide tile (read
    once), else the row is read twice, TC columns at a time (amax, then quantize)."""
    for r in range(ct.bid(0), ct.cdiv(x.shape[0], TR), ct.num_blocks(0)):
        if ONE_PASS:
            xt = ct.load(x, (r, 0), (TR, TC), padding_mode=ZERO).astype(ct.float32)
            scale = _fp8_scale(_abs_max(xt, 1), fp8_max)
            ct.store(q, (r, 0), _fp8_cast(xt, scale, fp8_max, q.dtype))
        else:
            chunks = ct.cdiv(x.shape[1], TC)
            amax = ct.zeros((TR, 1), ct.float32)
            for c in range(chunks):
                xt = ct.load(x, (r, c), (TR, TC), padding_mode=ZERO).astype(ct.float32)
                amax = ct.maximum(amax, _abs_max(xt, 1), propagate_nan=True)
            scale = _fp8_scale(amax, fp8_max)
            for c in range(chunks):
                xt = ct.load(x, (r, c), (TR, TC), padding_mode=ZERO).astype(ct.float32)
                ct.store(q, (r, c), _fp8_cast(xt, scale, fp8_max, q.dtype))
        ct.store(s, (r, 0), scale)


@ct.kernel
def quantize_1x128_kernel(x, q, s_t, fp8_max, TR: ct.Constant[int], G: ct.Constant[int]):
    """1x128 blocks: (TR, G * 128) tiles, each CTA striding over them (a persistent grid).
    s_t (cdiv(K, 128), M): the scales stored M-major, as torch._scaled_mm takes scale_a."""
    col_tiles = ct.cdiv(x.shape[1], G * BLOCK)
    for t in range(ct.bid(0), ct.cdiv(x.shape[0], TR) * col_tiles, ct.num_blocks(0)):
        r = t // col_tiles
        c = t % col_tiles
        xt = ct.load(x, (r, c), (TR, G * BLOCK), padding_mode=ZERO).astype(ct.float32)
        x3 = ct.reshape(xt, (TR, G, BLOCK))
        scale = _fp8_scale(_abs_max(x3, 2), fp8_max)                      # (TR, G, 1)
        qt = _fp8_cast(x3, scale, fp8_max, q.dtype)
        ct.store(q, (r, c), ct.reshape(qt, (TR, G * BLOCK)))
        ct.store(s_t, (c, r), ct.transpose(ct.reshape(scale, (TR, G))))


def _block_tile(x, r, c, TR, G, LATENCY, FLAT):
    """Rows [r * TR, (r + 1) * TR) x column blocks [c * G, (c + 1) * G) of x in float32, loaded
    with the latency hint LATENCY (0: none): (TR, 128) when FLAT (G is 1), else (TR, G, 128)."""
    xt = _load(x, (r, c), (TR, G * BLOCK), LATENCY).astype(ct.float32)
    if ct.static_eval(FLAT):
        tile = xt
    else:
        tile = ct.reshape(xt, (TR, G, BLOCK))
    return tile


def _block_amax(tile, FLAT):
    """Per block: (1, 1) of a FLAT tile, (1, G, 1) of a (TR, G, 128) one."""
    if ct.static_eval(FLAT):
        amax = ct.max(_abs_max(tile, 1), 0, keepdims=True, propagate_nan=True)
    else:
        amax = _abs_max(tile, (0, 2))
    return amax


def _store_block_tile(q, tile, scale, fp8_max, r, c, TR, G):
    ct.store(q, (r, c), ct.reshape(_fp8_cast(tile, scale, fp8_max, q.dtype), (TR, G * BLOCK)))


def _block_chunks(rows, block, TR):
    """(the first chunk, the number of chunks) of TR rows in block `block` of 128 rows, of
    `rows` in all: chunks wholly past the last row are left out (a load wholly outside a tensor
    is undefined)."""
    first = block * (BLOCK // TR)
    return first, ct.minimum(ct.cdiv(rows, TR) - first, BLOCK // TR)


def _quantize_block_chunks(x, q, r, c, fp8_max, TR, G, LATENCY, FLAT):
    """Quantize block row r, column block(s) c of x into q in chunks of TR rows, read twice
    (amax, then cast: the second read hits L2). Returns the scale."""
    first, chunks = _block_chunks(x.shape[0], r, TR)
    amax = ct.zeros((1, 1) if FLAT else (1, G, 1), ct.float32)
    for i in range(chunks):
        tile = _block_tile(x, first + i, c, TR, G, LATENCY, FLAT)
        amax = ct.maximum(amax, _block_amax(tile, FLAT), propagate_nan=True)
    scale = _fp8_scale(amax, fp8_max)
    for i in range(chunks):
        tile = _block_tile(x, first + i, c, TR, G, LATENCY, FLAT)
        _store_block_tile(q, tile, scale, fp8_max, first + i, c, TR, G)
    return scale


@ct.kernel
def quantize_128x128_kernel(x, q, s, fp8_max, TR: ct.Constant[int], G: ct.Constant[int],
                            LATENCY: ct.Constant[int], FLAT: ct.Constant[bool]):
    """128x128 blocks: s (cdiv(M, 128), cdiv(K, 128)). Each CTA strides over tiles of 128 rows x
    G blocks (a persistent grid). TR 128: the tile is read once; TR 16-64: it is read in chunks
    of TR rows, twice (amax, then quantize: the block, 32 KiB in bf16, was just read into L2).
    Chunks wholly below the last row are skipped (a load wholly outside x is undefined). The
    amax is the same max in any grouping, so the results do not depend on TR. LATENCY > 0: the
    chunk loads' latency hint. FLAT: 2-D (TR, 128) tiles, else (TR, G, 128) (see
    block128x128_configs for which wins where)."""
    col_tiles = ct.cdiv(x.shape[1], G * BLOCK)
    for t in range(ct.bid(0), ct.cdiv(x.shape[0], BLOCK) * col_tiles, ct.num_blocks(0)):
        r = t // col_tiles
        c = t % col_tiles
        if ct.static_eval(TR == BLOCK):
            tile = _block_tile(x, r, c, BLOCK, G, LATENCY, FLAT)
            scale = _fp8_scale(_block_amax(tile, FLAT), fp8_max)
            _store_block_tile(q, tile, scale, fp8_max, r, c, BLOCK, G)
        else:
            scale = _quantize_block_chunks(x, q, r, c, fp8_max, TR, G, LATENCY, FLAT)
        ct.store(s, (r, c), ct.reshape(scale, (1, G)))


@ct.kernel
def quantize_128x128_pair_kernel(x, x_t, q, s, q_t, s_t, fp8_max, TR: ct.Constant[int]):
    """quantize_128x128_kernel's (q, s) of x and of x^T: q_t (K, M) and s_t, where x_t is the
    x.t() view. The blocks of x^T are x's blocks transposed, so one amax serves both. Each
    block is read from memory once, in chunks of TR rows through x (amax, then q), then in
    chunks of TR rows through x_t (q_t), which L2 serves in the major the stores want; a
    transpose of the FP8 tile in registers instead ran 3-6% slower on an H100. 2-D (FLAT) tiles:
    on (TR, 1, 128) tiles this kernel ran 1.7x slower at its winning config."""
    col_tiles = ct.cdiv(x.shape[1], BLOCK)
    for t in range(ct.bid(0), ct.cdiv(x.shape[0], BLOCK) * col_tiles, ct.num_blocks(0)):
        r = t // col_tiles
        c = t % col_tiles
        scale = _quantize_block_chunks(x, q, r, c, fp8_max, TR, 1, 0, True)
        first, chunks = _block_chunks(x.shape[1], c, TR)
        for i in range(chunks):
            tile = _block_tile(x_t, first + i, r, TR, 1, 0, True)
            _store_block_tile(q_t, tile, scale, fp8_max, first + i, r, TR, 1)
        ct.store(s, (r, c), scale)
        ct.store(s_t, (c, r), scale)


@ct.kernel
def amax_kernel(x, amax_bits, TR: ct.Constant[int], TC: ct.Constant[int]):
    """Tensorwise, first launch: amax_bits[0] = max over x of |x|, as the int32 bits of the
    float32 (cuTile has no float atomic max; for floats >= 0, NaN included, the bit patterns
    order as the values). amax_bits starts at 0 (= +0.0). Each CTA strides over (TR, TC) tiles
    (a persistent grid) keeping an elementwise running max, reduces it once and takes one atomic
    max: max is exact and order-free, so the result does not depend on the grid."""
    col_tiles = ct.cdiv(x.shape[1], TC)
    m = ct.zeros((TR, TC), ct.float32)
    for t in range(ct.bid(0), ct.cdiv(x.shape[0], TR) * col_tiles, ct.num_blocks(0)):
        xt = ct.load(x, (t // col_tiles, t % col_tiles), (TR, TC), padding_mode=ZERO)
        m = ct.maximum(m, ct.abs(xt.astype(ct.float32)), propagate_nan=True)
    ct.atomic_max(amax_bits, 0, ct.bitcast(ct.max(m, propagate_nan=True), ct.int32))


@ct.kernel
def quantize_tensor_kernel(x, amax_bits, q, s, fp8_max, TR: ct.Constant[int],
                           TC: ct.Constant[int]):
    """Tensorwise, second launch: one scale from amax_bits; each CTA strides over (TR, TC) tiles
    (a persistent grid); CTA 0 writes the scale to s (1,). Each CTA also keeps the row maxima of
    the tiles it reads and takes an atomic max of them into amax_bits, which changes nothing
    (no tile's max exceeds the tensor's): tileiras 13.4 builds this loop with TMA loads and
    stores only when it holds a reduction, and with plain LDG/STG without one. On an H200 the
    plain-load build's best entry ran 1.09x slower than this build's (58.8 against 53.7 us at
    16384x4096 bf16), its former default 1.28x (references/kernel-type-templates.md)."""
    scale = _fp8_scale(ct.bitcast(ct.gather(amax_bits, 0), ct.float32), fp8_max)
    col_tiles = ct.cdiv(x.shape[1], TC)
    seen = ct.zeros((TR, 1), ct.float32)
    for t in range(ct.bid(0), ct.cdiv(x.shape[0], TR) * col_tiles, ct.num_blocks(0)):
        r = t // col_tiles
        c = t % col_tiles
        xt = ct.load(x, (r, c), (TR, TC), padding_mode=ZERO).astype(ct.float32)
        seen = ct.maximum(seen, _abs_max(xt, 1), propagate_nan=True)
        ct.store(q, (r, c), _fp8_cast(xt, scale, fp8_max, q.dtype))
    ct.atomic_max(amax_bits, 0, ct.bitcast(ct.max(seen, propagate_nan=True), ct.int32))
    if ct.bid(0) == 0:
        ct.scatter(s, 0, scale)


# ---------------------------------------------------------------------------------------------
# GEMM configs: each sm_90 space holds only tiles whose sm_90 SASS (tileiras 13.4) keeps the
# accumulators in registers without spilling; the defaults are a safe middle, and the first H100
# searches beat them by 1.1x (rowwise) and 1.5x (block) at 4096^3 (BENCHMARKS.md). The spill
# pattern depends on the accumulation mode: exact accumulation (use_fast_acc=False) keeps a second
# float32 tile for its own promotion, so exact-mode 128x256 / 256x128 tiles per CTA, 4-warp 128x128
# and 4-warp occupancy-2 128x128 spill while fast mode does not. Each mode therefore has its own
# space (the mode is in the key: a search never mixes them). K tiles are 128 fp8 elements (128-byte
# rows), so exact mode promotes every 128 products, as torch._scaled_mm does (equal bf16 outputs on
# an H100). Block scaling's K tile is the block and has one mode (below).
# The last field, latency (absent in most rows: no hint), is the operand loads' latency hint,
# which sets the depth of the sm_90 TMA ring (fast 128x256: 215 KB of shared memory without,
# 231 KB at 6; exact 128x256 clusters: 75 KB without, 231 KB at 6).
# Per config on an H100, rowwise fast at 6 against no hint: 128x256 1.03-1.05x at 4096^3 and
# 8192^3 and 0.98x / 1.04x (one CTA per tile / persistent) at 16384x4096x14336, where the
# 256x256 cluster wins; 256x128 1.05-1.10x on all three. Those rows carry it. Exact mode gained
# at neither 6 nor 10: its rows have none.

FIELDS = ("tm", "tn", "tk", "occupancy", "num_ctas", "num_worker_warps", "persistent", "latency")
# One table for both modes: the last column names the spaces that hold the entry.
SM90_GEMM = [
    (128, 128, 128, 1, 1, 8, False, "exact fast"),      # the default of both
    (128, 128, 128, 1, 1, 8, True, "exact fast"),
    (256, 128, 128, 1, 2, 8, False, "exact"),           # a 2-CTA cluster of 8-warp CTAs
    (256, 128, 128, 1, 2, 8, True, "exact"),
    (128, 256, 128, 1, 2, 8, False, "exact"),
    (64, 256, 128, 1, 1, 8, False, "exact"),
    (64, 128, 128, 1, 1, None, False, "exact fast"),
    (64, 128, 128, 2, 1, None, True, "exact fast"),
    (128, 64, 128, 2, 1, None, False, "exact"),
    (64, 64, 128, 2, 1, None, False, "exact fast"),
    (128, 128, 128, 2, 1, None, False, "fast"),
    (128, 256, 128, 1, 1, 8, False, 6, "fast"),         # 6: the latency field (above)
    (128, 256, 128, 1, 1, 8, True, 6, "fast"),
    (256, 128, 128, 1, 1, 8, True, 6, "fast"),
    (256, 256, 128, 1, 2, 8, False, "fast"),            # 128x256 per CTA, pairs in a cluster
    (256, 256, 128, 1, 2, 8, True, "fast"),
    (64, 256, 128, 1, 1, None, False, "fast"),
]
SM90_EXACT = [r[:-1] for r in SM90_GEMM if "exact" in r[-1].split()]
SM90_FAST = [r[:-1] for r in SM90_GEMM if "fast" in r[-1].split()]
# Skinny keys (M <= SKINNY_ROWS) stream B: a deeper TMA ring per CTA pays there. Fast mode takes
# a 256-element K tile (its accumulation has no promotion boundary to keep); exact mode keeps
# K 128 and deepens the ring with the latency hint. H200, per config in turns with
# torch._scaled_mm at 128x4096x4096 and 128x4096x14336: fast 64x64x256 1.10-1.23x the space's
# best before it, exact 64x64x128 at latency 6 1.02-1.15x; at M 16 neither gained. Exact mode
# also takes 64x32x128 (twice the CTAs streaming B): 1.08x the space's best at 64x4096x4096; at
# M 16 and 128 and with fast accumulation it did not lead (references/kernel-type-templates.md).
SKINNY_ROWS = 128
SM90_SKINNY = [(64, 64, 256, 1, 1, None, False, "fast"),
               (64, 64, 128, 1, 1, None, False, 6, "exact"),
               (64, 32, 128, 1, 1, None, False, 4, "exact")]
# Split-K (sm_90), on matmul's terms (SPLITK_* there): SPLIT CTAs share each output tile's K
# tiles and write float32 partials that a second kernel sums (fp8_splitk_sum_kernel, which also
# scales them; block scaling's partials are scaled already and matmul's launch_splitk_sum
# sums them). Only where output tiles are few (at M 16 and N 4096 a whole-K grid has 32-64 CTAs
# for 132 SMs).
SPLITK_FIELDS = ("tm", "tn", "tk", "split")
SM90_SPLITK = [(64, 64, 128, 2), (64, 64, 128, 4), (64, 128, 128, 2), (64, 128, 128, 4)]
# Block spaces have one more field, overlap: the next block's product is issued before the
# current one is scaled into the accumulator (_block_scaled_tile), keeping a third float32 tile
# live, which the sm_90 SASS of these entries holds without spilling (168 registers at 8
# warps). Exact mode, per config on an H100 (4096^3, 8192^3, 16384x4096x14336 and its
# transpose, 128x4096x4096; BENCHMARKS.md): with 128x128 weight scales the overlapped 128x128
# (alone or as a 2-CTA cluster) won every large key, 1.6-1.7x the same tile without overlap;
# with per-column weight scales (1x128 x 1x128, the weight gradient's pairing) overlap did not
# help and 64x128 at occupancy 2 won; 64x64 won at 128 rows. 4-warp 128x64 and 64x128 at
# occupancy 1, 128x256 clusters and overlapped 64x256 never came within 10%: left out.
# Block scaling has one accumulation mode: every block's product starts from zero, so the
# tensor cores sum at most 128 products before the float32 promotion whichever mode is asked
# (exact mode's own promotion falls on the same boundary; the sm_90 SASS is four chained
# QGMMAs per block either way). Fast mode's code waited on every QGMMA and spilled at 8-warp
# 128x128, 1.2-1.5x slower than this space on an H100, so fast_accum=True runs this space.
# The last field, latency, is the operand loads' hint (absent: none). At 6 the sm_90 TMA ring
# holds more stages and the per-row scales become plain loads issued six blocks ahead; on an
# H200 the overlapped 128x128 gained 3-17% at 8192^3, 16384x4096x14336 and 128x4096x4096 and
# lost 1.5% at 4096^3. Its ceiling is the compiler's: each block's QGMMAs are waited on as
# soon as issued (WARPGROUP.DEPBAR 0), so a warpgroup's promotion never runs under its own
# next product; with no scales at all (acc + part) the overlapped 128x128 reached only
# 0.76-0.86x torch._scaled_mm (references/kernel-type-templates.md). The overlapped 128x128 on
# a persistent grid is left out: it spilled 80 bytes on sm_90, its local loads and stores among
# the QGMMAs (tileiras 13.4 and 13.5).
BLOCK_FIELDS = FIELDS[:-1] + ("overlap", "latency")
SM90_BLOCK = [
    (128, 128, 128, 1, 1, 8, False, True),     # the default
    (256, 128, 128, 1, 2, 8, False, True),     # 128x128 per CTA, pairs in a cluster
    (128, 128, 128, 1, 1, 8, False, False),
    (256, 128, 128, 1, 2, 8, True, False),
    (64, 256, 128, 1, 1, 8, False, False),
    (64, 128, 128, 2, 1, None, True, False),
    (64, 64, 128, 2, 1, None, False, False),
    (128, 128, 128, 1, 1, 8, False, True, 6),
    (256, 128, 128, 1, 2, 8, False, True, 6),
]
# sm_100 (compile-checked only; cuTile ignores use_fast_acc there, so one space serves both
# modes): accumulators live in tensor memory; 4-warp tiles and a 4-warp cluster.
SM100_SPACE = [(128, 128, 128, 1, 1, None, False), (128, 128, 128, 1, 1, None, True),
               (128, 256, 128, 1, 1, None, False), (256, 256, 128, 1, 2, None, False),
               (64, 128, 128, 2, 1, None, True), (64, 64, 128, 2, 1, None, False)]
SM100_BLOCK_SPACE = [(*r, False) for r in (
    (128, 128, 128, 1, 1, None, False), (128, 128, 128, 1, 1, None, True),
    (256, 128, 128, 1, 2, None, False), (64, 128, 128, 2, 1, None, True),
    (64, 64, 128, 2, 1, None, False))]
# Anything else cuTile takes fp8 on (sm_12x: less shared memory, no wgmma): a conservative pair.
OTHER_SPACE = [(128, 128, 128, 1, 1, None, False), (64, 128, 128, 1, 1, None, False)]


def _gemm_space(arch, m, sm90, sm100, other=OTHER_SPACE):
    """The arch's table; tiles taller than the rows there are (next power of two, at least 64)
    are mostly padding and are left out, except the default."""
    mj = major(arch)
    rows = sm90 if mj == 9 else sm100 if mj == 10 else other
    tall = max(64, next_pow2(m))
    return [r for i, r in enumerate(rows) if i == 0 or r[0] <= tall]


def fp8_configs(arch, m, n, k, fast=False):
    """The tensorwise / rowwise space for (m, k) @ (k, n) on `arch` in one accumulation mode
    (fast: use_fast_acc), default first."""
    rows = _gemm_space(arch, m, SM90_FAST if fast else SM90_EXACT, SM100_SPACE)
    if major(arch) == 9 and m <= SKINNY_ROWS:      # the last column names the modes, as above
        mode = "fast" if fast else "exact"
        rows += [r[:-1] for r in SM90_SKINNY if mode in r[-1].split()]
    yield from table(FIELDS, rows, group_m=8)
    if major(arch) == 9:
        yield from _splitk_table(m, n, k)


def _splitk_table(m, n, k, **common):
    """SM90_SPLITK's entries that fit the key (matmul's bounds)."""
    return table(SPLITK_FIELDS, splitk_rows(SM90_SPLITK, m, n, k),
                 occupancy=1, num_ctas=1, group_m=8, persistent=False, **common)


def fp8_block_configs(arch, m, n, k):
    """The block-scaling space, default first (tk is the block, 128); one for both modes.
    sm_90 keys with few output tiles also search split-K (the same entries and bounds as
    fp8_configs': each split takes whole blocks)."""
    yield from table(BLOCK_FIELDS, _gemm_space(arch, m, SM90_BLOCK, SM100_BLOCK_SPACE,
                                               [(*r, False) for r in OTHER_SPACE]), group_m=8)
    if major(arch) == 9:
        yield from _splitk_table(m, n, k, overlap=False)


# ---------------------------------------------------------------------------------------------
# Quantizer configs: memory-bound tiles of 2-16k elements on persistent grids (SMs x occupancy
# CTAs striding over the tiles), occupancy and worker warps searched; the default first.

# Two-pass transposed-view entries of the rowwise space left out for their builds: a cold search
# waits for its slowest build (references/hardware-constraints.md). tileiras 13.4 builds the
# first in 15-19 s (16.2 s of search at 16384x4096 on an H100), the second in 2.7 s on a 2-core
# CPU host, where the rest build in 0.6-2.0 s. Neither reached the final round at any H100 key
# timed: the first at 16384x4096 and 4096x14336, the second at those and at 8192x8192,
# 2048x7168 and 32768x2048 (1.10-1.92x the best entry's time).
SLOW_COL_BUILDS = (dict(tr=16, tc=512, num_worker_warps=4, occupancy=4),
                   dict(tr=16, tc=1024, num_worker_warps=4, occupancy=2))


def row_configs(arch, m, k, col=False):
    """(tr, tc, one_pass, occupancy, num_worker_warps): TR rows x TC columns per tile; one_pass
    where a row fits one tile (read once), else each row is read twice in TC-wide chunks. col: x
    is the transposed view of a row-major tensor, whose contiguous dim is the tile's rows: tiles
    16-32 rows tall (32-64 contiguous bytes; taller ones ran 2-3x slower on an H200). Persistent
    CTAs at occupancy 2-4 ran 1.5-2.5x faster than one CTA per tile. One-pass tiles won with 8
    warps on every H100 and H200 key while the cast held an IEEE division per element; with the
    one-reciprocal cast 4 warps at occupancy 2 ran within 3% of the best 8-warp entry either
    way on an H200 (16384x4096: 2 x 4096 54.6 against 56.3 us; 4096x14336: 1 x 16384 50.7
    against 49.6) and at occupancy 4 up to 1.3x slower, so one-pass tiles add 4 warps at
    occupancy 2 only. Two-pass row-major keys add 1 x 2048 at 4 warps and occupancy 8 (32
    registers, no spill, 27 KB of shared memory a CTA; at 8 the other two-pass tiles spill or
    need more shared memory than 8 CTAs have, except 2 x 2048 at 8 warps, not timed there).
    With the IEEE division per element it led the space at K 14336 on an H200; with the
    one-reciprocal cast the one-pass 1 x 16384 tile at occupancy 2 runs at K 14336 1.35x
    faster than it (references/kernel-type-templates.md), so it serves rows past 16384 columns.
    The transposed view leaves out two of its two-pass entries for their builds
    (SLOW_COL_BUILDS)."""
    whole = next_pow2(k)
    if col:
        tiles = [(32, 256), (16, 512), (32, 512), (16, 1024)]
    elif whole <= 16384:
        tiles = sorted({(max(1, e // whole), whole) for e in (4096, 8192, 16384)})
        tiles += [(1, 2048), (2, 2048), (4, 1024)] if whole > 8192 else []
    else:                        # two passes
        tiles = [(1, 2048), (2, 2048), (1, 4096), (4, 1024), (2, 4096)]
    shapes = [dict(tr=tr, tc=tc, one_pass=k <= tc, num_worker_warps=w) for tr, tc in tiles
              for w in ((8,) if k <= tc and not col else (8, 4))]
    # (16k-element tiles hold 64 floats a thread at 8 warps: occupancy 2 leaves them registers)
    first = shapes[0] if col or k <= tiles[0][1] else shapes[1]      # two-pass: 4 warps
    default = SimpleNamespace(**first, occupancy=2 if first["tr"] * first["tc"] >= 16384 else 4)
    yield from (c for c in product(default, tiles=shapes, occupancy=(2, 4))
                if not (col and any(vars(c) == {**slow, "one_pass": False}
                                    for slow in SLOW_COL_BUILDS)))
    for shape in shapes:
        if shape["one_pass"] and not col:
            yield SimpleNamespace(**{**shape, "num_worker_warps": 4}, occupancy=2)
    if not col and any(not shape["one_pass"] for shape in shapes):
        yield SimpleNamespace(tr=1, tc=2048, one_pass=False, num_worker_warps=4, occupancy=8)


def block1x128_configs(arch, m, k, col=False):
    """(tr, g, occupancy, num_worker_warps): TR rows x G blocks of 128 columns per tile, on a
    persistent grid (as the rowwise quantizer). Row-major x: 4 warps at occupancy 4 and 8 warps
    at occupancy 2, 16 x 256 at 4 warps first: with the one-reciprocal cast on an H200
    (16384x4096 and 4096x14336 bf16, every tile at 4 and 8 warps and occupancy 2-8, in turns) 4
    warps at occupancy 4 ran 55.1-56.0 and 48.9-49.5 us at its three best tiles, 8 warps at
    occupancy 2 56.5-57.6 and 50.4-51.1, and 8 warps at occupancy 4 (the H100's winners under
    the IEEE division) 1.2x slower. col: x is a transposed view (its rows are contiguous): tiles
    16-64 rows tall, 4 or 8 warps; 32 x 128 with 4 warps won by 1.6x on an H100."""
    blocks = cdiv(k, BLOCK)
    if col:
        rows = [(32, 1), (16, 2), (16, 4), (64, 1)]
        default = SimpleNamespace(tr=32, g=1, occupancy=4, num_worker_warps=4)
        yield from product(default, tiles=[dict(tr=tr, g=g) for tr, g in rows if g <= blocks],
                           occupancy=(2, 4), num_worker_warps=(4, 8))
    else:
        rows = [(16, 2), (8, 4), (32, 1), (4, 8), (16, 4), (64, 1)]
        default = SimpleNamespace(tr=16, g=2, occupancy=4, num_worker_warps=4)
        yield from product(default, tiles=[dict(tr=tr, g=g) for tr, g in rows if g <= blocks],
                           hints=[dict(occupancy=4, num_worker_warps=4),
                                  dict(occupancy=2, num_worker_warps=8)])


def block128x128_configs(arch, m, k, col=False):
    """(tr, g, occupancy, num_worker_warps, latency, flat): tiles of 128 rows x G blocks of 128
    columns on a persistent grid (as the rowwise and 1x128 quantizers). tr 128 reads the tile
    once: 16k floats at 8 warps, occupancy 2 (the rowwise quantizer's rule for 16k tiles); tr 32
    or 64 read it twice in chunks of tr rows, which leaves registers for occupancy 4 or 4 warps
    (searched, as for the rowwise quantizer, only on those two-pass tiles). col: x is a
    transposed view (its rows are contiguous): chunks 16-32 rows tall first, 32 rows at 4 warps
    as the 1x128 quantizer's transposed winner. G = 2 (256 float32 columns per row of the tile)
    compiled 5x slower and is left out. latency (0: no hint) is the chunk loads' hint: on an
    H100 (16384x4096 transposed view) 32-row chunks at 8 warps, occupancy 4 ran 1.23x faster at
    8 (108.6 against 133.8 us) and no faster at 2 or 4; the other chunk shapes gained at most 8%
    (64 rows, 4 warps) or lost up to 15% at 8, and the row-major tiles lost at 8. flat: the
    kernel's tiles are 2-D (TR, 128) rather than (TR, 1, 128): on an H100 (16384x4096 and
    4096x14336, every config in turns) the row-major space ran 1.16x faster at its winner (whole
    blocks, 82.1 against 95.1 us and 72.7 against 84.5) and 1.08-2.1x at every other entry; on
    the transposed view 2-D tiles were 0-20% slower and did not take the latency hint (137.7
    against 107.5 us at the hinted entry), so that space keeps the 3-D form."""
    if col:
        rows = [(32, 4, 4), (16, 4, 4), (32, 4, 8), (32, 4, 8, 8), (64, 2, 4), (64, 2, 8),
                (128, 2, 8)]
    else:
        rows = [(128, 2, 8), (64, 2, 8), (64, 4, 8), (32, 2, 8), (32, 4, 8), (32, 4, 4),
                (64, 2, 4)]
    yield from table(("tr", "occupancy", "num_worker_warps", "latency"), rows, g=1, latency=0,
                     flat=not col)


def pair_configs(arch, m, k):
    """(tr, occupancy, num_worker_warps) of the 128x128 quantize-and-transpose: chunks of tr
    rows, each block read through both majors. On an H100 (16384x4096 and 4096x14336 bf16) 32-row
    chunks at 8 warps and occupancy 2 ran 1.15x two quantize_fp8 calls; 64 rows 1.10-1.11x; 4
    warps at occupancy 4 1.07-1.08x; whole 128-row blocks 0.91x, so they are not searched.
    (The two calls then ran on (TR, 1, 128) tiles, 178-200 us; since the 128x128 quantizer's
    row-major tiles are 2-D the pair runs 1.08x them.)"""
    yield from table(("tr", "occupancy", "num_worker_warps"),
                     [(32, 2, 8), (64, 2, 8), (32, 4, 4), (64, 4, 4)])


def _flat_tiles(k, rows):
    """A tensorwise space from (tr, tc, occupancy, num_worker_warps) rows, the default first:
    the default and each tile no wider than the row (next power of two, at least 128), then 32 x
    128 with 4 warps at occupancy 4 for transposed views (the 1x128 quantizer's transposed
    winner)."""
    whole = max(next_pow2(k), 128)
    fields = ("tr", "tc", "occupancy", "num_worker_warps")
    yield from table(fields, [rows[0]] + [r for r in rows[1:] if r[1] <= whole])
    if (32, 128, 4, 4) not in rows:
        yield SimpleNamespace(tr=32, tc=128, occupancy=4, num_worker_warps=4)


def tensor_configs(arch, m, k):
    """(tr, tc, occupancy, num_worker_warps) of the tensorwise quantize launch, on a persistent
    grid: 4-8k-element tiles, 4 warps at occupancy 4 first. On an H200 (16384x4096 and
    4096x14336 bf16, every tile at 4 and 8 warps and occupancy 2-8, in turns) the eight entries
    below ran 53.7-56.2 and 48.2-51.2 us; 8 warps at occupancy 2 and 8k-element tiles at 4 warps
    and occupancy 8 ran 1.1-1.7x slower."""
    yield from _flat_tiles(k, [(64, 128, 4, 4), (16, 512, 4, 4), (32, 256, 4, 4), (16, 256, 8, 4),
                               (8, 512, 8, 4), (64, 128, 4, 8), (32, 256, 4, 8), (16, 512, 4, 8)])


def amax_configs(arch, m, k):
    """(tr, tc, occupancy, num_worker_warps) of the tensorwise amax launch, on a persistent grid.
    A CTA keeps a running max as large as its tile: an 8k-element tile holds 64 floats a thread
    at 4 warps, 32 at 8. On an H200 (16384x4096 and 4096x14336 bf16, six tiles, in turns) 4
    warps at occupancy 4 led at every tile (36.1-39.3 and 32.2-36.0 us); the same tiles ran
    1.02-1.20x slower at 8 warps, 1.15-1.29x at occupancy 2 and about 2.9x at occupancy 8."""
    yield from _flat_tiles(k, [(8, 1024, 4, 4), (128, 64, 4, 4), (16, 512, 4, 4), (64, 128, 4, 4),
                               (128, 64, 4, 8), (16, 512, 2, 4), (64, 128, 4, 8)])


# ---------------------------------------------------------------------------------------------
# Launch. GEMM inputs: a (M, K), b (K, N), sa, sb, c (M, N), then the constants the key holds:
# fast (use_fast_acc), widen (mixed fp8 formats) and, for block scaling, the rows / columns per
# scale of a and b.

def _grid(cfg, dev, a, b, sa, sb, c, *flags):
    grid = tile_grid(cfg, dev, a.shape[0], b.shape[1])
    return (*grid, split_of(cfg)) if split_of(cfg) > 1 else grid


def _args(cfg, a, b, sa, sb, c, fast, widen, w=None):
    """cfg's kernel writes c, or for split-K the partials w."""
    if split_of(cfg) > 1:
        return (a, b, w, cfg.tm, cfg.tn, cfg.tk, cfg.group_m, fast, widen,
                getattr(cfg, "latency", 0), split_of(cfg))
    return (a, b, sa, sb, c, cfg.tm, cfg.tn, cfg.tk, cfg.group_m, fast, widen,
            getattr(cfg, "latency", 0), cfg.persistent)


def _scaled_kernel(cfg):
    return fp8_mm_splitk_kernel if split_of(cfg) > 1 else fp8_mm_kernel


def _splitk_scratch(cfg, dev, a, b, sa, sb, c, *flags):
    """Split-K's float32 partials; None (no buffer) for whole-K configs."""
    if split_of(cfg) == 1:
        return None
    return (split_of(cfg), a.shape[0], b.shape[1]), torch.float32


def _sum_grid(c):
    return (cdiv(c.shape[0], SUM_TILE[0]) * cdiv(c.shape[1], SUM_TILE[1]),)


def _scaled_run(cfg, kernel, stream, dev, a, b, sa, sb, c, fast, widen, w):
    """cfg's kernel, then for split-K the partials' scaled sum into c (in a fixed order)."""
    ct.launch(stream, _grid(cfg, dev, a, b, sa, sb, c), kernel,
              _args(cfg, a, b, sa, sb, c, fast, widen, w))
    if split_of(cfg) > 1:
        ct.launch(stream, _sum_grid(c), fp8_splitk_sum_kernel,
                  (w, sa, sb, c, *SUM_TILE, split_of(cfg)))


def _block_args(cfg, a, b, sa, sb, c, fast, widen, a_group, b_group, w=None):
    """cfg's kernel writes c, or for split-K the partials w."""
    if split_of(cfg) > 1:
        return (a, b, sa, sb, w, cfg.tm, cfg.tn, cfg.group_m, a_group, b_group, fast, widen,
                getattr(cfg, "latency", 0), split_of(cfg))
    return (a, b, sa, sb, c, cfg.tm, cfg.tn, cfg.group_m, a_group, b_group, fast, widen,
            getattr(cfg, "overlap", False), getattr(cfg, "latency", 0), cfg.persistent)


def _block_kernel(cfg):
    return fp8_mm_block_splitk_kernel if split_of(cfg) > 1 else fp8_mm_block_kernel


def _block_run(cfg, kernel, stream, dev, a, b, sa, sb, c, fast, widen, a_group, b_group, w):
    """cfg's kernel, then for split-K the partials' sum into c (in a fixed order; the scales
    are already in them)."""
    ct.launch(stream, _grid(cfg, dev, a, b, sa, sb, c), kernel,
              _block_args(cfg, a, b, sa, sb, c, fast, widen, a_group, b_group, w))
    if split_of(cfg) > 1:
        launch_splitk_sum(stream, split_of(cfg), c, w)


def _gemm_work(a, b, sa, sb, c, *flags):
    return Work(flops=2.0 * a.shape[0] * a.shape[1] * b.shape[1])


def _gemm_space_args(a, b, sa, sb, c, fast, *rest):
    return dict(m=bucket(a.shape[0]), n=b.shape[1], k=a.shape[1], fast=fast)


def _block_space_args(a, b, sa, sb, c, *rest):
    return dict(m=bucket(a.shape[0]), n=b.shape[1], k=a.shape[1])


_DEFAULT = SimpleNamespace(tm=128, tn=128, tk=128, occupancy=1, num_ctas=1, persistent=False,
                           group_m=8)
_scaled_tuner = Autotuner("fp8_mm", _scaled_kernel, fp8_configs, default=_DEFAULT,
                          space=_gemm_space_args, grid=_grid, args=_args, work=_gemm_work,
                          scratch=_splitk_scratch, run=_scaled_run, tune_key=bucketed(1),
                          partly_timed=lambda cfg: split_of(cfg) > 1)   # the sum: final round
_block_tuner = Autotuner("fp8_mm_block", _block_kernel, fp8_block_configs,
                         default=_DEFAULT, space=_block_space_args, grid=_grid, args=_block_args,
                         work=_gemm_work, scratch=_splitk_scratch, run=_block_run,
                         tune_key=bucketed(3), partly_timed=lambda cfg: split_of(cfg) > 1)


# Quantizer inputs: x, q, scales (and amax bits for tensorwise), fp8_max. Launch keys:
# (granularity, M, K, ...); tuning buckets M.
_BY_ROWS = bucketed(1)

def _quant_space(x, *rest):
    return dict(m=bucket(x.shape[0]), k=x.shape[1])


def _layout_space(x, *rest):
    """The rowwise and block spaces differ for a transposed view (contiguous columns): read
    from the layout the launch key holds, so that one key has one space (a (1, K) row of unit
    strides is a row-major x, whatever its size-1 dim's stride)."""
    return dict(m=bucket(x.shape[0]), k=x.shape[1], col=layout(x) == "col" and x.shape[1] > 1)


def _quant_work(x, q, *rest):
    return Work(bytes=float(x.numel() * (x.element_size() + 1)))


def _tile_grid(cfg, dev, x, *rest):
    tiles = cdiv(x.shape[0], cfg.tr) * cdiv(x.shape[1], cfg.tc)
    return (persistent_ctas(tiles, dev, cfg.occupancy),)


def _row_grid(cfg, dev, x, q, s, fp8_max):
    return (persistent_ctas(cdiv(x.shape[0], cfg.tr), dev, cfg.occupancy),)


def _row_args(cfg, x, q, s, fp8_max):
    return (x, q, s, fp8_max, cfg.tr, cfg.tc, cfg.one_pass)


def _1x128_grid(cfg, dev, x, q, s_t, fp8_max):
    tiles = cdiv(x.shape[0], cfg.tr) * cdiv(x.shape[1], cfg.g * BLOCK)
    return (persistent_ctas(tiles, dev, cfg.occupancy),)


def _1x128_args(cfg, x, q, s_t, fp8_max):
    return (x, q, s_t, fp8_max, cfg.tr, cfg.g)


def _128x128_grid(cfg, dev, x, q, s, fp8_max):
    tiles = cdiv(x.shape[0], BLOCK) * cdiv(x.shape[1], cfg.g * BLOCK)
    return (persistent_ctas(tiles, dev, cfg.occupancy),)


def _128x128_args(cfg, x, q, s, fp8_max):
    return (x, q, s, fp8_max, cfg.tr, cfg.g, cfg.latency, cfg.flat)


def _pair_grid(cfg, dev, x, *rest):
    tiles = cdiv(x.shape[0], BLOCK) * cdiv(x.shape[1], BLOCK)
    return (persistent_ctas(tiles, dev, cfg.occupancy),)


def _pair_args(cfg, x, x_t, q, s, q_t, s_t, fp8_max):
    return (x, x_t, q, s, q_t, s_t, fp8_max, cfg.tr)


def _amax_args(cfg, x, bits):
    return (x, bits, cfg.tr, cfg.tc)


def _tensor_args(cfg, x, bits, q, s, fp8_max):
    return (x, bits, q, s, fp8_max, cfg.tr, cfg.tc)


_quantize_row = Autotuner("quantize_fp8_row", quantize_rows_kernel, row_configs,
                          default=SimpleNamespace(tr=4, tc=1024, one_pass=False, occupancy=2,
                                                  num_worker_warps=4),
                          space=_layout_space, grid=_row_grid, args=_row_args, work=_quant_work,
                          tune_key=_BY_ROWS)
_quantize_1x128 = Autotuner("quantize_fp8_1x128", quantize_1x128_kernel, block1x128_configs,
                            default=SimpleNamespace(tr=16, g=2, occupancy=4,
                                                    num_worker_warps=4), space=_layout_space,
                            grid=_1x128_grid, args=_1x128_args, work=_quant_work,
                            tune_key=_BY_ROWS)
_quantize_128x128 = Autotuner("quantize_fp8_128x128", quantize_128x128_kernel,
                              block128x128_configs,
                              default=SimpleNamespace(tr=128, g=1, occupancy=2,
                                                      num_worker_warps=8, latency=0, flat=True),
                              space=_layout_space, grid=_128x128_grid, args=_128x128_args,
                              work=_quant_work, tune_key=_BY_ROWS)
# x is read once and both FP8 tensors written: 2 bytes an element more than x's
_quantize_pair = Autotuner("quantize_fp8_128x128_pair", quantize_128x128_pair_kernel,
                           pair_configs,
                           default=SimpleNamespace(tr=32, occupancy=2, num_worker_warps=8),
                           space=_quant_space, grid=_pair_grid, args=_pair_args,
                           work=lambda x, *rest: Work(bytes=float(x.numel() *
                                                                  (x.element_size() + 2))),
                           tune_key=_BY_ROWS)
# The amax launch accumulates with an atomic max, which a search may repeat: max is idempotent.
_tensor_amax = Autotuner("quantize_fp8_amax", amax_kernel, amax_configs,
                         default=SimpleNamespace(tr=8, tc=1024, occupancy=4, num_worker_warps=4),
                         space=_quant_space, grid=_tile_grid, args=_amax_args, tune_key=_BY_ROWS,
                         work=lambda x, bits: Work(bytes=float(x.numel() * x.element_size())))
_quantize_tensor = Autotuner("quantize_fp8_tensor", quantize_tensor_kernel, tensor_configs,
                             default=SimpleNamespace(tr=64, tc=128, occupancy=4,
                                                     num_worker_warps=4),
                             space=_quant_space, grid=_tile_grid, args=_tensor_args,
                             work=_quant_work, tune_key=_BY_ROWS)
# the quantizers with a space per layout of x (_layout_space)
LAYOUT_TUNERS = (_quantize_row, _quantize_1x128, _quantize_128x128)
TUNERS = (_scaled_tuner, _block_tuner, _quantize_row, _quantize_1x128, _quantize_128x128,
          _quantize_pair, _tensor_amax, _quantize_tensor)


def launch(mode, a, b, sa, sb, c, fast, a_group=1, b_group=1):
    """c = a @ b scaled (a (M, K) row-major, b (K, N) either major). mode "row": sa (M, 1) or
    (M,) and sb (1, N) or (N,); "tensor": one element each, 0-D, (1,) or (1, 1) (each shape a
    JIT specialization of the key's kernel); "block": the 2-D scales with a_group / b_group rows /
    columns per scale. fast: use_fast_acc (off where the formats differ: the float16 path has
    none). The key holds the mode, M (tuning buckets it), N, K, the dtypes, b's layout and fast."""
    widen = a.dtype != b.dtype
    fast = bool(fast) and not widen
    dev = a.get_device()
    M, K = a.shape
    if mode == "block":
        fast = False       # one mode: each block is promoted from zero either way (the space)
        key = ("block", a_group, b_group, M, b.shape[1], K, a.dtype, b.dtype, layout(b), c.dtype,
               fast, dev)
        _block_tuner.launch(key, dev, a, b, sa, sb, c, fast, widen, a_group, b_group)
    else:
        key = (mode, M, b.shape[1], K, a.dtype, b.dtype, layout(b), c.dtype, fast, dev)
        _scaled_tuner.launch(key, dev, a, b, sa, sb, c, fast, widen)


# ---------------------------------------------------------------------------------------------
# Host side: checks in the order types, shapes, dtypes, scales, devices, arch (everything but
# the device can be checked on CPU tensors).

def _scaling(M, N, K, scale_a, scale_b):
    """(mode, a_group, b_group) from the scales' shapes, as torch._scaled_mm reads them (in its
    order: where two modes' shapes coincide, so do their meanings); else a ValueError listing
    the shapes each mode needs."""
    if scale_a.numel() == 1 and scale_b.numel() == 1:
        return "tensor", 1, 1
    kb, mb, nb = cdiv(K, BLOCK), cdiv(M, BLOCK), cdiv(N, BLOCK)
    sa, sb = tuple(scale_a.shape), tuple(scale_b.shape)
    if scale_a.dim() == 2 and scale_b.dim() == 2:
        if sa == (M, 1) and sb == (1, N):
            return "row", 1, 1
        if sa == (M, kb) and sb == (kb, nb):
            return "block", 1, BLOCK
        if sa == (M, kb) and sb == (kb, N):
            return "block", 1, 1
        if sa == (mb, kb) and sb == (kb, N):
            return "block", BLOCK, 1
    raise ValueError(
        f"fp8_mm: scale_a {sa} and scale_b {sb} match no scaling mode for a ({M}, {K}) @ b "
        f"({K}, {N}): tensorwise takes one element each; rowwise ({M}, 1) and (1, {N}); block "
        f"({M}, {kb}) with ({kb}, {nb}) or ({kb}, {N}), or ({mb}, {kb}) with ({kb}, {N})")


_ANY_OPERAND = (*FP8_DTYPES, torch.float32)    # what validate.tensor accepts of all four


def _check(a, b, scale_a, scale_b, out_dtype, fast_accum):
    """The scaling (mode, a_group, b_group), or a TypeError / ValueError naming the argument.
    (Each check reads as little as it can where it passes: this runs on every call.)"""
    tensors = (("a", a), ("b", b), ("scale_a", scale_a), ("scale_b", scale_b))
    for name, t in tensors:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"fp8_mm: {name} must be a torch.Tensor, got {type(t).__name__}")
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"fp8_mm: a and b must be 2-D (a (M, K), b (K, N)), got {a.dim()}-D "
                         f"and {b.dim()}-D")
    a_dtype, b_dtype = a.dtype, b.dtype
    if a_dtype not in FP8_DTYPES:
        validate.dtype("fp8_mm", "a", a, FP8_DTYPES)
    if b_dtype not in FP8_DTYPES:
        validate.dtype("fp8_mm", "b", b, FP8_DTYPES)
    if a_dtype == b_dtype == torch.float8_e5m2:
        raise TypeError("fp8_mm: a and b are both float8_e5m2; e5m2 is allowed for one operand "
                        "only (as torch._scaled_mm)")
    M, K = a.shape
    K_b, N = b.shape
    if K != K_b:
        raise ValueError(f"fp8_mm: inner dims differ: a {tuple(a.shape)} @ b {tuple(b.shape)}")
    if K % 16:
        raise ValueError(f"fp8_mm: K (a.shape[1] = b.shape[0]) must be a multiple of 16, got {K}")
    if scale_a.dtype != torch.float32:
        raise TypeError(f"fp8_mm: scale_a must be float32, got {scale_a.dtype}")
    if scale_b.dtype != torch.float32:
        raise TypeError(f"fp8_mm: scale_b must be float32, got {scale_b.dtype}")
    if out_dtype not in OUT_DTYPES:
        _refuse_non_dtype("fp8_mm", "out_dtype", out_dtype, "bfloat16, float16 or float32")
        raise TypeError(f"fp8_mm: out_dtype {out_dtype} is not supported (bfloat16, float16, "
                        "float32)")
    if not isinstance(fast_accum, bool):
        raise TypeError(f"fp8_mm: fast_accum must be a bool, got {type(fast_accum).__name__}")
    scaling = _scaling(M, N, K, scale_a, scale_b)
    refuse_transforms("fp8_mm")        # (first: under torch.func.grad x requires grad too)
    if records_graph():
        _refuse_grad("fp8_mm", tensors)
    # the dtypes are checked above; where all four are on one CUDA device, four integer reads
    # say so (eagerly: the traced call and any mismatch take the checks that name the argument)
    dev = -1 if tracing() else a.get_device()
    if dev < 0 or not a.is_cuda or b.get_device() != dev or scale_a.get_device() != dev or \
            scale_b.get_device() != dev:
        device = a.device
        for name, t in tensors:
            validate.tensor("fp8_mm", name, t, device=device, dtypes=_ANY_OPERAND)
    return scaling


def _refuse_non_dtype(op, name, value, names):
    """A TypeError where a dtype argument is no torch.dtype: the string "bfloat16" prints as
    the dtype it names, so the refusal of a dtype would read as refusing a supported one."""
    if not isinstance(value, torch.dtype):
        raise TypeError(f"{op}: {name} must be a torch.dtype ({names}), got "
                        f"{type(value).__name__} {value!r}")


def _check_fp8_dtype(op, dtype):
    """The quantizers' output dtype: e4m3 or e5m2, else a TypeError naming `op`."""
    if dtype not in FP8_DTYPES:
        _refuse_non_dtype(op, "dtype", dtype, "float8_e4m3fn or float8_e5m2")
        raise TypeError(f"{op}: dtype must be float8_e4m3fn or float8_e5m2, got {dtype}")


def _refuse_grad(op, tensors):
    """An input that requires grad: ValueError (called where autograd records a graph). The op
    has no gradient (as torch._scaled_mm and a cast to FP8 have none to give): its output would
    silently cut the graph."""
    for name, t in tensors:
        if t.requires_grad:
            raise ValueError(f"{op}: {name} requires grad, but {op} is not differentiable; "
                             "detach it or call under torch.no_grad() or "
                             "torch.inference_mode() (fp8_linear trains with FP8 GEMMs)")


def _check_arch(op, name, t):
    """Below sm_90: ValueError. Checked where the kernels launch (eagerly, or inside the custom
    op under torch.compile, whose trace should not read device properties); once per CUDA
    device (_FP8_DEVICES)."""
    index = t.get_device()
    if index in _FP8_DEVICES:
        return
    arch = device_arch(t.device)
    if major(arch) < 9:
        raise ValueError(f"{op}: FP8 needs compute capability 9.0 or newer (cuTile 1.7 compiles "
                         f"no float8 below sm_90, Ada's sm_89 included); {name} is on "
                         f"{t.device}, {arch}")
    if index >= 0:
        _FP8_DEVICES.add(index)


_FP8_DEVICES = set()       # CUDA device indices _check_arch has found to be sm_90 or newer


def _check_out(out, M, N, out_dtype, a, inputs):
    validate.out("fp8_mm", out, (M, N), out_dtype, a.device, dtype_of="out_dtype",
                 inputs=inputs)


def _operands(a, b):
    """a row-major; b column-major (b_nk.t(), as torch._scaled_mm takes it) or row-major, both
    served in place; any other layout is copied to column-major."""
    if a.stride(1) != 1 and a.shape[1] > 1:
        a = a.contiguous()
    if layout(b) == "strided":
        b = b.t().contiguous().t()
    return a, b


def _scale_arrays(scale_a, scale_b):
    """Tensorwise and rowwise scales as the kernels take them: as they are (0-D to 2-D: no
    views, about 1 us of host time each), a tensorwise scale of more dims as (1,)."""
    if scale_a.dim() > 2:
        scale_a = scale_a.reshape(1)
    if scale_b.dim() > 2:
        scale_b = scale_b.reshape(1)
    return scale_a, scale_b


def _fp8_mm(a, b, scale_a, scale_b, out_dtype, fast_accum, out, scaling):
    _check_arch("fp8_mm", "a", a)
    mode, a_group, b_group = scaling
    M, K = a.shape
    N = b.shape[1]
    c = out if out is not None else a.new_empty(M, N, dtype=out_dtype)
    if c.numel() == 0:
        return c
    if K == 0:
        return c.zero_()
    a, b = _operands(a, b)
    if mode == "block":
        launch("block", a, b, scale_a, scale_b, c, fast_accum, a_group, b_group)
    else:
        sa, sb = _scale_arrays(scale_a, scale_b)
        launch(mode, a, b, sa, sb, c, fast_accum)
    if out is not None:      # written by the kernel: tell autograd that out changed
        torch.autograd.graph.increment_version(out)
    return c


# torch.compile(fullgraph=True) sees one custom op (no gradient: torch._scaled_mm has none).
@torch.library.custom_op("tiletune::fp8_mm", mutates_args=(),
                         schema="(Tensor a, Tensor b, Tensor scale_a, Tensor scale_b, "
                                "ScalarType out_dtype, bool fast_accum) -> Tensor")
def _fp8_mm_op(a, b, scale_a, scale_b, out_dtype, fast_accum):
    scaling = _scaling(a.shape[0], b.shape[1], a.shape[1], scale_a, scale_b)
    return _fp8_mm(a, b, scale_a, scale_b, out_dtype, fast_accum, None, scaling)


@_fp8_mm_op.register_fake
def _(a, b, scale_a, scale_b, out_dtype, fast_accum):
    return a.new_empty((a.shape[0], b.shape[1]), dtype=out_dtype)


def fp8_mm(a, b, scale_a, scale_b, *, out_dtype=torch.bfloat16, fast_accum=False, out=None):
    """torch._scaled_mm's FP8 GEMM: out = (a * scale_a) @ (b * scale_b), float32 accumulation,
    returned in out_dtype (bfloat16, float16 or float32).

    a (M, K) and b (K, N) are float8_e4m3fn, or one of them float8_e5m2 (gradients); two e5m2
    operands are refused, as torch refuses them. A mixed pair is multiplied as float16 (exact
    products, float32 sums) at about half the fp8 rate. K must be a multiple of 16; M and N are
    free. Layouts served without copies: a row-major, b column-major (b_nk.t(), what
    torch._scaled_mm wants) or row-major; a in any other layout is copied to row-major, b to
    column-major.

    The scaling mode comes from the scales' shapes (float32, any strides), as torch reads them:
    tensorwise: one element each; rowwise: scale_a (M, 1), scale_b (1, N); block:
    scale_a (M, cdiv(K, 128)) (DeepSeek's 1x128 activations; M-major as torch wants it, or
    K-major) with scale_b (cdiv(K, 128), cdiv(N, 128)) (128x128 weights) or (cdiv(K, 128), N)
    (1x128), or scale_a (cdiv(M, 128), cdiv(K, 128)) with scale_b (cdiv(K, 128), N). Block
    scaling multiplies each 128-K block's product by its scales in float32 (promotion every
    128 K); a K that is not a multiple of 128 ends in a partial block, zero-padded (the scales
    still have cdiv(K, 128) columns).

    fast_accum: cuTile's `ct.mma(..., use_fast_acc=True)`, Hopper's fast FP8 accumulation
    (the whole K summed in the tensor cores' narrower accumulator, higher throughput), only
    when asked; False promotes the sum into float32 every 128 products, as torch._scaled_mm
    does. The two modes never share a tuning key. It has no effect with block scaling (each
    128-K block is promoted from zero in both modes; torch refuses it there), for a mixed
    e4m3/e5m2 pair (float16 path) or off Hopper (cuTile ignores it there).

    `out`, if given, receives the result: exactly (M, N), out_dtype, on a's device, not
    overlapping an input, not requiring grad where autograd records a graph. Needs compute
    capability 9.0 or newer (ValueError below). Not differentiable, as torch._scaled_mm is not:
    an input that requires grad, where autograd records a graph (grad mode on, outside
    torch.inference_mode()), is a ValueError (its output would cut the graph); a call inside a
    forward-mode AD dual level or a torch.func transform is a TypeError. Works under
    torch.compile(fullgraph=True).

    Against torch._scaled_mm's call: the arguments after the scales are keywords,
    use_fast_accum is spelled fast_accum, out_dtype defaults to bfloat16 (no FP8 output), and
    there is no bias or scale_result (add a bias to the result, or use fp8_linear).
    """
    scaling = _check(a, b, scale_a, scale_b, out_dtype, fast_accum)
    M, N = a.shape[0], b.shape[1]
    if out is not None:
        _check_out(out, M, N, out_dtype, a, {"a": a, "b": b, "scale_a": scale_a,
                                             "scale_b": scale_b})
    if tracing():
        c = _fp8_mm_op(a, b, scale_a, scale_b, out_dtype, fast_accum)
        return c if out is None else out.copy_(c)
    return _fp8_mm(a, b, scale_a, scale_b, out_dtype, fast_accum, out, scaling)


# ---------------------------------------------------------------------------------------------
# Quantizers.

def quantize_fp8_reference(x, granularity="tensor", dtype=torch.float8_e4m3fn):
    """The torch definition quantize_fp8 matches bit for bit: per group (the whole tensor, a
    row, 1x128 or 128x128 elements; partial groups at the edges), amax = max |x| in float32,
    scale = max(amax, 1e-12) / fp8_max, q = clamp(x / scale, -fp8_max, fp8_max) cast to `dtype`
    (round to nearest even). Returns (q, scale) in quantize_fp8's majors, unpadded (quantize_fp8
    pads 1x128 scale columns and 128x128 scale rows to 16 bytes). Divisions are tensor / tensor:
    torch divides a CUDA tensor by a Python number as a multiplication by its reciprocal, which
    is not the same rounding."""
    op = "quantize_fp8_reference"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be 2-D (M, K), got shape {tuple(x.shape)}")
    _check_fp8_dtype(op, dtype)
    fp8_max = torch.finfo(dtype).max
    M, K = x.shape
    xf = x.float()
    if granularity == "tensor":
        amax = xf.abs().amax() if xf.numel() else xf.new_zeros(())
        scale = _reference_scale(amax, fp8_max)
        return _reference_cast(xf, scale, fp8_max, dtype), scale
    if granularity == "row":
        amax = xf.abs().amax(1, keepdim=True) if K else xf.new_zeros((M, 1))
        scale = _reference_scale(amax, fp8_max)
        return _reference_cast(xf, scale, fp8_max, dtype), scale
    kb, mb = cdiv(K, BLOCK), cdiv(M, BLOCK)
    if granularity == "block1x128":
        padded = torch.nn.functional.pad(xf, (0, kb * BLOCK - K))
        amax = padded.view(M, kb, BLOCK).abs().amax(2) if M * kb else xf.new_zeros((M, kb))
        scale = _reference_scale(amax, fp8_max)
        full = scale.repeat_interleave(BLOCK, 1)[:, :K]
        return _reference_cast(xf, full, fp8_max, dtype), scale.t().contiguous().t()
    if granularity == "block128x128":
        padded = torch.nn.functional.pad(xf, (0, kb * BLOCK - K, 0, mb * BLOCK - M))
        amax = (padded.view(mb, BLOCK, kb, BLOCK).abs().amax((1, 3)) if mb * kb
                else xf.new_zeros((mb, kb)))
        scale = _reference_scale(amax, fp8_max)
        full = scale.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[:M, :K]
        return _reference_cast(xf, full, fp8_max, dtype), scale
    raise ValueError(f"quantize_fp8_reference: granularity must be one of {GRANULARITIES}, got "
                     f"{granularity!r}")


def _reference_scale(amax, fp8_max):
    return torch.div(amax.clamp(min=AMAX_EPS), torch.full_like(amax, fp8_max))


def _reference_cast(xf, scale, fp8_max, dtype):
    return torch.div(xf, scale).clamp(-fp8_max, fp8_max).to(dtype)


def _check_quantize(x, granularity, dtype, op="quantize_fp8"):
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{op}: x must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 2:
        raise ValueError(f"{op}: x must be 2-D (M, K), got shape {tuple(x.shape)}")
    if x.dtype not in IN_DTYPES:
        raise TypeError(f"{op}: x dtype {x.dtype} is not supported (bfloat16, float16, float32)")
    if not isinstance(granularity, str):
        raise TypeError(f"{op}: granularity must be a str, got {type(granularity).__name__}")
    if granularity not in GRANULARITIES:
        raise ValueError(f"{op}: granularity must be one of {', '.join(GRANULARITIES)}; "
                         f"got {granularity!r}")
    _check_fp8_dtype(op, dtype)
    validate.tensor(op, "x", x, dtypes=IN_DTYPES)
    refuse_transforms(op)
    if records_graph():
        _refuse_grad(op, (("x", x),))


def _quantize_raw(x, granularity, dtype):
    """(q, scales as stored): tensor (1,), row (M, 1), block1x128 (cdiv(K, 128), M rounded up
    to a multiple of 4) (its transpose is the M-major scale_a), block128x128 (cdiv(M, 128),
    cdiv(K, 128) rounded up to a multiple of 4); block rows are padded to 16 bytes so that
    fp8_mm loads them with TMA (torch._scaled_mm's 128x128 mode needs it too); all fresh,
    contiguous tensors (what a custom op may return)."""
    _check_arch("quantize_fp8", "x", x)
    M, K = x.shape
    fp8_max = float(torch.finfo(dtype).max)
    if x.numel() == 0:            # no kernel: the reference's scales in fresh storage
        q, s = quantize_fp8_reference(x, granularity, dtype)
        storage = x.new_empty(_scale_storage(granularity, M, K), dtype=torch.float32)
        _scales_view(granularity, storage, M, K).copy_(s)
        return q, storage
    dev = x.get_device()
    q = x.new_empty(M, K, dtype=dtype)
    key = (granularity, M, K, x.dtype, layout(x), dtype, dev)
    if granularity == "row":
        s = x.new_empty(M, 1, dtype=torch.float32)
        _quantize_row.launch(key, dev, x, q, s, fp8_max)
    elif granularity == "block1x128":
        s = torch.empty(_scale_storage(granularity, M, K), device=x.device, dtype=torch.float32)
        _quantize_1x128.launch(key, dev, x, q, s[:, :M], fp8_max)
    elif granularity == "block128x128":
        s = torch.empty(_block_scale_storage(M, K), device=x.device, dtype=torch.float32)
        _quantize_128x128.launch(key, dev, x, q, s[:, :cdiv(K, BLOCK)], fp8_max)
    else:
        bits = x.new_zeros(1, dtype=torch.int32)
        s = x.new_empty(1, dtype=torch.float32)
        _tensor_amax.launch(key, dev, x, bits)
        _quantize_tensor.launch(key, dev, x, bits, q, s, fp8_max)
    return q, s


def _block_scale_storage(M, K):
    return (cdiv(M, BLOCK), f32_row(cdiv(K, BLOCK)))


def _scale_storage(granularity, M, K):
    """The shape _quantize_raw stores a granularity's scales in."""
    return {"tensor": (1,), "row": (M, 1), "block1x128": (cdiv(K, BLOCK), f32_row(M)),
            "block128x128": _block_scale_storage(M, K)}[granularity]


def _scales_view(granularity, s, M, K):
    """quantize_fp8's scales from their storage (_quantize_raw)."""
    if granularity == "tensor":
        return s.view(())
    if granularity == "block128x128":
        return s[:, :cdiv(K, BLOCK)]
    return s[:, :M].t() if granularity == "block1x128" else s


@torch.library.custom_op("tiletune::quantize_fp8", mutates_args=(),
                         schema="(Tensor x, str granularity, ScalarType dtype) -> "
                                "(Tensor, Tensor)")
def _quantize_op(x, granularity, dtype):
    return _quantize_raw(x, granularity, dtype)


@_quantize_op.register_fake
def _(x, granularity, dtype):
    M, K = x.shape
    return (x.new_empty((M, K), dtype=dtype),
            x.new_empty(_scale_storage(granularity, M, K), dtype=torch.float32))


def quantize_fp8(x, granularity="tensor", dtype=torch.float8_e4m3fn):
    """(x_fp8, scales): x (M, K) bfloat16/float16/float32, any strides, quantized with current
    scaling in the layouts fp8_mm takes. Per group, scale = max(amax, 1e-12) / fp8_max (a
    dequantization scale: x ~ x_fp8 * scale) and x_fp8 = clamp(x / scale, -fp8_max, fp8_max)
    rounded to nearest even; bit-exact against quantize_fp8_reference (NaN propagates to the
    group's scale as torch's amax propagates it).

    granularity:
      "tensor"        scales () float32: fp8_mm's tensorwise scale for either operand.
      "row"           scales (M, 1): scale_a of a rowwise product; for b quantize the (N, K)
                      weight and pass b = w_fp8.t(), scale_b = scales.t() (1, N).
      "block1x128"    scales (M, cdiv(K, 128)), M-major: DeepSeek-V3's activation blocks.
                      Where M % 4 != 0 its columns are padded to 16 bytes (fp8_mm loads them
                      with TMA); torch._scaled_mm takes scale_a only unpadded, stride (1, M):
                      pass it `scales.t().contiguous().t()` there.
      "block128x128"  scales (cdiv(M, 128), cdiv(K, 128)), rows 16-byte aligned: weight
                      blocks; for b pass b = w_fp8.t(), scale_b = scales.t().
    dtype: float8_e4m3fn (max 448) or float8_e5m2 (max 57344). For x and x^T together (a
    tensor two GEMMs read in different majors): quantize_fp8_pair. Needs compute capability
    9.0 or newer. Not differentiable: an x that requires grad, where autograd records a graph
    (grad mode on, outside torch.inference_mode()), is a ValueError; a call inside a
    forward-mode AD dual level or a torch.func transform is a TypeError. Works under
    torch.compile(fullgraph=True)."""
    _check_quantize(x, granularity, dtype)
    if tracing():
        q, s = _quantize_op(x, granularity, dtype)
    else:
        q, s = _quantize_raw(x, granularity, dtype)
    return q, _scales_view(granularity, s, *x.shape)


def _quantize_pair_raw(x, dtype):
    """((q, s), (q_t, s_t)) of 128x128 blocks, scales as stored (_quantize_raw's storage for
    x and for x.t()). A transposed view is served as the row-major x.t() with the roles of the
    two outputs swapped: the kernel reads through both majors either way."""
    _check_arch("quantize_fp8_pair", "x", x)
    if x.numel() == 0:
        return _quantize_raw(x, "block128x128", dtype), _quantize_raw(x.t(), "block128x128", dtype)
    M, K = x.shape
    dev = x.get_device()
    q = x.new_empty(M, K, dtype=dtype)
    q_t = x.new_empty(K, M, dtype=dtype)
    s = torch.empty(_block_scale_storage(M, K), device=x.device, dtype=torch.float32)
    s_t = torch.empty(_block_scale_storage(K, M), device=x.device, dtype=torch.float32)
    pair = [(x, q, s[:, :cdiv(K, BLOCK)]), (x.t(), q_t, s_t[:, :cdiv(M, BLOCK)])]
    if layout(x) == "col":
        pair.reverse()
    (xa, qa, sa), (xb, qb, sb) = pair
    key = ("block128x128 pair", *xa.shape, x.dtype, layout(xa), dtype, dev)
    _quantize_pair.launch(key, dev, xa, xb, qa, sa, qb, sb, float(torch.finfo(dtype).max))
    return (q, s), (q_t, s_t)


@torch.library.custom_op("tiletune::quantize_fp8_pair", mutates_args=(),
                         schema="(Tensor x, ScalarType dtype) -> (Tensor, Tensor, Tensor, Tensor)")
def _quantize_pair_op(x, dtype):
    (q, s), (q_t, s_t) = _quantize_pair_raw(x, dtype)
    return q, s, q_t, s_t


@_quantize_pair_op.register_fake
def _(x, dtype):
    M, K = x.shape
    return (x.new_empty((M, K), dtype=dtype),
            x.new_empty(_block_scale_storage(M, K), dtype=torch.float32),
            x.new_empty((K, M), dtype=dtype),
            x.new_empty(_block_scale_storage(K, M), dtype=torch.float32))


def quantize_fp8_pair(x, granularity="block128x128", dtype=torch.float8_e4m3fn):
    """((x_fp8, scales), (xt_fp8, scales_t)): quantize_fp8(x, granularity, dtype) and
    quantize_fp8(x.t(), granularity, dtype), bit for bit and in the same layouts (xt_fp8 a
    fresh (K, M) row-major tensor), for a tensor that two GEMMs read along different dims: a
    weight quantized once for the forward (along K) and the input gradient (along N).

    block128x128: one kernel reads x once and writes both (x^T's blocks are x's transposed, so
    they share the scales' values); on an H100 1.08x the two calls at 16384x4096 and
    4096x14336 bf16. The other granularities run as the two quantize_fp8 calls: a row's or
    tensor's scale along the other major needs a whole column's amax first, and a one-read
    1x128 kernel ran no faster than two calls (1.00x on an H100). Arguments and errors as
    quantize_fp8's; works under torch.compile(fullgraph=True)."""
    _check_quantize(x, granularity, dtype, op="quantize_fp8_pair")
    if granularity != "block128x128":
        if not tracing():
            _check_arch("quantize_fp8_pair", "x", x)
        return quantize_fp8(x, granularity, dtype), quantize_fp8(x.t(), granularity, dtype)
    if tracing():
        q, s, q_t, s_t = _quantize_pair_op(x, dtype)
    else:
        (q, s), (q_t, s_t) = _quantize_pair_raw(x, dtype)
    M, K = x.shape
    return ((q, _scales_view(granularity, s, M, K)), (q_t, _scales_view(granularity, s_t, K, M)))


# ---------------------------------------------------------------------------------------------
# The training path: a linear layer with FP8 GEMMs and current scaling. Each GEMM quantizes both
# operands along its reduction dim just before it runs (the scales never go stale); every FP8
# tensor is e4m3, as torchao's rowwise recipe and DeepSeek-V3's blocks keep gradients too.
#
#   forward   y  = x  @ w^T     x (M, K) along K,  w (N, K) along K
#   dgrad     dx = dy @ w       dy along N,         w^T (K, N) along N
#   wgrad     dw = dy^T @ x     dy^T (N, M) along M, x^T (K, M) along M
#
# rowwise: one scale per row of each operand (per output row/column of the GEMM); block: 1x128
# groups for activations and gradients, 128x128 blocks for the weight (DeepSeek-V3). The block
# weight's two quantizations are one quantize_fp8_pair apart, but keeping w^T's FP8 from the
# forward to the backward would hold N*K bytes a layer to save one weight read (15-23 us at
# 14336x4096 on an H100), so the backward quantizes w^T again.

# recipe -> (groups of the forward's and dgrad's (activation-like, weight) operands, groups of
# the wgrad's two operands, both activation-like)
RECIPES = {"rowwise": (("row", "row"), ("row", "row")),
           "block": (("block1x128", "block128x128"), ("block1x128", "block1x128"))}


def _fp8_product(a, b_t, granularities, out_dtype):
    """a (M, K) @ b_t (N, K)^T with both quantized along K (any strides: a transposed view is
    read in place), float32 accumulation, out_dtype."""
    qa, sa = quantize_fp8(a, granularities[0])
    qb, sb = quantize_fp8(b_t, granularities[1])
    return fp8_mm(qa, qb.t(), sa, sb.t(), out_dtype=out_dtype)


def _zero_rows_to(t, multiple):
    """t with zero rows appended up to a multiple of `multiple` rows: the weight gradient sums
    over the tokens M, which fp8_mm needs in multiples of 16; zero rows add nothing."""
    pad = -t.shape[0] % multiple
    return t if pad == 0 else torch.cat([t, t.new_zeros((pad, *t.shape[1:]))])


def _linear_forward(x2, weight, bias, recipe):
    y = _fp8_product(x2, weight, RECIPES[recipe][0], x2.dtype)
    if bias is not None:
        y += bias
    return y


class _FP8Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias, recipe):
        y = _linear_forward(x2, weight, bias, recipe)
        # each operand only for the other's gradient: a frozen weight keeps no activation
        need_x, need_w = ctx.needs_input_grad[:2]
        ctx.save_for_backward(x2 if need_w else None, weight if need_x else None)
        ctx.recipe, ctx.bias_dtype = recipe, None if bias is None else bias.dtype
        ctx.x_dtype, ctx.w_dtype = x2.dtype, weight.dtype
        return y

    @staticmethod
    def backward(ctx, dy):
        bind_context()          # (autograd's thread for the device: tiletune/device.py)
        if torch.is_grad_enabled():     # create_graph=True: FP8 kernels have no double backward
            with torch.no_grad():
                grads = _FP8Linear.backward(ctx, dy)
            return no_second_order("fp8_linear", grads, (dy, *ctx.saved_tensors))
        x2, weight = ctx.saved_tensors
        need_x, need_w, need_b, _ = ctx.needs_input_grad
        if 0 in dy.stride() and dy.numel():   # expanded gradients (e.g. of .sum()): one real copy
            dy = dy.contiguous()
        groups, wgrad_groups = RECIPES[ctx.recipe]
        dx = dw = db = None
        if need_x:
            dx = _fp8_product(dy, weight.t(), groups, ctx.x_dtype)
        if need_w:
            dw = _fp8_product(_zero_rows_to(dy, 16).t(), _zero_rows_to(x2, 16).t(),
                              wgrad_groups, ctx.w_dtype)
        if need_b:
            db = dy.sum(0, dtype=torch.float32).to(ctx.bias_dtype)
        return dx, dw, db, None


def fp8_linear(x, weight, bias=None, *, recipe="rowwise"):
    """y = x @ weight^T + bias, as torch.nn.functional.linear, with its forward and both backward
    GEMMs in FP8 (for training). x (..., K) and weight (N, K) bfloat16, float16 or float32 on one
    CUDA device, bias (N,) or None; K and N multiples of 16 (fp8_mm's K in the forward and the
    input-gradient GEMMs); any number of tokens (the weight gradient pads dy and x with zero rows,
    a copy of each, where the token count is not a multiple of 16). y has x's dtype, also under
    torch.autocast (where F.linear would return the autocast dtype: cast x first where later ops
    need it); dx, dweight and dbias the dtypes of their inputs.

    recipe: "rowwise" (a scale per row of each operand) or "block" (1x128 groups for x and the
    gradients, 128x128 blocks for the weight, as DeepSeek-V3). Current scaling: every GEMM
    quantizes its two operands to e4m3 along its reduction dim with quantize_fp8, just before it
    runs; fp8_mm accumulates exactly in float32 (no fast accumulation). The weight gradient
    sums over the tokens.

    Precision: each product carries e4m3's 3 mantissa bits on both operands; against the same
    linear in float64, DeepGEMM's measure 1 - 2 sum(xy) / sum(x^2 + y^2) of y, dx and dweight
    stays below 2e-3 on the GPU tests' inputs (their numbers: references/reliability.md). The
    bias is added to the product after its rounding to x's dtype (one rounding more than
    F.linear, which adds it before); its gradient is summed in float32. Needs compute capability
    9.0 or newer. Reverse mode only: a call inside a forward-mode AD dual level or a torch.func
    transform is a TypeError."""
    _check_linear(x, weight, bias, recipe)
    refuse_transforms("fp8_linear")     # dual x or weight: the tangent would be dropped
    K, N = x.shape[-1], weight.shape[0]
    x2 = x.reshape(-1, K)
    if records_graph() and any(t is not None and t.requires_grad for t in (x, weight, bias)):
        y = _FP8Linear.apply(x2, weight, bias, recipe)
    else:
        y = _linear_forward(x2, weight, bias, recipe)
    return y.reshape(*x.shape[:-1], N)


def _check_linear(x, weight, bias, recipe):
    """TypeError / ValueError naming the argument: types, shapes, dtypes and the recipe first
    (checkable on CPU tensors), then the device, then the arch."""
    op = "fp8_linear"
    named = [("x", x), ("weight", weight)] + ([] if bias is None else [("bias", bias)])
    for name, t in named:
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if not isinstance(recipe, str) or recipe not in RECIPES:
        raise ValueError(f"{op}: recipe must be one of {sorted(RECIPES)}, got {recipe!r}")
    if x.dim() < 1 or weight.dim() != 2 or x.shape[-1] != weight.shape[1]:
        raise ValueError(f"{op}: x (..., K) and weight (N, K) must share K; got x "
                         f"{tuple(x.shape)} and weight {tuple(weight.shape)}")
    N, K = weight.shape
    if bias is not None and tuple(bias.shape) != (N,):
        raise ValueError(f"{op}: bias must be (N,) = ({N},); got {tuple(bias.shape)}")
    if K % 16 or N % 16 or K == 0:
        raise ValueError(f"{op}: K ({K}) and N ({N}) must be multiples of 16, K at least 16 "
                         "(the reduction dims of the forward and input-gradient FP8 GEMMs)")
    for name, t in named:
        if t.dtype not in IN_DTYPES:
            validate.dtype(op, name, t, IN_DTYPES)
    for name, t in named:
        validate.tensor(op, name, t, like=x, dtypes=IN_DTYPES)
    _check_arch(op, "x", x)
