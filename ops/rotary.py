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

from tiletune import validate
from tiletune.device import persistent_ctas

ZERO = ct.PaddingMode.ZERO

# ---------------------------------------------------------------------------------------------
# Tile helpers (called from kernels). cos/sin are (B, S', R) views (stride-0 batch when shared);
# pos (B, S) int32 rows of cos/sin when HAS_POS.


def cos_sin_rows(cos, sin, b, p, half, TILE_S, TILE_R, BACKWARD):
    """cos1, cos2, sin1, sin2 as [1, TILE_S, TILE_R] f32 tiles: rows p*TILE_S.. of batch b."""
    shape = (1, TILE_S, TILE_R)
    c1 = ct.load(cos.slice(2, 0, half), (b, p, 0), shape, padding_mode=ZERO).astype(ct.float32)
    c2 = ct.load(cos.slice(2, half, 2 * half), (b, p, 0), shape, padding_mode=ZERO).astype(ct.float32)
    s1 = ct.load(sin.slice(2, 0, half), (b, p, 0), shape, padding_mode=ZERO).astype(ct.float32)
    s2 = ct.load(sin.slice(2, half, 2 * half), (b, p, 0), shape, padding_mode=ZERO).astype(ct.float32)
    if BACKWARD:
        return c1, c2, 0.0 - s2, 0.0 - s1
    return c1, c2, s1, s2


def cos_sin(cos, sin, b, p, half, TILE_R, BACKWARD):
    """One position's cos1, cos2, sin1, sin2 as [1, TILE_R] f32 tiles."""
    c1, c2, s1, s2 = cos_sin_rows(cos, sin, b, p, half, 1, TILE_R, BACKWARD)
    return (ct.reshape(c1, (1, TILE_R)), ct.reshape(c2, (1, TILE_R)),
            ct.reshape(s1, (1, TILE_R)), ct.reshape(s2, (1, TILE_R)))


def position(pos, b, s, HAS_POS):
    """The cos/sin row of position s of batch b: position_ids[b, s], or s itself."""
    if HAS_POS:
        return ct.load(pos, (b, s), (1, 1)).item()
    return s


def position_at(bs, S, cos, sin, pos, half, TILE_R, HAS_POS, BACKWARD):
    """Flat (batch, position) index -> b, s and the [1, TILE_R] cos/sin halves there."""
    b = bs // S
    s = bs - b * S
    c1, c2, s1, s2 = cos_sin(cos, sin, b, position(pos, b, s, HAS_POS), half, TILE_R, BACKWARD)
    return b, s, c1, c2, s1, s2


def position_tile_at(t, S, cos, sin, pos, half, TILE_S, TILE_R, HAS_POS, BACKWARD):
    """Flat (batch, position tile) index -> b, st and the [1, TILE_S, TILE_R] cos/sin halves.
    With HAS_POS, TILE_S is 1 (rows are gathered one position at a time)."""
    tiles = ct.cdiv(S, TILE_S)
    b = t // tiles
    st = t - b * tiles
    c1, c2, s1, s2 = cos_sin_rows(cos, sin, b, position(pos, b, st, HAS_POS), half, TILE_S,
                                  TILE_R, BACKWARD)
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
# Host side: memory overlap of tensors written in place. Pure functions of (address, shape,
# strides, element size): no device work, any device. Conservative: "may overlap" is refused.

def _span(t):
    """(first byte, end byte, element size, [(size, stride in bytes) of the dims of size > 1])
    of t's elements, or None when t is empty."""
    es = t.element_size()
    dims = []
    reach = es
    for n, st in zip(t.shape, t.stride()):
        if n > 1:
            dims.append((n, st * es))
            reach += (n - 1) * st * es
        elif n == 0:
            return None
    start = t.data_ptr()
    return start, start + reach, es, dims


def _self_overlaps(span):
    if span is None:
        return False
    reach = 0
    for n, st in sorted(span[3], key=lambda d: d[1]):
        if st <= reach:
            return True
        reach += (n - 1) * st
    return False


def self_overlaps(t):
    """True if two elements of t may share memory (an expanded, stride-0 dim of size > 1, or
    as_strided dims that interleave); False if every element has its own memory: with the dims
    sorted by stride, each stride exceeds the reach of the dims below it."""
    return _self_overlaps(_span(t))


def _arc(span, m):
    """The byte residues mod m that a span's elements occupy, as an arc of the circle Z/m:
    (start, length - 1), or None when it may be the whole circle. Dims whose stride is a
    multiple of m leave the residue alone; the others (and the element's own bytes) move it by
    at most the sum of their reaches."""
    reach = span[2] - 1
    for n, st in span[3]:
        if st % m:
            reach += (n - 1) * st
    return (span[0] % m, reach) if reach < m - 1 else None


def _overlap(sa, sb):
    if sa is None or sb is None or sa[1] <= sb[0] or sb[1] <= sa[0]:
        return False                     # empty, or disjoint byte ranges [start, end)
    for m in {st for _, st in sa[3] + sb[3] if st > 1}:
        arc_a, arc_b = _arc(sa, m), _arc(sb, m)
        if arc_a is not None and arc_b is not None and \
                (arc_b[0] - arc_a[0]) % m > arc_a[1] and (arc_a[0] - arc_b[0]) % m > arc_b[1]:
            return False                 # neither arc starts inside the other: disjoint
    return True


def overlaps(a, b):
    """True if tensors a and b may share memory (a byte of one element of a is a byte of an
    element of b); False only when provably disjoint. Tensors of different allocations, or
    empty ones, never overlap. Views that interleave within one buffer (the q and k columns of a
    fused qkv projection, the halves of a (B, 2, H, S, D) buffer) are told apart by their bytes'
    residues modulo a stride of theirs: each occupies its own arc of that period."""
    return _overlap(_span(a), _span(b))


def check_inplace(op, q, k):
    """Refuse an in-place rotation of q and k that would rotate an element twice or race: q or
    k with overlapping elements (a stride-0 expanded dim), or q and k sharing memory (k is q,
    overlapping views). ValueError naming `op` and the argument. (cos/sin/position_ids are not
    checked against q and k: a few microseconds on every call for a case no caller makes.)"""
    sq, sk = _span(q), _span(k)
    for name, t, span in (("q", q, sq), ("k", k, sk)):
        if _self_overlaps(span):
            raise ValueError(f"{op}: inplace=True needs {name} whose elements do not share "
                             f"memory; {name} {tuple(t.shape)} with strides {t.stride()} has "
                             "overlapping elements (an expanded, stride-0 dim?): pass a "
                             "contiguous copy or use inplace=False")
    if _overlap(sq, sk):
        what = "k is q" if k is q else "q and k overlap in memory"
        raise ValueError(f"{op}: inplace=True needs q and k in separate memory, but {what}: "
                         "use inplace=False")


# ---------------------------------------------------------------------------------------------
# Host side: checks and normalization. `op` names the public function in every error.

def prepare(op, q, k, cos, sin, position_ids, rotary_dim):
    """Validate; return (cos, sin, pos, rot): cos/sin as (B, S', rot) views (stride-0 batch when
    shared), pos as (B, S) int32 or None, rot the rotary width."""
    validate.tensor(op, "q", q)
    for name, t in (("k", k), ("cos", cos), ("sin", sin)):
        validate.tensor(op, name, t, device=q.device)
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
    if Hk == 0 or Hq % Hk:
        raise ValueError(f"{op}: q heads ({Hq}) must be a multiple of k heads ({Hk})")
    if cos.shape != sin.shape:
        raise ValueError(f"{op}: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")
    if cos.dim() == 4 and cos.shape[1] == 1:      # (B, 1, S, R): HF unsqueezed form
        cos, sin = cos[:, 0], sin[:, 0]
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    if cos.dim() != 3 or cos.shape[0] not in (1, B):
        raise ValueError(f"{op}: cos/sin must be (S, R), (1, S, R) or ({B}, S, R), got "
                         f"{tuple(cos.shape)}")
    rot = cos.shape[-1] if rotary_dim is None else int(rotary_dim)
    if rot <= 0 or rot % 2 or rot > D:
        raise ValueError(f"{op}: rotary width must be even and in [2, head_dim={D}], got {rot}")
    if cos.shape[-1] < rot:
        raise ValueError(f"{op}: cos/sin have {cos.shape[-1]} columns, fewer than the rotary "
                         f"width {rot}")
    cos, sin = cos[..., :rot], sin[..., :rot]
    if cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    cos, sin = cos.expand(B, -1, -1), sin.expand(B, -1, -1)
    pos = None
    if position_ids is not None:
        if not isinstance(position_ids, torch.Tensor) or \
                position_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"{op}: position_ids must be an int32/int64 tensor")
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        if position_ids.dim() != 2 or position_ids.shape[1] != S or \
                position_ids.shape[0] not in (1, B):
            raise ValueError(f"{op}: position_ids must be (S,), (1, S) or ({B}, S) with "
                             f"S={S}, got {tuple(position_ids.shape)}")
        if position_ids.device != q.device:
            raise ValueError(f"{op}: position_ids is on {position_ids.device}, q on {q.device}")
        # Out-of-range rows would read outside cos/sin: checked here (one device sync), except
        # under CUDA graph capture or torch.compile, where it is the caller's contract.
        if position_ids.numel() and not torch.compiler.is_compiling() and \
                not torch.cuda.is_current_stream_capturing():
            lo, hi = int(position_ids.min()), int(position_ids.max())
            if lo < 0 or hi >= cos.shape[1]:
                raise ValueError(f"{op}: position_ids range [{lo}, {hi}] is outside the "
                                 f"{cos.shape[1]} rows of cos/sin")
        pos = position_ids.to(torch.int32).expand(B, S)
    elif cos.shape[1] < S:
        raise ValueError(f"{op}: cos/sin have {cos.shape[1]} rows, fewer than S={S}")
    return cos, sin, pos, rot
