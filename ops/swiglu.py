# Gated activations of the MLP: swiglu(gate, up) = silu(gate) * up and
# geglu(gate, up) = gelu(gate) * up (tanh or erf form), forward and backward, math in float32.
#
# With s = sigmoid(g) the activations and their derivatives are
#   silu(g)      = g * s                          silu'(g)      = s * (1 + g * (1 - s))
#   gelu_tanh(g) = g * sigmoid(2u),               gelu_tanh'(g) = S + g * S * (1 - S) * 2u'
#                  u = sqrt(2/pi) * (g + 0.044715 g^3), S = sigmoid(2u)
#                  (0.5 * (1 + tanh(u)) is sigmoid(2u): one exp, no tanh)
#   gelu_erf(g)  = g * Phi(g),                    gelu_erf'(g)  = Phi(g) + g * phi(g)
# and the gradients dup = dy * act(g), dgate = dy * up * act'(g).
#
# No `from __future__ import annotations` here: it would hide the ct.Constant annotations.
from types import SimpleNamespace

import cuda.tile as ct
import torch

from tiletune import validate
from tiletune.autotune import Autotuner, Work, bucketed
from tiletune.device import persistent_ctas
from tiletune.ops.rows import as_rows, host_rows
from tiletune.space import INT32_MAX, cdiv, next_pow2, product, row_chunks
from tiletune.torch_op import TrainableOp

ZERO = ct.PaddingMode.ZERO

# The activation a kernel computes (a ct.Constant: one compile each).
SILU, GELU_TANH, GELU_ERF = 0, 1, 2

# ---------------------------------------------------------------------------------------------
# Kernels. Arrays are (M, N) rows with unit column stride and any row stride (the halves of a
# fused gate_up projection come in as they are), or (..., N) tensors whose leading dims merge
# into such rows, viewed as rows in the kernel (ops/rows.py). A 2-D tile index t walks the (row
# tile, column tile) grid row-major: grid-stride over SMs x occupancy CTAs (persistent) or one
# tile per CTA. Tiles past the array's end load zeros (their results are dropped on store).


def _tile(a, tm, tn, TILE_M, TILE_N):
    """Tile (tm, tn) of a as float32."""
    return ct.load(a, (tm, tn), (TILE_M, TILE_N), padding_mode=ZERO).astype(ct.float32)


def _rcp(x):
    """1 / x, approximate (a 2-ulp MUFU reciprocal instead of IEEE division's Newton steps and
    slow path: 2% off the silu forward on an H200); 1 / inf = 0."""
    return ct.truediv(1.0, x, rounding_mode=ct.RoundingMode.APPROX, flush_to_zero=True)


def _sigmoid(x):
    return _rcp(1.0 + ct.exp(0.0 - x))


def _tanh_gate(g):
    """sigmoid(2u) = 0.5 * (1 + tanh(u)) with u = sqrt(2/pi) * (g + 0.044715 g^3)."""
    return _sigmoid(g * (1.5957691216057308 + 0.0713548162726009 * g * g))


def _normal_cdf(g):
    """Phi(g) = 0.5 * erfc(-g / sqrt(2)); cuTile has no erf. erfc(z), z >= 0, from the
    Chebyshev fit of Numerical Recipes (6.2, erfcc), relative error below 1.2e-7: Phi keeps its
    relative accuracy in the negative tail too (in float32 within 1e-6 for g >= -4 and 1e-5 out
    to -12, where 0.5 * (1 + erf(g / sqrt(2))) has cancelled to nothing)."""
    z = ct.abs(g) * 0.7071067811865476
    t = _rcp(1.0 + 0.5 * z)
    p = -0.82215223 + t * 0.17087277
    p = 1.48851587 + t * p
    p = -1.13520398 + t * p
    p = 0.27886807 + t * p
    p = -0.18628806 + t * p
    p = 0.09678418 + t * p
    p = 0.37409196 + t * p
    p = 1.00002368 + t * p
    p = -1.26551223 + t * p
    half_erfc = 0.5 * t * ct.exp(p - 0.5 * g * g)         # exp(-z^2) = exp(-g^2 / 2)
    return ct.where(g >= 0.0, 1.0 - half_erfc, half_erfc)


def activation(g, ACT):
    """act(g) of a float32 tile (also the epilogue of ops/gated_mlp.py)."""
    if ACT == SILU:
        return g * _sigmoid(g)
    if ACT == GELU_TANH:
        return g * _tanh_gate(g)
    return g * _normal_cdf(g)


def _act_and_grad(g, ACT):
    """(act(g), act'(g)) of a float32 tile, sharing the exp."""
    if ACT == SILU:
        s = _sigmoid(g)
        return g * s, s * (1.0 + g * (1.0 - s))
    if ACT == GELU_TANH:
        s = _tanh_gate(g)
        du2 = 1.5957691216057308 + 0.2140644488178027 * g * g        # d(2u)/dg
        return g * s, s + g * s * (1.0 - s) * du2
    cdf = _normal_cdf(g)
    pdf = ct.exp(-0.5 * g * g) * 0.3989422804014327
    return g * cdf, cdf + g * pdf


@ct.kernel
def glu_fwd(gate, up, out, ACT: ct.Constant[int], TILE_M: ct.Constant[int],
            TILE_N: ct.Constant[int]):
    """out = act(gate) * up."""
    gate = as_rows(gate)
    up = as_rows(up)
    out = as_rows(out)
    col_tiles = ct.cdiv(gate.shape[1], TILE_N)
    for t in range(ct.bid(0), ct.cdiv(gate.shape[0], TILE_M) * col_tiles, ct.num_blocks(0)):
        tm = t // col_tiles
        tn = t - tm * col_tiles
        g = _tile(gate, tm, tn, TILE_M, TILE_N)
        y = activation(g, ACT) * _tile(up, tm, tn, TILE_M, TILE_N)
        ct.store(out, (tm, tn), y.astype(out.dtype))


@ct.kernel
def glu_bwd(dy, gate, up, dgate, dup, ACT: ct.Constant[int], TILE_M: ct.Constant[int],
            TILE_N: ct.Constant[int]):
    """dup = dy * act(gate), dgate = dy * up * act'(gate): the activation is recomputed from
    gate (nothing but gate and up is kept for the backward)."""
    dy = as_rows(dy)
    gate = as_rows(gate)
    up = as_rows(up)
    dgate = as_rows(dgate)
    dup = as_rows(dup)
    col_tiles = ct.cdiv(gate.shape[1], TILE_N)
    for t in range(ct.bid(0), ct.cdiv(gate.shape[0], TILE_M) * col_tiles, ct.num_blocks(0)):
        tm = t // col_tiles
        tn = t - tm * col_tiles
        a, da = _act_and_grad(_tile(gate, tm, tn, TILE_M, TILE_N), ACT)
        d = _tile(dy, tm, tn, TILE_M, TILE_N)
        ct.store(dup, (tm, tn), (d * a).astype(dup.dtype))
        ct.store(dgate, (tm, tn), (d * _tile(up, tm, tn, TILE_M, TILE_N) * da).astype(dgate.dtype))


# ---------------------------------------------------------------------------------------------
# Configs: tile shape x (occupancy, worker warps), one tile per CTA, plus a few persistent grids
# (SMs x occupancy CTAs striding over the tiles); default first. Both kernels share the space.
# Measured on an H200 at 16384 x 14336 bf16: 2048-element tiles, one per CTA, occupancy 2-4 and
# 4 worker warps won the silu and gelu-erf forward and the silu backward (forward 371 us against
# 445 for the best 4096- or 8192-element tile, 450 for 1024; the copy ceiling is 335 us);
# persistent grids lost about 20%; 8192-element tiles at best tied 2048 and are left out, as is
# occupancy 4 with 8 worker warps (a 64-register cap: its sm_90 cubins spilled). Occupancy 8 at
# 4 warps (63 registers instead of 76: 8 CTAs an SM instead of 6) ran the 2048-element forward
# 1.09x faster on an H200 and the backward 0.95x: one entry, for the forward. The kernels use no
# shared memory and no clusters: nothing here depends on the arch.

MAX_TILE_N = 4096
THREADS = [dict(occupancy=2, num_worker_warps=4), dict(occupancy=4, num_worker_warps=4),
           dict(occupancy=2, num_worker_warps=8), dict(occupancy=1, num_worker_warps=8)]


def _tiles(n_cols):
    """(tile_m, tile_n) pairs: tiles of 2048, 4096 and 1024 elements as wide as the row allows
    (up to MAX_TILE_N), and 4096 elements at half that width."""
    row = min(next_pow2(n_cols), MAX_TILE_N)
    shapes = [(e // min(row, e), min(row, e)) for e in (2048, 4096, 1024)]
    m, n = shapes[1]
    if n >= 32:
        shapes.append((2 * m, n // 2))
    return [dict(tile_m=m, tile_n=n) for m, n in shapes]


def configs(arch, n_cols):
    """The space for rows of `n_cols` elements (at most 21 configs), default first."""
    tiles = _tiles(n_cols)
    yield from product(SimpleNamespace(**tiles[0], **THREADS[0], persistent=False),
                       tiles=tiles, threads=THREADS)
    yield SimpleNamespace(**tiles[0], occupancy=8, num_worker_warps=4, persistent=False)
    yield from product(SimpleNamespace(**tiles[0], occupancy=4, num_worker_warps=4,
                                       persistent=True), tiles=tiles[:2], occupancy=(2, 4))


# ---------------------------------------------------------------------------------------------
# Launches. Each tuner declares its grid and arguments once; the engine looks the config up (or
# tunes it) and launches. Every array holds M rows of N with unit column stride (gate, up and dy
# any row stride, 0 included: an expanded up or upstream gradient; out, dgate and dup are
# contiguous), as (M, N) or as (..., N) the kernels view as rows.

def _grid(c, dev, M, N):
    tiles = cdiv(M, c.tile_m) * cdiv(N, c.tile_n)
    return (persistent_ctas(tiles, dev, c.occupancy) if c.persistent else tiles,)


_DEFAULT = SimpleNamespace(tile_m=1, tile_n=2048, occupancy=2, num_worker_warps=4,
                           persistent=False)
# Every launch key is (N, M, act, dtype, aligned, device); tuning buckets M.
_BY_ROWS = bucketed(1)

_fwd = Autotuner(
    "swiglu_fwd", glu_fwd, configs, default=_DEFAULT,
    space=lambda gate, up, out, act, M, N: dict(n_cols=N),
    grid=lambda c, dev, gate, up, out, act, M, N: _grid(c, dev, M, N),
    args=lambda c, gate, up, out, act, M, N: (gate, up, out, act, c.tile_m, c.tile_n),
    work=lambda gate, up, out, act, M, N: Work(bytes=3 * M * N * gate.element_size()),
    tune_key=_BY_ROWS)

_bwd = Autotuner(
    "swiglu_bwd", glu_bwd, configs, default=_DEFAULT,
    space=lambda dy, gate, up, dgate, dup, act, M, N: dict(n_cols=N),
    grid=lambda c, dev, dy, gate, up, dgate, dup, act, M, N: _grid(c, dev, M, N),
    args=lambda c, dy, gate, up, dgate, dup, act, M, N: (dy, gate, up, dgate, dup, act, c.tile_m,
                                                         c.tile_n),
    work=lambda dy, gate, up, dgate, dup, act, M, N: Work(bytes=5 * M * N * gate.element_size()),
    tune_key=_BY_ROWS)
TUNERS = (_fwd, _bwd)


def launch_fwd(gate, up, out, act, aligned, M, N):
    """out = act(gate) * up over M rows of N (M * N > 0, int32-indexable). aligned: every
    array's base and row stride are multiples of 16 bytes (the JIT then compiles 128-bit
    accesses; a chunk() half of an odd width gets narrower ones): a key flag, so that both
    layouts keep their own winner."""
    dev = gate.get_device()
    _fwd.launch((N, M, act, gate.dtype, aligned, dev), dev, gate, up, out, act, M, N)


def launch_bwd(dy, gate, up, dgate, dup, act, aligned, M, N):
    """dgate, dup written over M rows of N (M * N > 0, int32-indexable)."""
    dev = gate.get_device()
    _bwd.launch((N, M, act, gate.dtype, aligned, dev), dev, dy, gate, up, dgate, dup, act, M, N)


# ---------------------------------------------------------------------------------------------
# Host side: validation, rows, int32-safe row chunks.

_MAX_SPAN = INT32_MAX   # kernels index with int32: a launch reaches at most this many elements


def _launch_rows(launch, N, inputs, outputs, act):
    """launch(*inputs, *outputs, act, aligned, M, N) once, or per row chunk where the arrays
    span more than int32 indexes (each chunk starts a multiple of 16 rows in: aligned as the
    whole). Inputs whose leading dims merge into rows go as they are (a view costs 1-2 us of
    host time a tensor), others as (M, N) rows: a view, or one copy; outputs are new contiguous
    tensors (row stride N, bases from the allocator: 16-byte aligned) and go as they are. Each
    input's strides and address are read once (stride(i) costs more than stride()), and the
    loops are written out (a generator costs a microsecond per call)."""
    es = outputs[0].element_size()
    M = outputs[0].numel() // N
    if outputs[0].dim() == 1:       # as_rows makes rows of 2-D and wider arrays only
        outputs = tuple(o.view(1, N) for o in outputs)
    stride = N
    bits = N * es
    arrays = []
    for a in inputs:
        a, row = host_rows(a, N)
        if row > stride:
            stride = row
        bits |= a.data_ptr() | row * es
        arrays.append(a)
    arrays += outputs
    aligned = bits % 16 == 0
    if (M - 1) * stride + N <= _MAX_SPAN:
        launch(*arrays, act, aligned, M, N)
        return
    arrays = [a.reshape(M, N) for a in arrays]
    for s, e in row_chunks(M, N, stride, _MAX_SPAN):
        launch(*(a[s:e] for a in arrays), act, aligned, e - s, N)


def _forward(gate, up, act):
    """act(gate) * up: a new contiguous tensor shaped like gate."""
    out = gate.new_empty(*gate.shape)      # (sizes unpacked: a torch.Size argument costs more)
    if gate.numel():
        _launch_rows(launch_fwd, gate.shape[-1], (gate, up), (out,), act)
    return out


def backward(dy, gate, up, act):
    """(dgate, dup), new contiguous tensors shaped like gate. Both are always computed (one
    kernel reads dy, gate and up once for the pair). Also the activation's part of
    ops/gated_mlp.py's backward."""
    dgate = gate.new_empty(*gate.shape)
    dup = gate.new_empty(*gate.shape)
    if gate.numel():
        _launch_rows(launch_bwd, gate.shape[-1], (dy, gate, up), (dgate, dup), act)
    return dgate, dup


def _check(op, gate, up):
    validate.pair(op, "gate", gate, "up", up)
    if up.dtype != gate.dtype:
        raise TypeError(f"{op}: up dtype {up.dtype} differs from gate dtype {gate.dtype}")
    if up.shape != gate.shape:
        raise ValueError(f"{op}: up shape {tuple(up.shape)} differs from gate shape "
                         f"{tuple(gate.shape)}")
    if gate.dim() < 1:
        raise ValueError(f"{op}: gate must have at least one dimension, got a 0-dim tensor")
    if gate.shape[-1] > _MAX_SPAN:
        raise ValueError(f"{op}: rows of {gate.shape[-1]} elements are not supported (at most "
                         f"{_MAX_SPAN} = 2^31 - 1: the kernels index a row with int32)")


# ---------------------------------------------------------------------------------------------
# Autograd, custom op and the public functions. One op for every activation (`act`); the
# backward keeps gate and up (not the product) and recomputes the activation.

def _empty_like(t):
    return torch.empty_like(t, memory_format=torch.contiguous_format)


_glu = TrainableOp(
    "tiletune::gated_activation", forward=_forward,
    forward_schema="(Tensor gate, Tensor up, int act) -> Tensor",
    forward_fake=lambda gate, up, act: _empty_like(gate),
    save=lambda args, results: ((args[0], args[1]), (args[2],)),
    backward=lambda needs, dy, gate, up, act: backward(dy, gate, up, act),
    backward_schema="(bool[] needs, Tensor dy, Tensor gate, Tensor up, int act) "
                    "-> (Tensor, Tensor)",
    backward_fake=lambda needs, dy, gate, up, act: (_empty_like(gate), _empty_like(gate)))

_GELU = {"tanh": GELU_TANH, "none": GELU_ERF}


def swiglu(gate, up):
    """`silu(gate) * up` (silu(x) = x * sigmoid(x)), the gated activation of Llama/Mistral/Qwen
    MLPs, in one pass.

    gate, up: (..., N) CUDA tensors of one shape and one dtype (float32, float16, bfloat16);
    leading dims are flattened to rows. Rows may have any stride as long as the last dim has
    stride 1 and the leading dims merge into one run of rows (`gate, up = gate_up.chunk(2,
    dim=-1)` of a fused (..., 2N) projection is read in place, not copied); other layouts (a
    transposed or stepped last dim, a batch sliced along its middle dim) are copied, and in
    training copied again by the backward, which keeps gate and up as given. Math in float32;
    returns a new contiguous tensor of gate's shape and dtype. Differentiable in gate and up
    (the backward recomputes silu from gate: only gate and up are kept). Works under
    torch.compile(fullgraph=True).
    """
    _check("swiglu", gate, up)
    return _glu(gate, up, SILU)


def geglu(gate, up, approximate="tanh"):
    """`gelu(gate, approximate=approximate) * up` in one pass, gelu as torch.nn.functional.gelu
    computes it: approximate="tanh" (HF's "gelu_pytorch_tanh", Gemma; the default here, as in
    Liger's GeGLU, while F.gelu defaults to "none") or "none" (the erf form, HF's "gelu"; cuTile
    has no erf: a float32 fit with relative error below 1.2e-7 stands in).

    Inputs, layouts, output and autograd as `swiglu`.
    """
    _check("geglu", gate, up)
    act = _GELU.get(approximate) if isinstance(approximate, str) else None
    if act is None:
        raise ValueError(f"geglu: approximate must be 'tanh' or 'none', got {approximate!r}")
    return _glu(gate, up, act)
