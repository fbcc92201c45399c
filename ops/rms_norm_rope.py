# Per-head RMSNorm of q and k (each with its own (D,) weight, as in Qwen3's QK-norm), then RoPE
# (HF rotate_half, first R dims), in one pass over q and k:
#   n = x * rsqrt(mean(x^2 over D) + eps) * w ;  out = rope(n)
# Backward: dn = rope^T(dy); dx = r*g - x*r^3*mean(g*x) with g = dn*w; dw = sum over b,s,h of dn*x*r.
#
# No `from __future__ import annotations` here: it would hide the ct.Constant annotations.
import cuda.tile as ct
import torch

from tiletune import validate
from tiletune.autotune import Autotuner, Work, bucketed
from tiletune.ops.partials import sum_rows
from tiletune.ops.rotary import ctas, position_at, prepare
from tiletune.space import next_pow2, table
from tiletune.torch_op import TrainableOp

ZERO = ct.PaddingMode.ZERO

# ---------------------------------------------------------------------------------------------
# Kernels. One CTA handles one (batch, position) at a time: all q heads, then all k heads, with
# the cos/sin row read once (ops/rotary.py gathers it). Persistent or one CTA per position.


def _heads(x, b, s, lo, hi, TILE_H, TILE, LATENCY):
    """x[b, :, s, lo:hi] as a [TILE_H, TILE] float32 tile (zero-padded); LATENCY: ct.load's
    DRAM-latency hint."""
    t = ct.load(x.slice(3, lo, hi), (b, 0, s, 0), (1, TILE_H, 1, TILE), padding_mode=ZERO,
                latency=LATENCY)
    return ct.reshape(t, (TILE_H, TILE)).astype(ct.float32)


def _halves(x, b, s, half, TILE_H, TILE_R, LATENCY):
    """The two rotary halves of x[b, :, s] as [TILE_H, TILE_R] float32 tiles."""
    return (_heads(x, b, s, 0, half, TILE_H, TILE_R, LATENCY),
            _heads(x, b, s, half, 2 * half, TILE_H, TILE_R, LATENCY))


def _put(out, b, s, lo, hi, tile, TILE_H, TILE):
    ct.store(out.slice(3, lo, hi), (b, 0, s, 0),
             ct.reshape(tile, (1, TILE_H, 1, TILE)).astype(out.dtype))


def _vec(w, lo, hi, TILE):
    return ct.reshape(ct.load(w.slice(0, lo, hi), (0,), (TILE,), padding_mode=ZERO)
                      .astype(ct.float32), (1, TILE))


def _weights(w, half, D, TILE_R, TILE_P, HAS_REST):
    """w's two rotary halves and its pass-through part (zeros without one) as [1, TILE] float32
    tiles, read once per CTA, not per position."""
    wp = ct.zeros((1, TILE_P), ct.float32)
    if HAS_REST:
        wp = _vec(w, 2 * half, D, TILE_P)
    return _vec(w, 0, half, TILE_R), _vec(w, half, 2 * half, TILE_R), wp


def _norm_rope(x, w, out, rstd, b, s, half, inv_d, eps, c1, c2, s1, s2,
               TILE_H, TILE_R, TILE_P, HAS_REST, LATENCY):
    D = x.shape[3]
    w1, w2, wp = w
    x1, x2 = _halves(x, b, s, half, TILE_H, TILE_R, LATENCY)
    ss = ct.sum(x1 * x1 + x2 * x2, axis=1, keepdims=True)
    if HAS_REST:
        xp = _heads(x, b, s, 2 * half, D, TILE_H, TILE_P, LATENCY)
        ss = ss + ct.sum(xp * xp, axis=1, keepdims=True)
    r = ct.rsqrt(ss * inv_d + eps)                                    # [TILE_H, 1]
    n1 = x1 * r * w1
    n2 = x2 * r * w2
    _put(out, b, s, 0, half, n1 * c1 - n2 * s1, TILE_H, TILE_R)
    _put(out, b, s, half, 2 * half, n2 * c2 + n1 * s2, TILE_H, TILE_R)
    if HAS_REST:
        _put(out, b, s, 2 * half, D, xp * r * wp, TILE_H, TILE_P)
    ct.store(rstd, (b, 0, s), ct.reshape(r, (1, TILE_H, 1)))


@ct.kernel
def rms_norm_rope_fwd(q, k, wq, wk, cos, sin, pos, q_out, k_out, rstd_q, rstd_k,
                      half: ct.Constant[int], inv_d, eps,
                      TILE_HQ: ct.Constant[int], TILE_HK: ct.Constant[int], TILE_R: ct.Constant[int],
                      TILE_P: ct.Constant[int], HAS_POS: ct.Constant[bool],
                      HAS_REST: ct.Constant[bool], LATENCY: ct.Constant[int]):
    """q (B, Hq, S, D), k (B, Hk, S, D) any strides; wq, wk (D,); cos/sin (B, S', 2*half);
    rstd_q (B, Hq, S), rstd_k (B, Hk, S) float32 for the backward, any strides (the op lays
    them out (B, S, H), so a position's values are one contiguous store)."""
    S = q.shape[2]
    D = q.shape[3]
    wq_t = _weights(wq, half, D, TILE_R, TILE_P, HAS_REST)
    wk_t = _weights(wk, half, D, TILE_R, TILE_P, HAS_REST)
    for bs in range(ct.bid(0), q.shape[0] * S, ct.num_blocks(0)):
        b, s, c1, c2, s1, s2 = position_at(bs, S, cos, sin, pos, half, TILE_R, HAS_POS)
        _norm_rope(q, wq_t, q_out, rstd_q, b, s, half, inv_d, eps, c1, c2, s1, s2,
                   TILE_HQ, TILE_R, TILE_P, HAS_REST, LATENCY)
        _norm_rope(k, wk_t, k_out, rstd_k, b, s, half, inv_d, eps, c1, c2, s1, s2,
                   TILE_HK, TILE_R, TILE_P, HAS_REST, LATENCY)


def _norm_rope_bwd(dy, x, w, rstd, dx, b, s, half, inv_d, c1, c2, s1, s2,
                   TILE_H, TILE_R, TILE_P, HAS_REST, LATENCY):
    """Returns the three [1, TILE] dweight contributions (rotary halves, pass-through part)."""
    D = x.shape[3]
    w1, w2, wp = w
    dy1, dy2 = _halves(dy, b, s, half, TILE_H, TILE_R, LATENCY)
    dn1 = dy1 * c1 + dy2 * s2                  # rope transpose
    dn2 = dy2 * c2 - dy1 * s1
    x1, x2 = _halves(x, b, s, half, TILE_H, TILE_R, LATENCY)
    r = ct.reshape(ct.load(rstd, (b, 0, s), (1, TILE_H, 1), padding_mode=ZERO), (TILE_H, 1))
    g1 = dn1 * w1
    g2 = dn2 * w2
    gx = ct.sum(g1 * x1 + g2 * x2, axis=1, keepdims=True)
    dwp = ct.zeros((1, TILE_P), ct.float32)
    if HAS_REST:
        dnp = _heads(dy, b, s, 2 * half, D, TILE_H, TILE_P, LATENCY)
        xp = _heads(x, b, s, 2 * half, D, TILE_H, TILE_P, LATENCY)
        gp = dnp * wp
        gx = gx + ct.sum(gp * xp, axis=1, keepdims=True)
    c = gx * inv_d * (r * r * r)
    _put(dx, b, s, 0, half, g1 * r - x1 * c, TILE_H, TILE_R)
    _put(dx, b, s, half, 2 * half, g2 * r - x2 * c, TILE_H, TILE_R)
    if HAS_REST:
        _put(dx, b, s, 2 * half, D, gp * r - xp * c, TILE_H, TILE_P)
        dwp = ct.sum(dnp * xp * r, axis=0, keepdims=True)
    return (ct.sum(dn1 * x1 * r, axis=0, keepdims=True),
            ct.sum(dn2 * x2 * r, axis=0, keepdims=True), dwp)


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
    wq_t = _weights(wq, half, D, TILE_R, TILE_P, HAS_REST)
    wk_t = _weights(wk, half, D, TILE_R, TILE_P, HAS_REST)
    aq1 = ct.zeros((1, TILE_R), ct.float32)
    aq2 = ct.zeros((1, TILE_R), ct.float32)
    aqp = ct.zeros((1, TILE_P), ct.float32)
    ak1 = ct.zeros((1, TILE_R), ct.float32)
    ak2 = ct.zeros((1, TILE_R), ct.float32)
    akp = ct.zeros((1, TILE_P), ct.float32)
    for bs in range(ct.bid(0), q.shape[0] * S, ct.num_blocks(0)):
        b, s, c1, c2, s1, s2 = position_at(bs, S, cos, sin, pos, half, TILE_R, HAS_POS)
        d1, d2, dp = _norm_rope_bwd(dq, q, wq_t, rstd_q, dq_in, b, s, half, inv_d, c1, c2, s1,
                                    s2, TILE_HQ, TILE_R, TILE_P, HAS_REST, LATENCY)
        aq1, aq2, aqp = aq1 + d1, aq2 + d2, aqp + dp
        d1, d2, dp = _norm_rope_bwd(dk, k, wk_t, rstd_k, dk_in, b, s, half, inv_d, c1, c2, s1,
                                    s2, TILE_HK, TILE_R, TILE_P, HAS_REST, LATENCY)
        ak1, ak2, akp = ak1 + d1, ak2 + d2, akp + dp
    _store_dw(dwq_partial, ct.bid(0), half, D, aq1, aq2, aqp, TILE_R, TILE_P, HAS_REST)
    _store_dw(dwk_partial, ct.bid(0), half, D, ak1, ak2, akp, TILE_R, TILE_P, HAS_REST)


# ---------------------------------------------------------------------------------------------
# Configs: grid shape x occupancy x ct.load latency hint. Default: persistent grid at occupancy 2,
# latency 5, the best forward on an H200 at B4 Hq32 Hkv8 S4096 D128 and B1 Hq64 Hkv8 S16384 D128
# bf16 (occupancy 4 led at D64; on an H100 the searches picked occupancy 4 at the first, 2 at
# latency 10 at the second, within 3% of the default); occupancy 8-16 lost 5x and is left out
# (at 8 the sm_90 forward spills). Occupancy 4 at latency 10 is left out too: its kernels took
# 7.5 s (forward) and 14.2 s (backward) to compile against at most 4.4 s for every other entry,
# which made it the whole wait of a cold key, and on an H100 it never led. So is occupancy 1: on
# an H100 at B1 Hq32 Hkv4 S4096 D128 (the shipped rows' searches) latency 5 / 10 ran 1.4x / 2.1x
# the best forward and 1.4x / 4.3x the best backward, on an H200 1.5-1.9x the best forward
# (before the cos/sin rows became plain loads), and its kernels were the slowest of the space to
# compile (sm_90, one at a time on the CPU: backward 1.45 / 3.07 s, forward 0.58 / 1.49 s, every
# other entry 0.10-0.94 s). Occupancy 3 is searched for the forward alone: it builds without
# spills on sm_90 at D64 and D128 and ran B4 Hq32 Hkv8 S4096 D128 in 102.6-106.3 us on an H200
# against occupancy 4's 114.7-116.1 (torch.compile of HF's code 106.4-107.0), its time alike in
# every process, where the default's moved between 100 and 125 us; the backward at occupancy 3
# spills (144-272 bytes at D128) and ran 1.05-1.24x the best. Measurements:
# references/parameter-space-design.md ("Fused RMSNorm+RoPE").

def fused_configs(arch, heads, rot, backward=False):
    rows = ((2, True, 5), (2, True, 1), (2, True, 10), (4, True, 1), (4, True, 5))
    if not backward:
        rows += ((3, True, 1), (3, True, 5))
    yield from table(("occupancy", "persistent", "latency"), rows + ((2, False, 5), (4, False, 5)))


DEFAULT = next(fused_configs("sm_90", 40, 128))

# ---------------------------------------------------------------------------------------------
# Launches. cos/sin (B, S', rot) views, pos (B, S) int32 or None (the kernels then get cos in
# its place, unused). The backward's dweight partials (one row per CTA, q's then k's) are one
# (2, CTAs, D) float32 scratch buffer, summed over the CTAs by partials.sum_rows.


def _tiles(q, k, rot):
    """TILE_HQ, TILE_HK, TILE_R, TILE_P."""
    return (next_pow2(q.shape[1]), next_pow2(k.shape[1]), next_pow2(rot // 2),
            next_pow2(max(q.shape[3] - rot, 1)))


def _grid(c, dev, x, *rest):
    return (ctas(c, x.shape[0] * x.shape[2], dev),)


def _fwd_args(c, q, k, wq, wk, cos, sin, pos, q_out, k_out, rstd_q, rstd_k, rot, eps):
    D = q.shape[3]
    return (q, k, wq, wk, cos, sin, cos if pos is None else pos, q_out, k_out, rstd_q, rstd_k,
            rot // 2, 1.0 / D, eps, *_tiles(q, k, rot), pos is not None, rot < D, c.latency)


def _bwd_args(c, dq, dk, q, k, wq, wk, cos, sin, pos, rstd_q, rstd_k, dq_in, dk_in, rot, partial):
    D = q.shape[3]
    return (dq, dk, q, k, wq, wk, cos, sin, cos if pos is None else pos, rstd_q, rstd_k, dq_in,
            dk_in, partial[0], partial[1], rot // 2, 1.0 / D, *_tiles(q, k, rot), pos is not None,
            rot < D, c.latency)


_fwd = Autotuner(
    "rms_norm_rope_fwd", rms_norm_rope_fwd, fused_configs, default=DEFAULT,
    space=lambda q, k, *rest: dict(heads=q.shape[1] + k.shape[1], rot=rest[-2]),
    grid=_grid, args=_fwd_args, tune_key=bucketed(4),
    work=lambda q, k, *rest: Work(bytes=2 * (q.numel() + k.numel()) * q.element_size()))
_bwd = Autotuner(
    "rms_norm_rope_bwd", rms_norm_rope_bwd, fused_configs, default=DEFAULT,
    space=lambda dq, dk, *rest: dict(heads=dq.shape[1] + dk.shape[1], rot=rest[-1],
                                     backward=True),
    scratch=lambda c, dev, dq, *rest: ((2, _grid(c, dev, dq)[0], dq.shape[3]), torch.float32),
    grid=_grid, args=_bwd_args, tune_key=bucketed(4),
    work=lambda dq, dk, *rest: Work(bytes=3 * (dq.numel() + dk.numel()) * dq.element_size()))
TUNERS = (_fwd, _bwd)


# ---------------------------------------------------------------------------------------------
# Host side: outputs, empty inputs, the weight-gradient sums. Validation and cos/sin/position_ids
# normalization are shared with rope (ops/rotary.py: prepare).

def _rstd(x):
    """The float32 rstd of x (B, H, S, D), laid out (B, S, H): one position's heads are one
    contiguous store, not H stores S apart."""
    B, H, S = x.shape[:3]
    return torch.empty_strided((B, H, S), (S * H, 1, H), dtype=torch.float32, device=x.device)


def _forward(q, k, wq, wk, cos, sin, pos, rot, eps):
    """(q_out, k_out, rstd_q (B, Hq, S), rstd_k (B, Hk, S) float32)."""
    B, Hq, S, D = q.shape
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    rstd_q, rstd_k = _rstd(q), _rstd(k)
    if B * S:
        dev = q.get_device()
        key = (Hq, k.shape[1], D, rot, B * S, q.dtype, wq.dtype, cos.dtype, pos is not None, dev)
        _fwd.launch(key, dev, q, k, wq, wk, cos, sin, pos, q_out, k_out, rstd_q, rstd_k, rot, eps)
    return q_out, k_out, rstd_q, rstd_k


def _backward(dq, dk, q, k, wq, wk, cos, sin, pos, rstd_q, rstd_k, rot, need_wq=True,
              need_wk=True):
    """(dq_in, dk_in, dwq, dwk): input gradients like q and k, weight gradients like wq, wk
    (None for a weight that needs none: its partials are left unsummed)."""
    B, Hq, S, D = q.shape
    dq_in, dk_in = torch.empty_like(q), torch.empty_like(k)
    dwq = torch.empty_like(wq) if need_wq else None
    dwk = torch.empty_like(wk) if need_wk else None
    if B * S == 0:
        return (dq_in, dk_in, dwq if dwq is None else dwq.zero_(),
                dwk if dwk is None else dwk.zero_())
    dev = q.get_device()
    key = (Hq, k.shape[1], D, rot, B * S, q.dtype, dq.dtype, wq.dtype, cos.dtype,
           pos is not None, dev)
    partial = _bwd.launch(key, dev, dq, dk, q, k, wq, wk, cos, sin, pos, rstd_q, rstd_k, dq_in,
                          dk_in, rot)
    if need_wq:
        sum_rows(partial[0], dwq)
    if need_wk:
        sum_rows(partial[1], dwk)
    return dq_in, dk_in, dwq, dwk


# ---------------------------------------------------------------------------------------------
# Autograd, custom op and the public function.

def _forward_fake(q, k, *rest):
    """The normed q and k, and the float32 rstd (B, H, S) of each, as _forward lays them out."""
    return torch.empty_like(q), torch.empty_like(k), _rstd(q), _rstd(k)


_rms_norm_rope = TrainableOp(
    "tiletune::rms_norm_rope", forward=_forward,
    forward_schema="(Tensor q, Tensor k, Tensor q_weight, Tensor k_weight, Tensor cos, "
                   "Tensor sin, Tensor? pos, int rot, float eps) -> (Tensor, Tensor, Tensor, Tensor)",
    forward_fake=_forward_fake,
    save=lambda args, results: ((*args[:7], results[2], results[3]), (args[7],)),
    backward=lambda needs, *grads_and_saved: _backward(*grads_and_saved, needs[2], needs[3]),
    backward_schema="(bool[] needs, Tensor dq, Tensor dk, Tensor q, Tensor k, Tensor q_weight, "
                    "Tensor k_weight, Tensor cos, Tensor sin, Tensor? pos, Tensor rstd_q, "
                    "Tensor rstd_k, int rot) -> (Tensor, Tensor, Tensor?, Tensor?)",
    backward_fake=lambda needs, dq, dk, q, k, wq, wk, *rest: (
        torch.empty_like(q), torch.empty_like(k), torch.empty_like(wq) if needs[2] else None,
        torch.empty_like(wk) if needs[3] else None),
    outputs=2)


def rms_norm_rope(q, k, q_weight, k_weight, cos, sin, *, eps=1e-6, position_ids=None,
                  rotary_dim=None):
    """Per-head RMSNorm of q and k (weights (D,), float32 statistics over the whole head_dim),
    then RoPE as `tiletune.ops.rope.apply_rope` (same q/k/cos/sin/position_ids/rotary_dim rules),
    in one kernel. Returns new (q_out, k_out) laid out like q and k where those are dense (HF's
    transposed views), else contiguous. Differentiable in q, k and both weights (weight grads
    in the weights' dtypes). Works under torch.compile(fullgraph=True).
    """
    cos, sin, pos, rot = prepare("rms_norm_rope", q, k, cos, sin, position_ids, rotary_dim)
    D = q.shape[3]
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        validate.tensor("rms_norm_rope", name, w, like=q)
        if w.dim() != 1 or w.shape[0] != D:
            raise ValueError(f"rms_norm_rope: {name} must have shape ({D},), got {tuple(w.shape)}")
    if q_weight.dtype != k_weight.dtype:
        raise TypeError("rms_norm_rope: q_weight and k_weight must have the same dtype")
    eps = validate.eps("rms_norm_rope", eps)
    wq, wk = q_weight.contiguous(), k_weight.contiguous()
    return _rms_norm_rope(q, k, wq, wk, cos, sin, pos, rot, eps)
