# Fused multi-head attention (FlashAttention-2 style) forward and backward for
# q (B, Hq, Sq, D), k/v (B, Hkv, Sk, D), Hq a multiple of Hkv (GQA/MQA), bf16/fp16.
#
#   S = scale * Q K^T (masked), P = softmax(S) row-wise, O = P V
# computed tile by tile with an online softmax in float32 and exp2: scores are multiplied by
# c = scale * log2(e), so P = exp2(S * c - LSE2) where LSE2 = m + log2(l) is the row log-sum-exp
# in base 2, kept (B, Hq, Sq) float32 for the backward. Causal masking keeps key j for query i
# iff j <= i + offset: offset = Sk - Sq aligns the diagonal bottom-right (FlashAttention 2,
# `fmha(causal=True)`), offset = 0 top-left (torch SDPA's `is_causal`). A query row that sees no
# key (bottom-right with Sq > Sk) gets output 0 and LSE2 = +inf, so its P is 0 in the backward.
#
# Backward (dO given):
#   delta_i = rowsum(dO_i * O_i); dP = dO V^T; dS = P * (dP - delta)
#   dV = P^T dO; dK = scale * dS^T Q; dQ = scale * dS K
# in two kernels, no atomics: the dQ kernel owns a query tile (grid over query tiles x B*Hq) and
# loops over key tiles; it also computes delta for its rows (it loads dO anyway; adding O is one
# tile per CTA) and writes it for the second kernel, which saves a separate preprocessing launch
# and a second read of dO. The dK/dV kernel owns a key tile of one kv head (grid over key tiles x
# B*Hkv) and loops over the query tiles of every q head of its group, so GQA needs no atomics or
# reduction over heads. P is recomputed from LSE2 in both.
#
# Not yet measured on a GPU: the config spaces below are built from the register budget and
# checked by compiling (spill-free on sm_90 per `cuobjdump -res-usage`); the searches decide.
#
# No `from __future__ import annotations` here: it would hide the ct.Constant annotations.
import math
from types import SimpleNamespace

import cuda.tile as ct
import torch

from tiletune import validate
from tiletune.autotune import Autotuner, Search, Work, bucket, next_pow2
from tiletune.device import current_stream, major

ZERO = ct.PaddingMode.ZERO
LOG2E = 1.4426950408889634
NEG_INF = float("-inf")
POS_INF = float("inf")
MAX_HEAD_DIM = 256


# ---------------------------------------------------------------------------------------------
# Kernels. Arrays are 4-D (B, H, S, D) with any strides (HF's (B, S, H, D).transpose(1, 2) views
# included); tiles are [1, 1, TILE, TD] reshaped to 2-D. TD = next_pow2(D) (>= 16): a smaller D
# is zero-padded by the loads (exact: padded columns add 0 to Q K^T, the extra output columns are
# dropped by the store). LSE2 and delta are (B*Hq, Sq) float32. The kernels' own index math is
# sequence positions and tile indices (< 2^31); element offsets come from the compiler, from the
# tile indices and the arrays' strides (ct.launch itself rejects shapes/strides past int32).

def _heads(bh, q, k):
    """Flat batch*head block index -> (b, q head, kv head) for GQA/MQA (group = Hq // Hkv)."""
    hq = q.shape[1]
    b = bh // hq
    h = bh - b * hq
    return b, h, h // (hq // k.shape[1])


def _key_tiles(m, sk, offset, TM, TN, CAUSAL):
    """For query tile m: key tiles [0, n_end) are visited; tiles from n_mask on need a mask
    (causal diagonal or keys past Sk), tiles before it are whole and fully visible."""
    if CAUSAL:
        hi = min(max((m + 1) * TM + offset, 0), sk)         # keys < hi seen by some row
        n_end = ct.cdiv(hi, TN)
        n_mask = min(max(m * TM + offset + 1, 0) // TN, sk // TN)
    else:
        n_end = ct.cdiv(sk, TN)
        n_mask = sk // TN
    return n_end, n_mask


def _tile(a, b, h, i, TI, TD):
    """[TI, TD] tile i of a[b, h] (zero-padded past S and D)."""
    return ct.reshape(ct.load(a, (b, h, i, 0), (1, 1, TI, TD), padding_mode=ZERO), (TI, TD))


def _row(a, bh, i, TI):
    """[1, TI] slice i of row bh of a (B*H, S) float32 array (zero-padded past S)."""
    return ct.load(a, (bh, i), (1, TI), padding_mode=ZERO)


@ct.kernel
def fmha_fwd_kernel(q, k, v, o, lse, qk_scale, offset, TM: ct.Constant[int],
                    TN: ct.Constant[int], TD: ct.Constant[int], CAUSAL: ct.Constant[bool],
                    HEAVY_FIRST: ct.Constant[bool]):
    """o = softmax(scale q k^T, masked) v and lse (B*Hq, Sq) = LSE2 per row.
    Grid (cdiv(Sq, TM), B*Hq). qk_scale = scale * log2(e) > 0. HEAVY_FIRST: each head's query
    tiles run last to first; under a causal mask the last see the most keys, so the light
    ones run at the end of the grid and the tail is short."""
    if HEAVY_FIRST:
        m = ct.num_blocks(0) - 1 - ct.bid(0)
    else:
        m = ct.bid(0)
    bh = ct.bid(1)
    b, h, hk = _heads(bh, q, k)
    sk = k.shape[2]
    qt = _tile(q, b, h, m, TM, TD)                                    # [TM, TD]
    n_end, n_mask = _key_tiles(m, sk, offset, TM, TN, CAUSAL)
    last_key = m * TM + ct.arange(TM, dtype=ct.int32)[:, None] + offset  # [TM, 1]
    cols = ct.arange(TN, dtype=ct.int32)[None, :]                     # [1, TN]
    m_i = ct.full((TM, 1), NEG_INF, ct.float32)
    l_i = ct.zeros((TM, 1), ct.float32)
    acc = ct.zeros((TM, TD), ct.float32)
    for n in range(n_end):
        kt = ct.load(k, (b, hk, 0, n), (1, 1, TD, TN), order=(0, 1, 3, 2), padding_mode=ZERO)
        s = ct.mma(qt, ct.reshape(kt, (TD, TN)), ct.zeros((TM, TN), ct.float32))  # [TM, TN]
        if n >= n_mask:
            key = n * TN + cols
            ok = key < sk
            if CAUSAL:
                ok = ok & (key <= last_key)
            s = ct.where(ok, s, NEG_INF)
        m_new = ct.maximum(m_i, ct.max(s, axis=1, keepdims=True) * qk_scale)
        m_use = ct.where(m_new == NEG_INF, 0.0, m_new)     # rows with no key yet: no NaN
        p = ct.exp2(s * qk_scale - m_use, flush_to_zero=True)        # [TM, TN]
        alpha = ct.exp2(m_i - m_use, flush_to_zero=True)              # [TM, 1]
        l_i = l_i * alpha + ct.sum(p, axis=1, keepdims=True)
        vt = _tile(v, b, hk, n, TN, TD)                                # [TN, TD]
        acc = ct.mma(p.astype(q.dtype), vt, acc * alpha)
        m_i = m_new
    live = l_i > 0.0                                   # False: the row saw no key at all
    out = acc * ct.where(live, 1.0 / l_i, 0.0)
    ct.store(o, (b, h, m, 0), ct.reshape(out.astype(o.dtype), (1, 1, TM, TD)))
    lse2 = ct.where(live, m_i + ct.log2(l_i), POS_INF)
    ct.store(lse, (bh, m), ct.reshape(lse2, (1, TM)))


@ct.kernel
def fmha_bwd_dq_kernel(q, k, v, o, do, lse, delta, dq, qk_scale, scale, offset,
                       TM: ct.Constant[int], TN: ct.Constant[int], TD: ct.Constant[int],
                       CAUSAL: ct.Constant[bool]):
    """delta (B*Hq, Sq) = rowsum(dO * O) and dq = scale * dS k for one query tile.
    Grid (cdiv(Sq, TM), B*Hq). Rows past Sq and keys past Sk need no mask: their q/dO (resp.
    k/v) tiles are zero-padded, so they add exactly 0 (LSE2/delta pad with 0: finite P)."""
    m = ct.bid(0)
    bh = ct.bid(1)
    b, h, hk = _heads(bh, q, k)
    sk = k.shape[2]
    qt = _tile(q, b, h, m, TM, TD)
    dot = _tile(do, b, h, m, TM, TD)
    ot = _tile(o, b, h, m, TM, TD)
    dl = ct.sum(ot.astype(ct.float32) * dot.astype(ct.float32), axis=1, keepdims=True)  # [TM, 1]
    ct.store(delta, (bh, m), ct.reshape(dl, (1, TM)))
    lse2 = ct.reshape(_row(lse, bh, m, TM), (TM, 1))
    n_end, n_mask = _key_tiles(m, sk, offset, TM, TN, CAUSAL)
    last_key = m * TM + ct.arange(TM, dtype=ct.int32)[:, None] + offset
    cols = ct.arange(TN, dtype=ct.int32)[None, :]
    acc = ct.zeros((TM, TD), ct.float32)
    for n in range(n_end):
        kt = _tile(k, b, hk, n, TN, TD)                                # [TN, TD]
        vt = _tile(v, b, hk, n, TN, TD)
        s = ct.mma(qt, ct.transpose(kt), ct.zeros((TM, TN), ct.float32))
        p = ct.exp2(s * qk_scale - lse2, flush_to_zero=True)          # [TM, TN]
        if CAUSAL:
            if n >= n_mask:
                p = ct.where(n * TN + cols <= last_key, p, 0.0)
        dp = ct.mma(dot, ct.transpose(vt), ct.zeros((TM, TN), ct.float32))
        ds = p * (dp - dl)
        acc = ct.mma(ds.astype(q.dtype), kt, acc)
    ct.store(dq, (b, h, m, 0), ct.reshape((acc * scale).astype(dq.dtype), (1, 1, TM, TD)))


@ct.kernel
def fmha_bwd_dkdv_kernel(q, k, v, do, lse, delta, dk, dv, qk_scale, scale, offset,
                         TM: ct.Constant[int], TN: ct.Constant[int], TD: ct.Constant[int],
                         CAUSAL: ct.Constant[bool]):
    """dk = scale * dS^T q and dv = P^T dO for one key tile of one kv head, summed over the query
    tiles of every q head in its group (one flat loop over (head, query tile)).
    Grid (cdiv(Sk, TN), B*Hkv)."""
    n = ct.bid(0)
    bhk = ct.bid(1)
    hkv = k.shape[1]
    hq = q.shape[1]
    group = hq // hkv
    b = bhk // hkv
    hk = bhk - b * hkv
    sq = q.shape[2]
    kt = _tile(k, b, hk, n, TN, TD)                                    # [TN, TD]
    vt = _tile(v, b, hk, n, TN, TD)
    num_m = ct.cdiv(sq, TM)
    if CAUSAL:
        m_start = min(max(n * TN - offset, 0) // TM, num_m)  # first query tile seeing a key here
        m_full = ct.cdiv(max((n + 1) * TN - 1 - offset, 0), TM)   # from here on: no mask
    else:
        m_start = 0
        m_full = 0
    per_head = num_m - m_start
    keys = n * TN + ct.arange(TN, dtype=ct.int32)[:, None]            # [TN, 1]
    rows = ct.arange(TM, dtype=ct.int32)[None, :] + offset            # [1, TM]
    dk_acc = ct.zeros((TN, TD), ct.float32)
    dv_acc = ct.zeros((TN, TD), ct.float32)
    for t in range(group * per_head):
        g = t // per_head
        mi = m_start + (t - g * per_head)
        h = hk * group + g
        bh = b * hq + h
        qt = _tile(q, b, h, mi, TM, TD)                                # [TM, TD]
        dot = _tile(do, b, h, mi, TM, TD)
        lse2 = _row(lse, bh, mi, TM)                                   # [1, TM]
        dl = _row(delta, bh, mi, TM)
        s_t = ct.mma(kt, ct.transpose(qt), ct.zeros((TN, TM), ct.float32))   # [TN, TM]
        p_t = ct.exp2(s_t * qk_scale - lse2, flush_to_zero=True)
        if CAUSAL:
            if mi < m_full:
                p_t = ct.where(keys <= mi * TM + rows, p_t, 0.0)
        dv_acc = ct.mma(p_t.astype(q.dtype), dot, dv_acc)
        dp_t = ct.mma(vt, ct.transpose(dot), ct.zeros((TN, TM), ct.float32))
        ds_t = p_t * (dp_t - dl)
        dk_acc = ct.mma(ds_t.astype(q.dtype), qt, dk_acc)
    ct.store(dk, (b, hk, n, 0), ct.reshape((dk_acc * scale).astype(dk.dtype), (1, 1, TN, TD)))
    ct.store(dv, (b, hk, n, 0), ct.reshape(dv_acc.astype(dv.dtype), (1, 1, TN, TD)))


# ---------------------------------------------------------------------------------------------
# Configs: (tm, tn) = (query tile, key tile) in every kernel (the dK/dV kernel owns a key tile
# and loops over query tiles), occupancy, num_worker_warps, num_ctas. Default first.
#
# sm_90 keeps every MMA accumulator in registers: the forward holds O (tm x D) and S (tm x tn)
# in float32, the dQ kernel dQ (tm x D) plus S and dP (tm x tn), the dK/dV kernel dK and dV
# (tn x D each) plus S^T and dP^T (tn x tm). tileiras 13.4 gives 4 worker warps 255 registers a
# thread and 8 worker warps 168 (occupancy 1); occupancy 2 halves that or, when the tile cannot
# fit, is ignored (same cubin as occupancy 1: left out here). The lists below are the candidates
# that compiled spill-free (STACK 0 in `cuobjdump -res-usage`, B4 H32 S4096 bf16, causal and
# not) for their head-dim tile TD (64 stands for every TD <= 64); tiles with spills were dropped
# (e.g. D128 fwd 128x128 with 4 warps: 440 B stack; D256 fwd 128x128: 96 B with 8 warps, 4.6 KB
# with 4; D64 fwd/dQ 128x64 at occupancy 2 with 8 warps: 8/128 B when causal). The
# 2-CTA-cluster forward configs compile to 128-row CTAs in pairs (the 256-row block is split
# across the cluster). 256x128 in a cluster never won but comes close in searches (H100: 1.003x
# the winner at D128, 10.8% behind it in the final round); 128x128 in a cluster ran 2.2-2.4x the
# winner's time on the H200 and the H100 and was dropped (session 5). Forward key tiles of
# 256 compile spill-free (64x256 with 4 warps: 255 registers, 8 warps: 168, D128 and D64;
# 128x256 with 8 warps at D64) and lost every H100 search (session 5): 1.31-1.59x (64x256, 4
# warps), 1.81-2.20x (8 warps), 1.12-1.20x (128x256, D64) the winner's time. Not in the space.
# Entries: (tm, tn, occupancy, num_worker_warps[, num_ctas]).

SM90_SPACES = {
    ("fwd", 128): [(128, 128, 1, 8), (128, 64, 1, 8), (128, 64, 1, 4), (256, 64, 1, 8),
                   (64, 128, 1, 8), (64, 128, 2, 8), (64, 128, 1, 4), (64, 128, 2, 4),
                   (64, 64, 1, 8), (64, 64, 2, 8), (64, 64, 2, 4), (128, 32, 1, 8),
                   (256, 128, 1, 8, 2)],
    ("fwd", 64): [(128, 128, 1, 8), (128, 128, 1, 4), (128, 64, 1, 8), (128, 64, 1, 4),
                  (128, 64, 2, 4), (256, 64, 1, 8), (256, 32, 1, 8), (64, 128, 1, 8),
                  (64, 128, 2, 8), (64, 128, 2, 4), (64, 64, 2, 8), (64, 64, 2, 4),
                  (256, 128, 1, 8, 2)],
    ("fwd", 256): [(128, 64, 1, 8), (128, 32, 1, 8), (64, 128, 1, 8), (64, 128, 1, 4),
                   (64, 64, 1, 8), (64, 64, 1, 4), (64, 32, 1, 8)],
    ("dq", 128): [(128, 64, 1, 8), (128, 128, 1, 8), (128, 32, 1, 8), (128, 32, 1, 4),
                  (64, 128, 1, 8), (64, 128, 1, 4), (64, 64, 1, 8), (64, 64, 2, 8),
                  (64, 64, 1, 4), (64, 64, 2, 4), (64, 32, 2, 8)],
    ("dq", 64): [(128, 64, 1, 8), (128, 128, 1, 8), (128, 64, 1, 4), (128, 64, 2, 4),
                 (256, 64, 1, 8), (64, 128, 1, 8), (64, 128, 2, 8), (64, 128, 2, 4),
                 (64, 64, 2, 8), (64, 64, 2, 4), (128, 32, 2, 8)],
    ("dq", 256): [(64, 64, 1, 8), (64, 64, 1, 4), (64, 32, 1, 8), (64, 32, 1, 4),
                  (128, 32, 1, 8)],
    ("dkdv", 128): [(64, 128, 1, 8), (128, 64, 1, 8), (64, 64, 1, 8), (64, 64, 1, 4),
                    (64, 64, 2, 4), (32, 128, 1, 8), (32, 64, 1, 8), (32, 64, 1, 4),
                    (32, 64, 2, 4), (64, 32, 1, 8)],
    ("dkdv", 64): [(64, 128, 1, 8), (128, 64, 1, 8), (128, 64, 1, 4), (256, 64, 1, 8),
                   (32, 128, 1, 8), (32, 128, 2, 4), (64, 64, 1, 8), (64, 64, 2, 8),
                   (64, 64, 2, 4), (32, 64, 2, 8), (32, 64, 2, 4)],
    ("dkdv", 256): [(64, 64, 1, 8), (32, 64, 1, 8)],
}
# sm_100 (compile-checked only): accumulators live in tensor memory, not registers, so larger
# tiles and 2-CTA clusters are plausible; worker warps are left to the compiler.
SM100_SPACES = {
    "fwd": [(128, 128, 1), (256, 128, 1), (256, 128, 1, None, 2)],
    "dq": [(128, 64, 1), (128, 128, 1), (64, 64, 2)],
    "dkdv": [(64, 128, 1), (128, 128, 1), (64, 64, 2)],
}
# Anything else (pre-Hopper, sm_12x): a conservative pair, never measured here.
OTHER_SPACES = {"fwd": [(64, 64, 2, 4), (128, 64, 1, 4)],
                "dq": [(64, 64, 2, 4), (128, 64, 1, 4)],
                "dkdv": [(64, 64, 2, 4), (64, 128, 1, 4)]}


def _cfg(tm, tn, occ, warps=None, nc=1):
    c = SimpleNamespace(tm=tm, tn=tn, occupancy=occ, num_ctas=nc)
    if warps is not None:
        c.num_worker_warps = warps
    return c


def head_tile(d):
    """The head-dim tile: next power of two, at least 16 (the MMA's K step)."""
    return max(16, next_pow2(d))


def _space(kind, arch, td, sq, sk):
    mj = major(arch)
    if mj == 9:
        entries = SM90_SPACES[(kind, 64 if td <= 64 else td)]
    elif mj == 10 and td <= 128:
        entries = SM100_SPACES[kind]
    elif mj == 10:
        entries = SM90_SPACES[(kind, 256)]
    else:
        entries = OTHER_SPACES[kind]
    # Tiles longer than the (bucketed) sequence only compute padding: leave them out (decode,
    # short prompts); if that leaves nothing, the first entry with its tiles cut to fit.
    cap_m, cap_n = max(64, next_pow2(sq)), max(64, next_pow2(sk))
    fits = [e for e in entries if e[0] <= cap_m and e[1] <= cap_n]
    if not fits:
        e = entries[0]
        fits = [(min(e[0], cap_m), min(e[1], cap_n), *e[2:4])]
    for e in fits:
        yield _cfg(*e)


# Causal forward only: the query tiles' order (heaviest first) for the entries that won or came
# close on sm_90 (D128 and D64: 64x128 occupancy 2 / 4 warps; 128x128 / 8 warps).
HEAVY_FIRST_TRIALS = [(64, 128, 2, 4), (128, 128, 1, 8)]     # (tm, tn, occupancy, worker warps)


def fwd_configs(arch, td, sq=4096, sk=4096, causal=False):
    cfgs = list(_space("fwd", arch, td, sq, sk))
    yield from cfgs
    if causal and major(arch) == 9:
        for c in cfgs:
            entry = (c.tm, c.tn, c.occupancy, getattr(c, "num_worker_warps", None))
            if c.num_ctas == 1 and entry in HEAVY_FIRST_TRIALS:
                yield SimpleNamespace(**vars(c), heavy_first=True)


def dq_configs(arch, td, sq=4096, sk=4096, causal=False):
    yield from _space("dq", arch, td, sq, sk)


def dkdv_configs(arch, td, sq=4096, sk=4096, causal=False):
    yield from _space("dkdv", arch, td, sq, sk)


_fwd = Autotuner("fmha_fwd", fmha_fwd_kernel, fwd_configs, default=_cfg(64, 64, 2, 4))
_dq = Autotuner("fmha_bwd_dq", fmha_bwd_dq_kernel, dq_configs, default=_cfg(64, 64, 2, 4))
_dkdv = Autotuner("fmha_bwd_dkdv", fmha_bwd_dkdv_kernel, dkdv_configs,
                  default=_cfg(64, 64, 2, 4))
TUNERS = (_fwd, _dq, _dkdv)


# ---------------------------------------------------------------------------------------------
# Host launch.

def _cdiv(a, b):
    return -(-a // b)


def visible_pairs(sq, sk, causal, offset):
    """Number of (query, key) pairs that are not masked (for FLOP counts)."""
    if not causal:
        return sq * sk
    # row i sees min(max(i + offset + 1, 0), sk) keys: a clamped arithmetic series
    lo = min(max(0, -offset), sq)                  # first row that sees a key
    full = min(max(sk - offset - 1, lo), sq)       # first row that sees all sk keys
    n = full - lo                                  # rows lo..full-1 see i + offset + 1 keys
    return n * (lo + offset + 1) + n * (n - 1) // 2 + (sq - full) * sk


def _key(q, k, causal, offset):
    B, hq, sq, d = q.shape
    sk = k.shape[2]
    diag = None if not causal else ("bottom_right" if offset == sk - sq else
                                    "top_left" if offset == 0 else "offset")
    return (bucket(B * hq), bucket(sq), bucket(sk), d, diag, hq // k.shape[1], q.dtype,
            q.get_device())


def _flat(t):
    """(B, H, S) float32 -> the (B*H, S) view the kernels index by flat head."""
    return t.view(t.shape[0] * t.shape[1], t.shape[2])


def launch_fwd(q, k, v, o, lse, causal, offset, scale):
    B, hq, sq, d = q.shape
    sk = k.shape[2]
    td = head_tile(d)
    qk_scale = scale * LOG2E
    lse2 = _flat(lse)
    key = _key(q, k, causal, offset)

    def grid(c):
        return (_cdiv(sq, c.tm), B * hq)

    def args(c):
        return (q, k, v, o, lse2, qk_scale, offset, c.tm, c.tn, td, causal,
                getattr(c, "heavy_first", False))
    cfg, kernel = _fwd.cache.get(key) or _fwd.tune(key, q, Search(
        shape=dict(td=td, sq=bucket(sq), sk=bucket(sk), causal=causal), grid_fn=grid,
        args_fn=args,
        work=Work(flops=4.0 * B * hq * d * visible_pairs(sq, sk, causal, offset))))
    ct.launch(current_stream(q.get_device()), grid(cfg), kernel, args(cfg))


def launch_bwd(do, q, k, v, o, lse, dq, dk, dv, delta, causal, offset, scale):
    B, hq, sq, d = q.shape
    hkv, sk = k.shape[1], k.shape[2]
    td = head_tile(d)
    qk_scale = scale * LOG2E
    lse2 = _flat(lse)
    key = _key(q, k, causal, offset)
    dev = q.get_device()

    def search(grid_fn, args_fn, pair_flops):   # built only on a cache miss
        return Search(shape=dict(td=td, sq=bucket(sq), sk=bucket(sk), causal=causal),
                      grid_fn=grid_fn, args_fn=args_fn,
                      work=Work(flops=pair_flops * B * hq * d *
                                visible_pairs(sq, sk, causal, offset)))

    def dq_grid(c):
        return (_cdiv(sq, c.tm), B * hq)

    def dq_args(c):
        return (q, k, v, o, do, lse2, delta, dq, qk_scale, scale, offset, c.tm, c.tn, td, causal)
    cfg, kernel = _dq.cache.get(key) or _dq.tune(key, q, search(dq_grid, dq_args, 6.0))
    ct.launch(current_stream(dev), dq_grid(cfg), kernel, dq_args(cfg))   # also writes delta

    def kv_grid(c):
        return (_cdiv(sk, c.tn), B * hkv)

    def kv_args(c):
        return (q, k, v, do, lse2, delta, dk, dv, qk_scale, scale, offset, c.tm, c.tn, td, causal)
    cfg, kernel = _dkdv.cache.get(key) or _dkdv.tune(key, q, search(kv_grid, kv_args, 8.0))
    ct.launch(current_stream(dev), kv_grid(cfg), kernel, kv_args(cfg))


def _forward(q, k, v, causal, offset, scale):
    """(o laid out like q, lse (B, Hq, Sq) float32 in base 2)."""
    B, hq, sq, _ = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((B, hq, sq), device=q.device, dtype=torch.float32)
    if o.numel() == 0:
        return o, lse
    if k.shape[2] == 0:                  # no keys at all: every row is fully masked
        o.zero_()
        lse.fill_(POS_INF)
        return o, lse
    launch_fwd(q, k, v, o, lse, causal, offset, scale)
    return o, lse


def _backward(do, q, k, v, o, lse, causal, offset, scale):
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    if 0 in do.stride() and do.numel():  # expanded gradients (e.g. of .sum()): one real copy
        do = do.contiguous()
    if q.numel() == 0 or k.numel() == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    B, hq, sq, _ = q.shape
    delta = torch.empty((B * hq, sq), device=q.device, dtype=torch.float32)
    launch_bwd(do, q, k, v, o, lse, dq, dk, dv, delta, causal, offset, scale)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# Autograd (eager) and the custom op (torch.compile).

class FMHAFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, causal, offset, scale):
        o, lse = _forward(q, k, v, causal, offset, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = (causal, offset, scale)
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _backward(do, q, k, v, o, lse, *ctx.args)
        return dq, dk, dv, None, None, None


@torch.library.custom_op("tiletune::fmha_fwd", mutates_args=())
def _fmha_fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, offset: int,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return _forward(q, k, v, causal, offset, scale)


@_fmha_fwd_op.register_fake
def _(q, k, v, causal, offset, scale):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("tiletune::fmha_bwd", mutates_args=())
def _fmha_bwd_op(do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 o: torch.Tensor, lse: torch.Tensor, causal: bool, offset: int,
                 scale: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(do, q, k, v, o, lse, causal, offset, scale)


@_fmha_bwd_op.register_fake
def _(do, q, k, v, o, lse, causal, offset, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _op_setup(ctx, inputs, output):
    q, k, v, causal, offset, scale = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.args = (causal, offset, scale)


def _op_backward(ctx, do, dlse):
    # lse is an auxiliary output for the backward: not differentiable (its gradient is ignored)
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = _fmha_bwd_op(do, q, k, v, o, lse, *ctx.args)
    return dq, dk, dv, None, None, None


_fmha_fwd_op.register_autograd(_op_backward, setup_context=_op_setup)


# ---------------------------------------------------------------------------------------------
# Public functions.

def _check(op, q, k, v, scale):
    dts = (torch.bfloat16, torch.float16)
    validate.tensor(op, "q", q, dtypes=dts)
    validate.tensor(op, "k", k, device=q.device, dtypes=dts)
    validate.tensor(op, "v", v, device=q.device, dtypes=dts)
    for name, t in (("k", k), ("v", v)):
        if t.dtype != q.dtype:
            raise TypeError(f"{op}: {name} dtype {t.dtype} differs from q dtype {q.dtype}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{op}: {name} must be 4-D (B, H, S, D), got shape {tuple(t.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"{op}: v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)}")
    B, hq, _, d = q.shape
    if k.shape[0] != B:
        raise ValueError(f"{op}: k batch {k.shape[0]} differs from q batch {B}")
    if k.shape[3] != d:
        raise ValueError(f"{op}: k head_dim {k.shape[3]} differs from q head_dim {d}")
    hkv = k.shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{op}: q heads ({hq}) must be a multiple of k/v heads ({hkv})")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"{op}: head_dim {d} is not supported (1 to {MAX_HEAD_DIM})")
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, (float, int)):
        raise TypeError(f"{op}: scale must be a float, got {type(scale).__name__}")
    if not 0.0 < scale < float("inf"):
        raise ValueError(f"{op}: scale must be a finite number > 0, got {scale}")
    return float(scale)


def _attention(q, k, v, causal, offset, scale):
    if torch.compiler.is_compiling():
        return _fmha_fwd_op(q, k, v, causal, offset, scale)[0]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return FMHAFunction.apply(q, k, v, causal, offset, scale)
    return _forward(q, k, v, causal, offset, scale)[0]


def fmha(q, k, v, *, causal=False, scale=None):
    """Fused multi-head attention, softmax(scale * q k^T) v, FlashAttention-2 style.

    q: (B, Hq, Sq, D); k, v: (B, Hkv, Sk, D) with Hq a multiple of Hkv (GQA; Hkv = 1 is MQA).
    bf16 or fp16 (all three alike), on one CUDA device, any strides (e.g. the
    (B, S, H, D).transpose(1, 2) views HF produces; a unit-stride last dim is fastest).
    D: any head_dim from 1 to 256; D that is not a power of two (>= 16) is zero-padded to one
    inside the kernel (D 80 computes as 128); D > 256 raises ValueError. Sq and Sk are arbitrary
    (Sq != Sk allowed). causal=True masks key j for query i unless j <= i + Sk - Sq (diagonal
    aligned bottom-right, as FlashAttention 2); rows that see no key (Sq > Sk) return 0, and
    Sk = 0 returns zeros. scale defaults to 1/sqrt(D) and must be > 0. Softmax statistics are
    float32 (exp2); the output has q's dtype and, where q is dense, q's layout.
    Differentiable in q, k and v (backward: separate dQ and dK/dV kernels, each tuned).
    For torch SDPA semantics (top-left causal) use `scaled_dot_product_attention`.
    """
    scale = _check("fmha", q, k, v, scale)
    causal = bool(causal)
    offset = k.shape[2] - q.shape[2] if causal else 0
    return _attention(q, k, v, causal, offset, scale)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """Drop-in for torch.nn.functional.scaled_dot_product_attention on 4-D bf16/fp16 inputs.

    Same semantics as torch: `is_causal` aligns the causal diagonal top-left (query i sees keys
    j <= i) when Sq != Sk; `attn_mask` may be None or a torch.nn.attention.bias.CausalBias
    (`causal_upper_left` / `causal_lower_right`); other masks and dropout_p > 0 raise
    ValueError. Key/value heads may differ from query heads only with enable_gqa=True.
    """
    op = "scaled_dot_product_attention"
    if dropout_p:
        raise ValueError(f"{op}: dropout_p={dropout_p} is not supported (only 0.0)")
    causal, lower_right = bool(is_causal), False
    if attn_mask is not None:
        from torch.nn.attention.bias import CausalBias, CausalVariant
        if not isinstance(attn_mask, CausalBias):
            raise ValueError(f"{op}: attn_mask must be None or a CausalBias, got "
                             f"{type(attn_mask).__name__}")
        if is_causal:
            raise ValueError(f"{op}: pass either is_causal=True or a CausalBias attn_mask")
        causal, lower_right = True, attn_mask.variant == CausalVariant.LOWER_RIGHT
    scale = _check(op, query, key, value, scale)
    if not enable_gqa and key.shape[1] != query.shape[1]:
        raise ValueError(f"{op}: key heads ({key.shape[1]}) differ from query heads "
                         f"({query.shape[1]}); pass enable_gqa=True for GQA/MQA")
    offset = key.shape[2] - query.shape[2] if (causal and lower_right) else 0
    return _attention(query, key, value, causal, offset, scale)


# ---------------------------------------------------------------------------------------------
# Ahead-of-time compile cases (CI compiles each for sm_90 and sm_100). Inputs in HF's layout
# ((B, S, H, D) storage seen as (B, H, S, D)), outputs laid out like their input, LSE2/delta
# (B*H, S) float32. Every sm_90 config of the three kernels at B4 H32 S4096 D128 bf16 causal;
# the sm_100 and fallback configs not already in it; then each kernel's default for non-causal,
# D64 fp16, a ragged Sq/Sk (1000/4097: no 16-divisible shapes, LSE rows without TMA), GQA 32/8,
# D256, and the forward for decode (Sq = 1) and D80 (zero-padded to 128).

def aot_params(kind, tm, tn, dt, B, hq, hkv, sq, sk, d, causal, heavy_first=False):
    """The signature the JIT specializes `kind`'s kernel on for inputs in HF's layout (outputs
    laid out like their inputs, LSE2/delta (B*Hq, Sq) float32), constants in place."""
    from cuda.tile.compilation import ScalarConstraint
    from tiletune.aot import F32, jit_array
    i32 = ScalarConstraint(ct.int32)

    def hf(H, S):
        return jit_array(dt, (B, H, S, d), (S * H * d, d, H * d, 1))
    q, kv = hf(hq, sq), hf(hkv, sk)
    rows = jit_array(torch.float32, (B * hq, sq))
    tail = [tm, tn, head_tile(d), causal]
    if kind == "fwd":
        return [q, kv, kv, q, rows, F32, i32] + tail + [heavy_first]
    if kind == "dq":
        return [q, kv, kv, q, q, rows, rows, q, F32, F32, i32] + tail
    return [q, kv, kv, q, rows, rows, kv, kv, F32, F32, i32] + tail


def aot_cases():
    from tiletune.aot import CompileCase

    def params(kind, cfg, *shape):
        return aot_params(kind, cfg.tm, cfg.tn, *shape, getattr(cfg, "heavy_first", False))

    tuners = {"fwd": _fwd, "dq": _dq, "dkdv": _dkdv}
    gens = {"fwd": fwd_configs, "dq": dq_configs, "dkdv": dkdv_configs}
    bf, f16 = torch.bfloat16, torch.float16
    head = (bf, 4, 32, 32, 4096, 4096, 128, True)
    for kind, gen in gens.items():
        seen = []
        for arch in ("sm_90", "sm_100", "sm_80"):
            for cfg in gen(arch, 128, causal=True):
                if cfg in seen:
                    continue
                seen.append(cfg)
                yield CompileCase("fmha", tuners[kind].build(cfg), params(kind, cfg, *head),
                                  f"fmha {kind} {arch} space B4 H32 S4096 D128 bf16 causal "
                                  f"{vars(cfg)}")
    variants = [  # label, kinds, (dtype, B, Hq, Hkv, Sq, Sk, D, causal)
        ("non-causal", ("fwd", "dkdv"), (bf, 4, 32, 32, 4096, 4096, 128, False)),
        ("D64 fp16 causal", ("fwd", "dq", "dkdv"), (f16, 8, 16, 16, 2048, 2048, 64, True)),
        ("ragged Sq1000 Sk4097 causal", ("fwd", "dq", "dkdv"),
         (bf, 2, 8, 8, 1000, 4097, 128, True)),
        ("GQA 32/8 causal", ("fwd", "dkdv"), (bf, 4, 32, 8, 4096, 4096, 128, True)),
        ("D256 causal", ("fwd", "dq", "dkdv"), (bf, 2, 8, 8, 2048, 2048, 256, True)),
        ("decode Sq1 Sk4097", ("fwd",), (bf, 4, 32, 8, 1, 4097, 128, False)),
        ("D80 (padded to 128)", ("fwd",), (bf, 2, 32, 32, 2048, 2048, 80, True)),
    ]
    for label, kinds, shape in variants:
        dt, B, hq, hkv, sq, sk, d, causal = shape
        for kind in kinds:
            cfg = next(gens[kind]("sm_90", head_tile(d), bucket(sq), bucket(sk)))
            yield CompileCase("fmha", tuners[kind].build(cfg), params(kind, cfg, *shape),
                              f"fmha {kind} {label} default {vars(cfg)}")


# ---------------------------------------------------------------------------------------------
# Benchmarks (python -m tiletune bench fmha): torch SDPA per backend (flash, cuDNN, efficient)
# and TileGym's cuTile attention when importable, forward and forward+backward. FLOPs count the
# visible (unmasked) pairs: 4 * B * Hq * pairs * D forward (causal square ~ half of Sq * Sk),
# backward 2.5x forward.

BENCH_SHAPES = (  # B, Hq, Hkv, Sq, Sk, D, causal
    (4, 32, 32, 4096, 4096, 128, False), (4, 32, 32, 4096, 4096, 128, True),
    (8, 16, 16, 2048, 2048, 64, False), (8, 16, 16, 2048, 2048, 64, True),
    (4, 32, 8, 4096, 4096, 128, True),          # GQA 4:1
    (4, 32, 32, 1024, 4096, 128, True),         # Sq != Sk: chunked prefill, bottom-right
)


def _tilegym():
    try:
        from tilegym.ops.cutile.attention import tile_fmha, tile_fmha_with_backward
        return tile_fmha, tile_fmha_with_backward
    except Exception:
        return None


def bench_cases():
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    from tiletune.bench import BenchCase
    sdpa = torch.nn.functional.scaled_dot_product_attention
    backends = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}
    tg = _tilegym()
    cases = []
    for B, hq, hkv, sq, sk, d, causal in BENCH_SHAPES:
        dt = torch.bfloat16
        q = torch.randn(B, sq, hq, d, device="cuda", dtype=dt).transpose(1, 2)   # HF layout
        k = torch.randn(B, sk, hkv, d, device="cuda", dtype=dt).transpose(1, 2)
        v = torch.randn(B, sk, hkv, d, device="cuda", dtype=dt).transpose(1, 2)
        do = torch.randn(B, hq, sq, d, device="cuda", dtype=dt)
        name = (f"B{B} H{hq}" + (f"/{hkv}" if hkv != hq else "") +
                (f" S{sq}" if sq == sk else f" Sq{sq} Sk{sk}") + f" D{d} bf16" +
                (" causal" if causal else ""))
        # torch's is_causal aligns top-left; for Sq != Sk the bottom-right mask is a CausalBias
        mask = causal_lower_right(sq, sk) if causal and sq != sk else None
        kw = dict(attn_mask=mask, is_causal=causal and mask is None, enable_gqa=hkv != hq)

        def torch_fn(backend, kw=kw):
            def f(q, k, v):
                with sdpa_kernel(backend):
                    return sdpa(q, k, v, **kw)
            return f
        fns = {label: torch_fn(b) for label, b in backends.items()}
        ours = lambda q, k, v, c=causal: fmha(q, k, v, causal=c)
        fwd_peers = dict(fns)
        bwd_peers = dict(fns)
        if tg is not None and sq == sk:        # TileGym's causal assumes Sq == Sk here
            fwd_peers["tilegym"] = lambda q, k, v, c=causal: tg[0](q, k, v, is_causal=c)
            bwd_peers["tilegym"] = lambda q, k, v, c=causal: tg[1](q, k, v, is_causal=c)
        flops = 4.0 * B * hq * d * visible_pairs(sq, sk, causal, sk - sq)
        cases.append(BenchCase("fmha", name, "fwd", lambda f=ours, q=q, k=k, v=v: f(q, k, v),
                               {lb: (lambda f=f, q=q, k=k, v=v: f(q, k, v))
                                for lb, f in fwd_peers.items()}, flops=flops))
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

        def step(f, qg=qg, kg=kg, vg=vg, do=do):   # grad(): no accumulation into .grad
            return lambda: torch.autograd.grad(f(qg, kg, vg), (qg, kg, vg), do)
        cases.append(BenchCase("fmha", name, "fwd+bwd", step(ours),
                               {lb: step(f) for lb, f in bwd_peers.items()},
                               flops=3.5 * flops))
    return cases
