# What the GEMM family (matmul, grouped GEMM, FP8 GEMM) shares: the grouped order of output tiles
# inside kernels, and the operand layout that each GEMM key holds on the host; and slice64, the
# run-time slice of the kernels that slice arrays by device-side offsets (grouped GEMM, FMHA).
import cuda.tile as ct

from tiletune.device import persistent_ctas
from tiletune.space import cdiv


def slice64(a, axis, start, end):
    """a.slice with int64 bounds: the view's base offset is start * stride in the bounds' type,
    which passes 2^31 in a tensor of more than 2^31 elements, or in a strided one whose
    (rows - 1) * stride does where its size does not."""
    return a.slice(axis, ct.astype(start, ct.int64), ct.astype(end, ct.int64))


def tile_count(rows, cols, TM, TN):
    """Output tiles of one rows x cols product."""
    return ct.cdiv(rows, TM) * ct.cdiv(cols, TN)


def output_tile(tile, rows, cols, TM, TN, GROUP_M):
    """(m, n) of output tile `tile` of a rows x cols product, in grouped order."""
    return tile_coords(tile, ct.cdiv(rows, TM), ct.cdiv(cols, TN), GROUP_M)


def tile_coords(tile, num_m, num_n, GROUP_M):
    """Grouped ("swizzled") order of output tiles: walk GROUP_M row tiles down a column band,
    so the row tiles of a band share the B columns they read while those are in L2."""
    per_group = GROUP_M * num_n
    group = tile // per_group
    first_m = group * GROUP_M
    rows = min(num_m - first_m, GROUP_M)
    within = tile - group * per_group
    return first_m + within % rows, within // rows


def tile_grid(cfg, dev, rows, cols):
    """The grid of a kernel over the output tiles of a rows x cols product: one CTA per tile,
    or with cfg.persistent SMs x occupancy clusters of num_ctas CTAs (the grid counts clusters,
    one per logical tile)."""
    tiles = cdiv(rows, cfg.tm) * cdiv(cols, cfg.tn)
    if cfg.persistent:
        return (persistent_ctas(tiles, dev, cfg.occupancy, cfg.num_ctas),)
    return (tiles,)


def layout(t):
    """'row' if the last dim has unit stride, 'col' if the middle one has, else 'strided' (a
    part of every GEMM key: each layout is its own JIT specialization). (One stride() tuple:
    stride(i) costs more host time.)"""
    strides = t.stride()
    if strides[-1] == 1:
        return "row"
    if strides[-2] == 1:
        return "col"
    return "strided"
