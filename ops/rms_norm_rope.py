# Per-head RMSNorm of q and k (each with its own (D,) weight, as in Qwen3's QK-norm), then RoPE
# (HF rotate_half, first R dims), in one pass over q and k:
#   n = x * rsqrt(mean(x^2 over D) + eps) * w ;  out = rope(n)
# Backward: dn = rope^T(dy); dx = r*g - x*r^3*mean(g*x) with g = dn*w; dw = sum over b,s,h of dn*x*r.
#
# No `from __future__ import annotations` here: it would hide the ct.Constant annotations.
from types import SimpleNamespace

import cuda.tile as ct
import torch

from tiletune.autotune import Autotuner, Search, Work, bucket, next_pow2
from tiletune.device import current_stream
from tiletune.ops.rms_norm import launch_column_sum
from tiletune import validate
from tiletune.ops.rope import _at, _prepare, ctas

ZERO = ct.PaddingMode.ZERO


def _heads(x, b, s, lo, hi, TILE_H, TILE, LATENCY):
    """x[b, :, s, lo:hi] as a [TILE_H, TILE] float32 tile (zero-padded); LATENCY: ct.load's
    DRAM-latency hint."""
    t = ct.load(x.slice(3, lo, hi), (b, 0, s, 0), (1, TILE_H, 1, TILE), padding_mode=ZERO,
                latency=LATENCY)
    return ct.reshape(t, (TILE_H, TILE)).astype(ct.float32)


def _put(out, b, s, lo, hi, tile, TILE_H, TILE):
    ct.store(out.slice(3, lo, hi), (b, 0, s, 0), ct.reshape(tile, (1, TILE_H, 1, TILE)).astype(out.dtype))


def _vec(w, lo, hi, TILE):
    return ct.reshape(ct.load(w.slice(0, lo, hi), (0,), (TILE,), padding_mode=ZERO).astype(ct.float32),
                      (1, TILE))


def _norm_rope(x, w, out, rstd, b, s, half, inv_d, eps, c1, c2, s1, s2,
               TILE_H, TILE_R, TILE_P, HAS_REST, LATENCY):
    D = x.shape[3]
    x1 = _heads(x, b, s, 0, half, TILE_H, TILE_R, LATENCY)
    x2 = _heads(x, b, s, half, 2 * half, TILE_H, TILE_R, LATENCY)
    ss = ct.sum(x1 * x1, axis=1, keepdims=True) + ct.sum(x2 * x2, axis=1, keepdims=True)
    if HAS_REST:
        xp = _heads(x, b, s, 2 * half, D, TILE_H, TILE_P, LATENCY)
        ss = ss + ct.sum(xp * xp, axis=1, keepdims=True)
    r = ct.rsqrt(ss * inv_d + eps)                                    # [TILE_H, 1]
    n1 = x1 * r * _vec(w, 0, half, TILE_R)
    n2 = x2 * r * _vec(w, half, 2 * half, TILE_R)
    _put(out, b, s, 0, half, n1 * c1 - n2 * s1, TILE_H, TILE_R)
    _put(out, b, s, half, 2 * half, n2 * c2 + n1 * s2, TILE_H, TILE_R)
    if HAS_REST:
        _put(out, b, s, 2 * half, D, xp * r * _vec(w, 2 * half, D, TILE_P), TILE_H, TILE_P)
    ct.store(rstd, (b, 0, s), ct.reshape(r, (1, TILE_H, 1)))


@ct.kernel
def rms_norm_rope_fwd(q, k, wq, wk, cos, sin, pos, q_out, k_out, rstd_q, rstd_k,
                      half: ct.Constant[int], inv_d, eps,
                      TILE_HQ: ct.Constant[int], TILE_HK: ct.Constant[int], TILE_R: ct.Constant[int],
                      TILE_P: ct.Constant[int], HAS_POS: ct.Constant[bool],
                      HAS_REST: ct.Constant[bool], LATENCY: ct.Constant[int]):
    """q (B, Hq, S, D), k (B, Hk, S, D) any strides; wq, wk (D,); cos/sin (B, S', 2*half);
    rstd_q (B, Hq, S), rstd_k (B, Hk, S) float32 for the backward."""
    S = q.shape[2]
    for bs in range(ct.bid(0), q.shape[0] * S, ct.num_blocks(0)):
        b, s, c1, c2, s1, s2 = _at(bs, S, cos, sin, pos, half, TILE_R, HAS_POS, False)
        _norm_rope(q, wq, q_out, rstd_q, b, s, half, inv_d, eps, c1, c2, s1, s2,
                   TILE_HQ, TILE_R, TILE_P, HAS_REST, LATENCY)
        _norm_rope(k, wk, k_out, rstd_k, b, s, half, inv_d, eps, c1, c2, s1, s2,
                   TILE_HK, TILE_R, TILE_P, HAS_REST, LATENCY)


def _norm_rope_bwd(dy, x, w, rstd, dx, b, s, half, inv_d, c1, c2, s1, s2,
                   TILE_H, TILE_R, TILE_P, HAS_REST, LATENCY):
    """Returns the three [1, TILE] dweight contributions (rotary halves, pass-through part)."""
    D = x.shape[3]
    dy1 = _heads(dy, b, s, 0, half, TILE_H, TILE_R, LATENCY)
    dy2 = _heads(dy, b, s, half, 2 * half, TILE_H, TILE_R, LATENCY)
    dn1 = dy1 * c1 + dy2 * s2                  # rope transpose
    dn2 = dy2 * c2 - dy1 * s1
    x1 = _heads(x, b, s, 0, half, TILE_H, TILE_R, LATENCY)
    x2 = _heads(x, b, s, half, 2 * half, TILE_H, TILE_R, LATENCY)
    r = ct.reshape(ct.load(rstd, (b, 0, s), (1, TILE_H, 1), padding_mode=ZERO), (TILE_H, 1))
    g1 = dn1 * _vec(w, 0, half, TILE_R)
    g2 = dn2 * _vec(w, half, 2 * half, TILE_R)
    gx = ct.sum(g1 * x1, axis=1, keepdims=True) + ct.sum(g2 * x2, axis=1, keepdims=True)
    dwp = ct.zeros((1, TILE_P), ct.float32)
    if HAS_REST:
        dnp = _heads(dy, b, s, 2 * half, D, TILE_H, TILE_P, LATENCY)
        xp = _heads(x, b, s, 2 * half, D, TILE_H, TILE_P, LATENCY)
        gp = dnp * _vec(w, 2 * half, D, TILE_P)
        gx = gx + ct.sum(gp * xp, axis=1, keepdims=True)
    c = gx * inv_d * (r * r * r)
    _put(dx, b, s, 0, half, g1 * r - x1 * c, TILE_H, TILE_R)
    _put(dx, b, s, half, 2 * half, g2 * r - x2 * c, TILE_H, TILE_R)
    if HAS_REST:
        _put(dx, b, s, 2 * half, D, gp * r - xp * c, TILE_H, TILE_P)
        dwp = ct.sum(dnp * xp * r, axis=0, keepdims=True)
    return (ct.sum(dn1 * x1 * r, axis=0, keepdims=True), ct.sum(dn2 * x2 * r, axis=0, keepdims=True),
            dwp)


def _store_dw(partial, row, half, D, d1, d2, dp, TILE_R, TILE_P, HAS_REST):
    ct.store(partial.slice(1, 0, half), (row, 0), d1)
    ct.store(partial.slice(1, half, 2 * half), (row, 0), d2)
    if HAS_REST:
        ct.store(partial.slice(1, 2 * half, D), (row, 0), dp)


@ct.kernel
def rms_norm_rope_bwd(dq, dk, q, k, wq, wk, cos, sin, pos, rstd_q, rstd_k, dq_in, dk_in,
                      dwq_partial, dwk_partial, half: ct.Constant[int], inv_d,
                      TILE_HQ: ct.Constant[int], TILE_HK: ct.Constant[int], TILE_R: ct.Constant[int],
                      TILE_P: ct.Constant[int], HAS_POS: ct.Constant[bool],
                      HAS_REST: ct.Constant[bool], LATENCY: ct.Constant[int]):
    """dq_in, dk_in like q, k; dwq_partial/dwk_partial (G, D) float32, one row per CTA."""
    S = q.shape[2]
    D = q.shape[3]
    aq1 = ct.zeros((1, TILE_R), ct.float32)
    aq2 = ct.zeros((1, TILE_R), ct.float32)
    aqp = ct.zeros((1, TILE_P), ct.float32)
    ak1 = ct.zeros((1, TILE_R), ct.float32)
    ak2 = ct.zeros((1, TILE_R), ct.float32)
    akp = ct.zeros((1, TILE_P), ct.float32)
    for bs in range(ct.bid(0), q.shape[0] * S, ct.num_blocks(0)):
        b, s, c1, c2, s1, s2 = _at(bs, S, cos, sin, pos, half, TILE_R, HAS_POS, False)
        d1, d2, dp = _norm_rope_bwd(dq, q, wq, rstd_q, dq_in, b, s, half, inv_d, c1, c2, s1, s2,
                                    TILE_HQ, TILE_R, TILE_P, HAS_REST, LATENCY)
        aq1, aq2, aqp = aq1 + d1, aq2 + d2, aqp + dp
        d1, d2, dp = _norm_rope_bwd(dk, k, wk, rstd_k, dk_in, b, s, half, inv_d, c1, c2, s1, s2,
                                    TILE_HK, TILE_R, TILE_P, HAS_REST, LATENCY)
        ak1, ak2, akp = ak1 + d1, ak2 + d2, akp + dp
    _store_dw(dwq_partial, ct.bid(0), half, D, aq1, aq2, aqp, TILE_R, TILE_P, HAS_REST)
    _store_dw(dwk_partial, ct.bid(0), half, D, ak1, ak2, akp, TILE_R, TILE_P, HAS_REST)


# ---------------------------------------------------------------------------------------------
# Configs: grid shape x occupancy x ct.load latency hint. H200, B4 Hq32 Hkv8 S4096 D128 bf16
# forward: a persistent grid at occupancy 2 won (167.5 us; occupancy 4: 208.7, 1: 267.8; one CTA
# per position at occupancy 2/4: 262.5/233.2; occupancy 8/16: 834-852, dropped). The latency
# hint cut the plain RoPE kernel's time by 5-37% (assets/scripts/explore_rope.py); here it is
# searched, default first without a strong hint (1), as measured.

def fused_configs(arch, heads, rot):
    cfg = lambda occ, persistent, lat: SimpleNamespace(occupancy=occ, persistent=persistent,
                                                       latency=lat)
    yield cfg(2, True, 1)
    for occ, lat in ((2, 5), (2, 10), (4, 1), (4, 5), (4, 10), (1, 5), (1, 10)):
        yield cfg(occ, True, lat)
    for occ in (2, 4):
        yield cfg(occ, False, 5)


DEFAULT = next(fused_configs("sm_90", 40, 128))
_fwd = Autotuner("rms_norm_rope_fwd", rms_norm_rope_fwd, fused_configs, default=DEFAULT)
_bwd = Autotuner("rms_norm_rope_bwd", rms_norm_rope_bwd, fused_configs, default=DEFAULT)
TUNERS = (_fwd, _bwd)


# ---------------------------------------------------------------------------------------------
# Host launches.

def _tiles(q, k, rot):
    D = q.shape[3]
    return [next_pow2(q.shape[1]), next_pow2(k.shape[1]), next_pow2(rot // 2),
            next_pow2(max(D - rot, 1))]


def _forward(q, k, wq, wk, cos, sin, pos, rot, eps):
    B, Hq, S, D = q.shape
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    rstd_q = torch.empty((B, q.shape[1], S), device=q.device, dtype=torch.float32)
    rstd_k = torch.empty((B, k.shape[1], S), device=q.device, dtype=torch.float32)
    if B * S == 0:
        return q_out, k_out, rstd_q, rstd_k
    dev = q.get_device()
    has_pos = pos is not None
    flags = [has_pos, rot < D]
    args = (q, k, wq, wk, cos, sin, pos if has_pos else cos, q_out, k_out, rstd_q, rstd_k,
            rot // 2, 1.0 / D, float(eps), *_tiles(q, k, rot), *flags)     # + the latency hint
    key = (q.shape[1], k.shape[1], D, rot, bucket(B * S), q.dtype, wq.dtype,
           cos.dtype, has_pos, dev)
    cfg, kernel = _fwd.cache.get(key) or _fwd.tune(key, q, Search(
        shape=dict(heads=Hq + k.shape[1], rot=rot), grid_fn=lambda c: (ctas(c, B * S, dev),),
        args_fn=lambda c: args + (c.latency,),
        work=Work(bytes=2 * (q.numel() + k.numel()) * q.element_size())))
    ct.launch(current_stream(dev), (ctas(cfg, B * S, dev),), kernel, args + (cfg.latency,))
    return q_out, k_out, rstd_q, rstd_k


def _backward(dq, dk, q, k, wq, wk, cos, sin, pos, rstd_q, rstd_k, rot):
    B, Hq, S, D = q.shape
    dq_in, dk_in = torch.empty_like(q), torch.empty_like(k)
    dwq, dwk = torch.empty_like(wq), torch.empty_like(wk)
    if B * S == 0:
        return dq_in, dk_in, dwq.zero_(), dwk.zero_()
    dev = q.get_device()
    has_pos = pos is not None
    key = (Hq, k.shape[1], D, rot, bucket(B * S), q.dtype, dq.dtype, wq.dtype,
           cos.dtype, has_pos, dev)

    def args(c, partial_q, partial_k):
        return (dq, dk, q, k, wq, wk, cos, sin, pos if has_pos else cos, rstd_q, rstd_k, dq_in,
                dk_in, partial_q, partial_k, rot // 2, 1.0 / D, *_tiles(q, k, rot), has_pos,
                rot < D, c.latency)

    def search():
        g = max(ctas(c, B * S, dev) for c in fused_configs("", 0, 0))
        pq = torch.empty((g, D), device=q.device, dtype=torch.float32)
        pk = torch.empty((g, D), device=q.device, dtype=torch.float32)
        return Search(shape=dict(heads=Hq + k.shape[1], rot=rot),
                      grid_fn=lambda c: (ctas(c, B * S, dev),),
                      args_fn=lambda c: args(c, pq[:ctas(c, B * S, dev)], pk[:ctas(c, B * S, dev)]),
                      work=Work(bytes=3 * (q.numel() + k.numel()) * q.element_size()))
    cfg, kernel = _bwd.cache.get(key) or _bwd.tune(key, q, search())
    g = ctas(cfg, B * S, dev)
    pq = torch.empty((g, D), device=q.device, dtype=torch.float32)
    pk = torch.empty((g, D), device=q.device, dtype=torch.float32)
    ct.launch(current_stream(dev), (g,), kernel, args(cfg, pq, pk))
    launch_column_sum(pq, dwq)
    launch_column_sum(pk, dwk)
    return dq_in, dk_in, dwq, dwk


# ---------------------------------------------------------------------------------------------
# Autograd and the public function.

class RMSNormRoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, wq, wk, cos, sin, pos, rot, eps):
        q_out, k_out, rstd_q, rstd_k = _forward(q, k, wq, wk, cos, sin, pos, rot, eps)
        ctx.save_for_backward(q, k, wq, wk, cos, sin, pos, rstd_q, rstd_k)
        ctx.rot = rot
        return q_out, k_out

    @staticmethod
    def backward(ctx, dq, dk):
        q, k, wq, wk, cos, sin, pos, rstd_q, rstd_k = ctx.saved_tensors
        dq = torch.zeros_like(q) if dq is None else dq
        dk = torch.zeros_like(k) if dk is None else dk
        dq_in, dk_in, dwq, dwk = _backward(dq, dk, q, k, wq, wk, cos, sin, pos, rstd_q, rstd_k,
                                           ctx.rot)
        return dq_in, dk_in, dwq, dwk, None, None, None, None, None


def rms_norm_rope(q, k, q_weight, k_weight, cos, sin, *, eps=1e-6, position_ids=None,
                  rotary_dim=None):
    """Per-head RMSNorm of q and k (weights (D,), float32 statistics over the whole head_dim),
    then RoPE as `tiletune.ops.rope.apply_rope` (same q/k/cos/sin/position_ids/rotary_dim rules),
    in one kernel. Returns new (q_out, k_out) laid out like q and k. Differentiable in q, k and
    both weights (weight grads in the weights' dtypes)."""
    cos, sin, pos, rot = _prepare(q, k, cos, sin, position_ids, rotary_dim)
    D = q.shape[3]
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        validate.tensor("rms_norm_rope", name, w, device=q.device)
        if w.dim() != 1 or w.shape[0] != D:
            raise ValueError(f"rms_norm_rope: {name} must have shape ({D},), got {tuple(w.shape)}")
    if q_weight.dtype != k_weight.dtype:
        raise TypeError("rms_norm_rope: q_weight and k_weight must have the same dtype")
    eps = validate.eps("rms_norm_rope", eps)
    wq, wk = q_weight.contiguous(), k_weight.contiguous()
    return RMSNormRoPEFunction.apply(q, k, wq, wk, cos, sin, pos, rot, float(eps))


# ---------------------------------------------------------------------------------------------
# Ahead-of-time compile cases: every config, forward and backward, for the Qwen3-like layout
# (GQA 32/8, D 128, bf16, HF views); the default config for partial rotary + position_ids.

def aot_cases():
    from tiletune.aot import F32, CompileCase, jit_array
    f32 = torch.float32

    def params(dt, B, Hq, Hk, S, D, R, has_pos):
        q = jit_array(dt, (B, Hq, S, D), (S * Hq * D, D, Hq * D, 1))
        k = jit_array(dt, (B, Hk, S, D), (S * Hk * D, D, Hk * D, 1))
        w, c = jit_array(dt, (D,)), jit_array(dt, (B, S, R), (0, R, 1))
        pos = jit_array(torch.int32, (B, S), (0, 1)) if has_pos else c
        qo, ko = jit_array(dt, (B, Hq, S, D)), jit_array(dt, (B, Hk, S, D))
        rq, rk = jit_array(f32, (B, Hq, S)), jit_array(f32, (B, Hk, S))
        tiles = [next_pow2(Hq), next_pow2(Hk), next_pow2(R // 2), next_pow2(max(D - R, 1)),
                 has_pos, R < D]
        part = jit_array(f32, (264, D))
        fwd = [q, k, w, w, c, c, pos, qo, ko, rq, rk, R // 2, F32, F32] + tiles
        bwd = [qo, ko, q, k, w, w, c, c, pos, rq, rk, qo, ko, part, part, R // 2, F32] + tiles
        return fwd, bwd

    fwd, bwd = params(torch.bfloat16, 4, 32, 8, 4096, 128, 128, False)
    for cfg in fused_configs("sm_90", 40, 128):
        yield CompileCase("rms_norm_rope", _fwd.build(cfg), fwd + [cfg.latency],
                          f"rms_norm_rope_fwd {vars(cfg)}")
        yield CompileCase("rms_norm_rope", _bwd.build(cfg), bwd + [cfg.latency],
                          f"rms_norm_rope_bwd {vars(cfg)}")
    fwd, bwd = params(torch.float16, 2, 7, 1, 423, 80, 40, True)
    cfg = next(fused_configs("sm_90", 8, 40))
    yield CompileCase("rms_norm_rope", _fwd.build(cfg), fwd + [cfg.latency],
                      "rms_norm_rope_fwd fp16 D80 R40 pos")
    yield CompileCase("rms_norm_rope", _bwd.build(cfg), bwd + [cfg.latency],
                      "rms_norm_rope_bwd fp16 D80 R40 pos")


def bench_cases():
    """Fused vs the two ops run separately (tiletune rms_norm per head, then apply_rope)."""
    from tiletune.bench import BenchCase
    from tiletune.ops.rms_norm import rms_norm
    from tiletune.ops.rope import apply_rope
    B, Hq, Hk, S, D, dt = 4, 32, 8, 4096, 128, torch.bfloat16
    q = torch.randn(B, S, Hq, D, device="cuda", dtype=dt).transpose(1, 2)
    k = torch.randn(B, S, Hk, D, device="cuda", dtype=dt).transpose(1, 2)
    wq, wk = torch.rand(D, device="cuda", dtype=dt), torch.rand(D, device="cuda", dtype=dt)
    ang = torch.rand(S, D // 2, device="cuda") * 6.28
    cos = torch.cat((ang.cos(), ang.cos()), -1).to(dt)
    sin = torch.cat((ang.sin(), ang.sin()), -1).to(dt)

    def separate():
        return apply_rope(rms_norm(q, wq), rms_norm(k, wk), cos, sin)
    return [BenchCase("rms_norm_rope", f"B{B} Hq{Hq} Hkv{Hk} S{S} D{D} bf16", "fwd",
                      lambda: rms_norm_rope(q, k, wq, wk, cos, sin), {"separate": separate},
                      bytes=2 * (q.numel() + k.numel()) * 2)]
