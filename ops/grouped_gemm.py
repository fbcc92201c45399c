# Grouped GEMM for mixture-of-experts layers, with torch._grouped_mm's interface: int32
# cumulative END offsets on the device (group g owns rows offs[g-1]..offs[g], offs[-1] = 0),
# never read on the host, so a launch is CUDA-graph capturable and the tuning key does not
# depend on how tokens are routed.
#
#   2-D x 3-D (forward, dX):     out[rows_g] = x[rows_g] @ w[g]      "M-grouped"
#   2-D x 2-D (weight gradient): out[g] = a[:, rows_g] @ b[rows_g]    "K-grouped"
#   3-D x 3-D: batched matmul (tiletune.ops.matmul)
#
# `gmm(a, b, batch_sizes, trans_b)` takes Megatron's grouped GEMM call (rows per group, which may
# be on the host) to the 2-D x 3-D form.
#
# Both grouped kernels are persistent: SMs x occupancy CTAs each take every num_blocks-th work
# item. The M-grouped kernel derives its work items from offs on the device (each group has
# cdiv(rows, TM) x cdiv(N, TN) tiles): each CTA reads the E offsets as it walks, or (the table
# walk, a config field) a schedule kernel first writes every item to a table; the K-grouped
# kernel's items are the fixed (E, M, N) output tiles, each summing its group's rows TK at a
# time. A group starts at any row: the M-grouped kernel reads x through one tiled view that
# steps a row at a time (TMA from any row, one descriptor) or through gathers, a config field the
# search decides, and stores with a masked scatter (a store on a per-group slice of out, whose
# descriptor is rebuilt per tile, ran 5-14% slower); the K-grouped kernel reads each group's
# rows through views sliced to the group (zero past its end, as its sum needs).
# bf16/fp16 operands (alike), float32 accumulation, any strides.
#
# No `from __future__ import annotations` here: it would hide the ct.Constant annotations.
import math

import cuda.tile as ct
import torch

from tiletune import validate
from tiletune.autotune import Autotuner, Work, bucket, bucketed
from tiletune.device import major, persistent_ctas
from tiletune.ops.gemm_tiles import layout, output_tile, slice64, tile_coords, tile_count
from tiletune.ops.matmul import matmul
from tiletune.space import INT32_MAX, cdiv, next_pow2, table
from tiletune.torch_op import TrainableOp, tracing

ZERO = ct.PaddingMode.ZERO
DTYPES = (torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------------------
# Kernels. ct.gather of offs at g - 1 < 0 or g = E (out of bounds) yields its padding value:
# the first group starts at 0, and "group" E is the rows past offs[E-1], which the M-grouped
# kernel writes as zeros (usually none: cdiv(0, TM) tiles).

def _w_tile(w, g, kk, n, TK, TN):
    return ct.reshape(ct.load(w, (g, kk, n), (1, TK, TN), padding_mode=ZERO), (TK, TN))


def _group_end(offs, g, start, T):
    """Group g's end row, clamped to [start, T]: offs that decrease or pass T (not checked: a
    host sync) then give some split of the rows, never a negative count or a walk past T."""
    return ct.minimum(ct.maximum(ct.gather(offs, g, padding_value=T), start), T)


def _group_items(start, end, TM, num_n):
    """Work items of the group owning rows start..end."""
    return ct.cdiv(end - start, TM) * num_n


def _group_tile(x, w, out, rows_view, g, start, end, tile, num_n, TM, TN, TK, GROUP_M, GATHER):
    """Work item `tile` of group g (rows start..end of x and out); group E (the rows no group
    owns) is written as zeros."""
    m, n = tile_coords(tile, ct.cdiv(end - start, TM), num_n, GROUP_M)
    rows = start + m * TM + ct.arange(TM, dtype=ct.int32)
    k_end = ct.cdiv(x.shape[1], TK)
    if g == w.shape[0]:
        k_end = 0
    acc = ct.zeros((TM, TN), ct.float32)
    for kk in range(k_end):
        if GATHER:
            cols = kk * TK + ct.arange(TK, dtype=ct.int32)
            a = ct.gather(x, (rows[:, None], cols[None, :]))
        else:
            a = rows_view.load((start + m * TM, kk))
        acc = ct.mma(a, _w_tile(w, g, kk, n, TK, TN), acc)
    cols = n * TN + ct.arange(TN, dtype=ct.int32)
    ct.scatter(out, (rows[:, None], cols[None, :]), acc.astype(out.dtype),
               mask=rows[:, None] < end)


def _window(offs, g, T, WALK: ct.Constant[int]):
    """offs[g+1 .. g+WALK] (past the end: T) as a tuple, loaded together."""
    ends = ()
    for j in ct.static_iter(range(WALK)):
        ends += (ct.gather(offs, g + 1 + j, padding_value=T),)
    return ends


def _advance(t, g, start, end, base, items, ends, T, TM, num_n):
    """Step the walk over the groups whose ends are `ends` while item t is past group g."""
    for j in ct.static_iter(range(len(ends))):
        if t >= base + items:
            base += items
            start = end
            end = ct.minimum(ct.maximum(ends[j], start), T)
            items = _group_items(start, end, TM, num_n)
            g += 1
    return g, start, end, base, items


@ct.kernel
def grouped_mm_kernel(x, w, offs, out, TM: ct.Constant[int], TN: ct.Constant[int],
                      TK: ct.Constant[int], GROUP_M: ct.Constant[int],
                      GATHER: ct.Constant[bool], WALK: ct.Constant[int]):
    """x (T, K), w (E, K, N), offs (E,) int32, out (T, N); a 1-D persistent grid. Rows of x
    come through one tiled view that steps one row at a time (TMA from any row, one descriptor
    for the whole kernel) or, with GATHER, through gathers; a tile's rows past its group hold
    the next group's data and are not stored (the store is a masked scatter).

    WALK 0: loop over the groups and take this CTA's items in each. A branch on a loaded value
    around the mma loop (the group loop's item test) makes tileiras 13.4 hand each item from the
    TMA producer to the consumers and back (an mbarrier pair), so the producer cannot load the
    next item while the consumers store this one.
    WALK >= 1: first count the work items (the count's loop has a fixed trip count, so its loads
    issue together), then loop over this CTA's items, stepping the group forward as they pass:
    one offset load at a time (WALK 1), or from a window of the next WALK offsets loaded
    together and reloaded as soon as the walk moves, so its loads are in flight while the item
    runs (a CTA's next item is usually several groups ahead: num_blocks items later)."""
    T = x.shape[0]
    E = w.shape[0]
    num_n = ct.cdiv(w.shape[2], TN)
    rows_view = x.tiled_view((TM, TK), padding_mode=ZERO, traversal_steps=(1, TK))
    if WALK == 0:
        t = ct.bid(0)      # this CTA's next work item, counted over all groups
        base = 0
        start = 0
        for g in range(E + 1):
            end = _group_end(offs, g, start, T)
            items = _group_items(start, end, TM, num_n)
            while t < base + items:
                _group_tile(x, w, out, rows_view, g, start, end, t - base, num_n, TM, TN, TK,
                            GROUP_M, GATHER)
                t += ct.num_blocks(0)
            base += items
            start = end
    else:
        total = 0
        start = 0
        for g in range(E + 1):
            end = _group_end(offs, g, start, T)
            total += _group_items(start, end, TM, num_n)
            start = end
        g = 0
        start = 0
        base = 0           # work items of the groups before g
        end = _group_end(offs, 0, start, T)
        items = _group_items(start, end, TM, num_n)
        if WALK == 1:
            for t in range(ct.bid(0), total, ct.num_blocks(0)):
                while t >= base + items:
                    base += items
                    start = end
                    g += 1
                    end = _group_end(offs, g, start, T)
                    items = _group_items(start, end, TM, num_n)
                _group_tile(x, w, out, rows_view, g, start, end, t - base, num_n, TM, TN, TK,
                            GROUP_M, GATHER)
        else:
            ends = _window(offs, g, T, WALK)
            for t in range(ct.bid(0), total, ct.num_blocks(0)):
                while t >= base + items:
                    g, start, end, base, items = _advance(t, g, start, end, base, items, ends,
                                                          T, TM, num_n)
                    ends = _window(offs, g, T, WALK)
                _group_tile(x, w, out, rows_view, g, start, end, t - base, num_n, TM, TN, TK,
                            GROUP_M, GATHER)


def _group_bounds(offs, T, EP: ct.Constant[int]):
    """Every group's (start, end) as tiles of EP (group E: the rows no group owns; groups past
    it empty), clamped as _group_end clamps them: an end is the running maximum of offs,
    within [0, T]."""
    g = ct.arange(EP, dtype=ct.int32)
    end = ct.scan(ct.maximum(ct.gather(offs, g, padding_value=T), 0), 0, ct.maximum, 0)
    # Group 0 starts at row 0; groups past E start at T (they are empty, and their items must
    # not count toward the table's total).
    prior = ct.where(g > 0, ct.gather(offs, g - 1, padding_value=T), 0)
    start = ct.scan(ct.maximum(prior, 0), 0, ct.maximum, 0)
    return g, ct.minimum(start, T), ct.minimum(end, T)


@ct.kernel
def grouped_schedule_kernel(offs, table, T: int, TM: ct.Constant[int], num_n: int,
                            EP: ct.Constant[int], CHUNK: ct.Constant[int]):
    """The M-grouped kernel's work items for the table walk: CTA g writes group g's items
    (group, start row, end row, tile within the group) to columns base_g.. of table rows 0-3;
    CTA 0 writes the item count to table[4, 0]. One CTA per group (E + 1)."""
    groups, starts, ends = _group_bounds(offs, T, EP)
    items = _group_items(starts, ends, TM, num_n)
    after = ct.cumsum(items, 0)
    g = ct.bid(0)
    mine = groups == g
    start = ct.sum(ct.where(mine, starts, 0))
    end = ct.sum(ct.where(mine, ends, 0))
    base = ct.sum(ct.where(mine, after - items, 0))
    count = ct.sum(ct.where(mine, items, 0))
    for c in range(ct.cdiv(count, CHUNK)):
        tile = c * CHUNK + ct.arange(CHUNK, dtype=ct.int32)
        col = base + tile
        keep = tile < count
        ct.scatter(table, (0, col), ct.full((CHUNK,), g, ct.int32), mask=keep)
        ct.scatter(table, (1, col), ct.full((CHUNK,), start, ct.int32), mask=keep)
        ct.scatter(table, (2, col), ct.full((CHUNK,), end, ct.int32), mask=keep)
        ct.scatter(table, (3, col), tile, mask=keep)
    if g == 0:
        ct.scatter(table, (4, ct.arange(1, dtype=ct.int32)),
                   ct.full((1,), ct.sum(items), ct.int32))


def _table_item(table, t, total):
    """Work item t's (group, start, end, tile): four loads that depend on t alone, masked past
    the item count (the columns there were never written; the walk does not use them)."""
    live = t < total
    return (ct.gather(table, (0, t), mask=live), ct.gather(table, (1, t), mask=live),
            ct.gather(table, (2, t), mask=live), ct.gather(table, (3, t), mask=live))


@ct.kernel
def grouped_mm_table_kernel(x, w, offs, out, table, TM: ct.Constant[int],
                            TN: ct.Constant[int], TK: ct.Constant[int],
                            GROUP_M: ct.Constant[int], GATHER: ct.Constant[bool]):
    """The M-grouped kernel reading its work items from the table grouped_schedule_kernel
    wrote: the next item's fields are loaded before this item runs, so no load waits on
    another and none is waited for between items (the walks load one group end after
    another, in the consumers, between an item's epilogue and the next item's K loop)."""
    num_n = ct.cdiv(w.shape[2], TN)
    rows_view = x.tiled_view((TM, TK), padding_mode=ZERO, traversal_steps=(1, TK))
    total = ct.minimum(ct.gather(table, (4, 0)), table.shape[1])
    g, start, end, tile = _table_item(table, ct.bid(0), total)
    for t in range(ct.bid(0), total, ct.num_blocks(0)):
        following = _table_item(table, t + ct.num_blocks(0), total)
        _group_tile(x, w, out, rows_view, g, start, end, tile, num_n, TM, TN, TK, GROUP_M,
                    GATHER)
        g, start, end, tile = following


@ct.kernel
def grouped_mm_k_kernel(a, b, offs, out, TM: ct.Constant[int], TN: ct.Constant[int],
                        TK: ct.Constant[int], GROUP_M: ct.Constant[int],
                        GATHER: ct.Constant[bool]):
    """a (M, T), b (T, N), offs (E,) int32, out (E, M, N); a 1-D persistent grid. An empty
    group's tiles are zeros."""
    tiles = tile_count(a.shape[0], b.shape[1], TM, TN)
    for t in range(ct.bid(0), tiles * out.shape[0], ct.num_blocks(0)):
        g = t // tiles
        m, n = output_tile(t - g * tiles, a.shape[0], b.shape[1], TM, TN, GROUP_M)
        start = ct.minimum(ct.maximum(ct.gather(offs, g - 1), 0), a.shape[1])
        end = _group_end(offs, g, start, a.shape[1])
        acc = ct.zeros((TM, TN), ct.float32)
        if end > start:
            if GATHER:
                mi = m * TM + ct.arange(TM, dtype=ct.int32)
                ni = n * TN + ct.arange(TN, dtype=ct.int32)
                for kk in range(ct.cdiv(end - start, TK)):
                    rows = start + kk * TK + ct.arange(TK, dtype=ct.int32)
                    at = ct.gather(a, (mi[:, None], rows[None, :]), mask=rows[None, :] < end)
                    bt = ct.gather(b, (rows[:, None], ni[None, :]), mask=rows[:, None] < end)
                    acc = ct.mma(at, bt, acc)
            else:
                ag = slice64(a, 1, start, end)
                bg = slice64(b, 0, start, end)
                for kk in range(ct.cdiv(end - start, TK)):
                    at = ct.load(ag, (m, kk), (TM, TK), padding_mode=ZERO)
                    acc = ct.mma(at, ct.load(bg, (kk, n), (TK, TN), padding_mode=ZERO), acc)
        ct.store(out, (g, m, n), ct.reshape(acc.astype(out.dtype), (1, TM, TN)))


# ---------------------------------------------------------------------------------------------
# Configs. Hopper holds float32 accumulators in registers: 4 worker warps up to 128x128, 8 up to
# 128x256 / 256x128; a 2-CTA cluster makes 256x256 of two 128x256 halves. Measured per config on
# the MoE bench keys (references/kernel-type-templates.md, grouped GEMM): in the M-grouped kernel
# the row-stepping view led the gathers at every key; gathers stay in the space for layouts TMA
# cannot take; 2-way occupancy of 128x128 ran 3-10x behind and gathers in 2-CTA clusters 9x
# behind: left out. In the K-grouped kernel gathers of both operands ran 3-6x behind the sliced
# views: views only. The M-grouped kernel walks its work items (walk >= 1) or its groups (walk
# 0): per config on an H100 the item loop ran 0-6% faster at K 768-2048 (Qwen3-MoE, DeepSeek-like
# down) and the group loop 1-3.5% faster at 128x256 with K 4096-7168. At 128x256 (8 warps)
# tileiras 13.4 takes ~10 s to compile the one-offset walk (1 s the group loop; 0.5-2 s the walk
# at other tiles), on every new signature, and it led the group loop there by at most 1.2%:
# 128x256 keeps the group loop, the other tiles walk. At 128x128 the walk from a window of 4 or
# 8 offsets ran up to 6% faster than the one-offset walk on an H200 (and up to 3% slower) on the
# MoE bench keys, in no order that the shape predicts: both are searched. The table walk (a
# schedule kernel writes every item's group and rows first; the M-grouped kernel then reads its
# next item with loads that wait on nothing) ran 2-5% ahead of the walks at 128x128 on Qwen3-MoE
# gate_up and down and 13% ahead on E 256 with T 777, and 1-6% behind them with K 2048-4096 at
# E 8-32 (H200): both are searched, the table timed with its schedule kernel.
# 128x128 at 4 worker warps ran 4-5x behind the same tile at 8 in the M-grouped kernel (0.20-0.27x
# _grouped_mm on five forward and dX keys, H100) and 25-35% behind the best config in the
# K-grouped one; it was also the slowest of the space to compile (2.2 s on a 2-core CPU): sm_90
# leaves it out, sm_100 (accumulators in tensor memory) keeps it.
# Small groups (4-64 rows a group over 128 experts, 8 over 8; H200, in turns): the table walk's
# 64-row and 16-row tiles ran 1.00-1.15x faster than the best of the item-walk 4-warp entries
# they replace, and 1.23-1.57x `_grouped_mm`; these keys stream the weights (up to 4.1 TB/s).

FIELDS = ("tm", "tn", "tk", "occupancy", "num_ctas", "num_worker_warps", "gather", "group_m")
M_FIELDS = FIELDS + ("walk",)
TABLE = "table"        # the walk of grouped_mm_table_kernel
TABLE_MAX_GROUPS = 1023  # the schedule kernel holds every group's bounds in one tile
SM90_SPACE = [
    (128, 256, 64, 1, 1, 8, False, 8, 0),      # the default
    (128, 256, 64, 1, 1, 8, True, 8, 0),
    (256, 128, 64, 1, 1, 8, False, 8),
    (256, 128, 64, 1, 1, 8, True, 8),
    (256, 256, 64, 1, 2, 8, False, 8),         # 128x256 per CTA, pairs in a cluster
    (128, 128, 64, 1, 1, 8, False, 8),
    (128, 128, 64, 1, 1, 8, True, 8),
    (128, 128, 64, 1, 1, 8, False, 8, 4),      # walks from a window of 4 or 8 offsets
    (128, 128, 64, 1, 1, 8, False, 8, 8),
    (128, 128, 64, 1, 1, 8, False, 8, TABLE),  # items read from the schedule kernel's table
    (128, 256, 64, 1, 1, 8, False, 8, TABLE),
    (128, 256, 64, 1, 1, 8, False, 4, 0),
    # Below 8 warps only on the table walk: on the item walk these tiles spill and lose TMA.
    (128, 128, 128, 1, 1, None, False, 8, TABLE),
    (64, 256, 64, 1, 1, 8, False, 8, TABLE),
    (64, 128, 64, 2, 1, None, False, 8, TABLE),
    (64, 128, 64, 2, 1, None, True, 8, TABLE),
    (64, 64, 64, 2, 1, None, False, 8, TABLE),
    # 16-row tiles (HMMA) for groups of at most 16 rows: each row tile of a group reads the
    # group's weights again, so they are offered only where one covers the average group.
    (16, 128, 128, 1, 1, None, False, 8, TABLE),
    (16, 64, 64, 2, 1, None, False, 8, TABLE),
]
# The K-grouped kernel (no walk, views only, GROUP_M 8): its M is the weight's rows, usually the
# larger side, hence 128x64 at 2-way occupancy where the M-grouped space has 64x128.
SM90_K_SPACE = [
    (128, 256, 64, 1, 1, 8, False, 8),
    (256, 128, 64, 1, 1, 8, False, 8),
    (256, 256, 64, 1, 2, 8, False, 8),
    (128, 128, 64, 1, 1, 8, False, 8),
    (128, 128, 128, 1, 1, None, False, 8),
    (64, 256, 64, 1, 1, None, False, 8),
    (64, 64, 64, 2, 1, None, False, 8),
    (128, 64, 64, 2, 1, None, False, 8),
]
# sm_100 (compile-checked only): accumulators live in tensor memory; the 4-warp entries and a
# 4-warp cluster. Anything else: a conservative pair, never measured.
SM100_DEFAULT = (128, 128, 64, 1, 1, None, False, 8)     # 128x128 at 4 warps
SM100_SPACE = [SM100_DEFAULT] + [r for r in SM90_SPACE if r[5] is None] + [
    (256, 256, 64, 1, 2, None, False, 8), (128, 128, 64, 1, 1, None, False, 8, TABLE)]
SM100_K_SPACE = [SM100_DEFAULT] + [r for r in SM90_K_SPACE if r[5] is None] + [
    (256, 256, 64, 1, 2, None, False, 8)]
OTHER_SPACE = [(128, 128, 32, 1, 1, None, False, 8), (64, 128, 32, 2, 1, None, True, 8)]


def _space(arch, sm90, sm100):
    mj = major(arch)
    return sm90 if mj == 9 else sm100 if mj == 10 else OTHER_SPACE


def grouped_configs(arch, t, e, k, n):
    """The space of the M-grouped kernel for T tokens over E groups (x (T, K), w (E, K, N)),
    default first. Tiles taller than the average group (next power of two of T / E, at least
    64) are mostly padding and are left out; tiles under 64 rows are offered only where one
    covers the average group; the table walk is left out past TABLE_MAX_GROUPS."""
    group = next_pow2(cdiv(t, max(e, 1)))
    space = _space(arch, SM90_SPACE, SM100_SPACE)
    yield from table(M_FIELDS, [r for i, r in enumerate(space) if i == 0 or (
        min(64, group) <= r[0] <= max(64, group)
        and (r[8:] != (TABLE,) or e <= TABLE_MAX_GROUPS))], walk=1)


def k_grouped_configs(arch, t, e, m, n):
    """The space of the K-grouped kernel (out (E, M, N) summed over T rows), default first."""
    yield from table(FIELDS, _space(arch, SM90_K_SPACE, SM100_K_SPACE))


# ---------------------------------------------------------------------------------------------
# Launch. The M-grouped grid is bounded by the most work items any offs can make: every group
# adds at most one partly filled row tile (E groups and the unowned rows). The table walk's
# configs launch two kernels (the search times both): the schedule into a scratch table of that
# many columns, then the M-grouped kernel reading it.

def _k_args(cfg, a, b, offs, out):
    return (a, b, offs, out, cfg.tm, cfg.tn, cfg.tk, cfg.group_m, cfg.gather)


def _m_kernel(cfg):
    return grouped_mm_table_kernel if cfg.walk == TABLE else grouped_mm_kernel


def _args(cfg, x, w, offs, out, table=None):
    if cfg.walk == TABLE:
        return (x, w, offs, out, table, cfg.tm, cfg.tn, cfg.tk, cfg.group_m, cfg.gather)
    return (x, w, offs, out, cfg.tm, cfg.tn, cfg.tk, cfg.group_m, cfg.gather, cfg.walk)


def _most_items(cfg, x, w):
    return (cdiv(x.shape[0], cfg.tm) + w.shape[0] + 1) * cdiv(w.shape[2], cfg.tn)


def _grid(cfg, dev, x, w, offs, out, table=None):
    """The grid counts clusters of num_ctas CTAs (one per logical tile)."""
    return (persistent_ctas(_most_items(cfg, x, w), dev, cfg.occupancy, cfg.num_ctas),)


def _table_scratch(cfg, dev, x, w, offs, out):
    """The table walk's item table: rows group, start, end, tile; row 4 holds the count."""
    return ((5, _most_items(cfg, x, w)), torch.int32) if cfg.walk == TABLE else None


SCHEDULE_CHUNK = 256     # items a schedule CTA writes per step


def _schedule_args(cfg, x, w, offs, table):
    return (offs, table, x.shape[0], cfg.tm, cdiv(w.shape[2], cfg.tn), next_pow2(w.shape[0] + 1),
            SCHEDULE_CHUNK)


def _m_run(cfg, kernel, stream, dev, x, w, offs, out, table):
    if table is not None:
        ct.launch(stream, (w.shape[0] + 1,), grouped_schedule_kernel,
                  _schedule_args(cfg, x, w, offs, table))
    ct.launch(stream, _grid(cfg, dev, x, w, offs, out), kernel,
              _args(cfg, x, w, offs, out, table))


def _k_grid(cfg, dev, a, b, offs, out):
    items = out.shape[0] * cdiv(a.shape[0], cfg.tm) * cdiv(b.shape[1], cfg.tn)
    return (persistent_ctas(items, dev, cfg.occupancy, cfg.num_ctas),)


# Both kernels: the launch key holds T itself (the grid needs it), the tuning key its bucket.
_grouped = Autotuner(
    "grouped_mm", _m_kernel, grouped_configs, grid=_grid, args=_args, scratch=_table_scratch,
    run=_m_run, timed_by_run=lambda cfg: cfg.walk == TABLE,
    default=next(table(M_FIELDS, OTHER_SPACE, walk=1)), tune_key=bucketed(3),
    space=lambda x, w, *_: dict(t=bucket(x.shape[0]), e=w.shape[0], k=x.shape[1], n=w.shape[2]),
    work=lambda x, w, *_: Work(flops=2.0 * x.shape[0] * x.shape[1] * w.shape[2]))
_k_grouped = Autotuner(
    "grouped_mm_k", grouped_mm_k_kernel, k_grouped_configs, grid=_k_grid, args=_k_args,
    default=next(table(FIELDS, OTHER_SPACE)), tune_key=bucketed(3),
    space=lambda a, b, offs, out: dict(t=bucket(a.shape[1]), e=out.shape[0], m=a.shape[0],
                                       n=b.shape[1]),
    work=lambda a, b, *_: Work(flops=2.0 * a.shape[0] * a.shape[1] * b.shape[1]))
TUNERS = (_grouped, _k_grouped)


def launch(x, w, offs, out):
    """out = x @ w[g] on each group's rows (x (T, K), w (E, K, N), out (T, N)). The key holds
    the shapes and the layouts (tuning buckets T), not how the rows are split."""
    dev = x.get_device()
    key = (w.shape[0], x.shape[1], w.shape[2], x.shape[0], x.dtype, layout(x), layout(w), dev)
    _grouped.launch(key, dev, x, w, offs, out)


def launch_k(a, b, offs, out):
    """out[g] = a[:, rows_g] @ b[rows_g] (a (M, T), b (T, N), out (E, M, N))."""
    dev = a.get_device()
    key = (out.shape[0], a.shape[0], b.shape[1], a.shape[1], a.dtype, layout(a), layout(b), dev)
    _k_grouped.launch(key, dev, a, b, offs, out)


def _mgrouped(x, w, offs):
    out = x.new_empty(x.shape[0], w.shape[2])
    if out.numel():
        if x.shape[1] == 0 or w.shape[0] == 0:
            out.zero_()
        else:
            launch(x, w, offs, out)
    return out


def _kgrouped(a, b, offs):
    out = a.new_empty(offs.shape[0], a.shape[0], b.shape[1])
    if out.numel():
        if a.shape[1] == 0:
            out.zero_()
        else:
            launch_k(a, b, offs, out)
    return out


# ---------------------------------------------------------------------------------------------
# Autograd and custom ops. out = x @ w[g] (rows_g): dX = dY @ w[g]^T, the M-grouped kernel on
# w's transposed view; dW[g] = x[rows_g]^T @ dY[rows_g], the K-grouped kernel, computed as
# (dY^T x)^T when w is a transposed view so that dW comes back in w's layout. And for
# out[g] = a[:, rows_g] @ b[rows_g]: da[:, rows_g] = (b[rows_g] @ dout[g]^T)^T and
# db[rows_g] = a[:, rows_g]^T @ dout[g], both M-grouped. offs gets no gradient.

def _w_like(like, w_col, e, k, n):
    """An (e, k, n) tensor in w's layout: row-major, or the transposed view of (e, n, k)."""
    if w_col:
        return like.new_empty((e, n, k)).transpose(-2, -1)
    return like.new_empty((e, k, n))


def _backward(needs, dy, x, w, offs, w_col):
    """x is kept only where w needs a gradient, w only where x does (frozen experts keep no
    activations); w_col: w's layout, which the weight gradient comes back in."""
    dy = dy.contiguous()               # autograd may hand in expanded (stride-0) gradients
    dx = _mgrouped(dy, w.transpose(-2, -1), offs) if needs[0] else None
    dw = None
    if needs[1]:
        dw = (_kgrouped(dy.t(), x, offs).transpose(-2, -1) if w_col
              else _kgrouped(x.t(), dy, offs))
    return dx, dw


def _k_backward(needs, dout, a, b, offs):
    dout = dout.contiguous()
    da = _mgrouped(b, dout.transpose(-2, -1), offs).t() if needs[0] else None
    db = _mgrouped(a.t(), dout, offs) if needs[1] else None
    return da, db


def _save_for_the_other(args, results):
    """Each operand only where the other one needs a gradient (its gradient reads it)."""
    a, b, offs = args
    return (a if b.requires_grad else None, b if a.requires_grad else None, offs), ()


def _save_for_the_other_and_layout(args, results):
    return _save_for_the_other(args, results)[0], (layout(args[1]) == "col",)


_grouped_op = TrainableOp(
    "tiletune::grouped_mm", forward=_mgrouped,
    forward_schema="(Tensor x, Tensor w, Tensor offs) -> Tensor",
    forward_fake=lambda x, w, offs: x.new_empty((x.shape[0], w.shape[2])),
    save=_save_for_the_other_and_layout, backward=_backward,
    backward_schema="(bool[] needs, Tensor dy, Tensor? x, Tensor? w, Tensor offs, bool w_col) "
                    "-> (Tensor?, Tensor?)",
    backward_fake=lambda needs, dy, x, w, offs, w_col: (
        dy.new_empty((dy.shape[0], w.shape[1])) if needs[0] else None,
        _w_like(dy, w_col, offs.shape[0], x.shape[1], dy.shape[1]) if needs[1] else None))
_k_grouped_op = TrainableOp(
    "tiletune::grouped_mm_k", forward=_kgrouped,
    forward_schema="(Tensor a, Tensor b, Tensor offs) -> Tensor",
    forward_fake=lambda a, b, offs: a.new_empty((offs.shape[0], a.shape[0], b.shape[1])),
    save=_save_for_the_other, backward=_k_backward,
    backward_schema="(bool[] needs, Tensor dy, Tensor? a, Tensor? b, Tensor offs) "
                    "-> (Tensor?, Tensor?)",
    backward_fake=lambda needs, dout, a, b, offs: (
        dout.new_empty((b.shape[0], dout.shape[1])).t() if needs[0] else None,
        dout.new_empty((a.shape[1], dout.shape[2])) if needs[1] else None))


# ---------------------------------------------------------------------------------------------
# Host side: checks in the order shapes, dtypes, devices (so that everything but the device can
# be checked on CPU tensors), then the mode.

def _check(x, w, offs, op="grouped_mm", names=("x", "w")):
    """The mode, "2d3d", "2d2d" or "3d3d", or a ValueError / TypeError naming `op` and the
    argument (x and w as `names` call them)."""
    xn, wn = names
    validate.is_tensor(op, xn, x)
    validate.is_tensor(op, wn, w)
    mode = f"{x.dim()}d{w.dim()}d"
    if mode not in ("2d3d", "2d2d", "3d3d"):
        raise ValueError(f"{op}: {xn} and {wn} must be 2-D x 3-D ({xn} (T, K), {wn} (E, K, N)), "
                         f"2-D x 2-D (a (M, T), b (T, N)) or 3-D x 3-D; got {x.dim()}-D x "
                         f"{w.dim()}-D")
    for name, t in ((xn, x), (wn, w)):
        if t.dtype not in DTYPES:
            raise TypeError(f"{op}: {name} dtype {t.dtype} is not supported "
                            "(bfloat16, float16)")
    if x.dtype != w.dtype:
        raise TypeError(f"{op}: {xn} is {x.dtype} but {wn} is {w.dtype}")
    if x.shape[-1] != w.shape[-2]:
        raise ValueError(f"{op}: inner dims differ: {xn} {tuple(x.shape)} @ {wn} "
                         f"{tuple(w.shape)}")
    if mode == "3d3d":
        if offs is not None:
            raise ValueError(f"{op}: offs must be None for 3-D x 3-D (a batched matmul)")
        if x.shape[0] != w.shape[0]:
            raise ValueError(f"{op}: batch sizes differ ({x.shape[0]} vs {w.shape[0]})")
    else:
        if offs is None:
            raise ValueError(f"{op}: offs is required for {mode[0]}-D x {mode[2]}-D")
        validate.is_tensor(op, "offs", offs)
        if offs.dtype != torch.int32:
            raise TypeError(f"{op}: offs must be int32 (cumulative end offsets), got "
                            f"{offs.dtype}")
        validate.dims(op, "offs", offs, 1, "(groups,)")
        if mode == "2d3d" and offs.shape[0] != w.shape[0]:
            raise ValueError(f"{op}: offs has {offs.shape[0]} entries but {wn} has "
                             f"{w.shape[0]} groups")
    for name, t in ((xn, x), (wn, w), ("offs", offs)):
        if t is not None:
            validate.tensor(op, name, t, like=x, dtypes=(*DTYPES, torch.int32))
    if mode != "3d3d":                    # (the batched product is matmul's: any size)
        for name, n in ((xn, x.numel()), (wn, w.numel()),
                        ("the result", math.prod(_result_shape(mode, x, w, offs)))):
            if n > INT32_MAX:
                # the array with a dim per group (w of 2-D x 3-D, the result of 2-D x 2-D)
                # shrinks with fewer groups per call, the others with fewer tokens
                per_group = name == (wn if mode == "2d3d" else "the result")
                raise ValueError(f"{op}: {name} has {n} elements, more than the kernels "
                                 "index (2^31 - 1); split the "
                                 + ("groups" if per_group else "tokens"))
    return mode


def _result_shape(mode, x, w, offs):
    if mode == "2d3d":
        return (x.shape[0], w.shape[2])
    if mode == "2d2d":
        return (offs.shape[0], x.shape[0], w.shape[1])
    return (x.shape[0], x.shape[1], w.shape[2])


def _check_out(out, shape, x, w):
    validate.out("grouped_mm", out, shape, x.dtype, x.device, kept={"x": x, "w": w})


def grouped_mm(x, w, offs=None, *, out=None):
    """torch._grouped_mm's grouped GEMM, bf16 or fp16 (both alike), float32 accumulation, output
    in the input dtype; any strides (no 16-byte rule), any K and N.

    - 2-D x 3-D: x (T, K) with rows sorted by group, w (E, K, N) (an (E, N, K) nn.Linear-style
      weight passes as w_nk.transpose(-2, -1)), offs (E,) int32 cumulative end offsets on x's
      device: group g is rows offs[g-1]..offs[g] (offs[-1] = 0), empty groups allowed. Returns
      (T, N); rows past offs[E-1] are zeros (torch leaves them unspecified).
    - 2-D x 2-D: a (M, T) (typically x.t()), b (T, N), offs (E,) splitting T. Returns (E, M, N)
      with out[g] = a[:, rows_g] @ b[rows_g]; an empty group gives zeros.
    - 3-D x 3-D without offs: the batched matmul (E, M, K) @ (E, K, N).

    offs is never read on the host (CUDA-graph capturable), so it is not checked against the
    data: offs must be non-decreasing with offs[E-1] <= T. Otherwise the kernels clamp the
    bounds into [0, T]: a wrong result, but no hang and no access outside the tensors (the
    forward and dX kernels then split the rows by the running maximum of offs, the K-grouped
    kernel, which the 2-D x 2-D form and the weight gradient run, starts each group at its
    clamped offs[g-1], so a row can count in two groups there).
    Differentiable in x and w (offs gets no gradient); the weight gradient comes back as the
    transposed view of a contiguous (E, N, K) where w's middle dim has unit stride (an
    nn.Linear-style weight passed transposed, sliced or not), and contiguous otherwise.
    Works under torch.compile(fullgraph=True). `out`, if given, receives a copy of the result
    (gradients flow through it as through `out.copy_(result)`): exactly the result's shape,
    dtype and device, and writable: no stride-0 dims, and, where autograd records a graph
    (grad mode on, outside torch.inference_mode(), as torch's copy_ decides), not a leaf that
    requires grad nor a view of one, and no memory of x or w where one of them requires grad.
    x, w and the result of the grouped forms hold up to 2^31 - 1 elements each (ValueError
    beyond). Nested (jagged) tensors are refused (TypeError)."""
    try:
        mode = _check(x, w, offs)
        if out is not None:
            _check_out(out, _result_shape(mode, x, w, offs), x, w)
        if mode == "3d3d":
            c = matmul(x, w)
        elif mode == "2d3d":
            c = _grouped_op(x, w, offs)
        else:
            c = _k_grouped_op(x, w, offs)
    except Exception:
        validate.not_nested("grouped_mm", {"x": x, "w": w, "offs": offs})
        raise
    return c if out is None else out.copy_(c)


def _gmm_offsets(a, b, batch_sizes, trans_b):
    """gmm's own checks (the row counts, trans_b, the 2-D x 3-D form; grouped_mm's `_check`
    does the rest under gmm's names), then (offs (E,) int32 on a's device, the (E, K, N)
    weight)."""
    validate.is_tensor("gmm", "a", a)
    validate.is_tensor("gmm", "b", b)
    validate.is_tensor("gmm", "batch_sizes", batch_sizes)
    if not isinstance(trans_b, bool):
        raise TypeError(f"gmm: trans_b must be a bool, got {type(trans_b).__name__}")
    validate.dims("gmm", "a", a, 2, "(tokens, K)")
    validate.dims("gmm", "b", b, 3, "(groups, N, K)" if trans_b else "(groups, K, N)")
    if batch_sizes.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"gmm: batch_sizes must be int32 or int64 (rows per group), got "
                        f"{batch_sizes.dtype}")
    validate.dims("gmm", "batch_sizes", batch_sizes, 1, "(groups,)")
    if batch_sizes.shape[0] != b.shape[0]:
        raise ValueError(f"gmm: batch_sizes has {batch_sizes.shape[0]} entries but b has "
                         f"{b.shape[0]} groups")
    if batch_sizes.device.type == "cpu" and not tracing():
        if bool((batch_sizes < 0).any()):
            raise ValueError("gmm: batch_sizes must not be negative")
        ends = batch_sizes.cumsum(0)           # in batch_sizes' own dtype: the check's sum
        total = int(ends[-1]) if len(ends) else 0
        if total != a.shape[0]:
            raise ValueError(f"gmm: batch_sizes sum to {total} rows but a has {a.shape[0]}")
        offs = ends.to(a.device, torch.int32)  # (at most T, which _check bounds by int32)
    else:
        offs = batch_sizes.cumsum(0, dtype=torch.int32)
        offs = offs if offs.device == a.device else offs.to(a.device)
    w = b.transpose(-2, -1) if trans_b else b
    _check(a, w, offs, "gmm", ("a", "b" + ("^T" if trans_b else "")))
    return offs, w


def gmm(a, b, batch_sizes, trans_b=False):
    """The `gmm` of Megatron's grouped GEMM (the `grouped_gemm` package): a (T, K) with rows
    sorted by group, b (E, K, N), or (E, N, K) with trans_b, bf16 or fp16 alike, batch_sizes
    (E,) rows per group (int32 or int64). Returns (T, N), group g's rows times b[g] (or
    b[g]^T), as `grouped_mm(a, b, cumsum(batch_sizes))`, differentiable in a and b. Bad input
    raises a ValueError or TypeError naming gmm and the argument.

    batch_sizes may stay on the CPU, as that package takes them: their sum is then checked
    against T and they are copied to a's device with each call. On a's device they are never
    read on the host (CUDA-graph capturable, unchecked as grouped_mm's offs are)."""
    try:
        offs, w = _gmm_offsets(a, b, batch_sizes, trans_b)
    except Exception:
        validate.not_nested("gmm", {"a": a, "b": b, "batch_sizes": batch_sizes})
        raise
    return _grouped_op(a, w, offs)
