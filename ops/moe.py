# Mixture-of-experts token routing: permute the tokens into expert order for the grouped GEMMs
# (tiletune.ops.grouped_gemm) and combine the experts' rows back per token, weighted.
#
#   moe_permute(x, topk_ids, E) -> x_sorted (T*k, H), offs (E,) int32, inverse (T, k) int32
#   moe_unpermute(y_sorted, inverse, topk_weights) -> out (T, H)
#   moe_experts(...): Qwen3-MoE's experts block out of the two and grouped_mm + swiglu
#
# The routing indices come from torch device ops that never read data on the host: a stable
# sort of the flattened expert ids (slots of invalid ids get the key E and sort last), a
# searchsorted of 0..E-1 into the sorted keys (the cumulative end offsets, already int32) and a
# scatter of 0..T*k-1 by the sort's order (inverse[t, j] = the sorted row of token t's slot j).
# Sizes are static (T*k rows), so everything is CUDA-graph capturable.
#
# Row traffic is cuTile kernels over tokens, all slots of a token at once: the rows of inverse
# are a (tokens x slots) index tile, and a row of T*k-row arrays is reached through ct.gather /
# ct.scatter with (row index tile, column range) indices. Both are bounds-checked: an index
# outside the array reads zeros and writes nothing, which also masks the padded slots and the
# tokens past T (their index is -1). Token-major scatter reads each token's row once (x is read
# T*H times, not T*k*H times as a sorted-row-major gather would).
#
#   scatter:  dst[idx[t, j]] = src[t] (x w[t, j])         permute forward, unpermute backward
#             (+ dw[t, j] = dot(src[t], y[idx[t, j]]))    (the routing weights' gradient)
#   gather:   out[t] = sum_j (w[t, j] x) src[idx[t, j]]    unpermute forward, permute backward
#
# Every sum is float32; each output element is written by one CTA (no atomics: deterministic).
#
# No `from __future__ import annotations` here: it would hide the ct.Constant annotations.
from types import SimpleNamespace

import cuda.tile as ct
import torch

from tiletune import validate
from tiletune.autotune import Autotuner, Work, bucketed
from tiletune.device import major, persistent_ctas
from tiletune.ops.grouped_gemm import grouped_mm
from tiletune.ops.swiglu import swiglu
from tiletune.space import INT32_MAX, cdiv, next_pow2
from tiletune.torch_op import TrainableOp

ZERO = ct.PaddingMode.ZERO

# ---------------------------------------------------------------------------------------------
# Kernels. A step handles TILE_T tokens x KP slots (k padded to a power of two) x TILE_H columns;
# the persistent CTAs stride over token blocks and walk the columns in chunks.


def _tokens(tb, TILE_T):
    return tb * TILE_T + ct.arange(TILE_T, dtype=ct.int32)


def _slot_rows(idx, tok, KP):
    """(TILE_T, KP, 1) rows of the sorted array for the tokens' slots; -1 (out of bounds) for
    padded slots and tokens past the end."""
    j = ct.arange(KP, dtype=ct.int32)
    rows = ct.gather(idx, (tok[:, None], j[None, :]), padding_value=-1)
    return ct.expand_dims(rows, axis=2)


def _token_block(idx, w, tb, TILE_T, KP, WEIGHTED):
    """Token block tb: (tokens, their slots' rows (TILE_T, KP, 1), float32 slot weights
    (TILE_T, KP, 1): w's, zero for padded slots, where WEIGHTED, else ones)."""
    tok = _tokens(tb, TILE_T)
    rows = _slot_rows(idx, tok, KP)
    wt = ct.full((TILE_T, KP, 1), 1.0, ct.float32)
    if WEIGHTED:
        j = ct.arange(KP, dtype=ct.int32)
        wt = ct.expand_dims(ct.gather(w, (tok[:, None], j[None, :])).astype(ct.float32), axis=2)
    return tok, rows, wt


def _columns(c, rows, TILE_H):
    """(1, 1, TILE_H) column indices of chunk c, in the row indices' integer type."""
    cols = (c * TILE_H + ct.arange(TILE_H, dtype=ct.int32)).astype(rows.dtype)
    return ct.reshape(cols, (1, 1, TILE_H))


@ct.kernel
def moe_gather_kernel(src, idx, w, out, TILE_T: ct.Constant[int], KP: ct.Constant[int],
                      TILE_H: ct.Constant[int], WEIGHTED: ct.Constant[bool]):
    """out[t] = sum_j w[t, j] * src[idx[t, j]] (w ignored unless WEIGHTED), summed in float32:
    src (R, H), idx and w (T, k), out (T, H)."""
    num_chunks = ct.cdiv(out.shape[1], TILE_H)
    for tb in range(ct.bid(0), ct.cdiv(out.shape[0], TILE_T), ct.num_blocks(0)):
        _, rows, wt = _token_block(idx, w, tb, TILE_T, KP, WEIGHTED)
        for c in range(num_chunks):
            v = ct.gather(src, (rows, _columns(c, rows, TILE_H))).astype(ct.float32)
            ct.store(out, (tb, c), ct.sum(v * wt, axis=1).astype(out.dtype))


@ct.kernel
def moe_scatter_kernel(src, idx, w, y, dst, dw, TILE_T: ct.Constant[int],
                       KP: ct.Constant[int], TILE_H: ct.Constant[int],
                       SCALED: ct.Constant[bool], DOT: ct.Constant[bool]):
    """dst[idx[t, j]] = src[t], times w[t, j] in float32 if SCALED: src (T, H), idx and w
    (T, k), dst (R, H). With DOT also dw[t, j] = dot(src[t], y[idx[t, j]]) in float32, y like
    dst and dw like w. Arrays a variant does not use are not touched."""
    num_chunks = ct.cdiv(src.shape[1], TILE_H)
    for tb in range(ct.bid(0), ct.cdiv(src.shape[0], TILE_T), ct.num_blocks(0)):
        tok, rows, wt = _token_block(idx, w, tb, TILE_T, KP, SCALED)
        acc = ct.zeros((TILE_T, KP), ct.float32)
        for c in range(num_chunks):
            cols = _columns(c, rows, TILE_H)
            s = ct.load(src, (tb, c), (TILE_T, TILE_H), padding_mode=ZERO)
            s = ct.reshape(s, (TILE_T, 1, TILE_H))
            if SCALED:
                ct.scatter(dst, (rows, cols), (s.astype(ct.float32) * wt).astype(dst.dtype))
            else:
                ct.scatter(dst, (rows, cols), s.astype(dst.dtype))
            if DOT:
                yt = ct.gather(y, (rows, cols)).astype(ct.float32)
                acc = acc + ct.sum(s.astype(ct.float32) * yt, axis=2)
        if DOT:
            j = ct.arange(KP, dtype=ct.int32)
            ct.scatter(dw, (tok[:, None], j[None, :]), acc.astype(dw.dtype))


# ---------------------------------------------------------------------------------------------
# Configs: tokens per step, column chunk, occupancy. Memory-bound row traffic, so the space
# follows what the row-wise norms' searches measured (references/parameter-space-design.md):
# steps of 4K-16K elements (here tokens x padded slots x columns) at occupancy 2-4; more spill.
# The column chunk: the two widest of the row (up to 4096 wide), its half, quarter, ... (not
# under 128) that fit a step; tokens per step fill the rest. `kp` (k padded to a power of two)
# is fixed by the key, not searched. sm_90 and sm_100 search the space; other archs take the
# default.

MAX_CHUNK = 4096             # widest column chunk; wider rows take several
MAX_TOKENS = 256             # most tokens per step (narrow rows)
STEP_ELEMS = (4096, 8192, 16384)
DEFAULT_ELEMS = 8192


def _tokens_per_step(elems, kp, tile_h):
    return min(MAX_TOKENS, max(1, elems // (kp * tile_h)))


def configs(arch, h, k):
    """The space for rows of h elements and k slots per token, default first."""
    kp = next_pow2(k)
    full = min(next_pow2(h), MAX_CHUNK)
    tile_h = min(full, max(32, DEFAULT_ELEMS // kp))
    default = SimpleNamespace(tile_t=_tokens_per_step(DEFAULT_ELEMS, kp, tile_h),
                              tile_h=tile_h, kp=kp, occupancy=4)
    yield default
    if major(arch) not in (9, 10):
        return
    seen = [default]
    chunks = sorted({max(full >> s, min(full, 128)) for s in range(6)}, reverse=True)
    for tile_h in [c for c in chunks if kp * c <= STEP_ELEMS[-1]][:2]:   # the two widest
        for elems in STEP_ELEMS:
            if kp * tile_h > elems:
                continue
            for occupancy in (2, 4):
                cfg = SimpleNamespace(tile_t=_tokens_per_step(elems, kp, tile_h),
                                      tile_h=tile_h, kp=kp, occupancy=occupancy)
                if cfg not in seen:
                    seen.append(cfg)
                    yield cfg


# ---------------------------------------------------------------------------------------------
# Launches. Every launch key is (H, k, T, dtypes..., device); tuning buckets T. The inputs of a
# tuner start with the token-major array (T, H) or the sorted one and the (T, k) indices; arrays
# a variant leaves alone are passed as other arguments of the same launch.

def _grid(cfg, dev, a, idx, *rest):
    return (persistent_ctas(cdiv(idx.shape[0], cfg.tile_t), dev, cfg.occupancy),)


def _space(a, idx, *rest):
    return dict(h=a.shape[1], k=idx.shape[1])


def _row_bytes(t):
    return t.shape[1] * t.element_size()


def _tuner(name, kernel, args, work):
    return Autotuner(name, kernel, configs,
                     default=SimpleNamespace(tile_t=1, tile_h=1024, kp=8, occupancy=4),
                     space=_space, grid=_grid, args=args, work=work, tune_key=bucketed(2))


_permute_fwd = _tuner(
    "moe_permute", moe_scatter_kernel,
    lambda c, x, idx, out: (x, idx, idx, x, out, idx, c.tile_t, c.kp, c.tile_h, False, False),
    lambda x, idx, out: Work(bytes=(1 + idx.shape[1]) * x.shape[0] * _row_bytes(x)))
_permute_bwd = _tuner(
    "moe_permute_bwd", moe_gather_kernel,
    lambda c, dxs, idx, dx: (dxs, idx, idx, dx, c.tile_t, c.kp, c.tile_h, False),
    lambda dxs, idx, dx: Work(bytes=(1 + idx.shape[1]) * idx.shape[0] * _row_bytes(dxs)))
_unpermute_fwd = _tuner(
    "moe_unpermute", moe_gather_kernel,
    lambda c, ys, idx, w, out: (ys, idx, w, out, c.tile_t, c.kp, c.tile_h, True),
    lambda ys, idx, w, out: Work(bytes=(1 + idx.shape[1]) * idx.shape[0] * _row_bytes(ys)))
_unpermute_bwd = _tuner(
    "moe_unpermute_bwd", moe_scatter_kernel,
    lambda c, dout, idx, w, ys, dys, dw, dot: (dout, idx, w, ys, dys, dw, c.tile_t, c.kp,
                                               c.tile_h, True, dot),
    lambda dout, idx, w, ys, dys, dw, dot: Work(
        bytes=(1 + (2 if dot else 1) * idx.shape[1]) * idx.shape[0] * _row_bytes(dout)))
TUNERS = (_permute_fwd, _permute_bwd, _unpermute_fwd, _unpermute_bwd)


def launch_permute(x, idx, out):
    """out[idx[t, j]] = x[t] (x (T, H), idx (T, k), out (T*k, H))."""
    dev = x.get_device()
    key = (x.shape[1], idx.shape[1], x.shape[0], x.dtype, idx.dtype, dev)
    _permute_fwd.launch(key, dev, x, idx, out)


def launch_permute_bwd(dxs, idx, dx):
    """dx[t] = sum_j dxs[idx[t, j]] (dxs (T*k, H), dx (T, H))."""
    dev = dxs.get_device()
    key = (dxs.shape[1], idx.shape[1], idx.shape[0], dxs.dtype, idx.dtype, dev)
    _permute_bwd.launch(key, dev, dxs, idx, dx)


def launch_unpermute(ys, idx, w, out):
    """out[t] = sum_j w[t, j] * ys[idx[t, j]] (ys (T*k, H), idx and w (T, k), out (T, H))."""
    dev = ys.get_device()
    key = (ys.shape[1], idx.shape[1], idx.shape[0], ys.dtype, idx.dtype, w.dtype, dev)
    _unpermute_fwd.launch(key, dev, ys, idx, w, out)


def launch_unpermute_bwd(dout, idx, w, ys, dys, dw):
    """dys[idx[t, j]] = w[t, j] * dout[t]; with dw given also dw[t, j] = dot(dout[t],
    ys[idx[t, j]])."""
    dev = dout.get_device()
    dot = dw is not None
    key = (dout.shape[1], idx.shape[1], idx.shape[0], dout.dtype, idx.dtype, w.dtype, dot, dev)
    _unpermute_bwd.launch(key, dev, dout, idx, w, ys, dys, dw if dot else w, dot)


# ---------------------------------------------------------------------------------------------
# Routing indices (torch device ops, no host sync) and the row ops with their gradients.

def _route(topk_ids, num_experts):
    """(offs (E,) int32 cumulative end offsets, inverse (T, k) int32). Slots whose id is outside
    [0, E) sort after every expert's rows (past offs[E-1], rows no expert owns)."""
    T, k = topk_ids.shape
    dev = topk_ids.device
    ids = topk_ids.reshape(-1)
    keys = torch.where((ids >= 0) & (ids < num_experts), ids, num_experts).to(torch.int32)
    sorted_keys, order = torch.sort(keys, stable=True)
    experts = torch.arange(num_experts, device=dev, dtype=torch.int32)
    offs = torch.searchsorted(sorted_keys, experts, right=True, out_int32=True)
    inverse = torch.empty(T * k, device=dev, dtype=torch.int32).scatter_(
        0, order, torch.arange(T * k, device=dev, dtype=torch.int32))
    return offs, inverse.view(T, k)


def _permute_rows(x, inverse):
    """x_sorted (T*k, H): x_sorted[inverse[t, j]] = x[t]."""
    out = x.new_empty((inverse.numel(), x.shape[1]))
    if out.numel():
        launch_permute(x, inverse, out)
    return out


def _permute_rows_bwd(needs, dxs, inverse):
    dx = dxs.new_empty((inverse.shape[0], dxs.shape[1]))
    if dx.numel():
        launch_permute_bwd(dxs.contiguous(), inverse, dx)   # autograd may pass stride-0 grads
    return dx, None


def _unpermute_rows(ys, inverse, w, complete):
    out = ys.new_empty((inverse.shape[0], ys.shape[1]))
    if out.numel():
        launch_unpermute(ys, inverse, w, out)
    return out


def _unpermute_rows_bwd(needs, dout, ys, inverse, w, complete):
    """(dys, None, dw): dys (slots, H) contiguous, dw in w's dtype (None where not needed). ys
    is kept only where w needs a gradient (only dw reads it): otherwise dys stands in for it.
    complete: inverse names every slot (moe_permute's), so the scatter writes every row of dys;
    otherwise dys starts at zero (a slot no entry names, such as a dropped one, contributed
    nothing)."""
    dout = dout.contiguous()
    dys = (dout.new_empty if complete else dout.new_zeros)((inverse.numel(), dout.shape[1]))
    dw = torch.empty_like(w, memory_format=torch.contiguous_format) if needs[2] else None
    if dw is not None and dout.shape[1] == 0:
        dw.zero_()
    if dout.numel():
        launch_unpermute_bwd(dout, inverse, w, dys if ys is None else ys, dys, dw)
    return (dys if needs[0] else None), None, dw


_permute_op = TrainableOp(
    "tiletune::moe_permute", forward=_permute_rows,
    forward_schema="(Tensor x, Tensor inverse) -> Tensor",
    forward_fake=lambda x, inverse: x.new_empty((inverse.numel(), x.shape[1])),
    save=lambda args, results: ((args[1],), ()),
    backward=_permute_rows_bwd,
    backward_schema="(bool[] needs, Tensor dxs, Tensor inverse) -> (Tensor, Tensor?)",
    backward_fake=lambda needs, dxs, inverse: (
        dxs.new_empty((inverse.shape[0], dxs.shape[1])), None))
_unpermute_op = TrainableOp(
    "tiletune::moe_unpermute", forward=_unpermute_rows,
    forward_schema="(Tensor ys, Tensor inverse, Tensor w, bool complete) -> Tensor",
    forward_fake=lambda ys, inverse, w, complete: ys.new_empty((inverse.shape[0], ys.shape[1])),
    save=lambda args, results: ((args[0] if args[2].requires_grad else None, *args[1:3]),
                                (args[3],)),
    backward=_unpermute_rows_bwd,
    backward_schema="(bool[] needs, Tensor dout, Tensor? ys, Tensor inverse, Tensor w, "
                    "bool complete) -> (Tensor?, Tensor?, Tensor?)",
    backward_fake=lambda needs, dout, ys, inverse, w, complete: (
        dout.new_empty((inverse.numel(), dout.shape[1])) if needs[0] else None, None,
        torch.empty_like(w, memory_format=torch.contiguous_format) if needs[2] else None))


# ---------------------------------------------------------------------------------------------
# Host side: checks in the order types, shapes, dtypes, then devices (so everything but the
# device can be checked on CPU tensors).

MAX_ELEMS = 2**31 - 1       # the kernels index rows and columns with int32
INDEX_DTYPES = (torch.int32, torch.int64)


def _size(op, rows, cols):
    if rows * cols > MAX_ELEMS:
        raise ValueError(f"{op}: {rows} x {cols} sorted rows pass 2^31 - 1 elements, more than "
                         "the kernels index; split the tokens")


def _check_permute(x, topk_ids, num_experts):
    """num_experts as an int (any integer type: Python's, numpy's), or a TypeError /
    ValueError naming moe_permute and the argument."""
    op = "moe_permute"
    validate.is_tensor(op, "x", x)
    validate.is_tensor(op, "topk_ids", topk_ids)
    num_experts = validate.integer(op, "num_experts", num_experts)
    if not 1 <= num_experts < INT32_MAX:   # int32 offsets, and num_experts marks stray ids
        raise ValueError(f"{op}: num_experts must be in [1, 2^31 - 2], got {num_experts}")
    validate.dims(op, "x", x, 2, "(tokens, hidden)")
    validate.dims(op, "topk_ids", topk_ids, 2, "(tokens, k)")
    if topk_ids.shape[0] != x.shape[0]:
        raise ValueError(f"{op}: topk_ids has {topk_ids.shape[0]} rows but x has {x.shape[0]} "
                         "tokens")
    if topk_ids.shape[1] < 1:
        raise ValueError(f"{op}: topk_ids must choose at least one expert per token (k >= 1)")
    _size(op, topk_ids.numel(), max(x.shape[1], 1))
    validate.dtype(op, "x", x, validate.FLOAT_DTYPES)
    validate.dtype(op, "topk_ids", topk_ids, INDEX_DTYPES)
    validate.tensor(op, "x", x)
    validate.tensor(op, "topk_ids", topk_ids, like=x, dtypes=INDEX_DTYPES)
    return num_experts


def _check_unpermute(y_sorted, inverse, topk_weights):
    op = "moe_unpermute"
    for name, t in (("y_sorted", y_sorted), ("inverse", inverse),
                    ("topk_weights", topk_weights)):
        validate.is_tensor(op, name, t)
    validate.dims(op, "y_sorted", y_sorted, 2, "(tokens * k, hidden)")
    validate.dims(op, "inverse", inverse, 2, "(tokens, k)")
    if tuple(topk_weights.shape) != tuple(inverse.shape):
        raise ValueError(f"{op}: topk_weights has shape {tuple(topk_weights.shape)} but inverse "
                         f"has {tuple(inverse.shape)}")
    if inverse.shape[1] < 1:
        raise ValueError(f"{op}: inverse must hold at least one slot per token (k >= 1)")
    if y_sorted.shape[0] != inverse.numel():
        raise ValueError(f"{op}: y_sorted has {y_sorted.shape[0]} rows but inverse has "
                         f"{inverse.numel()} slots (tokens * k)")
    _size(op, inverse.numel(), max(y_sorted.shape[1], 1))
    validate.dtype(op, "y_sorted", y_sorted, validate.FLOAT_DTYPES)
    validate.dtype(op, "inverse", inverse, INDEX_DTYPES)
    if topk_weights.dtype not in (torch.float32, y_sorted.dtype):
        raise TypeError(f"{op}: topk_weights dtype {topk_weights.dtype} must be float32 or "
                        f"y_sorted's {y_sorted.dtype}")
    validate.tensor(op, "y_sorted", y_sorted)
    validate.tensor(op, "inverse", inverse, like=y_sorted, dtypes=INDEX_DTYPES)
    validate.tensor(op, "topk_weights", topk_weights, like=y_sorted)


def _check_experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj):
    op = "moe_experts"
    names = ("hidden_states", "top_k_index", "top_k_weights", "gate_up_proj", "down_proj")
    args = (hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj)
    for name, t in zip(names, args):
        validate.is_tensor(op, name, t)
    validate.dims(op, "hidden_states", hidden_states, 2, "(tokens, hidden)")
    for name, t in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        validate.dims(op, name, t, 3, "(experts, out, in)")
    T, H = hidden_states.shape
    E, two_i, h_in = gate_up_proj.shape
    if h_in != H or two_i % 2 or E < 1:
        raise ValueError(f"{op}: gate_up_proj must be (experts >= 1, 2 * intermediate, {H}), "
                         f"got {tuple(gate_up_proj.shape)}")
    if tuple(down_proj.shape) != (E, H, two_i // 2):
        raise ValueError(f"{op}: down_proj must be {(E, H, two_i // 2)} to match gate_up_proj "
                         f"{tuple(gate_up_proj.shape)}, got {tuple(down_proj.shape)}")
    for name, t in (("top_k_index", top_k_index), ("top_k_weights", top_k_weights)):
        if t.dim() != 2 or t.shape[0] != T or t.shape[1] < 1:
            raise ValueError(f"{op}: {name} must be ({T}, k) with k >= 1, got shape "
                             f"{tuple(t.shape)}")
    if top_k_weights.shape != top_k_index.shape:
        raise ValueError(f"{op}: top_k_weights has shape {tuple(top_k_weights.shape)} but "
                         f"top_k_index has {tuple(top_k_index.shape)}")
    _size(op, top_k_index.numel(), max(H, two_i, 1))
    for name, t in (("gate_up_proj", gate_up_proj), ("down_proj", down_proj)):
        if t.numel() > MAX_ELEMS:
            raise ValueError(f"{op}: {name} has {t.numel()} elements, more than the grouped GEMM "
                             "indexes (2^31 - 1); shard the experts")
    half = (torch.bfloat16, torch.float16)
    validate.dtype(op, "hidden_states", hidden_states, half)
    validate.dtype(op, "top_k_index", top_k_index, INDEX_DTYPES)
    validate.same_dtype(op, "hidden_states", hidden_states,
                        {"gate_up_proj": gate_up_proj, "down_proj": down_proj})
    if top_k_weights.dtype not in (torch.float32, hidden_states.dtype):
        raise TypeError(f"{op}: top_k_weights dtype {top_k_weights.dtype} must be float32 or "
                        f"hidden_states' {hidden_states.dtype}")
    validate.tensor(op, "hidden_states", hidden_states, dtypes=half)
    for name, t in zip(names[1:], args[1:]):
        validate.tensor(op, name, t, like=hidden_states,
                        dtypes=(*validate.FLOAT_DTYPES, *INDEX_DTYPES))


def _permute(x, topk_ids, num_experts):
    offs, inverse = _route(topk_ids, num_experts)
    return _permute_op(x, inverse), offs, inverse


def _experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj):
    """Checked inputs. The weights pass as transposed views ((E, H, 2I) and (E, I, H)):
    grouped_mm reads nn.Linear-style weights in place and returns their gradients in their
    layout."""
    x_sorted, offs, inverse = _permute(hidden_states, top_k_index, gate_up_proj.shape[0])
    gate, up = grouped_mm(x_sorted, gate_up_proj.transpose(1, 2), offs).chunk(2, -1)
    y_sorted = grouped_mm(swiglu(gate, up), down_proj.transpose(1, 2), offs)
    return _unpermute_op(y_sorted, inverse, top_k_weights, True)


# ---------------------------------------------------------------------------------------------
# Public functions.

def moe_permute(x, topk_ids, num_experts):
    """Group tokens by expert for grouped_mm: `(x_sorted, offs, inverse)`.

    x: (T, H) float32/float16/bfloat16 CUDA tensor, any strides. topk_ids: (T, k) int32/int64
    expert ids on x's device (k >= 1). num_experts: E >= 1, an int (numpy's too).
    x_sorted (T*k, H), x's dtype: token t's row once per chosen expert, grouped by expert in
    ascending order, within an expert in (token, slot) order. offs (E,) int32: cumulative end
    offsets (expert e owns rows offs[e-1]..offs[e]), the `offs` of grouped_mm and
    torch._grouped_mm. inverse (T, k) int32: x_sorted[inverse[t, j]] is token t's slot j (the
    index moe_unpermute takes).

    Nothing is read on the host (no synchronization, CUDA-graph capturable). Ids cannot be
    checked without reading them: a slot whose id is outside [0, E) belongs to no expert; its
    row lands after offs[E-1] (rows grouped_mm leaves as zeros, so it adds nothing through
    moe_unpermute, as transformers treats expert-parallel sentinels; torch._grouped_mm leaves
    those rows unspecified, so with it zero them, or the slot's weight, before moe_unpermute);
    nothing is ever accessed out of bounds. Differentiable in x (dx[t] = sum_j
    dx_sorted[inverse[t, j]], summed in float32, deterministic). Works under
    torch.compile(fullgraph=True). At most 2^31 - 1 elements in x_sorted."""
    try:
        num_experts = _check_permute(x, topk_ids, num_experts)
    except Exception:
        validate.not_nested("moe_permute", {"x": x, "topk_ids": topk_ids})
        raise
    return _permute(x, topk_ids, num_experts)


def moe_unpermute(y_sorted, inverse, topk_weights):
    """Combine the experts' rows per token: out[t] = sum_j topk_weights[t, j] *
    y_sorted[inverse[t, j]], summed in float32, returned in y_sorted's dtype.

    y_sorted: (T*k, H) float32/float16/bfloat16 CUDA tensor (the experts' output in
    moe_permute's row order). inverse: (T, k) int32/int64, moe_permute's. topk_weights: (T, k),
    float32 or y_sorted's dtype (transformers' routers return the model dtype: Qwen3-MoE's
    softmax runs in float32 and is cast back to the router logits' dtype).
    inverse must be a permutation of 0..T*k-1, as moe_permute returns (it is not read on the
    host): an entry outside 0..T*k-1 (such as -1 for a dropped slot) reads zeros and writes
    nothing, never out of bounds; rows no entry names get a zero gradient.
    Differentiable in y_sorted (dy_sorted[inverse[t, j]] = topk_weights[t, j] * dout[t], a
    scatter, no atomics) and topk_weights (dot(dout[t], y_sorted[inverse[t, j]]) in float32,
    cast to its dtype). Works under torch.compile(fullgraph=True). At most 2^31 - 1 elements in
    y_sorted."""
    try:
        _check_unpermute(y_sorted, inverse, topk_weights)
    except Exception:
        validate.not_nested("moe_unpermute", {"y_sorted": y_sorted, "inverse": inverse,
                                                "topk_weights": topk_weights})
        raise
    return _unpermute_op(y_sorted, inverse, topk_weights, False)


def moe_experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj):
    """transformers' Qwen3MoeExperts.forward: for each token and chosen expert e,
    `gate, up = linear(x, gate_up_proj[e]).chunk(2, -1)`, `linear(silu(gate) * up,
    down_proj[e])` times the routing weight, summed over the token's k experts.

    hidden_states (T, H) bf16/fp16; top_k_index (T, k) int32/int64; top_k_weights (T, k) in
    float32 or hidden_states' dtype; gate_up_proj (E, 2I, H) and down_proj (E, H, I) in
    hidden_states' dtype (the module's parameters as they are). Returns (T, H).
    moe_permute -> grouped_mm (gate_up) -> swiglu on the halves' views -> grouped_mm (down) ->
    moe_unpermute, all on the device without host synchronization; differentiable in
    hidden_states, top_k_weights and both weights (each piece's own backward). Ids outside
    [0, E) contribute nothing (transformers' expert-parallel sentinel convention).
    Numerics against transformers' loop: it multiplies each expert's output by the weight in
    bf16/fp16 and index_add_s it into a bf16/fp16 output, one rounding per slot in an order that
    varies from run to run (atomics), and rounds silu(gate) before the product; here the weight
    and the sum over the k slots are applied in float32 inside moe_unpermute with one rounding
    per output (deterministic, closer to a float32 reference), and swiglu rounds once."""
    try:
        _check_experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj)
    except Exception:
        validate.not_nested("moe_experts", dict(
            hidden_states=hidden_states, top_k_index=top_k_index, top_k_weights=top_k_weights,
            gate_up_proj=gate_up_proj, down_proj=down_proj))
        raise
    return _experts(hidden_states, top_k_index, top_k_weights, gate_up_proj, down_proj)
