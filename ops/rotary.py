# What the rotary ops (rope, rms_norm_rope) share: the tile helpers that gather cos/sin rows for
# a (batch, position) index, the host-side checks and normalization of q/k/cos/sin/position_ids,
# and the CTA count of their grids.
#
# cos/sin rows (R,) split in rotary halves: cos1, cos2 = cos[:R/2], cos[R/2:R] (sin alike). The
# backward of the rotation is the forward with (sin1, sin2) -> (-sin2, -sin1) (BACKWARD).
#
# No `from __future__ import annotations` here: it would hide the ct.Constant annotations.

import cuda.tile as ct
import torch
from torch.utils.weak import WeakTensorKeyDictionary

from tiletune import validate
from tiletune.device import persistent_ctas
from tiletune.torch_op import records_graph, tracing

ZERO = ct.PaddingMode.ZERO

# ---------------------------------------------------------------------------------------------
# Tile helpers (called from kernels). cos/sin are (B, S', R) views (stride-0 batch when shared);
# pos (B, S) int32 rows of cos/sin when HAS_POS.


def math_tile(t, like, MATH_F32):
    """t in the rotation's arithmetic dtype: float32 (MATH_F32), else the dtype of `like`."""
    if MATH_F32:
        return t.astype(ct.float32)
    return t.astype(like.dtype)


def load_tile(a, index, shape, WHOLE, LATENCY=None):
    """Tile `index` of `a`; WHOLE: the tile lies inside a, so the load checks no bounds, else
    what lies outside reads as zero. Without the checks the RoPE kernels build without the
    branch that guards each load (sm_90, tileiras 13.4, out of place at one CTA a position:
    1376 -> 816 instructions, 25 -> 4 branches), and there ran about 2x faster at D128 (H100,
    references/kernel-type-templates.md, "Whole tiles"). (tileiras 13.4 fails on a load with
    a padding mode and no bounds check, so WHOLE loads name none.)"""
    if WHOLE:
        return ct.load(a, index, shape, latency=LATENCY, check_bounds=False)
    return ct.load(a, index, shape, padding_mode=ZERO, latency=LATENCY)


def store_tile(a, index, tile, WHOLE):
    """store_tile(a, index, tile): load_tile's store; WHOLE: no bounds check."""
    ct.store(a, index, tile, check_bounds=not WHOLE)


def cos_sin_rows(cos, sin, b, p, half, TILE_S, TILE_R, BACKWARD, like, MATH_F32, WHOLE):
    """cos1, cos2, sin1, sin2 as [1, TILE_S, TILE_R] tiles in the arithmetic dtype (see
    math_tile): rows p*TILE_S.. of batch b. WHOLE: those rows lie inside cos and sin (see
    load_tile)."""
    shape = (1, TILE_S, TILE_R)
    c1 = math_tile(load_tile(cos.slice(2, 0, half), (b, p, 0), shape, WHOLE), like, MATH_F32)
    c2 = math_tile(load_tile(cos.slice(2, half, 2 * half), (b, p, 0), shape, WHOLE), like,
                   MATH_F32)
    s1 = math_tile(load_tile(sin.slice(2, 0, half), (b, p, 0), shape, WHOLE), like, MATH_F32)
    s2 = math_tile(load_tile(sin.slice(2, half, 2 * half), (b, p, 0), shape, WHOLE), like,
                   MATH_F32)
    if BACKWARD:
        return c1, c2, 0.0 - s2, 0.0 - s1
    return c1, c2, s1, s2


def position(pos, b, s, HAS_POS):
    """The cos/sin row of position s of batch b: position_ids[b, s], or s itself."""
    if HAS_POS:
        return ct.load(pos, (b, s), (1, 1)).item()
    return s


def _row(t, b, p, lo, hi, TILE_R, PLAIN):
    """t[b, p, lo:hi] as a [1, TILE_R] float32 tile, zero past hi; PLAIN: without TMA."""
    row = ct.load(t.slice(2, lo, hi), (b, p, 0), (1, 1, TILE_R), padding_mode=ZERO,
                  allow_tma=not PLAIN)
    return ct.reshape(row, (1, TILE_R)).astype(ct.float32)


def position_at(bs, S, cos, sin, pos, half, TILE_R, HAS_POS):
    """Flat (batch, position) index -> b, s and the [1, TILE_R] cos1, cos2, sin1, sin2 there.
    Where the halves fill their tiles (half a power of two) the rows are read with plain loads,
    not TMA: in rms_norm_rope, whose other loads go through TMA (its reductions want the tiles
    in shared memory), four TMA loads of 128-256 bytes a position, each waited on, cost more
    than the position's q and k (H200, B4 Hq32 Hkv8 S4096 D128: 163 against 100 us; Hq16
    Hkv16 S8192 D64: 352 against 86 us). Padded halves keep TMA: with plain loads there, the
    bf16 forward at D80, rotary 40 never finished on an H200 (tileiras 13.4)."""
    b = bs // S
    s = bs - b * S
    p = position(pos, b, s, HAS_POS)
    plain = TILE_R == half
    return (b, s, _row(cos, b, p, 0, half, TILE_R, plain),
            _row(cos, b, p, half, 2 * half, TILE_R, plain),
            _row(sin, b, p, 0, half, TILE_R, plain), _row(sin, b, p, half, 2 * half, TILE_R, plain))


def position_tile_at(t, S, cos, sin, pos, half, TILE_S, TILE_R, HAS_POS, BACKWARD, like,
                     MATH_F32, WHOLE):
    """Flat (batch, position tile) index -> b, st and the [1, TILE_S, TILE_R] cos/sin halves.
    With HAS_POS, TILE_S is 1 (rows are gathered one position at a time). WHOLE: the position
    tiles' cos/sin rows lie inside cos and sin (never with HAS_POS: ids unchecked under
    torch.compile and CUDA graphs must not read outside)."""
    tiles = ct.cdiv(S, TILE_S)
    b = t // tiles
    st = t - b * tiles
    c1, c2, s1, s2 = cos_sin_rows(cos, sin, b, position(pos, b, st, HAS_POS), half, TILE_S,
                                  TILE_R, BACKWARD, like, MATH_F32, WHOLE and not HAS_POS)
    return b, st, c1, c2, s1, s2


# ---------------------------------------------------------------------------------------------
# Grids: one CTA per position (tile), or a persistent grid of SMs x occupancy CTAs.

def ctas(cfg, positions, dev):
    """CTAs for `positions` (batch x position tiles) under a config with `persistent` and
    `occupancy`."""
    if not cfg.persistent:
        return max(positions, 1)
    return persistent_ctas(positions, dev, cfg.occupancy)


# ---------------------------------------------------------------------------------------------
# Host side: checks and normalization. `op` names the public function in every error.

def _as_3d(t):
    """(S', R), (1, S', R), (B, S', R) and HF's unsqueezed (B, 1, S', R) as (B', S', R) views;
    other shapes as they are (refused by the caller)."""
    if t.dim() == 4 and t.shape[1] == 1:
        return t[:, 0]
    return t[None] if t.dim() == 2 else t


_ID_RANGES = WeakTensorKeyDictionary()   # position_ids -> ((version, address), lo, hi)


def _id_range(position_ids):
    """(lo, hi) of an eager call's position_ids. Reading them is a device sync; a model passes
    one position_ids tensor to every layer, so the range is kept per tensor and reused while
    its version counter and address are unchanged (torch's in-place writes bump the counter).
    Inference tensors count no versions: read every call. (Only the range is kept, never the
    ids: a write torch does not count, such as a CUDA graph's replay, would leave a kept copy
    stale. A stale range can only miss a bad id, which then reads zeros from the bounds-checked
    cos/sin loads, as under torch.compile.)"""
    def read():     # both bounds in one read back (min and max one at a time would be two)
        return torch.stack(torch.aminmax(position_ids)).tolist()
    if position_ids.is_inference():
        return read()
    stamp = (position_ids._version, position_ids.data_ptr())
    seen = _ID_RANGES.get(position_ids)
    if seen is None or seen[0] != stamp:
        seen = stamp, *read()
        _ID_RANGES[position_ids] = seen
    return seen[1], seen[2]


def prepare(op, q, k, cos, sin, position_ids, rotary_dim):
    """Validate; return (cos, sin, pos, rot): cos/sin as (B, S', rot) views (stride-0 batch when
    shared), pos as (B, S) int32 or None, rot the rotary width."""
    validate.tensor(op, "q", q)
    for name, t in (("k", k), ("cos", cos), ("sin", sin)):
        validate.tensor(op, name, t, like=q)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"{op}: q and k must be 4-D (B, H, S, D), got {tuple(q.shape)} "
                         f"and {tuple(k.shape)}")
    B, Hq, S, D = q.shape
    if k.shape[0] != B or k.shape[2] != S or k.shape[3] != D:
        raise ValueError(f"{op}: k {tuple(k.shape)} does not match q {tuple(q.shape)} in "
                         "batch, sequence length or head_dim")
    if k.dtype != q.dtype:
        raise TypeError(f"{op}: k dtype {k.dtype} differs from q dtype {q.dtype}")
    Hk = k.shape[1]
    if Hq == 0 or Hk == 0 or Hq % Hk:
        raise ValueError(f"{op}: q heads ({Hq}) must be a positive multiple of k heads ({Hk})")
    if (cos.requires_grad or sin.requires_grad) and records_graph():
        raise ValueError(f"{op}: cos and sin must not require grad: gradients flow to q and k "
                         "only (detach them; HF's rotary tables are buffers)")
    if cos.shape != sin.shape:      # each in any of the documented forms: compared as (B', S', R)
        if _as_3d(cos).shape != _as_3d(sin).shape:
            raise ValueError(f"{op}: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")
    given = cos
    cos, sin = _as_3d(cos), _as_3d(sin)
    if cos.dim() != 3 or cos.shape[0] not in (1, B):
        raise ValueError(f"{op}: cos/sin must be (S, R), (1, S, R), ({B}, S, R) or ({B}, 1, S, "
                         f"R), got {tuple(given.shape)}")
    rot = cos.shape[-1] if rotary_dim is None else \
        validate.integer(op, "rotary_dim", rotary_dim, "an int or None")
    if rot <= 0 or rot % 2 or rot > D:
        raise ValueError(f"{op}: rotary width must be even and in [2, head_dim={D}], got {rot}")
    if cos.shape[-1] < rot:
        raise ValueError(f"{op}: cos/sin have {cos.shape[-1]} columns, fewer than the rotary "
                         f"width {rot}")
    # (views made only where they change something: each costs about 1 us of host time)
    if cos.shape[-1] != rot:
        cos, sin = cos[..., :rot], sin[..., :rot]
    # unit column strides, each table on its own (the kernels' row loads use TMA where it
    # applies; contiguous() leaves a table that has one as it is)
    if cos.stride(-1) != 1 or sin.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    if cos.shape[0] != B:
        cos, sin = cos.expand(B, -1, -1), sin.expand(B, -1, -1)
    pos = None
    if position_ids is not None:
        if not isinstance(position_ids, torch.Tensor) or \
                position_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{op}: position_ids must be an int32/int64 tensor")
        given = position_ids        # (the range is kept per given tensor)
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        if position_ids.dim() != 2 or position_ids.shape[1] != S or \
                position_ids.shape[0] not in (1, B):
            raise ValueError(f"{op}: position_ids must be (S,), (1, S) or ({B}, S) with "
                             f"S={S}, got {tuple(position_ids.shape)}")
        if position_ids.device != q.device:
            raise ValueError(f"{op}: position_ids is on {position_ids.device}, q on {q.device}")
        # Out-of-range rows would read outside cos/sin: checked here, except under CUDA graph
        # capture or torch.compile, where it is the caller's contract.
        if position_ids.numel() and not tracing() and \
                not torch.cuda.is_current_stream_capturing():
            lo, hi = _id_range(given)
            if lo < 0 or hi >= cos.shape[1]:
                raise ValueError(f"{op}: position_ids range [{lo}, {hi}] is outside the "
                                 f"{cos.shape[1]} rows of cos/sin")
        pos = position_ids.to(torch.int32).expand(B, S)
    elif cos.shape[1] < S:
        raise ValueError(f"{op}: cos/sin have {cos.shape[1]} rows, fewer than S={S}")
    return cos, sin, pos, rot
