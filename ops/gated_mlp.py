# The gate and up projections of a gated MLP with the activation as their epilogue:
#   y = act(x @ w_gate^T) * (x @ w_up^T)        (act = silu: SwiGLU, Llama/Mistral/Qwen)
# x (M, K), w_gate and w_up (N, K) as nn.Linear stores them; the kernels read the weights through
# their transposed (K, N) views (column-major: no copies). One CTA computes one (TM, TN) tile of
# y: per K step it loads the x tile once and multiplies it with the gate and the up weight tiles
# into two float32 accumulators, then computes act(g) * u in float32 and stores y in the input
# dtype. Neither g nor u goes through memory unless the backward needs them.
#
# Training: the forward kernel also stores g and u (a constant flag, one compile each way), so the
# backward does not run the two GEMMs again. The backward is ops/swiglu.py's (dgate, dup from g,
# u and dy), then dx = dgate @ w_gate + dup @ w_up in one kernel here (both products summed in
# one accumulator: no second (M, K) tensor and no add) and dw_gate = dgate^T x, dw_up = dup^T x
# through ops/matmul.py; a gradient not needed is not computed.
#
# No `from __future__ import annotations` here: it would hide the ct.Constant annotations.
import math
from types import SimpleNamespace

import cuda.tile as ct
import torch

from tiletune import validate
from tiletune.autotune import Autotuner, Work, bucket
from tiletune.device import major
from tiletune.ops import swiglu as glu
from tiletune.ops.gemm_tiles import layout, output_tile, tile_count, tile_grid
from tiletune.ops.matmul import DEFAULT as MATMUL_DEFAULT
from tiletune.ops.matmul import (a_tile, b_tile, mainloop, matmul_configs, plain_matmul,
                                  split_of, store_tile)
from tiletune.ops.swiglu import SILU, activation
from tiletune.space import table
from tiletune.torch_op import TrainableOp, records_graph

DTYPES = (torch.bfloat16, torch.float16)


# ---------------------------------------------------------------------------------------------
# Kernels. Arrays are 3-D with one batch (1, rows, cols), as matmul's: x (1, M, K), w_gate and
# w_up (1, K, N) with any strides, y, gate and up (1, M, N). Tile order, loads (zero padding past
# M, N and K) and stores are matmul's.

def dual_mainloop(x, wg, wu, m, n, TM, TN, TK):
    """(x @ wg, x @ wu) of output tile (m, n) in float32: each x tile is loaded once for both."""
    g = ct.zeros((TM, TN), ct.float32)
    u = ct.zeros((TM, TN), ct.float32)
    for kk in range(ct.cdiv(x.shape[2], TK)):
        xt = a_tile(x, 0, m, kk, TM, TK)
        g = ct.mma(xt, b_tile(wg, 0, kk, n, TK, TN), g)
        u = ct.mma(xt, b_tile(wu, 0, kk, n, TK, TN), u)
    return g, u


def gated_tile(x, wg, wu, y, gate, up, m, n, ACT, TM, TN, TK, SAVE):
    """y's output tile (m, n), and with SAVE the pre-activations' (else gate and up are not
    touched)."""
    g, u = dual_mainloop(x, wg, wu, m, n, TM, TN, TK)
    store_tile(y, 0, m, n, activation(g, ACT) * u)
    if SAVE:
        store_tile(gate, 0, m, n, g)
        store_tile(up, 0, m, n, u)


@ct.kernel
def gated_mlp_kernel(x, wg, wu, y, gate, up, ACT: ct.Constant[int], TM: ct.Constant[int],
                     TN: ct.Constant[int], TK: ct.Constant[int], GROUP_M: ct.Constant[int],
                     SAVE: ct.Constant[bool], PERSISTENT: ct.Constant[bool]):
    """Output tiles in grouped order: one per CTA on a 1-D grid over the tiles; PERSISTENT:
    SMs x occupancy CTAs (clusters), each walking the tiles."""
    if PERSISTENT:
        for t in range(ct.bid(0), tile_count(x.shape[1], wg.shape[2], TM, TN), ct.num_blocks(0)):
            m, n = output_tile(t, x.shape[1], wg.shape[2], TM, TN, GROUP_M)
            gated_tile(x, wg, wu, y, gate, up, m, n, ACT, TM, TN, TK, SAVE)
    else:
        m, n = output_tile(ct.bid(0), x.shape[1], wg.shape[2], TM, TN, GROUP_M)
        gated_tile(x, wg, wu, y, gate, up, m, n, ACT, TM, TN, TK, SAVE)


def dual_product_tile(a1, b1, a2, b2, c, m, n, TM, TN, TK):
    """c's output tile (m, n) of a1 @ b1 + a2 @ b2: matmul's K loop over each pair in turn, into
    one float32 accumulator, stored once."""
    acc = mainloop(a1, b1, 0, m, n, ct.zeros((TM, TN), ct.float32), TM, TN, TK)
    store_tile(c, 0, m, n, mainloop(a2, b2, 0, m, n, acc, TM, TN, TK))


@ct.kernel
def dual_product_kernel(a1, b1, a2, b2, c, TM: ct.Constant[int], TN: ct.Constant[int],
                        TK: ct.Constant[int], GROUP_M: ct.Constant[int],
                        PERSISTENT: ct.Constant[bool]):
    """c = a1 @ b1 + a2 @ b2 for (1, rows, cols) arrays with any strides (the input gradient
    dgate @ w_gate + dup @ w_up); tiles as gated_mlp_kernel's."""
    if PERSISTENT:
        for t in range(ct.bid(0), tile_count(a1.shape[1], b1.shape[2], TM, TN), ct.num_blocks(0)):
            m, n = output_tile(t, a1.shape[1], b1.shape[2], TM, TN, GROUP_M)
            dual_product_tile(a1, b1, a2, b2, c, m, n, TM, TN, TK)
    else:
        m, n = output_tile(ct.bid(0), a1.shape[1], b1.shape[2], TM, TN, GROUP_M)
        dual_product_tile(a1, b1, a2, b2, c, m, n, TM, TN, TK)


# ---------------------------------------------------------------------------------------------
# Configs. Two float32 accumulators per CTA: a (TM, TN) tile here holds what a (TM, 2 TN) tile of
# matmul holds in registers on sm_90 (and loads as many bytes per K step: one x tile, two weight
# tiles), so each entry is the twin of a matmul entry with twice the width (ops/matmul.py's
# notes: 4 worker warps hold 128x128 of float32 at most, 8 hold 128x256 without spilling). Hence
# 128x128 needs 8 worker warps (with 4 its sm_90 cubin spills 512 B), and 128x64 / 64x128 are
# the 4-warp tiles (255 registers, no stack). The default is the twin of matmul's 8-warp 128x256
# tile (within 1-4% of the search winner on all six large matmul keys): 168 registers and no
# stack on sm_90, the most headroom for the epilogue. The 2-CTA clusters split the M side
# (128x128 per CTA) and multicast the two weight tiles, the larger part of each K step. Register
# counts: CI cubins (references/parameter-space-design.md). On an H100 the default won the
# 16384x4096->14336 bf16 key, forward and training variants (BENCHMARKS.md).

FIELDS = ("tm", "tn", "tk", "occupancy", "num_ctas", "num_worker_warps", "persistent")
SM90_SPACE = [
    (128, 128, 64, 1, 1, 8, False),          # the default (see above)
    (128, 128, 64, 1, 1, 8, True),
    (256, 128, 64, 1, 2, 8, False),          # 128x128 per CTA, pairs in a cluster
    (256, 128, 64, 1, 2, 8, True),           # persistent clusters
    (256, 64, 64, 1, 1, 8, False),
    (128, 64, 64, 1, 1, None, False),
    (128, 64, 64, 1, 1, None, True),
    (128, 64, 64, 2, 1, None, False),
    (64, 128, 64, 1, 1, None, False),        # few rows (decode, small batches)
    (64, 64, 64, 1, 1, None, False),
]
# sm_100 (compile-checked only): accumulators live in tensor memory (2 x 128x128 float32 is half
# of it), not registers; 4 worker warps and clusters, as matmul's sm_100 space.
SM100_SPACE = [(128, 128, 64, 1, 1, None, False), (128, 128, 64, 1, 1, None, True),
               (256, 128, 64, 1, 2, None, False)] + [e for e in SM90_SPACE if e[5] is None]
# Anything else (no wgmma, less shared memory): a conservative pair, never measured.
OTHER_SPACE = [(128, 64, 32, 1, 1, None, False), (64, 64, 32, 2, 1, None, False)]


def configs(arch, m, n, k):
    """The space for (m, k) rows times (k, n) weights on `arch`, default first (every entry
    serves every shape: tiles past the ends are padded)."""
    mj = major(arch)
    yield from table(FIELDS, SM90_SPACE if mj == 9 else SM100_SPACE if mj == 10 else OTHER_SPACE,
                     group_m=8)


def dx_configs(arch, m, n, k):
    """The input gradient's space: matmul's without split-K (one float32 accumulator per tile,
    as a matmul tile's), default first."""
    yield from (cfg for cfg in matmul_configs(arch, m, n, k) if split_of(cfg) == 1)


# ---------------------------------------------------------------------------------------------
# Launch. Inputs: x3 (1, M, K), wg3 and wu3 (1, K, N), y3 (1, M, N), gate3 and up3 (1, M, N)
# (with save False, y3 stands in for both: not read, not written), act, save.

def _grid(cfg, dev, x3, wg3, wu3, y3, g3, u3, act, save):
    return tile_grid(cfg, dev, x3.shape[1], wg3.shape[2])


def _args(cfg, x3, wg3, wu3, y3, g3, u3, act, save):
    return (x3, wg3, wu3, y3, g3, u3, act, cfg.tm, cfg.tn, cfg.tk, cfg.group_m, save,
            cfg.persistent)


_gated = Autotuner(
    "gated_mlp", gated_mlp_kernel, configs,
    default=SimpleNamespace(tm=128, tn=128, tk=64, occupancy=1, num_ctas=1, num_worker_warps=8,
                            group_m=8, persistent=False),
    space=lambda x3, wg3, *rest: dict(m=bucket(x3.shape[1]), n=wg3.shape[2], k=x3.shape[2]),
    grid=_grid, args=_args,
    work=lambda x3, wg3, *rest: Work(flops=4.0 * x3.shape[1] * wg3.shape[2] * x3.shape[2]))
_dx = Autotuner(
    "gated_mlp_dx", dual_product_kernel, dx_configs, default=MATMUL_DEFAULT,
    space=lambda a1, b1, *rest: dict(m=bucket(a1.shape[1]), n=b1.shape[2], k=a1.shape[2]),
    grid=lambda cfg, dev, a1, b1, a2, b2, c: tile_grid(cfg, dev, a1.shape[1], b1.shape[2]),
    args=lambda cfg, a1, b1, a2, b2, c: (a1, b1, a2, b2, c, cfg.tm, cfg.tn, cfg.tk, cfg.group_m,
                                         cfg.persistent),
    work=lambda a1, b1, *rest: Work(flops=4.0 * a1.shape[1] * b1.shape[2] * a1.shape[2]))
TUNERS = (_gated, _dx)


def launch(x3, wg3, wu3, y3, g3, u3, act, save):
    """y3 = act(x3 @ wg3) * (x3 @ wu3), and with `save` gate3 = x3 @ wg3, up3 = x3 @ wu3. The
    key buckets M; the training variant (save) is tuned apart (it stores three times as much)."""
    M, K = x3.shape[1], x3.shape[2]
    dev = x3.get_device()
    key = (bucket(M), wg3.shape[2], K, x3.dtype, layout(x3), layout(wg3), layout(wu3), act,
           save, dev)
    _gated.launch(key, dev, x3, wg3, wu3, y3, g3, u3, act, save)


def launch_dx(a1, b1, a2, b2, c):
    """c = a1 @ b1 + a2 @ b2, all (1, rows, cols); the key buckets the rows, as launch's."""
    M, K = a1.shape[1], a1.shape[2]
    dev = a1.get_device()
    key = (bucket(M), b1.shape[2], K, a1.dtype, layout(a1), layout(b1), layout(a2), layout(b2),
           dev)
    _dx.launch(key, dev, a1, b1, a2, b2, c)


# ---------------------------------------------------------------------------------------------
# Host side.

def _rows(x):
    """x (..., K) as (M, K): x itself when 2-D (any strides: the kernel reads them), else a view
    where the leading dims allow one, else one copy."""
    K = x.shape[-1]
    return x.reshape(math.prod(x.shape[:-1]), K)


def _forward(x, w_gate, w_up, act, save):
    """(y (..., N), gate (M, N), up (M, N)); gate and up are empty unless `save`."""
    x2 = _rows(x)
    M, K = x2.shape
    N = w_gate.shape[0]
    # y in its final shape (a view made here could not be changed in place by the caller under
    # autograd); the kernel writes its (M, N) view
    y_out = x.new_empty(*x.shape[:-1], N)
    y = y_out.view(M, N)
    gate = x.new_empty(M, N) if save else x.new_empty(0)
    up = x.new_empty(M, N) if save else x.new_empty(0)
    if y.numel():
        if K == 0:       # empty products: gate = up = 0, y = act(0) * 0 = 0
            for t in (y, gate, up):
                t.zero_()
        else:
            y3 = y[None]
            launch(x2[None], w_gate.t()[None], w_up.t()[None], y3,
                   gate[None] if save else y3, up[None] if save else y3, act, save)
    return y_out, gate, up


def _backward(needs, dy, x, w_gate, w_up, gate, up, act):
    """(dx, dw_gate, dw_up), None where not needed. dgate and dup come from the activation's
    backward kernel (ops/swiglu.py), dx from dual_product_kernel, the weight gradients from
    matmul's kernel on transposed views."""
    dgate, dup = glu.backward(dy, gate, up, act)          # (M, N) each
    dx = dw_gate = dw_up = None
    if needs[0]:
        M, N = dgate.shape
        dx = dy.new_empty(*dy.shape[:-1], w_gate.shape[1])   # contiguous: viewed as (M, K)
        if dx.numel():
            if N == 0:
                dx.zero_()
            else:
                launch_dx(dgate[None], w_gate[None], dup[None], w_up[None],
                          dx.view(M, w_gate.shape[1])[None])
    if needs[1] or needs[2]:
        x2 = _rows(x)
        if needs[1]:
            dw_gate = plain_matmul(dgate.t(), x2)
        if needs[2]:
            dw_up = plain_matmul(dup.t(), x2)
    return dx, dw_gate, dw_up


def _forward_fake(x, w_gate, w_up, act, save):
    M, N = math.prod(x.shape[:-1]), w_gate.shape[0]
    return (x.new_empty((*x.shape[:-1], N)), x.new_empty((M, N) if save else (0,)),
            x.new_empty((M, N) if save else (0,)))


def _save(args, results):
    """The backward keeps the pre-activations and the activation; x only where a weight needs a
    gradient (only theirs read it: frozen weights keep no input), and the weights only where x
    needs one (only dx reads them: a frozen input keeps no weights, which may be tensors made
    for this call, a dequantized or merged weight)."""
    x, w_gate, w_up, act, _ = args
    keep_x = w_gate.requires_grad or w_up.requires_grad
    keep_w = x.requires_grad
    return (x if keep_x else None, w_gate if keep_w else None, w_up if keep_w else None,
            results[1], results[2]), (act,)


_op = TrainableOp(
    "tiletune::swiglu_linear", forward=_forward,
    forward_schema="(Tensor x, Tensor w_gate, Tensor w_up, int act, bool save) "
                   "-> (Tensor, Tensor, Tensor)",
    forward_fake=_forward_fake,
    save=_save,
    backward=_backward,
    backward_schema="(bool[] needs, Tensor dy, Tensor? x, Tensor? w_gate, Tensor? w_up, "
                    "Tensor gate, Tensor up, int act) -> (Tensor?, Tensor?, Tensor?)",
    backward_fake=lambda needs, dy, x, w_gate, w_up, gate, up, act: (
        dy.new_empty((*dy.shape[:-1], w_gate.shape[1])) if needs[0] else None,
        dy.new_empty((dy.shape[-1], x.shape[-1])) if needs[1] else None,
        dy.new_empty((dy.shape[-1], x.shape[-1])) if needs[2] else None))


def _check(op, x, w_gate, w_up):
    validate.tensor(op, "x", x, dtypes=DTYPES)
    validate.tensor(op, "w_gate", w_gate, like=x, dtypes=DTYPES)
    validate.tensor(op, "w_up", w_up, like=x, dtypes=DTYPES)
    validate.same_dtype(op, "x", x, {"w_gate": w_gate, "w_up": w_up})
    if x.dim() < 1:
        raise ValueError(f"{op}: x must have at least one dimension (..., K), got a 0-dim "
                         "tensor")
    validate.dims(op, "w_gate", w_gate, 2, "(N, K) as nn.Linear stores it")
    if w_up.shape != w_gate.shape:
        raise ValueError(f"{op}: w_up shape {tuple(w_up.shape)} differs from w_gate shape "
                         f"{tuple(w_gate.shape)}")
    if w_gate.shape[1] != x.shape[-1]:
        raise ValueError(f"{op}: w_gate is (N, K) = {tuple(w_gate.shape)} but x's last dim is "
                         f"{x.shape[-1]}: K must match")


def swiglu_linear(x, w_gate, w_up):
    """`silu(x @ w_gate.T) * (x @ w_up.T)`: the gate and up projections of a Llama/Mistral/Qwen
    MLP and its SwiGLU in one kernel (neither projection is written to memory in inference).

    x: (..., K) CUDA tensor, bfloat16 or float16; leading dims are flattened to rows (a view
    where possible, else one copy); a 2-D x is read with any strides (a transposed or sliced x
    is not copied). w_gate, w_up: (N, K) as nn.Linear stores its weight (no bias), of x's dtype
    and device, any strides (a fused (2N, K) gate_up weight: pass `w.chunk(2)`, no copy).
    Float32 accumulation and activation; returns a new contiguous (..., N) tensor of x's dtype.

    Differentiable in x, w_gate and w_up: with a gradient needed, the forward also keeps the
    pre-activations x @ w_gate.T and x @ w_up.T (two (M, N) tensors) for the backward. Works
    under torch.compile(fullgraph=True). Bad input raises TypeError / ValueError naming the
    argument.
    """
    _check("swiglu_linear", x, w_gate, w_up)
    save = records_graph() and (x.requires_grad or w_gate.requires_grad or w_up.requires_grad)
    return _op(x, w_gate, w_up, SILU, save)
