# Matmul C = A @ B for bf16/fp16 with float32 accumulation, 2-D or batched 3-D; A and B may be
# row- or column-major (transposed views): the kernel reads any strides and the JIT specializes
# on which dim has unit stride, so each layout gets its own TMA/wgmma code without copies.
#
# No `from __future__ import annotations` here: it would hide the ct.Constant annotations.
from types import SimpleNamespace

import cuda.tile as ct
import torch

from tiletune import validate
from tiletune.autotune import Autotuner, Work, bucket, bucketed
from tiletune.device import major, persistent_ctas
from tiletune.ops.gemm_tiles import layout, output_tile, tile_count
from tiletune.space import cdiv, table
from tiletune.torch_op import TrainableOp

ZERO = ct.PaddingMode.ZERO


# ---------------------------------------------------------------------------------------------
# Kernel: one CTA per (TM, TN) output tile, grouped tile order (GROUP_M row tiles share the B
# columns they read while those are in L2; ops/gemm_tiles.py), K loop with zero padding for
# ragged K.

def mainloop(a, b, z, m, n, acc, TM, TN, TK):
    """acc + a[z, m-tile, :] @ b[z, :, n-tile] in float32 (ct.mma: wgmma on sm_90). a (Z, M, K),
    b (Z, K, N), or 2-D (z is then ignored), any strides; K need not be a multiple of TK (zero
    padding)."""
    return mainloop_range(a, b, z, m, n, acc, TM, TN, TK, 0, ct.cdiv(a.shape[-1], TK))


def mainloop_range(a, b, z, m, n, acc, TM, TN, TK, k_first, k_end):
    """mainloop over the K tiles [k_first, k_end) only (split-K)."""
    for kk in range(k_first, k_end):
        acc = ct.mma(a_tile(a, z, m, kk, TM, TK), b_tile(b, z, kk, n, TK, TN), acc)
    return acc


# The tile loads and the store, shared with ops/gated_mlp.py's two-accumulator kernel. Arrays
# are 3-D (Z, rows, cols), or 2-D (one product; z is ignored): a 2-D call passes its tensors as
# they are, without the [None] views (about 1 us of host time each).

def batches(a):
    """Z of a 3-D array, 1 of a 2-D one."""
    return 1 if a.ndim == 2 else a.shape[0]


def _tile(a, z, i, j, TI, TJ):
    """a's (TI, TJ) tile (i, j) of batch z, zeros past its edges."""
    if a.ndim == 2:
        return ct.load(a, (i, j), (TI, TJ), padding_mode=ZERO)
    return ct.reshape(ct.load(a, (z, i, j), (1, TI, TJ), padding_mode=ZERO), (TI, TJ))


def a_tile(a, z, m, kk, TM, TK):
    """A's (TM, TK) tile (m, kk) of batch z, zeros past M and K."""
    return _tile(a, z, m, kk, TM, TK)


def b_tile(b, z, kk, n, TK, TN):
    """B's (TK, TN) tile (kk, n) of batch z, zeros past K and N."""
    return _tile(b, z, kk, n, TK, TN)


def store_tile(c, z, m, n, acc):
    """The float32 (TM, TN) tile acc into c[z] at tile (m, n), in c's dtype (the part past M
    and N is dropped)."""
    if c.ndim == 2:
        ct.store(c, (m, n), acc.astype(c.dtype))
    else:
        ct.store(c, (z, m, n), ct.reshape(acc.astype(c.dtype), (1, acc.shape[0], acc.shape[1])))


@ct.kernel
def matmul_kernel(a, b, c, TM: ct.Constant[int], TN: ct.Constant[int], TK: ct.Constant[int],
                  GROUP_M: ct.Constant[int]):
    """a (Z, M, K), b (Z, K, N), c (Z, M, N), or all 2-D, with any strides; grid (tiles, Z)."""
    z = ct.bid(1)
    m, n = output_tile(ct.bid(0), a.shape[-2], b.shape[-1], TM, TN, GROUP_M)
    acc = mainloop(a, b, z, m, n, ct.zeros((TM, TN), ct.float32), TM, TN, TK)
    store_tile(c, z, m, n, acc)


@ct.kernel
def matmul_persistent_kernel(a, b, c, TM: ct.Constant[int], TN: ct.Constant[int],
                             TK: ct.Constant[int], GROUP_M: ct.Constant[int]):
    """The same product on a grid of SMs x occupancy CTAs, each looping over output tiles of all
    batches in grouped order: no CTA launch or tail wave per tile."""
    tiles = tile_count(a.shape[-2], b.shape[-1], TM, TN)
    for t in range(ct.bid(0), tiles * batches(a), ct.num_blocks(0)):
        z = t // tiles
        m, n = output_tile(t - z * tiles, a.shape[-2], b.shape[-1], TM, TN, GROUP_M)
        acc = mainloop(a, b, z, m, n, ct.zeros((TM, TN), ct.float32), TM, TN, TK)
        store_tile(c, z, m, n, acc)


@ct.kernel
def matmul_splitk_kernel(a, b, w, TM: ct.Constant[int], TN: ct.Constant[int],
                         TK: ct.Constant[int], GROUP_M: ct.Constant[int],
                         SPLIT: ct.Constant[int]):
    """Split-K partials for skinny products (few output tiles, long K): grid (tiles, Z, SPLIT);
    CTA s sums its share of the K tiles into w[s * Z + z] (float32, (SPLIT * Z, M, N); Z is 1
    for 2-D a and b). splitk_reduce_kernel adds the SPLIT partials in a fixed order:
    deterministic."""
    z = ct.bid(1)
    s = ct.bid(2)
    m, n = output_tile(ct.bid(0), a.shape[-2], b.shape[-1], TM, TN, GROUP_M)
    k_tiles = ct.cdiv(a.shape[-1], TK)
    per = ct.cdiv(k_tiles, SPLIT)
    k_first = s * per
    acc = mainloop_range(a, b, z, m, n, ct.zeros((TM, TN), ct.float32), TM, TN, TK, k_first,
                         min(k_first + per, k_tiles))
    ct.store(w, (s * batches(a) + z, m, n), ct.reshape(acc, (1, TM, TN)))


@ct.kernel
def splitk_reduce_kernel(w, c, TM: ct.Constant[int], TN: ct.Constant[int],
                         SPLIT: ct.Constant[int]):
    """c[z] = sum over s of w[s * Z + z], in the output dtype (c 3-D, or 2-D with Z 1); grid
    (tiles, Z)."""
    z = ct.bid(1)
    num_n = ct.cdiv(c.shape[-1], TN)
    m = ct.bid(0) // num_n
    n = ct.bid(0) - m * num_n
    acc = ct.zeros((1, TM, TN), ct.float32)
    for s in range(SPLIT):
        acc = acc + ct.load(w, (s * batches(c) + z, m, n), (1, TM, TN), padding_mode=ZERO)
    store_tile(c, z, m, n, ct.reshape(acc, (TM, TN)))


# ---------------------------------------------------------------------------------------------
# Configs. Hopper keeps the float32 accumulator in the registers of the warps that issue the MMA,
# so what fits is tile size per worker warp: 4 worker warps (the compiler's default) hold up to
# 128x128 (128x256 spills); 8 worker warps hold 128x256 and 256x128 without spilling; a 2-CTA
# cluster makes 256x256 of two 128x256 CTAs (multicast TMA loads; a persistent grid counts
# clusters). Entries never within 5% of a search winner on the bench keys are left out (128x64,
# TK = 128 above 128 rows, 64x256, GROUP_M = 1, 4-warp 128x256 / 256x128 clusters, 8-warp
# persistent 128x128).
# Split-K only where output tiles are few and K long (see SPLITK_*). Per-config timings:
# references/parameter-space-design.md (matmul), references/kernel-type-templates.md (GEMM).

FIELDS = ("tm", "tn", "tk", "occupancy", "num_ctas", "num_worker_warps", "persistent")
SM90_SPACE = [
    (128, 128, 64, 2, 1, None, False),        # the known-good default
    (128, 128, 64, 1, 1, None, True),
    (128, 128, 64, 1, 1, None, False),
    (256, 128, 64, 2, 2, None, False),
    (128, 256, 64, 1, 1, 8, False),
    (128, 256, 64, 1, 1, 8, True),
    (256, 128, 64, 1, 1, 8, False),
    (256, 128, 64, 1, 1, 8, True),
    (128, 128, 64, 1, 1, 8, False),
    (256, 256, 64, 1, 2, 8, False),           # 128x256 per CTA, pairs in a cluster
    (256, 256, 64, 1, 2, 8, True),            # persistent clusters
    (256, 128, 64, 1, 2, None, True),
    (64, 128, 64, 1, 1, None, False),
    (64, 128, 64, 2, 1, None, False),
    (64, 64, 64, 1, 1, None, False),
    (64, 64, 64, 2, 1, None, True),
]
# sm_100 (compile-checked only): accumulators live in tensor memory, not registers; the 4-warp
# entries and clusters are what is plausible there.
SM100_SPACE = [e for e in SM90_SPACE if e[5] is None] + [(256, 256, 64, 1, 2, None, False)]
# Anything else (sm_80, sm_12x: no wgmma, smaller shared memory): a conservative pair, never
# measured.
OTHER_SPACE = [(128, 128, 32, 1, 1, None, False), (64, 128, 32, 2, 1, None, False)]
# Skinny products (sm_90; decode and small batches), where each CTA streams a long slab of B:
# a K step of 128 keeps more of it in flight (a 222 KB TMA ring against 165 KB at 64), and a
# 16-row tile builds as HMMA 16x8x16, not a 64-row HGMMA that carries 48 rows of padding. On an
# H200 they won M = 16, 64 and 128 of (M, 4096) @ (4096, 4096) by 6-7% over the space's best
# before them (references/parameter-space-design.md, matmul). Each is offered only where M
# (its bucket) is at most its last field.
SM90_SKINNY = [(64, 64, 128, 1, 1, None, False, 128), (16, 64, 128, 1, 1, None, False, 16)]
# Split-K (sm_90): SPLIT CTAs share each output tile's K range and write float32 partials that a
# second kernel sums. Only for keys with at most SPLITK_MAX_TILES output tiles, at least 2 K
# tiles per split and partials (SPLIT x Z x M x N float32, all batches) of at most
# SPLITK_MAX_BYTES; elsewhere the sum kernel's launch costs more than the split saves.
SPLITK_FIELDS = ("tm", "tn", "tk", "split")
SM90_SPLITK = [(64, 128, 64, 2), (64, 128, 64, 4), (64, 128, 64, 8), (64, 64, 64, 2),
               (64, 64, 64, 4), (128, 128, 64, 2)]
SPLITK_MAX_TILES = 128
SPLITK_MAX_BYTES = 64 << 20
# The partials' sum is memory-bound: small tiles, many CTAs (128x128 sum tiles spill on sm_90).
SUM_TILE = (8, 64)


def matmul_configs(arch, m, n, k, z=1):
    """The space for z batches of (m, k) @ (k, n) on `arch`, default first. z bounds split-K's
    scratch (split * z * m * n float32 partials)."""
    mj = major(arch)
    yield from table(FIELDS, SM90_SPACE if mj == 9 else SM100_SPACE if mj == 10 else OTHER_SPACE,
                     group_m=8)
    if mj == 9:
        yield from table(FIELDS, [r[:-1] for r in SM90_SKINNY if m <= r[-1]], group_m=8)
        yield from table(SPLITK_FIELDS, splitk_rows(SM90_SPLITK, m, n, k, z),
                         occupancy=1, num_ctas=1, group_m=8, persistent=False)


def splitk_rows(rows, m, n, k, z=1):
    """The split-K entries (tm, tn, tk, split, ...) worth searching for z products of (m, k) @
    (k, n): at most SPLITK_MAX_TILES output tiles, at least two K tiles a split, partials within
    SPLITK_MAX_BYTES (also FP8's split-K space)."""
    return [r for r in rows
            if cdiv(m, r[0]) * cdiv(n, r[1]) <= SPLITK_MAX_TILES and cdiv(k, r[2]) >= 2 * r[3]
            and r[3] * z * m * n * 4 <= SPLITK_MAX_BYTES]


def split_of(cfg):
    """How many CTAs share each output tile's K range (1: no split-K)."""
    return getattr(cfg, "split", 1)


def kernel_for(cfg):
    """The bare kernel a config runs (the engine applies its hints); a split-K config also runs
    splitk_reduce_kernel after it."""
    if split_of(cfg) > 1:
        return matmul_splitk_kernel
    return matmul_persistent_kernel if cfg.persistent else matmul_kernel


# ---------------------------------------------------------------------------------------------
# Launch. Inputs are a (Z, M, K), b (Z, K, N), c (Z, M, N), or all three 2-D (Z = 1), then the
# scratch buffer w: the float32 partials (split * Z, M, N) of a split-K config, empty for the
# others. A 2-D product and a 3-D one with Z = 1 share their keys and configs (the same grid);
# each rank is its own JIT specialization of the kernel.

def _dims(a, b):
    """(Z, M, K, N) of a @ b; Z is 1 for 2-D operands."""
    if a.dim() == 2:
        return 1, a.shape[0], a.shape[1], b.shape[1]
    return a.shape[0], a.shape[1], a.shape[2], b.shape[2]


def _grid(cfg, dev, a, b, c, w):
    Z, M, _, N = _dims(a, b)
    tiles = cdiv(M, cfg.tm) * cdiv(N, cfg.tn)
    if cfg.persistent:     # the grid counts clusters of num_ctas CTAs (one per logical tile)
        return (persistent_ctas(tiles * Z, dev, cfg.occupancy, cfg.num_ctas), 1)
    split = split_of(cfg)
    return (tiles, Z, split) if split > 1 else (tiles, Z)


def _args(cfg, a, b, c, w):
    """cfg's kernel writes c, or for split-K the partials w."""
    split = split_of(cfg)
    if split == 1:
        return (a, b, c, cfg.tm, cfg.tn, cfg.tk, cfg.group_m)
    return (a, b, w, cfg.tm, cfg.tn, cfg.tk, cfg.group_m, split)


def _scratch(cfg, dev, a, b, c):
    """Split-K's float32 partials; None (no buffer) for whole-K configs."""
    split = split_of(cfg)
    if split == 1:
        return None
    Z, M, _, N = _dims(a, b)
    return (split * Z, M, N), torch.float32


def _sum_grid(c):
    Z = 1 if c.dim() == 2 else c.shape[0]
    return (cdiv(c.shape[-2], SUM_TILE[0]) * cdiv(c.shape[-1], SUM_TILE[1]), Z)


def _sum_args(split, c, w):
    return (w, c, *SUM_TILE, split)


def launch_splitk_sum(stream, split, c, w):
    """c = the sum of the split float32 partials w (split * Z, M, N), in a fixed order: the
    second launch of a split-K config (also of FP8 block scaling's, whose partials are scaled)."""
    ct.launch(stream, _sum_grid(c), splitk_reduce_kernel, _sum_args(split, c, w))


def _run(cfg, kernel, stream, dev, a, b, c, w):
    """cfg's kernel, then for split-K the partials' sum into c (in a fixed order)."""
    ct.launch(stream, _grid(cfg, dev, a, b, c, w), kernel, _args(cfg, a, b, c, w))
    if split_of(cfg) > 1:
        launch_splitk_sum(stream, split_of(cfg), c, w)


def _space(a, b, c):
    Z, M, K, N = _dims(a, b)
    return dict(m=bucket(M), n=N, k=K, z=bucket(Z))


def _work(a, b, c):
    Z, M, K, N = _dims(a, b)
    return Work(flops=2.0 * Z * M * N * K)


# The hard-coded fallback of matmul's tuner and of the GEMMs that reuse its space.
DEFAULT = SimpleNamespace(tm=128, tn=128, tk=64, occupancy=1, num_ctas=1, group_m=8,
                          persistent=False)
_matmul = Autotuner(
    "matmul", kernel_for, matmul_configs, default=DEFAULT, space=_space,
    grid=_grid, args=_args, scratch=_scratch, run=_run, tune_key=bucketed(0, 3),
    partly_timed=lambda cfg: split_of(cfg) > 1,     # the search times the partials, not the sum
    work=_work)
TUNERS = (_matmul,)


MAX_BATCH = 65535      # CUDA's cap on a grid's second axis, where non-persistent configs put Z


def launch(a, b, c):
    """c = a @ b (all 3-D, or all 2-D). The launch key holds M and the batch Z themselves (a
    config without scratch launches on the grid planned for them), the tuning key their buckets
    (the space, split-K's scratch bound included, is that of the bucket's largest Z). A batch
    past MAX_BATCH runs as launches of at most MAX_BATCH products each."""
    if a.dim() == 2:
        M, K = a.shape
        Z = 1
    else:
        Z, M, K = a.shape
        if Z > MAX_BATCH:
            for z in range(0, Z, MAX_BATCH):
                launch(a[z:z + MAX_BATCH], b[z:z + MAX_BATCH], c[z:z + MAX_BATCH])
            return
    dev = a.get_device()
    key = (M, b.shape[-1], K, Z, a.dtype, layout(a), layout(b), dev)
    _matmul.launch(key, dev, a, b, c)


# ---------------------------------------------------------------------------------------------
# Host side.

def plain_matmul(a, b):
    """a (..., M, K) @ b (..., K, N) for 2-D or equal-batch 3-D inputs, without input checks or
    autograd (the custom op's forward; the GEMM family's backward passes call it)."""
    if a.dim() == 2:
        K = a.shape[1]
        c = a.new_empty(a.shape[0], b.shape[1])
    else:
        K = a.shape[2]
        c = a.new_empty(a.shape[0], a.shape[1], b.shape[2])
    if c.numel():
        if K == 0:
            c.zero_()
        else:
            launch(a, b, c)
    return c


def _check(a, b):
    validate.tensor("matmul", "a", a, dtypes=(torch.bfloat16, torch.float16))
    validate.tensor("matmul", "b", b, like=a, dtypes=(torch.bfloat16, torch.float16))
    if a.dtype != b.dtype:
        raise TypeError(f"matmul: a is {a.dtype} but b is {b.dtype}")
    if a.dim() not in (2, 3) or b.dim() != a.dim():
        raise ValueError(f"matmul: a and b must both be 2-D or both 3-D, got {a.dim()}-D and "
                         f"{b.dim()}-D")
    if a.dim() == 3 and a.shape[0] != b.shape[0]:
        raise ValueError(f"matmul: batch sizes differ ({a.shape[0]} vs {b.shape[0]})")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul: inner dims differ: a {tuple(a.shape)} @ b {tuple(b.shape)}")


# ---------------------------------------------------------------------------------------------
# Autograd and custom op: dA = dC @ B^T, dB = A^T @ dC, through the same kernel on transposed
# views (each its own key); a gradient not needed is not computed.

def _backward(needs, dc, a, b):
    return (plain_matmul(dc, b.transpose(-1, -2)) if needs[0] else None,
            plain_matmul(a.transpose(-1, -2), dc) if needs[1] else None)


def _mm_shape(a, b):
    return a.new_empty((*a.shape[:-1], b.shape[-1]))


def _save_for_the_other(args, results):
    """Each operand only where the other one needs a gradient (its gradient reads it)."""
    a, b = args
    return (a if b.requires_grad else None, b if a.requires_grad else None), ()


_matmul_op = TrainableOp(
    "tiletune::matmul", forward=plain_matmul,
    forward_schema="(Tensor a, Tensor b) -> Tensor", forward_fake=_mm_shape,
    save=_save_for_the_other,
    backward=_backward,
    backward_schema="(bool[] needs, Tensor dc, Tensor? a, Tensor? b) -> (Tensor?, Tensor?)",
    backward_fake=lambda needs, dc, a, b: (
        dc.new_empty((*dc.shape[:-1], b.shape[-2])) if needs[0] else None,
        dc.new_empty((*a.shape[:-2], a.shape[-1], dc.shape[-1])) if needs[1] else None))


def _check_out(a, b, out):
    """`out` must be exactly the result's shape, a's dtype and device (no broadcasting)."""
    validate.out("matmul", out, (*a.shape[:-1], b.shape[-1]), a.dtype, a.device,
                 kept={"a": a, "b": b})


def matmul(a, b, *, out=None):
    """C = A @ B. a (M, K) and b (K, N), or batched (Z, M, K) and (Z, K, N); bf16 or fp16 (both
    alike), float32 accumulation, output in the input dtype. Either operand may be a transposed
    (column-major) view: no copies. Any M, N, K. `out`, if given, receives a copy of the result
    (gradients flow through it as through `out.copy_(result)`): it must have the result's shape,
    a's dtype and device, and be writable: no stride-0 dims, and, where autograd records a
    graph (grad mode on, outside torch.inference_mode(), as torch's copy_ decides), not a leaf
    that requires grad nor a view of one, and no memory of a or b where one of them requires
    grad; else ValueError / TypeError. Nested (jagged) tensors are refused (TypeError).
    Differentiable in a and b; works under torch.compile(fullgraph=True)."""
    try:
        _check(a, b)
        if out is not None:
            _check_out(a, b, out)
        c = _matmul_op(a, b)
    except Exception:
        validate.not_nested("matmul", {"a": a, "b": b})
        raise
    if out is not None:
        return out.copy_(c)
    return c
