# Rotary position embedding (HF "rotate_half" convention) for q (B, Hq, S, D) and k (B, Hkv, S, D).
#
#   x1, x2 = x[..., :R/2], x[..., R/2:R]        (R = rotary width <= D; dims R..D pass through)
#   out1 = x1 * cos1 - x2 * sin1,  out2 = x2 * cos2 + x1 * sin2
# with cos/sin rows (R,) split the same way. The backward is the transpose:
#   dx1 = dy1 * cos1 + dy2 * sin2,  dx2 = dy2 * cos2 - dy1 * sin1
# i.e. the forward with (sin1, sin2) -> (-sin2, -sin1).
#
# No `from __future__ import annotations` here: it would hide the ct.Constant annotations.
from types import SimpleNamespace
from typing import Optional

import cuda.tile as ct
import torch

from tiletune import validate
from tiletune.autotune import Autotuner, Search, Work, bucket, next_pow2
from tiletune.device import current_stream, sm_count

ZERO = ct.PaddingMode.ZERO

# ---------------------------------------------------------------------------------------------
# Kernels. One CTA handles TILE_S consecutive positions of one batch row at a time: all q heads
# and all k heads, so each cos/sin row is read once. Arrays are 4-D views (B, H, S, D) with any
# strides; tiles are [1, TILE_H, TILE_S, TILE_R] over heads, positions and one rotary half.
# With position_ids (HAS_POS) the cos/sin rows are gathered one position at a time: TILE_S = 1.


def _cos_sin_rows(cos, sin, b, p, half, TILE_S, TILE_R, BACKWARD):
    """cos1, cos2, sin1, sin2 as [1, TILE_S, TILE_R] f32 tiles: rows p*TILE_S.. of batch b."""
    shape = (1, TILE_S, TILE_R)
    c1 = ct.load(cos.slice(2, 0, half), (b, p, 0), shape, padding_mode=ZERO).astype(ct.float32)
    c2 = ct.load(cos.slice(2, half, 2 * half), (b, p, 0), shape, padding_mode=ZERO).astype(ct.float32)
    s1 = ct.load(sin.slice(2, 0, half), (b, p, 0), shape, padding_mode=ZERO).astype(ct.float32)
    s2 = ct.load(sin.slice(2, half, 2 * half), (b, p, 0), shape, padding_mode=ZERO).astype(ct.float32)
    if BACKWARD:
        return c1, c2, 0.0 - s2, 0.0 - s1
    return c1, c2, s1, s2


def _cos_sin(cos, sin, b, p, half, TILE_R, BACKWARD):
    """One position's cos1, cos2, sin1, sin2 as [1, TILE_R] f32 tiles."""
    c1, c2, s1, s2 = _cos_sin_rows(cos, sin, b, p, half, 1, TILE_R, BACKWARD)
    return (ct.reshape(c1, (1, TILE_R)), ct.reshape(c2, (1, TILE_R)),
            ct.reshape(s1, (1, TILE_R)), ct.reshape(s2, (1, TILE_R)))


def _rotate(x, out, b, st, half, c1, c2, s1, s2, TILE_H, TILE_S, TILE_R, TILE_P, COPY_REST,
            LATENCY):
    """Rotate the first 2*half dims of x[b, :, st*TILE_S : (st+1)*TILE_S, :] into out; copy the
    rest. Positions past S load as zeros and their stores are dropped. LATENCY is ct.load's
    DRAM-latency hint (1-10) for the q/k loads."""
    shape = (1, TILE_H, TILE_S, TILE_R)
    x1 = ct.load(x.slice(3, 0, half), (b, 0, st, 0), shape, padding_mode=ZERO,
                 latency=LATENCY).astype(ct.float32)
    x2 = ct.load(x.slice(3, half, 2 * half), (b, 0, st, 0), shape, padding_mode=ZERO,
                 latency=LATENCY).astype(ct.float32)
    ct.store(out.slice(3, 0, half), (b, 0, st, 0), (x1 * c1 - x2 * s1).astype(out.dtype))
    ct.store(out.slice(3, half, 2 * half), (b, 0, st, 0), (x2 * c2 + x1 * s2).astype(out.dtype))
    if COPY_REST:
        rest = ct.load(x.slice(3, 2 * half, x.shape[3]), (b, 0, st, 0), (1, TILE_H, TILE_S, TILE_P),
                       padding_mode=ZERO, latency=LATENCY)
        ct.store(out.slice(3, 2 * half, x.shape[3]), (b, 0, st, 0), rest)


def _position(pos, b, s, HAS_POS):
    if HAS_POS:
        return ct.load(pos, (b, s), (1, 1)).item()
    return s


def _at(bs, S, cos, sin, pos, half, TILE_R, HAS_POS, BACKWARD):
    """Flat (batch, position) index -> b, s and the [1, TILE_R] cos/sin halves there."""
    b = bs // S
    s = bs - b * S
    c1, c2, s1, s2 = _cos_sin(cos, sin, b, _position(pos, b, s, HAS_POS), half, TILE_R, BACKWARD)
    return b, s, c1, c2, s1, s2


def _rows_at(t, S, cos, sin, pos, half, TILE_S, TILE_R, HAS_POS, BACKWARD):
    """Flat (batch, position tile) index -> b, st and the [1, TILE_S, TILE_R] cos/sin halves."""
    tiles = ct.cdiv(S, TILE_S)
    b = t // tiles
    st = t - b * tiles
    c1, c2, s1, s2 = _cos_sin_rows(cos, sin, b, _position(pos, b, st, HAS_POS), half, TILE_S,
                                   TILE_R, BACKWARD)
    return b, st, c1, c2, s1, s2


@ct.kernel
def rope_kernel(q, k, cos, sin, pos, q_out, k_out, half: ct.Constant[int],
                TILE_HQ: ct.Constant[int], TILE_HK: ct.Constant[int], TILE_S: ct.Constant[int],
                TILE_R: ct.Constant[int], TILE_P: ct.Constant[int], HAS_POS: ct.Constant[bool],
                COPY_REST: ct.Constant[bool], BACKWARD: ct.Constant[bool],
                LATENCY: ct.Constant[int]):
    """Out of place: q_out, k_out = rope(q), rope(k). cos/sin (Bc, S', R) with Bc in {1, B}
    (a stride-0 batch dim when shared); pos (B, S) int32 rows of cos/sin when HAS_POS."""
    S = q.shape[2]
    for t in range(ct.bid(0), q.shape[0] * ct.cdiv(S, TILE_S), ct.num_blocks(0)):
        b, st, c1, c2, s1, s2 = _rows_at(t, S, cos, sin, pos, half, TILE_S, TILE_R, HAS_POS,
                                         BACKWARD)
        _rotate(q, q_out, b, st, half, c1, c2, s1, s2, TILE_HQ, TILE_S, TILE_R, TILE_P, COPY_REST,
                LATENCY)
        _rotate(k, k_out, b, st, half, c1, c2, s1, s2, TILE_HK, TILE_S, TILE_R, TILE_P, COPY_REST,
                LATENCY)


@ct.kernel
def rope_inplace_kernel(q, k, cos, sin, pos, half: ct.Constant[int],
                        TILE_HQ: ct.Constant[int], TILE_HK: ct.Constant[int],
                        TILE_S: ct.Constant[int], TILE_R: ct.Constant[int],
                        HAS_POS: ct.Constant[bool], BACKWARD: ct.Constant[bool],
                        LATENCY: ct.Constant[int]):
    """In place: q, k = rope(q), rope(k) (each element is read before it is written, by the
    same CTA; pass-through dims are left alone)."""
    S = q.shape[2]
    for t in range(ct.bid(0), q.shape[0] * ct.cdiv(S, TILE_S), ct.num_blocks(0)):
        b, st, c1, c2, s1, s2 = _rows_at(t, S, cos, sin, pos, half, TILE_S, TILE_R, HAS_POS,
                                         BACKWARD)
        _rotate(q, q, b, st, half, c1, c2, s1, s2, TILE_HQ, TILE_S, TILE_R, 1, False, LATENCY)
        _rotate(k, k, b, st, half, c1, c2, s1, s2, TILE_HK, TILE_S, TILE_R, 1, False, LATENCY)


# ---------------------------------------------------------------------------------------------
# Configs, from H200 measurements at B4 Hq32 Hkv8 S4096 D128 bf16 (copy ceiling 86.9 us;
# assets/scripts/explore_rope.py; references/parameter-space-design.md):
# - grid: a persistent grid (SMs x occupancy CTAs looping over positions) beat one CTA per
#   position: 109.6 vs 184.7 us at occupancy 4; occupancy 2/8 persistent 165/130 us.
# - ct.load's latency hint on the q/k loads (in this kernel, which loads q, stores q, then loads
#   k): at occupancy 4, 104.8 us with latency 1, 115.3 with 5, 116.0 with 10 (the search in the
#   bench); at occupancy 2, 118.8 with latency 5 vs 165.2 without, 167.4 with 10. (A variant that
#   loads q and k before any store measured 104.0 with latency 5 or 10, 109.2 without: no better.)
# - positions per tile (TILE_S) never won at 32 x 128 (TILE_S 2: 141.7-144.8 us, 4: 182 us) but
#   one position of few narrow heads (8 x 64 bf16 = 1 KB) is too little work per iteration: kept
#   for those, bounded by registers (`cuobjdump -res-usage`, sm_90: 4 positions of 32 x 128
#   spill 152-360 B).

def rope_tile_configs(arch, heads, rot, has_pos=False):
    """heads: q heads; rot: rotary width. Default first: the best measured config."""
    cfg = lambda occ, persistent, tile_s, lat: SimpleNamespace(
        occupancy=occ, persistent=persistent, tile_s=tile_s, latency=lat)
    yield cfg(4, True, 1, 1)
    for occ, lat in ((4, 5), (4, 10), (2, 5), (8, 1), (8, 5)):
        yield cfg(occ, True, 1, lat)
    yield cfg(16, False, 1, 5)
    per_position = next_pow2(heads) * 2 * next_pow2(max(rot // 2, 1))
    for tile_s in (2, 4, 8, 16):
        elems = tile_s * per_position
        if has_pos or elems > MAX_TILE_ELEMS:
            break
        occs = [o for o in (1, 2, 4) if elems * o <= MAX_RESIDENT_ELEMS]
        for occ in occs[-2:]:
            yield cfg(occ, True, tile_s, 5)
        yield cfg(occs[-1], False, tile_s, 5)


MAX_TILE_ELEMS = 16384     # fp32 elements of one q tile (both halves)
MAX_RESIDENT_ELEMS = 32768  # tile elements x occupancy: beyond this, sm_90 cubins spill 150+ B
DEFAULT = next(rope_tile_configs("sm_90", 32, 128))

_rope = Autotuner("rope", rope_kernel, rope_tile_configs, default=DEFAULT)
# In place: the search times the out-of-place twin with a scratch output (split buffers), so
# q and k keep their values until the one in-place launch with the winning config.
_rope_inplace = Autotuner("rope_inplace", rope_inplace_kernel, rope_tile_configs,
                          default=DEFAULT, search_kernel=rope_kernel)
TUNERS = (_rope, _rope_inplace)


# ---------------------------------------------------------------------------------------------
# Host launch.

def ctas(cfg, positions, dev):
    """One CTA per position, or a persistent grid of SMs x occupancy CTAs."""
    if not cfg.persistent:
        return max(positions, 1)
    return max(1, min(positions, sm_count(dev) * cfg.occupancy))


def _launch(q, k, cos, sin, pos, q_out, k_out, rot, backward):
    """q_out/k_out None: in place. cos/sin (B, S', rot) views; pos (B, S) int32 or None."""
    B, Hq, S, D = q.shape
    Hk = k.shape[1]
    dev = q.get_device()
    half = rot // 2
    inplace = q_out is None
    th, tk, tr = next_pow2(Hq), next_pow2(Hk), next_pow2(half)
    tile_p = next_pow2(max(D - rot, 1))
    copy_rest = (not inplace) and rot < D
    has_pos = pos is not None
    pos_arg = pos if has_pos else cos      # unused when HAS_POS is False
    key = (Hq, Hk, D, rot, bucket(B * S), q.dtype, cos.dtype, has_pos, backward,
           dev)
    tuner = _rope_inplace if inplace else _rope

    def grid(c):
        return (ctas(c, B * -(-S // c.tile_s), dev),)

    def out_args(c, qo, ko):
        return (q, k, cos, sin, pos_arg, qo, ko, half, th, tk, c.tile_s, tr, tile_p, has_pos,
                copy_rest, backward, c.latency)

    def search():
        if inplace:   # split buffers: one scratch allocation per miss, reused by every sample
            scratch_q, scratch_k = torch.empty_like(q), torch.empty_like(k)
            args_fn = lambda c: out_args(c, scratch_q, scratch_k)
        else:
            args_fn = lambda c: out_args(c, q_out, k_out)
        nbytes = 2 * (q.numel() + k.numel()) * q.element_size() + 2 * S * rot * cos.element_size()
        return Search(shape=dict(heads=Hq, rot=rot, has_pos=has_pos), grid_fn=grid,
                      args_fn=args_fn, work=Work(bytes=nbytes))
    cfg, kernel = tuner.cache.get(key) or tuner.tune(key, q, search())
    if inplace:
        args = (q, k, cos, sin, pos_arg, half, th, tk, cfg.tile_s, tr, has_pos, backward,
                cfg.latency)
    else:
        args = out_args(cfg, q_out, k_out)
    ct.launch(current_stream(dev), grid(cfg), kernel, args)


# ---------------------------------------------------------------------------------------------
# Wrapper: validation and normalization of cos/sin/position_ids.

def _prepare(q, k, cos, sin, position_ids, rotary_dim):
    """Validate; return (cos3, sin3, pos, rot): cos/sin as (B, S', rot) views (stride-0 batch
    when shared), pos as (B, S) int32 or None."""
    validate.tensor("apply_rope", "q", q)
    for name, t in (("k", k), ("cos", cos), ("sin", sin)):
        validate.tensor("apply_rope", name, t, device=q.device)
    if q.dim() != 4 or k.dim() != 4:
        raise ValueError(f"apply_rope: q and k must be 4-D (B, H, S, D), got {tuple(q.shape)} "
                         f"and {tuple(k.shape)}")
    B, Hq, S, D = q.shape
    if k.shape[0] != B or k.shape[2] != S or k.shape[3] != D:
        raise ValueError(f"apply_rope: k {tuple(k.shape)} does not match q {tuple(q.shape)} in "
                         "batch, sequence length or head_dim")
    if k.dtype != q.dtype:
        raise TypeError(f"apply_rope: k dtype {k.dtype} differs from q dtype {q.dtype}")
    Hk = k.shape[1]
    if Hk == 0 or Hq % Hk:
        raise ValueError(f"apply_rope: q heads ({Hq}) must be a multiple of k heads ({Hk})")
    if cos.shape != sin.shape:
        raise ValueError(f"apply_rope: cos {tuple(cos.shape)} and sin {tuple(sin.shape)} differ")
    if cos.dim() == 4 and cos.shape[1] == 1:      # (B, 1, S, R): HF unsqueezed form
        cos, sin = cos[:, 0], sin[:, 0]
    if cos.dim() == 2:
        cos, sin = cos[None], sin[None]
    if cos.dim() != 3 or cos.shape[0] not in (1, B):
        raise ValueError(f"apply_rope: cos/sin must be (S, R), (1, S, R) or ({B}, S, R), got "
                         f"{tuple(cos.shape)}")
    rot = cos.shape[-1] if rotary_dim is None else int(rotary_dim)
    if rot <= 0 or rot % 2 or rot > D:
        raise ValueError(f"apply_rope: rotary width must be even and in [2, head_dim={D}], got {rot}")
    if cos.shape[-1] < rot:
        raise ValueError(f"apply_rope: cos/sin have {cos.shape[-1]} columns, fewer than the rotary "
                         f"width {rot}")
    cos, sin = cos[..., :rot], sin[..., :rot]
    if cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    cos, sin = cos.expand(B, -1, -1), sin.expand(B, -1, -1)
    pos = None
    if position_ids is not None:
        if not isinstance(position_ids, torch.Tensor) or position_ids.dtype not in (torch.int32, torch.int64):
            raise TypeError("apply_rope: position_ids must be an int32/int64 tensor")
        if position_ids.dim() == 1:
            position_ids = position_ids[None]
        if position_ids.dim() != 2 or position_ids.shape[1] != S or position_ids.shape[0] not in (1, B):
            raise ValueError(f"apply_rope: position_ids must be (S,), (1, S) or ({B}, S) with "
                             f"S={S}, got {tuple(position_ids.shape)}")
        if position_ids.device != q.device:
            raise ValueError(f"apply_rope: position_ids is on {position_ids.device}, q on {q.device}")
        # Out-of-range rows would read outside cos/sin: checked here (one device sync), except
        # under CUDA graph capture or torch.compile, where it is the caller's contract.
        if position_ids.numel() and not torch.compiler.is_compiling() and \
                not torch.cuda.is_current_stream_capturing():
            lo, hi = int(position_ids.min()), int(position_ids.max())
            if lo < 0 or hi >= cos.shape[1]:
                raise ValueError(f"apply_rope: position_ids range [{lo}, {hi}] is outside the "
                                 f"{cos.shape[1]} rows of cos/sin")
        pos = position_ids.to(torch.int32).expand(B, S)
    elif cos.shape[1] < S:
        raise ValueError(f"apply_rope: cos/sin have {cos.shape[1]} rows, fewer than S={S}")
    return cos, sin, pos, rot


def _rope_out(q, k, cos, sin, pos, rot, backward=False):
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if q.shape[0] * q.shape[2]:
        _launch(q, k, cos, sin, pos, q_out, k_out, rot, backward)
    return q_out, k_out


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, pos, rot, inplace):
        ctx.save_for_backward(cos, sin, pos)
        ctx.rot = rot
        if inplace:
            if q.shape[0] * q.shape[2]:
                _launch(q, k, cos, sin, pos, None, None, rot, False)
            ctx.mark_dirty(q, k)
            return q, k
        return _rope_out(q, k, cos, sin, pos, rot)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin, pos = ctx.saved_tensors
        dq = torch.zeros_like(dq if dq is not None else dk) if dq is None else dq
        dk = torch.zeros_like(dq) if dk is None else dk
        dq_in, dk_in = _rope_out(dq, dk, cos, sin, pos, ctx.rot, backward=True)
        return dq_in, dk_in, None, None, None, None, None


@torch.library.custom_op("tiletune::rope", mutates_args=())
def _rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
             pos: Optional[torch.Tensor], rot: int, backward: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _rope_out(q, k, cos, sin, pos, rot, backward)


@_rope_op.register_fake
def _(q, k, cos, sin, pos, rot, backward):
    return torch.empty_like(q), torch.empty_like(k)


def _rope_op_setup(ctx, inputs, output):
    _, _, cos, sin, pos, rot, backward = inputs
    ctx.save_for_backward(cos, sin, pos)
    ctx.rot, ctx.backward = rot, backward


def _rope_op_backward(ctx, dq, dk):
    cos, sin, pos = ctx.saved_tensors
    dq_in, dk_in = _rope_op(dq, dk, cos, sin, pos, ctx.rot, not ctx.backward)
    return dq_in, dk_in, None, None, None, None, None


_rope_op.register_autograd(_rope_op_backward, setup_context=_rope_op_setup)


def apply_rope(q, k, cos, sin, *, position_ids=None, rotary_dim=None, inplace=False):
    """Rotary position embedding, HF "rotate_half" convention, for q and k together.

    q: (B, Hq, S, D), k: (B, Hkv, S, D) with Hq a multiple of Hkv (GQA/MQA); any strides (e.g.
    the transposed views HF produces); float32/float16/bfloat16 (q and k alike).
    cos, sin: (S', R), (1, S', R), (B, S', R) or (B, 1, S', R), any of the three dtypes; R is the
    rotary width (`rotary_dim`, default cos's last dim; even, <= D): the first R dims of each head
    rotate, the rest pass through. Row s of cos/sin serves position s, or position_ids[b, s] when
    `position_ids` (B, S) / (1, S) / (S,) is given (range checked on the host: one sync).
    inplace=False returns new (q_embed, k_embed) laid out like q and k; inplace=True writes q and
    k in place (marked dirty for autograd) and returns them. Differentiable in q and k.
    """
    cos, sin, pos, rot = _prepare(q, k, cos, sin, position_ids, rotary_dim)
    if torch.compiler.is_compiling():       # the custom op: no graph break (in place = copy back)
        qo, ko = _rope_op(q, k, cos, sin, pos, rot, False)
        if inplace:
            return q.copy_(qo), k.copy_(ko)
        return qo, ko
    if inplace and (q.requires_grad or k.requires_grad) and torch.is_grad_enabled() and \
            (q.is_leaf or k.is_leaf):
        raise ValueError("apply_rope: inplace=True on a leaf tensor that requires grad")
    return RoPEFunction.apply(q, k, cos, sin, pos, rot, bool(inplace))


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """HF-compatible functional form: returns (q_embed, k_embed). cos/sin as HF passes them
    ((B, S, D) or (S, D)); `unsqueeze_dim` is accepted for signature compatibility (q/k must be
    (B, H, S, D), i.e. unsqueeze_dim=1)."""
    if unsqueeze_dim != 1:
        raise ValueError("apply_rotary_pos_emb: only unsqueeze_dim=1 ((B, H, S, D) q/k) is supported")
    return apply_rope(q, k, cos, sin, position_ids=position_ids)


# ---------------------------------------------------------------------------------------------
# Ahead-of-time compile cases: every config for the headline layout (HF transposed views, GQA
# 32/8, D 128, bf16) in both kernels; the default config for partial rotary + position_ids (fp16,
# D 80), MQA float32, and the backward.

def aot_cases():
    from tiletune.aot import CompileCase, jit_array

    def hf_view(dt, B, H, S, D):     # (B, S, H, D) storage seen as (B, H, S, D)
        return jit_array(dt, (B, H, S, D), (S * H * D, D, H * D, 1))

    def shared(dt, B, S, R):         # cos/sin expanded over the batch (stride 0)
        return jit_array(dt, (B, S, R), (0, R, 1))

    def out_params(dt, cdt, B, Hq, Hk, S, D, R, has_pos, backward, cfg):
        q, k = hf_view(dt, B, Hq, S, D), hf_view(dt, B, Hk, S, D)
        c = shared(cdt, B, S, R)
        pos = jit_array(torch.int32, (B, S), (0, 1)) if has_pos else c
        return [q, k, c, c, pos, hf_view(dt, B, Hq, S, D), hf_view(dt, B, Hk, S, D), R // 2,
                next_pow2(Hq), next_pow2(Hk), cfg.tile_s, next_pow2(R // 2),
                next_pow2(max(D - R, 1)), has_pos, R < D, backward, cfg.latency]

    B, S = 4, 4096
    for cfg in rope_tile_configs("sm_90", 32, 128):
        p = out_params(torch.bfloat16, torch.bfloat16, B, 32, 8, S, 128, 128, False, False, cfg)
        yield CompileCase("rope", _rope.build(cfg), p, f"rope 32/8 D128 bf16 {vars(cfg)}")
        yield CompileCase("rope", _rope_inplace.build(cfg), p[:5] + p[7:12] + [p[13], p[15], p[16]],
                          f"rope_inplace 32/8 D128 bf16 {vars(cfg)}")
    cfg = next(rope_tile_configs("sm_90", 32, 128))
    wide = list(rope_tile_configs("sm_90", 8, 64))[-1]       # largest TILE_S, ragged S
    variants = [("fp16 7/1 D80 R40 pos", cfg, (torch.float16, torch.float32, 2, 7, 1, 423, 80, 40, True, False)),
                ("f32 8/1 D64 backward", cfg, (torch.float32, torch.float32, 1, 8, 1, 17, 64, 64, False, True)),
                ("bf16 32/8 D128 pos backward", cfg, (torch.bfloat16, torch.bfloat16, B, 32, 8, S, 128, 128, True, True)),
                ("bf16 8/1 D80 R40 S423 widest tile", wide,
                 (torch.bfloat16, torch.bfloat16, 2, 8, 1, 423, 80, 40, False, False))]
    for label, c, args in variants:
        yield CompileCase("rope", _rope.build(c), out_params(*args, c), f"rope {label} {vars(c)}")


# ---------------------------------------------------------------------------------------------
# Benchmarks (python -m tiletune bench rope).

def _hf_rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def hf_apply_rotary_pos_emb(q, k, cos, sin):
    """The Hugging Face reference (cos/sin (B, S, D), unsqueezed over heads)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _hf_rotate_half(q) * sin, k * cos + _hf_rotate_half(k) * sin


def bench_inputs(B, Hq, Hk, S, D, dt):
    """Random q, k as HF passes them ((B, S, H, D) storage seen as (B, H, S, D)) and cos/sin
    (B, S, D) shared over the batch (stride 0), on the GPU: the bench's and the exploration
    scripts' inputs."""
    q = torch.randn(B, S, Hq, D, device="cuda", dtype=dt).transpose(1, 2)
    k = torch.randn(B, S, Hk, D, device="cuda", dtype=dt).transpose(1, 2)
    ang = torch.rand(S, D // 2, device="cuda") * 6.28
    cos = torch.cat((ang.cos(), ang.cos()), -1)[None].expand(B, S, D).to(dt)
    sin = torch.cat((ang.sin(), ang.sin()), -1)[None].expand(B, S, D).to(dt)
    return q, k, cos, sin


def bench_cases():
    from tiletune.bench import BenchCase
    cases = []
    for B, Hq, Hk, S, D in ((4, 32, 8, 4096, 128),):
        q, k, cos, sin = bench_inputs(B, Hq, Hk, S, D, torch.bfloat16)
        base = {"torch": hf_apply_rotary_pos_emb,
                "torch_compile": torch.compile(hf_apply_rotary_pos_emb)}
        try:
            from liger_kernel.transformers.rope import liger_rotary_pos_emb
            base["liger"] = liger_rotary_pos_emb
        except Exception:
            pass
        try:    # TileGym's cuTile RoPE (rotates q and k in place: timing only)
            from tilegym.ops.cutile.rope import apply_rope_base
            base["tilegym"] = apply_rope_base
        except Exception:
            pass
        qc, kc = q.contiguous(), k.contiguous()
        q_out, k_out = torch.empty_like(qc), torch.empty_like(kc)
        qi, ki = q.clone(), k.clone()
        # out of place, and in place as Liger and TileGym rotate: the same peers and bytes
        for mode, ours in (("fwd", lambda: apply_rope(q, k, cos, sin)),
                           ("fwd inplace", lambda: apply_rope(qi, ki, cos, sin, inplace=True))):
            cases.append(BenchCase(
                "rope", f"B{B} Hq{Hq} Hkv{Hk} S{S} D{D} bf16", mode, ours,
                {name: (lambda f=f: f(q, k, cos, sin)) for name, f in base.items()},
                bytes=2 * (q.numel() + k.numel()) * 2 + 2 * S * D * 2,
                ceiling=("copy", lambda: (q_out.copy_(qc), k_out.copy_(kc)))))
    return cases
