# Matmul C = A @ B for bf16/fp16 with float32 accumulation, 2-D or batched 3-D; A and B may be
# row- or column-major (transposed views): the kernel reads any strides and the JIT specializes
# on which dim has unit stride, so each layout gets its own TMA/wgmma code without copies.
#
# No `from __future__ import annotations` here: it would hide the ct.Constant annotations.
from types import SimpleNamespace

import cuda.tile as ct
import torch

from tiletune import validate
from tiletune.autotune import Autotuner, Search, Work, bucket
from tiletune.device import current_stream, major, sm_count

ZERO = ct.PaddingMode.ZERO


# ---------------------------------------------------------------------------------------------
# Kernel: one CTA per (TM, TN) output tile, grouped tile order (GROUP_M row tiles share the B
# columns they read while those are in L2), K loop with zero padding for ragged K. The two
# helpers (tile order, mainloop) are what grouped and FP8 GEMM kernels reuse.

def tile_coords(tile, num_m, num_n, GROUP_M):
    """Grouped ("swizzled") order of output tiles: walk GROUP_M row tiles down a column band."""
    per_group = GROUP_M * num_n
    group = tile // per_group
    first_m = group * GROUP_M
    rows = min(num_m - first_m, GROUP_M)
    within = tile - group * per_group
    return first_m + within % rows, within // rows


def mainloop(a, b, z, m, n, acc, TM, TN, TK):
    """acc + a[z, m-tile, :] @ b[z, :, n-tile] in float32 (ct.mma: wgmma on sm_90). a (Z, M, K),
    b (Z, K, N), any strides; K need not be a multiple of TK (zero padding)."""
    return mainloop_range(a, b, z, m, n, acc, TM, TN, TK, 0, ct.cdiv(a.shape[2], TK))


def mainloop_range(a, b, z, m, n, acc, TM, TN, TK, k_first, k_end):
    """mainloop over the K tiles [k_first, k_end) only (split-K)."""
    for kk in range(k_first, k_end):
        at = ct.reshape(ct.load(a, (z, m, kk), (1, TM, TK), padding_mode=ZERO), (TM, TK))
        bt = ct.reshape(ct.load(b, (z, kk, n), (1, TK, TN), padding_mode=ZERO), (TK, TN))
        acc = ct.mma(at, bt, acc)
    return acc


@ct.kernel
def matmul_kernel(a, b, c, TM: ct.Constant[int], TN: ct.Constant[int], TK: ct.Constant[int],
                  GROUP_M: ct.Constant[int]):
    """a (Z, M, K), b (Z, K, N), c (Z, M, N) with any strides; grid (tiles, Z)."""
    z = ct.bid(1)
    num_m = ct.cdiv(a.shape[1], TM)
    num_n = ct.cdiv(b.shape[2], TN)
    m, n = tile_coords(ct.bid(0), num_m, num_n, GROUP_M)
    acc = mainloop(a, b, z, m, n, ct.zeros((TM, TN), ct.float32), TM, TN, TK)
    ct.store(c, (z, m, n), ct.reshape(acc.astype(c.dtype), (1, TM, TN)))


@ct.kernel
def matmul_persistent_kernel(a, b, c, TM: ct.Constant[int], TN: ct.Constant[int],
                             TK: ct.Constant[int], GROUP_M: ct.Constant[int]):
    """The same product on a grid of SMs x occupancy CTAs, each looping over output tiles of all
    batches in grouped order: no CTA launch or tail wave per tile."""
    num_m = ct.cdiv(a.shape[1], TM)
    num_n = ct.cdiv(b.shape[2], TN)
    tiles = num_m * num_n
    for t in range(ct.bid(0), tiles * a.shape[0], ct.num_blocks(0)):
        z = t // tiles
        m, n = tile_coords(t - z * tiles, num_m, num_n, GROUP_M)
        acc = mainloop(a, b, z, m, n, ct.zeros((TM, TN), ct.float32), TM, TN, TK)
        ct.store(c, (z, m, n), ct.reshape(acc.astype(c.dtype), (1, TM, TN)))


@ct.kernel
def matmul_splitk_kernel(a, b, w, TM: ct.Constant[int], TN: ct.Constant[int],
                         TK: ct.Constant[int], GROUP_M: ct.Constant[int],
                         SPLIT: ct.Constant[int]):
    """Split-K partials for skinny products (few output tiles, long K): grid (tiles, Z, SPLIT);
    CTA s sums its share of the K tiles into w[s * Z + z] (float32, (SPLIT * Z, M, N)).
    splitk_reduce_kernel adds the SPLIT partials in a fixed order: deterministic."""
    z = ct.bid(1)
    s = ct.bid(2)
    num_m = ct.cdiv(a.shape[1], TM)
    num_n = ct.cdiv(b.shape[2], TN)
    m, n = tile_coords(ct.bid(0), num_m, num_n, GROUP_M)
    k_tiles = ct.cdiv(a.shape[2], TK)
    per = ct.cdiv(k_tiles, SPLIT)
    k_first = s * per
    acc = mainloop_range(a, b, z, m, n, ct.zeros((TM, TN), ct.float32), TM, TN, TK, k_first,
                         min(k_first + per, k_tiles))
    ct.store(w, (s * a.shape[0] + z, m, n), ct.reshape(acc, (1, TM, TN)))


@ct.kernel
def splitk_reduce_kernel(w, c, TM: ct.Constant[int], TN: ct.Constant[int],
                         SPLIT: ct.Constant[int]):
    """c[z] = sum over s of w[s * Z + z], in the output dtype; grid (tiles, Z)."""
    z = ct.bid(1)
    num_n = ct.cdiv(c.shape[2], TN)
    m = ct.bid(0) // num_n
    n = ct.bid(0) - m * num_n
    acc = ct.zeros((1, TM, TN), ct.float32)
    for s in range(SPLIT):
        acc = acc + ct.load(w, (s * c.shape[0] + z, m, n), (1, TM, TN), padding_mode=ZERO)
    ct.store(c, (z, m, n), acc.astype(c.dtype))


# ---------------------------------------------------------------------------------------------
# Configs. Built from our own searches on an H200 (2026-11-26, 9 bench keys: 4096^3 ..
# 16384x4096x14336, both B layouts, M = 16/128/512; per-config times and what each dimension
# bought in references/parameter-space-design.md). Hopper keeps the fp32 accumulator in the
# registers of the warps that issue the MMA, so what fits is tile size per worker warp:
#   - 4 worker warps (the compiler's default) hold 128x128 at 255 registers; 128x256 spills
#     (1.8 KB stack) and ran 9-35x slower. With `num_worker_warps=8` two warpgroups split the
#     tile: 128x128, 128x256 and 256x128 all compile to 168 registers, no stack (sm_90
#     `cuobjdump -res-usage`), 128x256 as HGMMA 64x256x16.
#   - Winners after the engine's final round: 128x128 persistent at occupancy 1 (4 of 6 large
#     keys), 128x256 8-warp persistent (4096^3), the default (16384x4096x14336); 64x128 / 64x64
#     at M = 16 / 128, 128x128 occupancy 1 at M = 512. Each other entry came within 1-5% of
#     some key's winner in a search; kept while timings move that much between runs.
#   - Never within 5% of a winner, dropped: 128x128x128, 128x64, 4-warp 128x256 / 256x128 in
#     clusters, 64x32 at M <= 128, group_m 1, 64x256 (7%+), 128x128 8-warp persistent (20%+).
#   - Persistent 2-CTA clusters: 256x256 (8 warps) and 256x128 compile spill-free with
#     multicast TMA loads (UTMALDG.MULTICAST) for sm_90; the grid is SMs / 2 clusters. On an
#     H100 (session 5) persistent 256x256 won all 6 large keys' final rounds (4096^3: 179.4 us
#     vs 186.2 for 128x256 persistent).
# Entries: (tm, tn, tk, occupancy, num_ctas, num_worker_warps or None, persistent). Default first.

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
    (256, 256, 64, 1, 2, 8, True),            # persistent clusters (above)
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
# measured here.
OTHER_SPACE = [(128, 128, 32, 1, 1, None, False), (64, 128, 32, 2, 1, None, False)]
# Split-K (sm_90): for keys with at most a wave of output tiles each tile's K range is shared by
# SPLIT CTAs that write float32 partials, summed by a second kernel. Only where every split keeps
# >= 2 K tiles and the partials stay <= 64 MiB. Measured on an H100 (session 5, final rounds):
# 1.04-1.49x the best whole-K config where tiles are few and K long (16x1024x4096 .. 64x1024x14336,
# 64x64 split 2 or 4 won); 0.90-0.95x at 16 / 128 x 4096 x 4096 (64 tiles of 64x64: the sum kernel's
# launch costs more than the split saves), where the final round keeps the whole-K config.
# Entries: (tm, tn, tk, split).
SM90_SPLITK = [(64, 128, 64, 2), (64, 128, 64, 4), (64, 128, 64, 8), (64, 64, 64, 2),
               (64, 64, 64, 4), (128, 128, 64, 2)]
SPLITK_MAX_TILES = 128
SPLITK_MAX_BYTES = 64 << 20
# The partials' sum is memory-bound: small tiles, many CTAs (M = 16, N = 4096: 128 CTAs).
# 128x128 sum tiles spilled (184 B, sm_90).
SUM_TILE = (8, 64)


def matmul_configs(arch, m, n, k):
    mj = major(arch)
    space = SM90_SPACE if mj == 9 else SM100_SPACE if mj == 10 else OTHER_SPACE
    for tm, tn, tk, occ, nc, warps, persistent in space:
        cfg = SimpleNamespace(tm=tm, tn=tn, tk=tk, occupancy=occ, num_ctas=nc, group_m=8,
                              persistent=persistent)
        if warps is not None:
            cfg.num_worker_warps = warps
        yield cfg
    if mj != 9:
        return
    for tm, tn, tk, split in SM90_SPLITK:
        if (-(-m // tm) * -(-n // tn) <= SPLITK_MAX_TILES and -(-k // tk) >= 2 * split
                and split * m * n * 4 <= SPLITK_MAX_BYTES):
            yield SimpleNamespace(tm=tm, tn=tn, tk=tk, occupancy=1, num_ctas=1, group_m=8,
                                  persistent=False, split=split)


def split_of(cfg):
    """How many CTAs share each output tile's K range (1: no split-K)."""
    return getattr(cfg, "split", 1)


def kernel_for(cfg):
    """The bare kernel a config runs (the engine applies its hints); a split-K config also runs
    splitk_reduce_kernel after it."""
    if split_of(cfg) > 1:
        return matmul_splitk_kernel
    return matmul_persistent_kernel if cfg.persistent else matmul_kernel


_matmul = Autotuner("matmul", kernel_for, matmul_configs,
                    default=SimpleNamespace(tm=128, tn=128, tk=64, occupancy=1, num_ctas=1,
                                            group_m=8, persistent=False))
TUNERS = (_matmul,)


# ---------------------------------------------------------------------------------------------
# Host launch.

def grid(cfg, M, N, Z, dev):
    """Launch grid for (Z, M, K) @ (Z, K, N) under cfg on device index dev."""
    tiles = -(-M // cfg.tm) * -(-N // cfg.tn)
    if cfg.persistent:     # the grid counts clusters of num_ctas CTAs (one per logical tile)
        return (max(1, min(tiles * Z, sm_count(dev) * cfg.occupancy // cfg.num_ctas)), 1)
    split = split_of(cfg)
    return (tiles, Z, split) if split > 1 else (tiles, Z)


def kernel_args(cfg, a3, b3, c3, w):
    """Arguments of cfg's kernel: it writes c3, or for split-K the float32 partials w."""
    if split_of(cfg) == 1:
        return (a3, b3, c3, cfg.tm, cfg.tn, cfg.tk, cfg.group_m)
    return (a3, b3, w, cfg.tm, cfg.tn, cfg.tk, cfg.group_m, split_of(cfg))


def run(cfg, kernel, a3, b3, c3, dev, w=None):
    """Launch cfg's kernel(s) for c3 = a3 @ b3: one launch, or for split-K the partials into w
    (float32 (split * Z, M, N); allocated here if not given) and their sum into c3."""
    Z, M, _ = a3.shape
    N = b3.shape[2]
    split = split_of(cfg)
    if split > 1 and w is None:
        w = torch.empty((split * Z, M, N), device=c3.device, dtype=torch.float32)
    stream = current_stream(dev)
    ct.launch(stream, grid(cfg, M, N, Z, dev), kernel, kernel_args(cfg, a3, b3, c3, w))
    if split > 1:
        ct.launch(stream, (-(-M // SUM_TILE[0]) * -(-N // SUM_TILE[1]), Z), splitk_reduce_kernel,
                  (w, c3, *SUM_TILE, split))


def _layout(t):
    """'row' if the last dim has unit stride, 'col' if the middle one has, else 'strided'."""
    if t.stride(-1) == 1:
        return "row"
    if t.stride(-2) == 1:
        return "col"
    return "strided"


def launch(a3, b3, c3):
    Z, M, K = a3.shape
    N = b3.shape[2]
    dev = a3.get_device()
    key = (bucket(M), N, K, Z > 1, a3.dtype, _layout(a3), _layout(b3), dev)
    cfg, kernel = _matmul.cache.get(key) or _matmul.tune(key, a3, _search(a3, b3, c3, dev))
    run(cfg, kernel, a3, b3, c3, dev)


def _search(a3, b3, c3, dev):
    """The miss path's Search: split-K configs time their partials into scratch buffers (one per
    split count, made when first needed); the final round runs each config's whole launch
    sequence, the partials' sum included."""
    Z, M, K = a3.shape
    N = b3.shape[2]
    scratch = {}

    def partials(c):
        split = split_of(c)
        if split > 1 and split not in scratch:
            scratch[split] = torch.empty((split * Z, M, N), device=c3.device, dtype=torch.float32)
        return scratch.get(split)
    return Search(shape=dict(m=bucket(M), n=N, k=K), grid_fn=lambda c: grid(c, M, N, Z, dev),
                  args_fn=lambda c: kernel_args(c, a3, b3, c3, partials(c)),
                  work=Work(flops=2.0 * Z * M * N * K),
                  run_fn=lambda c, kernel: run(c, kernel, a3, b3, c3, dev, partials(c)),
                  partly_timed=lambda c: split_of(c) > 1)      # the search skips the sum


def _mm(a, b):
    """a (..., M, K) @ b (..., K, N) for 2-D or equal-batch 3-D inputs."""
    batched = a.dim() == 3
    a3, b3 = (a, b) if batched else (a[None], b[None])
    Z, M, K = a3.shape
    N = b3.shape[2]
    c3 = torch.empty((Z, M, N), device=a.device, dtype=a.dtype)
    if c3.numel():
        if K == 0:
            c3.zero_()
        else:
            launch(a3, b3, c3)
    return c3 if batched else c3[0]


# ---------------------------------------------------------------------------------------------
# Autograd: dA = dC @ B^T, dB = A^T @ dC, through the same kernel on transposed views.

class MatmulFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return _mm(a, b)

    @staticmethod
    def backward(ctx, dc):
        a, b = ctx.saved_tensors
        da = _mm(dc, b.transpose(-1, -2)) if ctx.needs_input_grad[0] else None
        db = _mm(a.transpose(-1, -2), dc) if ctx.needs_input_grad[1] else None
        return da, db


@torch.library.custom_op("tiletune::matmul", mutates_args=())
def _matmul_op(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _mm(a, b)


@_matmul_op.register_fake
def _(a, b):
    return a.new_empty((*a.shape[:-1], b.shape[-1]))


def _op_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _op_backward(ctx, dc):
    a, b = ctx.saved_tensors
    return _matmul_op(dc, b.transpose(-1, -2)), _matmul_op(a.transpose(-1, -2), dc)


_matmul_op.register_autograd(_op_backward, setup_context=_op_setup)


def matmul(a, b, *, out=None):
    """C = A @ B. a (M, K) and b (K, N), or batched (Z, M, K) and (Z, K, N); bf16 or fp16 (both
    alike), float32 accumulation, output in the input dtype. Either operand may be a transposed
    (column-major) view: no copies. Any M, N, K. `out`, if given, receives the result (copied;
    it is not differentiable). Differentiable in a and b."""
    validate.tensor("matmul", "a", a, dtypes=(torch.bfloat16, torch.float16))
    validate.tensor("matmul", "b", b, device=a.device, dtypes=(torch.bfloat16, torch.float16))
    if a.dtype != b.dtype:
        raise TypeError(f"matmul: a is {a.dtype} but b is {b.dtype}")
    if a.dim() not in (2, 3) or b.dim() != a.dim():
        raise ValueError(f"matmul: a and b must both be 2-D or both 3-D, got {a.dim()}-D and "
                         f"{b.dim()}-D")
    if a.dim() == 3 and a.shape[0] != b.shape[0]:
        raise ValueError(f"matmul: batch sizes differ ({a.shape[0]} vs {b.shape[0]})")
    if a.shape[-1] != b.shape[-2]:
        raise ValueError(f"matmul: inner dims differ: a {tuple(a.shape)} @ b {tuple(b.shape)}")
    if torch.compiler.is_compiling():
        c = _matmul_op(a, b)
    elif torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
        c = MatmulFunction.apply(a, b)
    else:
        c = _mm(a, b)
    if out is not None:
        return out.copy_(c)
    return c


# ---------------------------------------------------------------------------------------------
# Ahead-of-time compile cases: every sm_90 config for 4096^3 row-major bf16; the default config
# for the other three layouts, fp16, ragged sizes, batched and decode (M = 1).

def aot_cases():
    from tiletune.aot import CompileCase, jit_array

    def params(cfg, dt, Z, M, N, K, ta=False, tb=False):
        a = jit_array(dt, (Z, M, K), (M * K, 1, M) if ta else None)
        b = jit_array(dt, (Z, K, N), (K * N, 1, K) if tb else None)
        return [a, b, jit_array(dt, (Z, M, N)), cfg.tm, cfg.tn, cfg.tk, cfg.group_m]

    bf, f16 = torch.bfloat16, torch.float16
    for a_ in ("sm_90", "sm_100"):
        for cfg in matmul_configs(a_, 4096, 4096, 4096):
            yield CompileCase("matmul", _matmul.build(cfg), params(cfg, bf, 1, 4096, 4096, 4096),
                              f"matmul {a_} space 4096^3 bf16 {vars(cfg)}")
    cfg = next(matmul_configs("sm_90", 4096, 4096, 4096))
    for label, args in [("A^T", (bf, 1, 4096, 4096, 4096, True, False)),
                        ("B^T", (bf, 1, 4096, 4096, 4096, False, True)),
                        ("A^T B^T", (bf, 1, 4096, 4096, 4096, True, True)),
                        ("fp16 ragged 1000x1999x777", (f16, 1, 1000, 1999, 777)),
                        ("batched 8x512x1024x4096", (bf, 8, 512, 1024, 4096)),
                        ("decode 1x4096x4096", (bf, 1, 1, 4096, 4096))]:
        yield CompileCase("matmul", _matmul.build(cfg), params(cfg, *args), f"matmul {label}")
    persistent = next(c for c in matmul_configs("sm_90", 512, 1024, 4096) if c.persistent)
    yield CompileCase("matmul", _matmul.build(persistent),
                      params(persistent, f16, 8, 1000, 1999, 777, True, False),
                      f"matmul persistent batched fp16 ragged A^T {vars(persistent)}")
    def split_params(cfg, dt, Z, M, N, K, tb=False):
        return [jit_array(dt, (Z, M, K)), jit_array(dt, (Z, K, N), (K * N, 1, K) if tb else None),
                jit_array(torch.float32, (cfg.split * Z, M, N)), cfg.tm, cfg.tn, cfg.tk,
                cfg.group_m, cfg.split]

    def reduce_params(cfg, dt, Z, M, N):
        return [jit_array(torch.float32, (cfg.split * Z, M, N)), jit_array(dt, (Z, M, N)),
                *SUM_TILE, cfg.split]

    sums = set()
    for cfg in matmul_configs("sm_90", 16, 4096, 4096):
        if split_of(cfg) > 1:
            yield CompileCase("matmul", _matmul.build(cfg), split_params(cfg, bf, 1, 16, 4096, 4096),
                              f"matmul split-K partials 16x4096x4096 bf16 {vars(cfg)}")
            if cfg.split not in sums:
                sums.add(cfg.split)
                yield CompileCase("matmul", splitk_reduce_kernel,
                                  reduce_params(cfg, bf, 1, 16, 4096),
                                  f"matmul split-K sum of {cfg.split} 16x4096 bf16")
    cfg = next(c for c in matmul_configs("sm_90", 128, 270, 2000) if split_of(c) > 1)
    yield CompileCase("matmul", _matmul.build(cfg), split_params(cfg, f16, 3, 100, 270, 2000, True),
                      f"matmul split-K partials batched fp16 ragged B^T {vars(cfg)}")
    yield CompileCase("matmul", splitk_reduce_kernel, reduce_params(cfg, f16, 3, 100, 270),
                      f"matmul split-K sum of {cfg.split} batched fp16 ragged")
    for cfg in matmul_configs("sm_80", 4096, 4096, 4096):
        yield CompileCase("matmul", _matmul.build(cfg), params(cfg, bf, 1, 4096, 4096, 4096),
                          f"matmul pre-Hopper default space {vars(cfg)}")


# ---------------------------------------------------------------------------------------------
# Benchmarks (python -m tiletune bench matmul): against cuBLAS (torch.matmul) in the same run.

BENCH_SHAPES = ((4096, 4096, 4096, False), (8192, 8192, 8192, False), (16384, 4096, 14336, False),
                (4096, 14336, 4096, False), (4096, 4096, 4096, True), (4096, 14336, 4096, True),
                (16, 4096, 4096, False), (128, 4096, 4096, False), (512, 4096, 4096, False))


def _tilegym_matmul():
    try:
        from tilegym.ops.cutile.matmul import matmul as tg_matmul
        return tg_matmul
    except Exception:
        return None


def bench_cases():
    from tiletune.bench import BenchCase
    tg = _tilegym_matmul()
    cases = []
    for M, N, K, b_t in BENCH_SHAPES:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = (torch.randn(N, K, device="cuda", dtype=torch.bfloat16).t() if b_t
             else torch.randn(K, N, device="cuda", dtype=torch.bfloat16))
        peers = {"cublas": lambda a=a, b=b: torch.matmul(a, b)}
        if tg is not None:     # TileGym refuses trans_b: it gets B copied to row-major, untimed
            peers["tilegym"] = lambda a=a, b=b.contiguous(): tg(a, b)
        cases.append(BenchCase("matmul", f"{M}x{N}x{K}{' B^T' if b_t else ''} bf16", "fwd",
                               lambda a=a, b=b: matmul(a, b), peers, flops=2.0 * M * N * K))
    return cases
