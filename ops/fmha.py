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
# The forward has two kernels the search chooses between per key: one query tile a CTA, or (dense
# batches, sm_90) two neighbouring tiles a CTA on one K/V stream, which tileiras runs on two
# consumer warpgroups.
#
# Backward (dO given):
#   delta_i = rowsum(dO_i * O_i); dP = dO V^T; dS = P * (dP - delta)
#   dV = P^T dO; dK = scale * dS^T Q; dQ = scale * dS K
# in two kernels, no atomics: the dQ kernel owns a query tile (grid over query tiles x B*Hq) and
# loops over key tiles; it also computes delta for its rows (it loads dO anyway; adding O is one
# tile per CTA) and writes it for the second kernel, which saves a separate preprocessing launch
# and a second read of dO. The dK/dV kernel owns a key tile of one kv head (grid over key tiles x
# B*Hkv) and loops over the query tiles of every q head of its group, so GQA needs no atomics or
# reduction over heads. P is recomputed from LSE2 in both. Or (dense D128 keys on sm_90, where
# the dK/dV search times whole plans) fused: the dK/dV kernel also adds each tile pair's dQ share
# into a float32 dQ with a TMA reduce-add (dQ's last bits then depend on the CTAs' order; never
# under torch's deterministic algorithms), between a kernel that writes delta and zeroes that dQ
# and one that casts it.
#
# No `from __future__ import annotations` here: it would hide the ct.Constant annotations.
import functools
import math
import numbers
from types import SimpleNamespace

import cuda.tile as ct
import torch

from tiletune import validate
from tiletune.autotune import Autotuner, StandIns, Work, bucket, bucketed
from tiletune.device import major, persistent_ctas, sm_count
from tiletune.ops.gemm_tiles import slice64
from tiletune.space import cdiv, f32_row, next_pow2, table
from tiletune.torch_op import TrainableOp, records_graph

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
# PACKED (variable-length batches in FlashAttention-2's varlen layout): the arrays hold one
# packed batch, q/o (1, Hq, Tq, D), k/v (1, Hkv, Tk, D), LSE2/delta (Hq, Tq); the grid's batch
# index is the sequence b, whose rows [cu_q[b], cu_q[b+1]) and keys [cu_k[b], cu_k[b+1]) the
# kernels slice out, so their loads zero-pad at its ends as at a dense batch's; causal is
# bottom-right per sequence. A CTA whose tile lies past its sequence's end returns at once (the
# grid covers the longest). Dense launches pass PACKED False and cu_q/cu_k unread.

def _unflatten(i, n):
    """(i // n, i % n): a flat (outer, inner) index with n inner entries, split."""
    outer = i // n
    return outer, i - outer * n


def _heads(bh, q, k):
    """Flat batch*head block index -> (b, q head, kv head) for GQA/MQA (group = Hq // Hkv)."""
    hq = q.shape[1]
    b, h = _unflatten(bh, hq)
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


def _keys_t(k, b, hk, n, TN, TD):
    """[TD, TN] tile n of k[b, hk], transposed (keys past Sk load as zeros)."""
    kt = ct.load(k, (b, hk, 0, n), (1, 1, TD, TN), order=(0, 1, 3, 2), padding_mode=ZERO)
    return ct.reshape(kt, (TD, TN))


def _scores(qt, k, b, hk, n, TN, TD):
    """S [R, TN] = qt [R, TD] k[b, hk] tile n^T in float32."""
    return ct.mma(qt, _keys_t(k, b, hk, n, TN, TD), ct.zeros((qt.shape[0], TN), ct.float32))


def _masked(s, n, cols, sk, last_key, TN, CAUSAL):
    """Scores s of key tile n with keys past sk, and under CAUSAL the keys past each row's last
    visible one (last_key [R, 1]), at -inf."""
    key = n * TN + cols
    ok = key < sk
    if CAUSAL:
        ok = ok & (key <= last_key)
    return ct.where(ok, s, NEG_INF)


def _online_softmax(s, m_i, l_i, qk_scale):
    """One key tile's scores s [R, TN] (masked keys at -inf) folded into a block of rows' running
    max m_i (base 2, scaled) and sum l_i. Returns (m_new, l_new, P [R, TN], alpha [R, 1]): the
    caller adds P v and rescales its output by alpha."""
    m_new = ct.maximum(m_i, ct.max(s, axis=1, keepdims=True) * qk_scale)
    m_use = ct.where(m_new == NEG_INF, 0.0, m_new)     # rows with no key yet: no NaN
    p = ct.exp2(s * qk_scale - m_use, flush_to_zero=True)             # [R, TN]
    alpha = ct.exp2(m_i - m_use, flush_to_zero=True)                   # [R, 1]
    return m_new, l_i * alpha + ct.sum(p, axis=1, keepdims=True), p, alpha


def _softmax_step(s, m_i, l_i, acc, v, b, hk, n, qk_scale, TN, TD):
    """Fold key tile n into the online softmax of a block of rows: s [R, TN] (masked keys at
    -inf) updates the running max m_i, the sum l_i and the output acc [R, TD] (rescaled, plus
    P v[b, hk] tile n). Returns the new (m_i, l_i, acc)."""
    m_new, l_i, p, alpha = _online_softmax(s, m_i, l_i, qk_scale)
    vt = _tile(v, b, hk, n, TN, TD)                                    # [TN, TD]
    return m_new, l_i, ct.mma(p.astype(v.dtype), vt, acc * alpha)


def _store_rows(o, lse, b, h, bh, m, acc, m_i, l_i, TM, TD):
    """Query tile m's output acc / l_i into o[b, h] and its LSE2 into lse[bh]; rows that saw no
    key get 0 and +inf."""
    live = l_i > 0.0
    out = acc * ct.where(live, 1.0 / l_i, 0.0)
    ct.store(o, (b, h, m, 0), ct.reshape(out.astype(o.dtype), (1, 1, TM, TD)))
    lse2 = ct.where(live, m_i + ct.log2(l_i), POS_INF)
    ct.store(lse, (bh, m), ct.reshape(lse2, (1, TM)))


def _span(cu, seq, rows):
    """[start, end) of sequence `seq` in a packed batch (cu: int32 cumulative offsets) of
    `rows` rows, clamped to [0, rows] with end >= start: offsets the host cannot check (a
    sync) then never slice outside the packed arrays (the rows stay unspecified)."""
    start = min(max(ct.gather(cu, seq), 0), rows)
    return start, min(max(ct.gather(cu, seq + 1), start), rows)


def _block():
    """(tile, flat batch*head) of this CTA on a grid (heads a round, tiles, rounds): see
    `_round_grid`."""
    return ct.bid(1), ct.bid(2) * ct.num_blocks(0) + ct.bid(0)


def _query_block(q, k, cu_q, HEAVY_FIRST, PACKED):
    """(m, b, h, hk, bh, q0, q1) of a CTA that owns one query tile: the tile (last to first
    when HEAVY_FIRST), batch, q head, kv head, flat batch*head, and the rows [q0, q1) of its
    sequence (all of S unless PACKED)."""
    m, bh = _block()
    if HEAVY_FIRST:
        m = ct.num_blocks(1) - 1 - m
    b, h, hk = _heads(bh, q, k)
    q0, q1 = 0, q.shape[2]
    if PACKED:
        q0, q1 = _span(cu_q, b, q.shape[2])
    return m, b, h, hk, bh, q0, q1


def _sequence_keys(cu_k, b, h, bh, k, v, sq, offset, CAUSAL, PACKED):
    """(k, v, sk, offset, b, bh) for the sq query rows of batch b, head h (flat row bh): the
    keys they see, their count, the causal offset, and the batch and row index of the
    query-side arrays. Dense: unchanged. PACKED: k and v sliced to sequence b's keys, the offset
    bottom-right per sequence, and the query-side arrays (sliced by the caller) read at batch 0,
    row h."""
    sk = k.shape[2]
    if PACKED:
        k0, k1 = _span(cu_k, b, k.shape[2])
        sk = k1 - k0
        if CAUSAL:
            offset = sk - sq
        k, v = _part(k, 2, k0, k1), _part(v, 2, k0, k1)
        b, bh = 0, h
    return k, v, sk, offset, b, bh


def _part(a, axis, start, end):
    """a's rows [start, end) along `axis` (zero-padded past end by the loads). A slice must
    start inside the array: an empty span at its very end gives a one-row view instead, which
    the caller never reads (its loops run over the span's own length)."""
    first = min(start, a.shape[axis] - 1)
    return slice64(a, axis, first, max(end, first))


@ct.kernel
def fmha_fwd_kernel(q, k, v, o, lse, cu_q, cu_k, qk_scale, offset, TM: ct.Constant[int],
                    TN: ct.Constant[int], TD: ct.Constant[int], CAUSAL: ct.Constant[bool],
                    PACKED: ct.Constant[bool]):
    """o = softmax(scale q k^T, masked) v and lse (B*Hq, Sq) = LSE2 per row.
    cdiv(Sq, TM) tiles x B*Hq heads (`_round_grid`). qk_scale = scale * log2(e) > 0.
    Under a causal mask each head's query tiles run last to first: the last see the most keys,
    so the light ones run at the end of the grid and the tail is short (on the round grid that
    beat the light-first order at 44 of 56 configs over four shapes and gave each shape's best
    time, H200). Without a mask the order changes nothing."""
    m, b, h, hk, bh, q0, q1 = _query_block(q, k, cu_q, CAUSAL, PACKED)
    if PACKED:
        if m * TM >= q1 - q0:       # past its sequence's end
            return
    k, v, sk, offset, b, bh = _sequence_keys(cu_k, b, h, bh, k, v, q1 - q0, offset, CAUSAL,
                                             PACKED)
    if PACKED:
        q, o, lse = slice64(q, 2, q0, q1), slice64(o, 2, q0, q1), slice64(lse, 1, q0, q1)
    qt = _tile(q, b, h, m, TM, TD)                                    # [TM, TD]
    n_end, n_mask = _key_tiles(m, sk, offset, TM, TN, CAUSAL)
    last_key = m * TM + ct.arange(TM, dtype=ct.int32)[:, None] + offset  # [TM, 1]
    cols = ct.arange(TN, dtype=ct.int32)[None, :]                     # [1, TN]
    m_i = ct.full((TM, 1), NEG_INF, ct.float32)
    l_i = ct.zeros((TM, 1), ct.float32)
    acc = ct.zeros((TM, TD), ct.float32)
    for n in range(n_end):
        s = _scores(qt, k, b, hk, n, TN, TD)                           # [TM, TN]
        if n >= n_mask:
            s = _masked(s, n, cols, sk, last_key, TN, CAUSAL)
        m_i, l_i, acc = _softmax_step(s, m_i, l_i, acc, v, b, hk, n, qk_scale, TN, TD)
    _store_rows(o, lse, b, h, bh, m, acc, m_i, l_i, TM, TD)


@ct.kernel
def fmha_fwd_pair_kernel(q, k, v, o, lse, cu_q, cu_k, qk_scale, offset, TM: ct.Constant[int],
                         TN: ct.Constant[int], TD: ct.Constant[int], CAUSAL: ct.Constant[bool],
                         PACKED: ct.Constant[bool], SPLIT: ct.Constant[bool]):
    """fmha_fwd_kernel's result with one CTA per two neighbouring query tiles (2p, 2p + 1).
    cdiv(cdiv(Sq, TM), 2) tiles x B*Hq heads. Each K and V tile is loaded once for both, so
    K/V cross L2 once per 2 * TM query rows, and the two online softmaxes are independent
    chains: on sm_90 at occupancy 1 tileiras runs them on two consumer warpgroups beside the TMA
    producer (384 threads), the structure of cuDNN's forward. A second tile past Sq computes on
    zero padding and its stores are clipped. Dense batches only: with PACKED's sliced views the
    sm_90 build puts both chains in one warpgroup and spills, so packed keys never choose it."""
    ct.static_assert(not PACKED, "fmha_fwd_pair_kernel takes dense batches only")
    p, b, h, hk, bh, _, _ = _query_block(q, k, cu_q, CAUSAL, False)
    m0 = 2 * p
    m1 = m0 + 1
    sk = k.shape[2]
    qt0 = _tile(q, b, h, m0, TM, TD)
    qt1 = _tile(q, b, h, m1, TM, TD)
    end0, mask0 = _key_tiles(m0, sk, offset, TM, TN, CAUSAL)
    end1, mask1 = _key_tiles(m1, sk, offset, TM, TN, CAUSAL)
    if not CAUSAL:
        # The same value (sk // TN), written so the compiler cannot merge the two tiles' mask
        # branches: merged, the chains share one warpgroup and the sm_90 build spills.
        mask1 = min(mask1, end1 + m1)
    rows = ct.arange(TM, dtype=ct.int32)[:, None]
    last0 = m0 * TM + rows + offset
    last1 = m1 * TM + rows + offset
    cols = ct.arange(TN, dtype=ct.int32)[None, :]
    m_0 = ct.full((TM, 1), NEG_INF, ct.float32)
    l_0 = ct.zeros((TM, 1), ct.float32)
    acc0 = ct.zeros((TM, TD), ct.float32)
    m_1 = ct.full((TM, 1), NEG_INF, ct.float32)
    l_1 = ct.zeros((TM, 1), ct.float32)
    acc1 = ct.zeros((TM, TD), ct.float32)
    # Under a causal mask tile 1 sees key tiles [end0, end1) that tile 0 does not. SPLIT runs
    # them for tile 1 alone in a second loop; without it one loop runs them for both, tile 0's
    # fully masked (P = 0): fewer instructions, but twice the MMAs on those tiles.
    both = min(end0, end1) if SPLIT else max(end0, end1)
    for n in range(both):
        kt = _keys_t(k, b, hk, n, TN, TD)
        s0 = ct.mma(qt0, kt, ct.zeros((TM, TN), ct.float32))
        s1 = ct.mma(qt1, kt, ct.zeros((TM, TN), ct.float32))
        if n >= mask0:
            s0 = _masked(s0, n, cols, sk, last0, TN, CAUSAL)
        if n >= mask1:
            s1 = _masked(s1, n, cols, sk, last1, TN, CAUSAL)
        vt = _tile(v, b, hk, n, TN, TD)
        m_0, l_0, p0, alpha0 = _online_softmax(s0, m_0, l_0, qk_scale)
        acc0 = ct.mma(p0.astype(v.dtype), vt, acc0 * alpha0)
        m_1, l_1, p1, alpha1 = _online_softmax(s1, m_1, l_1, qk_scale)
        acc1 = ct.mma(p1.astype(v.dtype), vt, acc1 * alpha1)
    if SPLIT:
        for n in range(both, end1):
            s1 = _masked(_scores(qt1, k, b, hk, n, TN, TD), n, cols, sk, last1, TN, CAUSAL)
            m_1, l_1, acc1 = _softmax_step(s1, m_1, l_1, acc1, v, b, hk, n, qk_scale, TN, TD)
    _store_rows(o, lse, b, h, bh, m0, acc0, m_0, l_0, TM, TD)
    _store_rows(o, lse, b, h, bh, m1, acc1, m_1, l_1, TM, TD)


@ct.kernel
def fmha_bwd_dq_kernel(q, k, v, o, do, lse, delta, dq, cu_q, cu_k, qk_scale, scale, offset,
                       TM: ct.Constant[int], TN: ct.Constant[int], TD: ct.Constant[int],
                       CAUSAL: ct.Constant[bool], PACKED: ct.Constant[bool],
                       SEES_PAST_SK: ct.Constant[bool]):
    """delta (B*Hq, Sq) = rowsum(dO * O) and dq = scale * dS k for one query tile.
    cdiv(Sq, TM) tiles x B*Hq heads, each head's last tile (under a causal mask the heaviest)
    first. Rows past Sq need no mask: their q/dO tiles are zero-padded, so they add exactly 0
    (LSE2/delta pad with 0: finite P). Keys past Sk are masked in P: their zero scores give
    P = 2^-LSE2, which overflows q's dtype in dS (then inf x their zero k rows = NaN) for a
    row whose every score is far below zero. Under CAUSAL the diagonal's mask does it for the
    rows whose last visible key is below Sk; SEES_PAST_SK: some row's is not (top-left causal
    with Sq > Sk), so the tail is masked too."""
    m, b, h, hk, bh, q0, q1 = _query_block(q, k, cu_q, True, PACKED)
    if PACKED:
        if m * TM >= q1 - q0:
            return
    if PACKED:
        q, o, do, dq = slice64(q, 2, q0, q1), slice64(o, 2, q0, q1), slice64(do, 2, q0, q1), \
            slice64(dq, 2, q0, q1)
        lse, delta = slice64(lse, 1, q0, q1), slice64(delta, 1, q0, q1)
    k, v, sk, offset, b, bh = _sequence_keys(cu_k, b, h, bh, k, v, q1 - q0, offset, CAUSAL,
                                             PACKED)
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
        if n >= n_mask:
            if CAUSAL:
                visible = n * TN + cols <= last_key
                if SEES_PAST_SK:
                    visible = visible & (n * TN + cols < sk)
                p = ct.where(visible, p, 0.0)
            else:
                p = ct.where(n * TN + cols < sk, p, 0.0)
        dp = ct.mma(dot, ct.transpose(vt), ct.zeros((TM, TN), ct.float32))
        ds = p * (dp - dl)
        acc = ct.mma(ds.astype(q.dtype), kt, acc)
    ct.store(dq, (b, h, m, 0), ct.reshape((acc * scale).astype(dq.dtype), (1, 1, TM, TD)))


@ct.kernel
def fmha_bwd_dkdv_kernel(q, k, v, do, lse, delta, dk, dv, cu_q, cu_k, qk_scale, scale, offset,
                         dq32, TM: ct.Constant[int], TN: ct.Constant[int], TD: ct.Constant[int],
                         CAUSAL: ct.Constant[bool], PACKED: ct.Constant[bool],
                         ADD_DQ: ct.Constant[bool], SEES_PAST_SK: ct.Constant[bool]):
    """dk = scale * dS^T q and dv = P^T dO for one key tile of one kv head, summed over the query
    tiles of every q head in its group (one flat loop over (head, query tile)).
    cdiv(Sk, TN) tiles x B*Hkv heads (key tile 0, the heaviest under a causal mask, first).
    Keys with no query (an empty query sequence) get zeros.
    ADD_DQ (the fused backward, dense batches): each pair's share of dQ, dS K unscaled, is also
    added into dq32 (B, Hq, Sq, D) float32 with a TMA reduce-add (not read otherwise).
    SEES_PAST_SK: some row's visible keys reach past Sk (no causal mask, or a top-left diagonal
    with Sq > Sk): the last key tile's padded keys are masked in P, since 2^-LSE2 can overflow
    dS there and the reduce-add would carry inf x 0 into dQ (dK/dV alone drop those rows on
    store)."""
    n, bhk = _block()
    hkv = k.shape[1]
    hq = q.shape[1]
    group = hq // hkv
    b, hk = _unflatten(bhk, hkv)
    sq = q.shape[2]
    if PACKED:
        k0, k1 = _span(cu_k, b, k.shape[2])
        if n * TN >= k1 - k0:
            return
        q0, q1 = _span(cu_q, b, q.shape[2])
        sq = q1 - q0
        if CAUSAL:
            offset = (k1 - k0) - sq
        k, v, dk, dv = slice64(k, 2, k0, k1), slice64(v, 2, k0, k1), slice64(dk, 2, k0, k1), \
            slice64(dv, 2, k0, k1)
        q, do = _part(q, 2, q0, q1), _part(do, 2, q0, q1)
        lse, delta = _part(lse, 1, q0, q1), _part(delta, 1, q0, q1)
        b = 0
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
        if SEES_PAST_SK:
            if (n + 1) * TN > k.shape[2]:
                p_t = ct.where(keys < k.shape[2], p_t, 0.0)
        dv_acc = ct.mma(p_t.astype(q.dtype), dot, dv_acc)
        dp_t = ct.mma(vt, ct.transpose(dot), ct.zeros((TN, TM), ct.float32))
        ds_t = (p_t * (dp_t - dl)).astype(q.dtype)
        dk_acc = ct.mma(ds_t, qt, dk_acc)
        if ADD_DQ:
            dq_part = ct.mma(ct.transpose(ds_t), kt, ct.zeros((TM, TD), ct.float32))
            dq32.tiled_view((1, 1, TM, TD)).atomic_store_add(
                (b, h, mi, 0), ct.reshape(dq_part, (1, 1, TM, TD)))
    ct.store(dk, (b, hk, n, 0), ct.reshape((dk_acc * scale).astype(dk.dtype), (1, 1, TN, TD)))
    ct.store(dv, (b, hk, n, 0), ct.reshape(dv_acc.astype(dv.dtype), (1, 1, TN, TD)))


# The fused backward (dense batches): delta and a zeroed float32 dQ first, then the dK/dV kernel
# under ADD_DQ, which also adds each (query tile, key tile) pair's dQ share, dS K, into that dQ
# with a TMA reduce-add (5 MMAs a pair against the split kernels' 7), then dQ scaled and cast.

@ct.kernel
def fmha_bwd_prep_kernel(o, do, delta, dq32, TM: ct.Constant[int], TD: ct.Constant[int]):
    """delta (B*Hq, Sq) = rowsum(dO * O) and the float32 dQ zeroed, for one query tile of one
    head: cdiv(Sq, TM) x B*Hq CTAs."""
    m, bh = ct.bid(0), ct.bid(1)
    b, h = _unflatten(bh, o.shape[1])
    ot = _tile(o, b, h, m, TM, TD).astype(ct.float32)
    dot = _tile(do, b, h, m, TM, TD).astype(ct.float32)
    ct.store(delta, (bh, m), ct.reshape(ct.sum(ot * dot, axis=1), (1, TM)))
    ct.store(dq32, (b, h, m, 0), ct.zeros((1, 1, TM, TD), ct.float32))


@ct.kernel
def fmha_bwd_cast_kernel(dq32, dq, scale, TM: ct.Constant[int], TD: ct.Constant[int]):
    """dq = scale * dq32 in dq's dtype, one query tile of one head (the prep kernel's grid)."""
    m, bh = ct.bid(0), ct.bid(1)
    b, h = _unflatten(bh, dq.shape[1])
    t = ct.load(dq32, (b, h, m, 0), (1, 1, TM, TD), padding_mode=ZERO)
    ct.store(dq, (b, h, m, 0), (t * scale).astype(dq.dtype))


# Decode (Sq <= 16): one CTA owns the Sq query rows of every q head of one kv head's group
# (rows packed g-major: row r = g * TQ + i, head g of the group, query i) and one of `splits`
# slices of the key range, so a GQA group reads its K/V once and short queries still fill the
# GPU. With splits > 1 each CTA writes its slice's normalized output and LSE2 (-inf: no key) as
# float32 partials, which the combine kernel merges; splits = 1 writes o and LSE2 directly.
# USED: batch b sees only keys [0, used[b]) (a cache's filled length; causal is bottom-right on
# it): k and v are sliced to it, so whatever the cache holds past it is never read.
# KEYS_M computes the transposed products, S^T = K q^T and O^T = V^T P^T, so that the MMA's M is
# the key tile and the head dim and its N the few rows: sm_90's HGMMA takes M in 64s, and with
# fewer rows (GQA 32/8: 4 heads x 4 rows) the row-major products build as HMMA 16x8x16.

def _decode_keys_m(qt, k, v, b, hk, n0, n1, hi, last_key, qk_scale, TN, TD, CAUSAL):
    """Key tiles [n0, n1) of k[b, hk] and v[b, hk] (keys < hi seen; under CAUSAL row r sees
    keys <= last_key[r]) folded into the rows of qt [R, TD] as transposed products. Returns
    the rows' (m_i, l_i, acc) as [R, 1], [R, 1] and [R, TD]."""
    rows = qt.shape[0]
    q_t = ct.transpose(qt)                                             # [TD, R]
    last = ct.reshape(last_key, (1, rows))
    keys = ct.arange(TN, dtype=ct.int32)[:, None]
    m_i = ct.full((1, rows), NEG_INF, ct.float32)
    l_i = ct.zeros((1, rows), ct.float32)
    acc = ct.zeros((TD, rows), ct.float32)                             # O^T
    for n in range(n0, n1):
        s = ct.mma(_tile(k, b, hk, n, TN, TD), q_t, ct.zeros((TN, rows), ct.float32))
        s = _masked(s, n, keys, hi, last, TN, CAUSAL)                  # S^T [TN, R]
        m_new = ct.maximum(m_i, ct.max(s, axis=0, keepdims=True) * qk_scale)
        m_use = ct.where(m_new == NEG_INF, 0.0, m_new)
        p = ct.exp2(s * qk_scale - m_use, flush_to_zero=True)          # P^T
        alpha = ct.exp2(m_i - m_use, flush_to_zero=True)
        l_i = l_i * alpha + ct.sum(p, axis=0, keepdims=True)
        vt = _keys_t(v, b, hk, n, TN, TD)                              # V^T [TD, TN]
        acc = ct.mma(vt, p.astype(v.dtype), acc * alpha)
        m_i = m_new
    return ct.reshape(m_i, (rows, 1)), ct.reshape(l_i, (rows, 1)), ct.transpose(acc)


@ct.kernel
def fmha_decode_kernel(q, k, v, used, o, lse, o_part, lse_part, qk_scale, offset,
                       GROUP: ct.Constant[int], TG: ct.Constant[int], TQ: ct.Constant[int],
                       TS: ct.Constant[int], TN: ct.Constant[int], TD: ct.Constant[int],
                       CAUSAL: ct.Constant[bool], USED: ct.Constant[bool],
                       SPLIT: ct.Constant[bool], KEYS_M: ct.Constant[bool]):
    """Grid (splits, B*Hkv). TG >= GROUP and TQ >= TS >= Sq are powers of two (TS: Sq rounded
    up; TQ may be padded further for the MMA). Where SPLIT, o_part (splits, B*Hkv*TG*TS, TD)
    and lse_part (splits, >= B*Hkv*TG*TS) float32 get each head's first TS rows (row block bhk
    of TG*TS rows: this CTA's; the padding rows are not stored); o and lse (B*Hq, Sq)
    otherwise."""
    s = ct.bid(0)
    splits = ct.num_blocks(0)
    bhk = ct.bid(1)
    b, hk = _unflatten(bhk, k.shape[1])
    sq = q.shape[2]
    sk = k.shape[2]
    if USED:
        sk = min(max(ct.gather(used, b), 0), sk)
        k = k.slice(2, 0, sk)
        v = v.slice(2, 0, sk)
        if CAUSAL:
            offset = sk - sq
    r = ct.arange(TG * TQ, dtype=ct.int32)[:, None]                    # [TR, 1]
    g = r // TQ
    i = r - g * TQ
    h = hk * GROUP + g
    cols_d = ct.arange(TD, dtype=ct.int32)[None, :]
    real = (g < GROUP) & (i < sq)                                      # rows that exist
    if TG == GROUP:        # a power-of-two group: its heads are one tile of q
        qt = ct.reshape(ct.load(q, (b, hk, 0, 0), (1, TG, TQ, TD), padding_mode=ZERO),
                        (TG * TQ, TD))
    else:                  # (a gather's index tiles cost registers: only where needed)
        qt = ct.gather(q, (b, h, i, cols_d), mask=real & (cols_d < q.shape[3]))   # [TR, TD]
    hi = sk                                                            # keys < hi are seen
    if CAUSAL:
        hi = min(max(sq + offset, 0), sk)
    n_tiles = ct.cdiv(hi, TN)
    per = ct.cdiv(n_tiles, splits)
    n0 = s * per
    n1 = min(n0 + per, n_tiles)
    last_key = i + offset                                              # [TR, 1]
    if KEYS_M:
        m_i, l_i, acc = _decode_keys_m(qt, k, v, b, hk, n0, n1, hi, last_key, qk_scale, TN, TD,
                                       CAUSAL)
    else:
        cols = ct.arange(TN, dtype=ct.int32)[None, :]
        m_i = ct.full((TG * TQ, 1), NEG_INF, ct.float32)
        l_i = ct.zeros((TG * TQ, 1), ct.float32)
        acc = ct.zeros((TG * TQ, TD), ct.float32)
        for n in range(n0, n1):
            sc = _masked(_scores(qt, k, b, hk, n, TN, TD), n, cols, hi, last_key, TN, CAUSAL)
            m_i, l_i, acc = _softmax_step(sc, m_i, l_i, acc, v, b, hk, n, qk_scale, TN, TD)
    live = l_i > 0.0
    out = acc * ct.where(live, 1.0 / l_i, 0.0)
    if SPLIT:
        part = ct.extract(ct.reshape(out, (TG, TQ, TD)), (0, 0, 0), shape=(TG, TS, TD))
        ct.store(o_part, (s, bhk, 0), ct.reshape(part, (1, TG * TS, TD)))
        lse2 = ct.where(live, m_i + ct.log2(l_i), NEG_INF)
        lse2 = ct.extract(ct.reshape(lse2, (TG, TQ)), (0, 0), shape=(TG, TS))
        ct.store(lse_part, (s, bhk), ct.reshape(lse2, (1, TG * TS)))
    else:
        lse2 = ct.where(live, m_i + ct.log2(l_i), POS_INF)
        if TG == GROUP:    # rows b * Hq + hk * GROUP + g of lse: row block bhk of TG
            ct.store(o, (b, hk, 0, 0), ct.reshape(out.astype(o.dtype), (1, TG, TQ, TD)))
            ct.store(lse, (bhk, 0), ct.reshape(lse2, (TG, TQ)))
        else:
            ct.scatter(o, (b, h, i, cols_d), out.astype(o.dtype),
                       mask=real & (cols_d < o.shape[3]))
            ct.scatter(lse, (b * q.shape[1] + h, i), lse2, mask=real)


@ct.kernel
def fmha_decode_combine_kernel(o_part, lse_part, o, lse, GROUP: ct.Constant[int],
                               TG: ct.Constant[int], TS: ct.Constant[int],
                               SP: ct.Constant[int], TDC: ct.Constant[int]):
    """o and lse (B*Hq, Sq) of each q head from the splits' partials: each split's output
    weighted by 2^(its LSE2 - the total's). A head's TS partial rows (Sq rounded up to a
    power of two) are row block (b * Hkv + hk) * TG + g of TS. Every split is loaded at once (SP >=
    splits, a power of two; LSE2 pads with -inf, weight 0) so the loads are in flight
    together; each CTA takes TDC columns of the head dim. Grid (CTAs striding over the B*Hq
    heads, cdiv(TD, TDC)): one CTA per head spent longer starting than loading (16-23 us for
    1024 heads on an H100)."""
    c = ct.bid(1)
    hq = o.shape[1]
    for bh in range(ct.bid(0), o.shape[0] * hq, ct.num_blocks(0)):
        b, h = _unflatten(bh, hq)
        hk = h // GROUP
        g = h - hk * GROUP
        blk = (b * (hq // GROUP) + hk) * TG + g                    # in blocks of TS rows
        # Measured on an H100: from 8 rows a (SP, rows) tile load of LSE2 faulted (a misaligned
        # 8-byte read, though the tile lies inside the array), so those rows are gathered; at
        # 4 rows or fewer the load is clean and the gather cost up to 60 us at 32 splits.
        if TS <= 4:
            part_lse = ct.load(lse_part, (0, blk), (SP, TS),
                               padding_mode=ct.PaddingMode.NEG_INF)
        else:
            split = ct.arange(SP, dtype=ct.int32)[:, None]
            part_lse = ct.gather(lse_part,
                                 (split, blk * TS + ct.arange(TS, dtype=ct.int32)[None, :]),
                                 mask=split < lse_part.shape[0], padding_value=NEG_INF)
        part_lse = ct.reshape(part_lse, (SP, TS, 1))
        m = ct.max(part_lse, axis=0, keepdims=True)                    # [1, TS, 1]
        m_use = ct.where(m == NEG_INF, 0.0, m)
        w = ct.exp2(part_lse - m_use, flush_to_zero=True)              # [SP, TS, 1]
        total = ct.sum(w, axis=0)                                      # [TS, 1]
        part = ct.load(o_part, (0, blk, c), (SP, TS, TDC), padding_mode=ZERO)
        live = total > 0.0
        out = ct.sum(w * part, axis=0) * ct.where(live, 1.0 / total, 0.0)   # [TS, TDC]
        ct.store(o, (b, h, 0, c), ct.reshape(out.astype(o.dtype), (1, 1, TS, TDC)))
        if c == 0:
            lse2 = ct.where(live, ct.reshape(m_use, (TS, 1)) + ct.log2(total), POS_INF)
            ct.store(lse, (bh, 0), ct.reshape(lse2, (1, TS)))


# ---------------------------------------------------------------------------------------------
# Configs: (tm, tn) = (query tile, key tile) in every kernel (the dK/dV kernel owns a key tile
# and loops over query tiles), occupancy, num_worker_warps, num_ctas. Default first.
#
# sm_90 keeps every MMA accumulator in registers (forward: O tm x D and S tm x tn in float32;
# dQ: dQ, S and dP; dK/dV: dK and dV tn x D, S^T and dP^T). 4 worker warps get 255 registers a
# thread, 8 get 168; occupancy 2 halves that, or is ignored when the tile cannot fit (same cubin
# as occupancy 1: left out). Only spill-free entries are listed (STACK 0 in
# `cuobjdump -res-usage`), per kernel and head-dim tile (64 stands for every TD <= 64), but one:
# the D64 forward's 64x64 tile at occupancy 4 (64 registers, 16 bytes of stack at some
# signatures), whose four CTAs an SM hide the latency of the MMA -> softmax -> MMA chain that
# bounds two (1.04-1.14x the best other entry on an H100 where it wins). The D64 dK/dV space's
# 32x64 at occupancy 3 (80 registers) is there for short sequences (1.04x at 1024 tokens). Spills
# removed 128x128 with 4 warps (D128 forward) or any warps (D256 forward, dK/dV), 256-row tiles
# at D256 and 128x64 at occupancy 2 with 8 warps (D64 forward/dQ, causal). Measured and dropped:
# forward key tiles of 256 and 128x128 in a 2-CTA cluster; 256x128 in a cluster (128-row CTAs
# in pairs) stays, close to the winner at D128. Numbers: references/parameter-space-design.md
# (FMHA) and references/kernel-type-templates.md (Attention).

FIELDS = ("tm", "tn", "occupancy", "num_worker_warps", "num_ctas")
SM90_SPACES = {
    ("fwd", 128): [(128, 128, 1, 8), (128, 64, 1, 8), (128, 64, 1, 4), (256, 64, 1, 8),
                   (64, 128, 1, 8), (64, 128, 2, 8), (64, 128, 1, 4), (64, 128, 2, 4),
                   (64, 64, 1, 8), (64, 64, 2, 8), (64, 64, 2, 4), (128, 32, 1, 8),
                   (256, 128, 1, 8, 2)],
    ("fwd", 64): [(128, 128, 1, 8), (128, 128, 1, 4), (128, 64, 1, 8), (128, 64, 1, 4),
                  (128, 64, 2, 4), (256, 64, 1, 8), (256, 32, 1, 8), (64, 128, 1, 8),
                  (64, 128, 2, 8), (64, 128, 2, 4), (64, 64, 2, 8), (64, 64, 2, 4),
                  (256, 128, 1, 8, 2), (64, 64, 4, 4)],
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
                   (64, 64, 2, 4), (32, 64, 2, 8), (32, 64, 2, 4), (32, 64, 3, 4)],
    ("dkdv", 256): [(64, 64, 1, 8), (32, 64, 1, 8)],
}
# sm_100 (compile-checked only): accumulators live in tensor memory, not registers, so larger
# tiles and 2-CTA clusters are plausible; worker warps are left to the compiler (None).
SM100_SPACES = {
    "fwd": [(128, 128, 1), (256, 128, 1), (256, 128, 1, None, 2)],
    "dq": [(128, 64, 1), (128, 128, 1), (64, 64, 2)],
    "dkdv": [(64, 128, 1), (128, 128, 1), (64, 64, 2)],
}
# Anything else (pre-Hopper, sm_12x): a conservative pair, never measured here.
OTHER_SPACES = {"fwd": [(64, 64, 2, 4), (128, 64, 1, 4)],
                "dq": [(64, 64, 2, 4), (128, 64, 1, 4)],
                "dkdv": [(64, 64, 2, 4), (64, 128, 1, 4)]}
DEFAULT = SimpleNamespace(tm=64, tn=64, occupancy=2, num_worker_warps=4, num_ctas=1)


def head_tile(d):
    """The head-dim tile: next power of two, at least 16 (the MMA's K step)."""
    return 16 if d <= 16 else 1 << (d - 1).bit_length()


def _tile_caps(sq, sk):
    """The longest query and key tiles worth a config at these (bucketed) lengths: longer ones
    only compute padding."""
    return max(64, next_pow2(sq)), max(64, next_pow2(sk))


def _entries(kind, arch, td, sq, sk):
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
    cap_m, cap_n = _tile_caps(sq, sk)
    fits = [e for e in entries if e[0] <= cap_m and e[1] <= cap_n]
    if not fits:
        e = entries[0]
        fits = [(min(e[0], cap_m), min(e[1], cap_n), *e[2:4])]
    yield from table(FIELDS, fits, num_ctas=1)


# sm_90, dense batches: the pair kernel (two query tiles a CTA on one K/V stream), per head-dim
# tile. At occupancy 1 its sm_90 builds run two consumer warpgroups (384 threads, 168 registers,
# no spill) at every TD; with PACKED the two chains share one warpgroup and spill, so packed
# keys leave it out. The D128 entry at occupancy 2 (64-key tiles: 256 threads, both chains in one
# warpgroup, 128 registers, no spill) halves K/V's L2 traffic and still overlaps one CTA's
# prologue and epilogue with another's loop: it leads where each CTA's loop is short (1024
# tokens: 0.90-0.93x cuDNN against 0.80-0.81x for the best one-tile entry, H100).
PAIR_ENTRIES = {64: [(64, 128, 1, 4)], 128: [(64, 128, 1, 4), (64, 64, 2, 4)],
                256: [(64, 64, 1, 4)]}
# Causal keys at these head-dim tiles also get each pair entry in its two-loop form (`split`):
# its best entry ran 1.04-1.10x the one-loop form's best on one H100 and 0.99-1.03x on another,
# so the search chooses. (At D64 its build spills, at D256 it overflows shared memory; without
# a mask it is the one-loop build.)
SPLIT_TDS = (128,)


def fwd_configs(arch, td, sq=4096, sk=4096, causal=False, packed=False):
    cfgs = list(_entries("fwd", arch, td, sq, sk))
    if major(arch) == 9 and not packed:
        cap_m, cap_n = _tile_caps(sq, sk)
        splits = (False, True) if causal and td in SPLIT_TDS else (False,)
        cfgs += [SimpleNamespace(**vars(c), pair=True, split=split) for c in
                 table(FIELDS, PAIR_ENTRIES[64 if td <= 64 else td], num_ctas=1)
                 if 2 * c.tm <= cap_m and c.tn <= cap_n for split in splits]
    yield from cfgs


def dq_configs(arch, td, sq=4096, sk=4096, causal=False, packed=False):
    yield from _entries("dq", arch, td, sq, sk)


# sm_90, dense batches: the fused backward (dK/dV with dQ added in, `fused`) beside the split
# kernels, per head-dim tile; its search times the whole backward either way (`_dkdv_run`).
# 64x128 at 8 warps: 168 registers, no stack; 64x64 at occupancy 2 spills. Against the tuned
# split kernels at B4 H32 S4096 D128 it ran 1.03-1.06x on two H100s and 0.88-0.95x on two others.
FUSED_ENTRIES = {128: [(64, 128, 1, 8)]}


def dkdv_configs(arch, td, sq=4096, sk=4096, causal=False, packed=False, deterministic=False):
    """deterministic: the split kernels alone (the fused entry's reduce-add into dQ sums each
    element's shares in whatever order the CTAs reach it)."""
    cfgs = list(_entries("dkdv", arch, td, sq, sk))
    if major(arch) == 9 and not packed and not deterministic and td in FUSED_ENTRIES:
        cap_n = _tile_caps(sq, sk)[1]
        cfgs += [SimpleNamespace(**vars(c), fused=True)
                 for c in table(FIELDS, FUSED_ENTRIES[td], num_ctas=1) if c.tn <= cap_n]
    yield from cfgs



# Decode (Sq <= DECODE_MAX_SQ, group rows TG * TQ <= DECODE_MAX_ROWS, TD <= 128): key tile,
# occupancy and number of key-range splits, default first; where no cache lengths are given,
# the plain forward's first entry joins, so the search decides between them. Splits stop at one
# key tile each and at DECODE_MAX_CTAS CTAs in all (the partials are float32 rows of TD).
DECODE_MAX_SQ = 16
DECODE_MAX_ROWS = 128
DECODE_MAX_CTAS = 2048
DECODE_SPLITS = (1, 2, 4, 8, 16, 32, 64)
# (key tile, occupancy), default first: 64-key tiles won all but one bench row; a CTA holds little
# (TG*TQ x TD float32), so two or four per SM hide the loads' latency where the grid is small.
DECODE_TILES = ((64, 2), (64, 1), (64, 4), (128, 2))
# Where a group's rows leave the row-major products short of HGMMA's 64 (DECODE_HGMMA_ROWS),
# the transposed products (KEYS_M) take these tiles, the first the default, and of the
# row-major ones (64, 2) stays: at GQA 32/8 (H200, CUDA graphs,
# references/kernel-type-templates.md) they ran 0.6-3.3% ahead of the tuned row-major kernel at
# B1, B8 and B32, Sk 1024-32768, and every search of the shipped H200 decode keys chose them
# (most often 128-key tiles at occupancy 2). At Sq 5 and group 4 (32 rows) they build without
# spills, where every row-major 64-key tile spills 168-360 bytes on sm_90.
DECODE_KEYS_M_TILES = ((128, 2), (64, 4), (128, 4))
DECODE_HGMMA_ROWS = 64
DECODE_FIELDS = ("tn", "splits", "num_worker_warps", "occupancy", "keys_m")


# The combine's tile: every split's [TQ, TDC] piece at once, at most COMBINE_TILE elements. Its
# launch hints occupancy 4 (64 registers, no spill on sm_90): the compiler's default took all
# 255 and so one CTA per SM, a wave per 132 heads.
COMBINE_TILE = 4096
COMBINE_OCCUPANCY = 4
COMBINE = fmha_decode_combine_kernel.replace_hints(occupancy=COMBINE_OCCUPANCY)


@functools.lru_cache(maxsize=None)
def combine_tiles(splits, sq, td):
    """(TS, SP, TDC): the combine's rows per head (Sq rounded up to a power of two), splits
    padded to a power of two, and the head-dim columns per combine CTA."""
    ts, sp = next_pow2(sq), next_pow2(splits)
    return ts, sp, max(8, min(td, COMBINE_TILE // (sp * ts)))


@functools.lru_cache(maxsize=None)
def decode_rows(group, sq, keys_m=False):
    """(TG, TQ): the padded group and query rows a decode CTA packs, at least 16 rows in all
    (the row-major MMA's smallest M; 8, its N, for KEYS_M) and, row-major, two query rows
    (TQ 1 made the sm_90 compile of MQA's 32-head tile spill; the transposed builds do not)."""
    tg = next_pow2(group)
    if keys_m:
        return tg, max(next_pow2(sq), cdiv(8, tg))
    return tg, max(next_pow2(sq), cdiv(16, tg), 2)


def decodes(group, sq, td):
    """Whether the decode kernel takes this shape."""
    tg, tq = decode_rows(group, sq)
    return sq <= DECODE_MAX_SQ and tg * tq <= DECODE_MAX_ROWS and td <= 128


def decode_configs(arch, td, sq=1, sk=4096, kv_heads=32, causal=False, used=False, *, group):
    """kv_heads: B * Hkv (CTAs per split), group: Hq // Hkv (whose rows decide whether the
    transposed products are offered, and then are the default). The default takes the fewest
    splits that give two CTAs per SM of an H100 (264), at most one per key tile."""
    mj = major(arch)
    warps = 4 if mj == 9 else None
    tiles = [(tn, occupancy, False) for tn, occupancy in DECODE_TILES]
    if mj == 9 and math.prod(decode_rows(group, sq)) < DECODE_HGMMA_ROWS:
        tiles = [(tn, occupancy, True) for tn, occupancy in DECODE_KEYS_M_TILES] + tiles[:1]
    rows = []
    for tn, occupancy, keys_m in tiles:
        for splits in DECODE_SPLITS:
            if splits == 1 or (splits <= cdiv(sk, tn) and splits * kv_heads <= DECODE_MAX_CTAS):
                rows.append((tn, splits, warps, occupancy, keys_m))
    want = next((s for s in DECODE_SPLITS if s * kv_heads >= 264), DECODE_SPLITS[-1])
    tn, occupancy, keys_m = tiles[0]
    best = max((r for r in rows if (r[0], r[3], r[4]) == (tn, occupancy, keys_m)
                and r[1] <= want), key=lambda r: r[1])
    rows.remove(best)
    yield from table(DECODE_FIELDS, [best, *rows], kind="split")
    if not used:
        plain = next(c for c in _entries("fwd", arch, td, sq, sk) if c.num_ctas == 1)
        yield SimpleNamespace(**vars(plain), kind="plain")


# ---------------------------------------------------------------------------------------------
# Launches. A tuner's inputs are its kernel's arguments without the tile sizes, in the kernel's
# order (so offset, td and causal come last, then `packed`); its grid and arguments are
# declared once, the engine looks the config up (or tunes it) and launches. The forward and dQ
# kernels own a query tile of one q head, the dK/dV kernel a key tile of one kv head.

def visible_pairs(sq, sk, causal, offset):
    """Number of (query, key) pairs that are not masked (for FLOP counts)."""
    if not causal:
        return sq * sk
    # row i sees min(max(i + offset + 1, 0), sk) keys: a clamped arithmetic series
    lo = min(max(0, -offset), sq)                  # first row that sees a key
    full = min(max(sk - offset - 1, lo), sq)       # first row that sees all sk keys
    n = full - lo                                  # rows lo..full-1 see i + offset + 1 keys
    return n * (lo + offset + 1) + n * (n - 1) // 2 + (sq - full) * sk


# The last input, `packed`, is None for a dense batch and (B, max_seqlen_q, max_seqlen_k) for a
# packed one, whose arrays are the (1, H, T, D) views the kernels take with PACKED.

def _shape(q, k, *rest):
    """The config generators' arguments."""
    td, causal, packed = rest[-3:]
    sq, sk = packed[1:] if packed else (q.shape[2], k.shape[2])
    return dict(td=td, sq=bucket(sq), sk=bucket(sk), causal=causal, packed=packed is not None)


def _dkdv_shape(*inputs):
    """_shape, with deterministic=True while torch's deterministic algorithms are on
    (`torch.use_deterministic_algorithms`): such keys search the split kernels alone, which
    write every element from one CTA in a fixed order (`_dkdv_key` names them apart)."""
    shape = _shape(*inputs)
    if torch.are_deterministic_algorithms_enabled():
        shape["deterministic"] = True
    return shape


def _dkdv_key(key):
    """The dK/dV launch key: the dense key, marked before its device index while torch's
    deterministic algorithms are on (their winner is one of the split plans)."""
    if torch.are_deterministic_algorithms_enabled():
        return (*key[:-1], "deterministic", key[-1])
    return key


def _pair_work(flops):
    """Work of a launch that does `flops` x D FLOPs per visible (query, key) pair and q head
    (None for a packed batch: its lengths live on the device)."""
    def work(q, k, *rest):
        B, hq, sq, d = q.shape
        offset, causal, packed = rest[-4], rest[-2], rest[-1]
        if packed:
            return None
        return Work(flops=flops * B * hq * d * visible_pairs(sq, k.shape[2], causal, offset))
    return work


@functools.lru_cache(maxsize=None)
def _round_grid(tiles, heads, slots, causal):
    """The grid (heads a round, tiles, rounds) of a launch with `tiles` tiles per head: the GPU
    starts CTAs x first, so it runs tile 0 of a round's heads, then their tile 1, and so on.
    Under a causal mask each head's heaviest tile comes first; head after head (one a round)
    leaves the last heads' heavy tiles to the end of the grid, where they run on a few SMs
    while the others idle. A round of as many heads as `slots` (SMs x occupancy) hold tiles of
    at once starts every heavy tile before the light ones and keeps as many heads' K/V (or
    q/dO) in L2 as head after head does: at B2 H16/8 S4096 D128 (the training step's attention,
    H200) the forward ran 1.09x, dQ 1.11x and dK/dV 1.18x the head-after-head grid. The round
    is the divisor of `heads` nearest that count (every round alike); without a mask every tile
    costs the same and the grid stays head after head."""
    per_round = 1
    if causal:
        want = slots / tiles
        small = [n for n in range(1, math.isqrt(heads) + 1) if heads % n == 0]
        divisors = small + [heads // n for n in small]
        per_round = min(divisors, key=lambda n: (abs(math.log(n / want)), n))
    return per_round, tiles, heads // per_round


def _query_grid(c, dev, q, *rest):
    causal, packed = rest[-2:]
    if packed:
        tiles, heads = cdiv(packed[1], c.tm), packed[0] * q.shape[1]
    else:
        tiles = cdiv(q.shape[2], 2 * c.tm if getattr(c, "pair", False) else c.tm)
        heads = q.shape[0] * q.shape[1]
    return _round_grid(tiles, heads, sm_count(dev) * c.occupancy, causal)


def fwd_kernel_for(c):
    return fmha_fwd_pair_kernel if getattr(c, "pair", False) else fmha_fwd_kernel


def _key_grid(c, dev, q, k, *rest):
    causal, packed = rest[-2:]
    if packed:
        tiles, heads = cdiv(packed[2], c.tn), packed[0] * k.shape[1]
    else:
        tiles, heads = cdiv(k.shape[2], c.tn), k.shape[0] * k.shape[1]
    return _round_grid(tiles, heads, sm_count(dev) * c.occupancy, causal)


def pair_constants(c):
    """The two-tile forward's constants after those of the one-tile kernels (none for a one-tile
    config): the launch and the CI's compile signatures both append them."""
    return (c.split,) if getattr(c, "pair", False) else ()


def _fwd_args(c, q, k, v, o, lse, cu_q, cu_k, qk_scale, offset, td, causal, packed):
    return (q, k, v, o, lse, cu_q, cu_k, qk_scale, offset, c.tm, c.tn, td, causal,
            packed is not None, *pair_constants(c))


def _dq_args(c, q, k, v, o, do, lse, delta, dq, cu_q, cu_k, qk_scale, scale, offset, td, causal,
             packed):
    return (q, k, v, o, do, lse, delta, dq, cu_q, cu_k, qk_scale, scale, offset, c.tm, c.tn, td,
            causal, packed is not None, _sees_past_sk(causal, offset, q, k, packed))


def _sees_past_sk(causal, offset, q, k, packed):
    """Whether some query row's last visible key is at or past Sk (a dense causal batch whose
    diagonal ends past the keys: SDPA's top-left with Sq > Sk); packed batches are bottom-right."""
    return causal and packed is None and offset + q.shape[2] > k.shape[2]


# The dK/dV tuner's inputs: (q, k, v, o, do, lse, delta, dq, dk, dv, cu_q, cu_k, qk_scale,
# scale, offset, td, causal, packed), then its scratch: a fused config's float32 dQ (None for
# the split kernel, which reads the delta the dQ kernel wrote).

def _dkdv_args(c, q, k, v, o, do, lse, delta, dq, dk, dv, cu_q, cu_k, qk_scale, scale, offset,
               td, causal, packed, dq32):
    fused = dq32 is not None             # (the split kernel takes dq, unread, in its place)
    return (q, k, v, do, lse, delta, dk, dv, cu_q, cu_k, qk_scale, scale, offset,
            dq32 if fused else dq, c.tm, c.tn, td, causal, packed is not None, fused,
            fused and (not causal or _sees_past_sk(causal, offset, q, k, packed)))


def _dkdv_grid(c, dev, *inputs):
    return _key_grid(c, dev, *inputs[:-1])


def _dkdv_scratch(c, dev, q, *rest):
    return (tuple(q.shape), torch.float32) if getattr(c, "fused", False) else None


FUSED_PREP_TM = 64     # the prep and cast kernels' query tile (a row of 64 x TD per CTA)


def _dkdv_run(c, kernel, stream, dev, q, k, v, o, do, lse, delta, dq, dk, dv, cu_q, cu_k,
              qk_scale, scale, offset, td, causal, packed, dq32):
    """The whole backward, as the search times it and a key's first launch runs it: a split
    config's dQ launch (tuned on its miss) then its kernel; a fused config's prep, its kernel
    and the cast of dQ. Later launches of a split plan take its kernel alone (launch_bwd
    launches dQ before it)."""
    inputs = (q, k, v, o, do, lse, delta, dq, dk, dv, cu_q, cu_k, qk_scale, scale, offset, td,
              causal, packed, dq32)
    grid, args = _dkdv_grid(c, dev, *inputs), _dkdv_args(c, *inputs)
    if dq32 is None:
        _dq.launch(_key(q, k, causal, offset, dev, packed), dev, q, k, v, o, do, lse, delta, dq,
                   cu_q, cu_k, qk_scale, scale, offset, td, causal, packed)
        ct.launch(stream, grid, kernel, args)
        return
    rows = (cdiv(q.shape[2], FUSED_PREP_TM), q.shape[0] * q.shape[1])
    ct.launch(stream, rows, fmha_bwd_prep_kernel, (o, do, delta, dq32, FUSED_PREP_TM, td))
    ct.launch(stream, grid, kernel, args)
    ct.launch(stream, rows, fmha_bwd_cast_kernel, (dq32, dq, scale, FUSED_PREP_TM, td))


# Launch keys: (B * Hq, Sq, Sk, D, diagonal, group, dtype, device), for a packed batch with the
# maximum lengths as Sq and Sk and "packed" in the diagonal; tuning buckets the first three.
_BY_SIZES = bucketed(0, 1, 2)
_fwd = Autotuner("fmha_fwd", fwd_kernel_for, fwd_configs, default=DEFAULT, space=_shape,
                 grid=_query_grid, args=_fwd_args, work=_pair_work(4.0), tune_key=_BY_SIZES)
_dq = Autotuner("fmha_bwd_dq", fmha_bwd_dq_kernel, dq_configs, default=DEFAULT, space=_shape,
                grid=_query_grid, args=_dq_args, work=_pair_work(6.0), tune_key=_BY_SIZES)
_dkdv = Autotuner("fmha_bwd_dkdv", fmha_bwd_dkdv_kernel, dkdv_configs, default=DEFAULT,
                  space=_dkdv_shape, grid=_dkdv_grid, args=_dkdv_args, scratch=_dkdv_scratch,
                  run=_dkdv_run, timed_by_run=lambda c: True, work=_pair_work(10.0),
                  tune_key=_BY_SIZES)


def _diagonal(causal, offset, sq, sk):
    return None if not causal else ("bottom_right" if offset == sk - sq else
                                    "top_left" if offset == 0 else "offset")


# CUDA's cap on a grid's second and third axes: the kernels put a head's tiles on the second
# and B x H (in rounds, or one head a round) on the third.
MAX_GRID_Y = 65535
MIN_TILE = min(min(e[:2]) for entries in (*SM90_SPACES.values(), *SM100_SPACES.values(),
                                          *OTHER_SPACES.values()) for e in entries)
MAX_SEQ = MAX_GRID_Y * MIN_TILE


def _key(q, k, causal, offset, dev, packed):
    """The dense and packed kernels' launch key; batch x query heads past MAX_GRID_Y, or a
    sequence past MAX_SEQ tokens, raise."""
    B, hq, sq, d = q.shape
    if packed:
        B, sq, sk = packed
        diagonal = "packed bottom_right" if causal else "packed"
    else:
        sk = k.shape[2]
        diagonal = _diagonal(causal, offset, sq, sk)
    _check_grid(B, hq)
    if sq > MAX_SEQ or sk > MAX_SEQ:      # (on every call: comparisons, not a max() call)
        raise ValueError(f"fmha: a sequence of {max(sq, sk)} tokens is more than the kernels' "
                         f"grid takes ({MAX_SEQ} query or key tokens)")
    return (B * hq, sq, sk, d, diagonal, hq // k.shape[1], q.dtype, dev)


def _check_grid(B, hq):
    if B * hq > MAX_GRID_Y:
        _grid_error("fmha", "batch", B, hq)


def _grid_error(op, batch, B, hq):
    raise ValueError(f"{op}: {batch} x query heads = {B} x {hq} = {B * hq} is more than the "
                     f"kernels' grid takes ({MAX_GRID_Y}); split the batch into calls of fewer "
                     "sequences")


def _flat(t):
    """(B, H, S) float32 -> the (B*H, S) view the kernels index by flat head."""
    return t.view(t.shape[0] * t.shape[1], t.shape[2])


def _rows(*shape, like):
    """A float32 array of per-row statistics (LSE2, delta) whose last dim S is a view of rows
    padded to 16 bytes: the backward loads each (1, TM) slice with TMA. (Without the padding,
    at S % 4 != 0, the compiler stages the slices through shared memory from every warp that
    holds a copy, which racecheck reports as write/write hazards.)"""
    *lead, s = shape
    padded = f32_row(s)
    rows = like.new_empty(*lead, padded, dtype=torch.float32)
    # no slice where there is no padding (host time); a symbolic size (torch.compile's fake
    # shapes) is always sliced, so that no guard on its value is made
    return rows if padded.__class__ is int and padded == s else rows[..., :s]


# A forward that no backward reads hands the kernels a stand-in for its (B*Hq, Sq) LSE2 rows
# (the engine's StandIns: the same JIT signature), saving the rows' allocation and view (about
# 2.5 us of host time on a 2-core host).
_NO_LSE = StandIns(lambda like, bh, sq: _flat(_rows(bh, 1, sq, like=like)))


def _lse_rows(lse, q, dev, bh, sq):
    """lse's (B*Hq, Sq) view, or where lse is None the stand-in for rows of that shape (dense
    and decode launches: their stores are bounded by the array; the packed kernels slice it)."""
    return _flat(lse) if lse is not None else _NO_LSE.get(q, dev, bh, sq)


_UNREAD = {}


def _unread(q, dev):
    """An int32 array for kernel arguments a launch never reads (one per device, shared by
    every stream, thread and CUDA graph: no kernel touches it). One made under a fake-tensor
    mode (make_fx, a memory estimator) is not kept: every later launch would take it."""
    a = _UNREAD.get(dev)
    if a is None:
        a = torch.zeros(2, dtype=torch.int32, device=q.device)
        if type(a) is torch.Tensor:
            a = _UNREAD.setdefault(dev, a)
    return a


def launch_fwd(q, k, v, o, lse, causal, offset, scale, packed=None, cu_q=None, cu_k=None):
    """o (like q) and lse (B, Hq, Sq) float32 written in place (lse None: o alone, dense
    batches only). A packed batch: q/k/v/o are its (1, H, T, D) views, packed = (B,
    max_seqlen_q, max_seqlen_k), cu_q/cu_k its offsets."""
    dev = q.get_device()
    if packed is None:
        cu_q = cu_k = _unread(q, dev)
    elif lse is None:         # the packed kernels slice lse at the offsets: no stand-in there
        raise ValueError("fmha_varlen: a packed batch's forward needs its lse rows")
    B, hq, sq, d = q.shape
    _fwd.launch(_key(q, k, causal, offset, dev, packed), dev, q, k, v, o,
                _lse_rows(lse, q, dev, B * hq, sq), cu_q, cu_k, scale * LOG2E, offset,
                head_tile(d), causal, packed)


def launch_decode(q, k, v, used, o, lse, causal, offset, scale):
    """o and lse (B, Hq, Sq) written in place (lse None: o alone) by the decode family (the
    split-KV kernel and its combine, or the plain forward: the search decides). used: (B,)
    int32 cache lengths or
    None. Launch keys: (B * Hkv, Sq, Sk, D, diagonal, group, lengths given, dtype, device); tuning
    buckets B * Hkv and Sk."""
    dev = q.get_device()
    lengths = used is not None
    if not lengths:
        used = _unread(q, dev)
    B, hq, sq, d = q.shape
    _check_grid(B, hq)          # (the plain forward, one of the candidates, puts B x Hq there)
    hkv, sk = k.shape[1], k.shape[2]
    key = (B * hkv, sq, sk, d, _diagonal(causal, offset, sq, sk), hq // hkv, lengths, q.dtype,
           dev)
    _decode.launch(key, dev, q, k, v, used, o, _lse_rows(lse, q, dev, B * hq, sq), scale * LOG2E,
                   offset, head_tile(d), causal, lengths)


def launch_bwd(do, q, k, v, o, lse, dq, dk, dv, delta, causal, offset, scale, packed=None,
               cu_q=None, cu_k=None):
    """dq, dk, dv and delta (B*Hq, Sq) float32 written in place (a packed batch as in
    launch_fwd); dk and dv None: keys and values that need no gradient, no dK/dV launch. The
    dK/dV tuner decides the plan: split (the dQ kernel, which writes delta, then dK/dV) or fused
    (one launch writes all three). A key's first dK/dV launch goes through `_dkdv_run`, which
    launches (and on a miss tunes) the dQ kernel itself for a split config; after it, a split
    plan launches dQ here first. Under torch's deterministic algorithms the plan is split."""
    dev = q.get_device()
    if packed is None:
        cu_q = cu_k = _unread(q, dev)
    key = _key(q, k, causal, offset, dev, packed)
    lse2, qk_scale, td = _flat(lse), scale * LOG2E, head_tile(q.shape[3])
    dkdv_key = _dkdv_key(key)
    plan = None if dk is None else _dkdv.planned_config(dkdv_key)
    if dk is None or (plan is not None and not getattr(plan, "fused", False)):
        _dq.launch(key, dev, q, k, v, o, do, lse2, delta, dq, cu_q, cu_k, qk_scale, scale,
                   offset, td, causal, packed)
    if dk is not None:
        _dkdv.launch(dkdv_key, dev, q, k, v, o, do, lse2, delta, dq, dk, dv, cu_q, cu_k, qk_scale,
                     scale, offset, td, causal, packed)



# Decode: inputs (q, k, v, used, o, lse, qk_scale, offset, td, causal, lengths), then the
# scratch buffer: a split config's float32 partials (output rows, then their LSE2), None for
# the others. lengths: `used` holds the (B,) int32 cache lengths; otherwise it is any int32
# array, never read.

def _decode_shape(q, k, v, used, o, lse, qk_scale, offset, td, causal, lengths):
    return dict(td=td, sq=q.shape[2], sk=bucket(k.shape[2]),
                kv_heads=bucket(k.shape[0] * k.shape[1]), causal=causal, used=lengths,
                group=q.shape[1] // k.shape[1])


def _decode_split(cfg):
    """Whether the combine follows the decode kernel. The search times such configs whole
    (`timed_by_run`), not the kernel alone: that lower bound leaves out a combine whose cost
    grows with the split count, so it can rank a many-split entry ahead of a few-split one
    that is faster whole, and keep the latter out of the final round."""
    return cfg.kind == "split" and cfg.splits > 1


def decode_kernel_for(cfg):
    return fmha_decode_kernel if cfg.kind == "split" else fmha_fwd_kernel


def partial_rows(kv_heads, group, sq):
    """(rows of o_part, of lse_part): each of the B * Hkv kv heads' TG q heads x TS query rows,
    the second rounded up to 4 so that lse_part's rows stay 16-byte aligned (TG * TS may be 1)."""
    rows = kv_heads * next_pow2(group) * next_pow2(sq)
    return rows, cdiv(rows, 4) * 4


def _decode_scratch(cfg, dev, q, k, v, used, o, lse, qk_scale, offset, td, causal, lengths):
    if not _decode_split(cfg):
        return None
    rows, lse_rows = partial_rows(k.shape[0] * k.shape[1], q.shape[1] // k.shape[1], q.shape[2])
    return (cfg.splits * (rows * td + lse_rows),), torch.float32


def _decode_grid(cfg, dev, q, k, *rest):
    if cfg.kind == "plain":
        return _query_grid(cfg, dev, q, False, None)   # a tile or two a head: no rounds
    return (cfg.splits, k.shape[0] * k.shape[1])


def _decode_args(cfg, q, k, v, used, o, lse, qk_scale, offset, td, causal, lengths, buf):
    if cfg.kind == "plain":
        return _fwd_args(cfg, q, k, v, o, lse, used, used, qk_scale, offset, td, causal, None)
    group = q.shape[1] // k.shape[1]
    tg, tq = decode_rows(group, q.shape[2], cfg.keys_m)
    o_part, lse_part = k, k                   # stand-ins where the kernel writes o directly
    if buf is not None:
        rows, lse_rows = partial_rows(k.shape[0] * k.shape[1], group, q.shape[2])
        n = cfg.splits * rows * td
        o_part, lse_part = buf[:n].view(cfg.splits, rows, td), buf[n:].view(cfg.splits, lse_rows)
    return (q, k, v, used, o, lse, o_part, lse_part, qk_scale, offset, group, tg, tq,
            next_pow2(q.shape[2]), cfg.tn, td, causal, lengths, buf is not None, cfg.keys_m)


def _decode_run(cfg, kernel, stream, dev, q, k, v, used, o, lse, qk_scale, offset, td, causal,
                lengths, buf):
    """The decode kernel, then for splits > 1 the combine of its partials (its grid and
    arguments made before the first launch, so that the GPU need not wait for the host
    between the two kernels)."""
    args = _decode_args(cfg, q, k, v, used, o, lse, qk_scale, offset, td, causal, lengths, buf)
    grid = _decode_grid(cfg, dev, q, k)
    if buf is None:
        ct.launch(stream, grid, kernel, args)
        return
    tiles = combine_tiles(cfg.splits, q.shape[2], td)
    combine_grid = (persistent_ctas(q.shape[0] * q.shape[1], dev, COMBINE_OCCUPANCY),
                    cdiv(q.shape[3], tiles[2]))      # (no column tile wholly past D)
    combine_args = (args[6], args[7], o, lse, args[10], args[11], *tiles)
    ct.launch(stream, grid, kernel, args)
    ct.launch(stream, combine_grid, COMBINE, combine_args)


def _decode_work(q, k, v, used, o, lse, qk_scale, offset, td, causal, lengths):
    """K and V read once per kv head (the bound at decode sizes)."""
    return Work(bytes=2 * k.numel() * k.element_size() + 2 * q.numel() * q.element_size())


_decode = Autotuner("fmha_decode", decode_kernel_for, decode_configs,
                    default=SimpleNamespace(tn=128, splits=1, num_worker_warps=4, occupancy=1,
                                            keys_m=False, kind="split"),
                    space=_decode_shape, grid=_decode_grid, args=_decode_args,
                    scratch=_decode_scratch, run=_decode_run, timed_by_run=_decode_split,
                    work=_decode_work, tune_key=bucketed(0, 2))
TUNERS = (_fwd, _dq, _dkdv, _decode)

# ---------------------------------------------------------------------------------------------
# Host side: validation, outputs, empty inputs.

_F32_TINY, _F32_MAX = torch.finfo(torch.float32).tiny, torch.finfo(torch.float32).max


def _check(op, q, k, v, scale, names=("q", "k", "v")):
    """names: what the caller calls q, k and v (SDPA: query, key, value). (Every call runs
    this: each attribute is read once, the messages built on a miss only.)"""
    dts = (torch.bfloat16, torch.float16)
    nq, nk, nv = names
    validate.tensor(op, nq, q, dtypes=dts)
    validate.tensor(op, nk, k, like=q, dtypes=dts)
    validate.tensor(op, nv, v, like=q, dtypes=dts)
    dtype = q.dtype
    if k.dtype != dtype or v.dtype != dtype:
        validate.same_dtype(op, nq, q, {nk: k, nv: v})
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        for name, t in zip(names, (q, k, v)):
            validate.dims(op, name, t, 4, "(B, H, S, D)")
    kshape = k.shape
    if v.shape != kshape:
        raise ValueError(f"{op}: {nv} shape {tuple(v.shape)} must equal {nk} shape "
                         f"{tuple(kshape)}")
    B, hq, _, d = q.shape
    kb, hkv, _, kd = kshape
    if kb != B:
        raise ValueError(f"{op}: {nk} batch {kb} differs from {nq} batch {B}")
    if kd != d:
        raise ValueError(f"{op}: {nk} head_dim {kd} differs from {nq} head_dim {d}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{op}: {nq} heads ({hq}) must be a multiple of {nk}/{nv} heads "
                         f"({hkv})")
    if not 1 <= d <= MAX_HEAD_DIM:
        raise ValueError(f"{op}: head_dim {d} is not supported (1 to {MAX_HEAD_DIM})")
    if B * hq > MAX_GRID_Y:
        _grid_error(op, "batch", B, hq)
    if scale is None:
        return 1.0 / math.sqrt(d)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        raise TypeError(f"{op}: scale must be a float, got {type(scale).__name__}")
    try:
        scaled = scale * LOG2E
    except OverflowError:            # an int past float's range
        scaled = math.inf
    if not _F32_TINY < scaled < _F32_MAX:    # the kernels take it in float32
        raise ValueError(f"{op}: scale must be a finite number > 0 (in float32's normal range), "
                         f"got {scale}")
    return float(scale)


def _check_seq(op, q, k, names=("q", "k")):
    """A dense call's sequences within the kernels' grid (MAX_SEQ), refused by the caller's name
    before any launch (the forward's decode kernels would take a longer cache; its backward
    could not)."""
    sq, sk = q.shape[2], k.shape[2]
    if sq > MAX_SEQ or sk > MAX_SEQ:
        name, n = (names[0], sq) if sq > MAX_SEQ else (names[1], sk)
        raise ValueError(f"{op}: {name} has {n} tokens, more than the kernels' grid takes "
                         f"({MAX_SEQ})")


def _check_dense(op, q, k, v, scale, names=("q", "k", "v")):
    """`_check` and `_check_seq` of a dense (B, H, S, D) call; the scale. A nested (jagged)
    tensor, whose ragged size fails their arithmetic with an error that names neither the op
    nor the argument (torch's SDPA takes them), is a TypeError naming both: looked for only
    where a check failed, so a valid call pays no host time for it."""
    try:
        scale = _check(op, q, k, v, scale, names)
        _check_seq(op, q, k, names[:2])
    except Exception:
        validate.not_nested(op, dict(zip(names, (q, k, v))),
                            "dense (B, H, S, D) tensors, or the packed sequences to fmha_varlen")
        raise
    return scale


def check_causal_bias(op, attn_mask, sq, sk):
    """A CausalBias describes a (seq_len_q, seq_len_kv) mask: it must be q's Sq by k's Sk. The
    kernel masks by position alone, so a bias made for other sizes would silently apply another
    mask than the one it describes. ValueError naming `op` and attn_mask."""
    if attn_mask.seq_len_q != sq or attn_mask.seq_len_kv != sk:
        raise ValueError(f"{op}: attn_mask is a CausalBias for seq_len_q={attn_mask.seq_len_q}, "
                         f"seq_len_kv={attn_mask.seq_len_kv}, but query has Sq={sq} and key "
                         f"Sk={sk}")


def _forward(q, k, v, causal, offset, scale, used=None, keep_lse=True):
    """(o laid out like q, lse (B, Hq, Sq) float32 in base 2; None unless keep_lse). used: (B,)
    int32 cache lengths (decode shapes only) or None."""
    B, hq, sq, d = q.shape
    o = torch.empty_like(q)
    lse = _rows(B, hq, sq, like=q) if keep_lse else None
    if o.numel() == 0:
        return o, lse
    if k.shape[2] == 0:                  # no keys at all: every row is fully masked
        o.zero_()
        if keep_lse:
            lse.fill_(POS_INF)
        return o, lse
    if used is not None or decodes(hq // k.shape[1], sq, head_tile(d)):
        launch_decode(q, k, v, used, o, lse, causal, offset, scale)
    else:
        launch_fwd(q, k, v, o, lse, causal, offset, scale)
    return o, lse


def _kv_grads(k, v, needs):
    """dk and dv, or None for both where neither needs a gradient (frozen keys and values:
    the dK/dV kernel, most of the backward's work, is not launched)."""
    if needs[1] or needs[2]:
        return torch.empty_like(k), torch.empty_like(v)
    return None, None


def _zeros(*grads):
    return tuple(g if g is None else g.zero_() for g in grads)


def _backward(do, q, k, v, o, lse, causal, offset, scale, needs=(True, True, True)):
    dq = torch.empty_like(q)
    dk, dv = _kv_grads(k, v, needs)
    if 0 in do.stride() and do.numel():  # expanded gradients (e.g. of .sum()): one real copy
        do = do.contiguous()
    if q.numel() == 0 or k.numel() == 0:
        return _zeros(dq, dk, dv)
    B, hq, sq, _ = q.shape
    delta = _rows(B * hq, sq, like=q)
    launch_bwd(do, q, k, v, o, lse, dq, dk, dv, delta, causal, offset, scale)
    return dq, dk, dv


def _packed(t):
    """A packed batch's (T, H, D) tensor as the (1, H, T, D) view the kernels take."""
    return t.permute(1, 0, 2).unsqueeze(0)


def _varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    """(o (Tq, Hq, D) laid out like q, lse (1, Hq, Tq) float32 in base 2)."""
    o = torch.empty_like(q)
    lse = _rows(1, q.shape[1], q.shape[0], like=q)
    batch = cu_q.shape[0] - 1
    if o.numel() == 0:
        return o, lse
    if k.shape[0] == 0 or batch == 0 or max_q == 0 or max_k == 0:
        o.zero_()                  # no keys anywhere (or no sequence): every row fully masked
        lse.fill_(POS_INF)
        return o, lse
    launch_fwd(_packed(q), _packed(k), _packed(v), _packed(o), lse, causal, 0, scale,
               (batch, max_q, max_k), cu_q, cu_k)
    return o, lse


def _varlen_backward(do, q, k, v, cu_q, cu_k, o, lse, max_q, max_k, causal, scale,
                     needs=(True, True, True)):
    dq = torch.empty_like(q)
    dk, dv = _kv_grads(k, v, needs)
    if 0 in do.stride() and do.numel():
        do = do.contiguous()
    batch = cu_q.shape[0] - 1
    if q.numel() == 0 or k.numel() == 0 or batch == 0 or max_q == 0 or max_k == 0:
        return _zeros(dq, dk, dv)
    delta = _rows(q.shape[1], q.shape[0], like=q)
    launch_bwd(_packed(do), _packed(q), _packed(k), _packed(v), _packed(o), lse, _packed(dq),
               None if dk is None else _packed(dk), None if dv is None else _packed(dv), delta,
               causal, 0, scale, (batch, max_q, max_k), cu_q, cu_k)
    return dq, dk, dv


# ---------------------------------------------------------------------------------------------
# Autograd, custom op and the public functions. lse is only for the backward (not
# differentiable).

_fmha = TrainableOp(
    "tiletune::fmha", forward=_forward,
    forward_schema="(Tensor q, Tensor k, Tensor v, bool causal, SymInt offset, float scale, "
                   "Tensor? used=None) -> (Tensor, Tensor)",
    forward_fake=lambda q, k, v, causal, offset, scale, used=None: (
        torch.empty_like(q), _rows(*q.shape[:3], like=q)),
    save=lambda args, results: ((*args[:3], *results), args[3:6]),
    backward=lambda needs, do, q, k, v, o, lse, causal, offset, scale: _backward(
        do, q, k, v, o, lse, causal, offset, scale, needs),
    backward_schema="(bool[] needs, Tensor grad, Tensor q, Tensor k, Tensor v, Tensor o, "
                    "Tensor lse, bool causal, SymInt offset, float scale) "
                    "-> (Tensor, Tensor?, Tensor?)",
    backward_fake=lambda needs, do, q, k, v, o, lse, causal, offset, scale: (
        torch.empty_like(q), *_kv_grads(k, v, needs)),
    inference=lambda q, k, v, causal, offset, scale, used=None: _forward(
        q, k, v, causal, offset, scale, used, keep_lse=False)[0])


def _check_lengths(op, seqused_k, q, k, v):
    """seqused_k: an int32 (B,) tensor on q's device, for inference at decode sizes."""
    validate.tensor(op, "seqused_k", seqused_k, like=q, dtypes=(torch.int32,))
    if seqused_k.shape != (q.shape[0],):
        raise ValueError(f"{op}: seqused_k must have shape (B,) = ({q.shape[0]},), got "
                         f"{tuple(seqused_k.shape)}")
    if records_graph() and any(t.requires_grad for t in (q, k, v)):
        raise ValueError(f"{op}: seqused_k is for inference (no backward); call it under "
                         "torch.no_grad() or torch.inference_mode(), or with inputs that do "
                         "not require grad")
    group = q.shape[1] // k.shape[1]
    if not decodes(group, q.shape[2], head_tile(q.shape[3])):
        tg, tq = decode_rows(group, q.shape[2])
        raise ValueError(
            f"{op}: seqused_k takes decode shapes: Sq <= {DECODE_MAX_SQ}, head_dim <= 128 and "
            f"at most {DECODE_MAX_ROWS} query rows per kv head (q heads per kv head x Sq, each "
            f"rounded up to a power of two, Sq to at least 2); got Sq={q.shape[2]}, "
            f"head_dim={q.shape[3]}, {group} q heads per kv head: {tg} x {tq} = {tg * tq} rows")


_fmha_varlen = TrainableOp(
    "tiletune::fmha_varlen", forward=_varlen_forward,
    forward_schema="(Tensor q, Tensor k, Tensor v, Tensor cu_q, Tensor cu_k, SymInt max_q, "
                   "SymInt max_k, bool causal, float scale) -> (Tensor, Tensor)",
    forward_fake=lambda q, k, v, cu_q, cu_k, max_q, max_k, causal, scale: (
        torch.empty_like(q), _rows(1, q.shape[1], q.shape[0], like=q)),
    save=lambda args, results: ((*args[:5], *results), args[5:]),
    backward=lambda needs, do, *saved: _varlen_backward(do, *saved, needs),
    backward_schema="(bool[] needs, Tensor grad, Tensor q, Tensor k, Tensor v, Tensor cu_q, "
                    "Tensor cu_k, Tensor o, Tensor lse, SymInt max_q, SymInt max_k, "
                    "bool causal, float scale) -> (Tensor, Tensor?, Tensor?)",
    backward_fake=lambda needs, do, q, k, v, *rest: (
        torch.empty_like(q), *_kv_grads(k, v, needs)))


def fmha(q, k, v, *, causal=False, scale=None, seqused_k=None):
    """Fused multi-head attention, softmax(scale * q k^T) v, FlashAttention-2 style.

    q: (B, Hq, Sq, D); k, v: (B, Hkv, Sk, D) with Hq a multiple of Hkv (GQA; Hkv = 1 is MQA).
    bf16 or fp16 (all three alike), on one CUDA device, any strides (e.g. the
    (B, S, H, D).transpose(1, 2) views HF produces; a unit-stride last dim is fastest).
    D: any head_dim from 1 to 256; D that is not a power of two (>= 16) is zero-padded to one
    inside the kernel (D 80 computes as 128); D > 256 raises ValueError. Sq and Sk are arbitrary
    up to 2,097,120 tokens (MAX_SEQ; Sq != Sk allowed); B x Hq at most 65535 (ValueError:
    split the batch). causal=True masks key j for query i
    unless j <= i + Sk - Sq (diagonal aligned bottom-right, as FlashAttention 2); rows that see
    no key (Sq > Sk) return 0, and Sk = 0 returns zeros. scale defaults to 1/sqrt(D) and must
    be > 0. Softmax statistics are float32 (exp2); the output has q's dtype and, where q is
    dense, q's layout. NaN and inf in the inputs propagate as in torch's math backend, except
    that a row whose every visible score is -inf (an inf in q or k) counts as fully masked and
    returns 0, as FlashAttention does.
    Differentiable in q, k and v (backward: dQ and dK/dV kernels, each tuned, or, where the
    dK/dV search picks it for a dense D128 key on sm_90, one kernel that also adds dQ in with a
    reduce-add, whose dQ can differ in its last bits between calls; README, Determinism).
    For torch SDPA semantics (top-left causal) use `scaled_dot_product_attention`.

    Decode (Sq <= 16): the key range may be split across CTAs and the partial softmaxes merged;
    the search decides between that and the plain forward. seqused_k: an int32 (B,) tensor of
    cache lengths on q's device: batch b attends to keys [0, seqused_k[b]) of its k/v (values
    are clamped to [0, Sk]; what the cache holds past them is never read), causal aligned
    bottom-right on that length. Inference only (ValueError when q, k or v requires grad where
    autograd records a graph: grad mode on, outside torch.inference_mode()), at decode sizes
    (ValueError otherwise).
    """
    scale = _check_dense("fmha", q, k, v, scale)
    causal = bool(causal)
    offset = k.shape[2] - q.shape[2] if causal else 0
    if seqused_k is not None:
        _check_lengths("fmha", seqused_k, q, k, v)
    return _fmha(q, k, v, causal, offset, scale, seqused_k)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0,
                                 is_causal=False, scale=None, enable_gqa=False):
    """Drop-in for torch.nn.functional.scaled_dot_product_attention on 4-D bf16/fp16 inputs.

    Same semantics as torch: `is_causal` aligns the causal diagonal top-left (query i sees keys
    j <= i) when Sq != Sk; `attn_mask` may be None or a torch.nn.attention.bias.CausalBias
    (`causal_upper_left` / `causal_lower_right`) made for q's Sq and k's Sk; other masks, a
    CausalBias of other sizes and dropout_p > 0 raise ValueError, nested (jagged) tensors
    TypeError. Key/value heads may differ from query heads only with enable_gqa=True. `scale`
    must be a finite number > 0 (torch also takes 0 and negative values; ValueError here).
    q, k and v are taken in their own dtype, also under torch.autocast (where torch's SDPA
    casts them to the autocast dtype): float32 or mixed dtypes raise TypeError, so cast them
    first. Limits as `fmha` (B x Hq at most 65535). Where torch is wider: value's head dim
    must equal key's, and query, key and value one batch size (no broadcasting); ValueError.
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
    scale = _check_dense(op, query, key, value, scale, ("query", "key", "value"))
    if attn_mask is not None:
        check_causal_bias(op, attn_mask, query.shape[2], key.shape[2])
    if not enable_gqa and key.shape[1] != query.shape[1]:
        raise ValueError(f"{op}: key heads ({key.shape[1]}) differ from query heads "
                         f"({query.shape[1]}); pass enable_gqa=True for GQA/MQA")
    offset = key.shape[2] - query.shape[2] if (causal and lower_right) else 0
    return _fmha(query, key, value, causal, offset, scale)


def _check_offsets(op, name, cu, like, batch=None):
    validate.tensor(op, name, cu, like=like, dtypes=(torch.int32,))
    if cu.dim() != 1 or cu.shape[0] < 1:
        raise ValueError(f"{op}: {name} must be 1-D (batch + 1,), got shape {tuple(cu.shape)}")
    if batch is not None and cu.shape[0] != batch + 1:
        raise ValueError(f"{op}: {name} has {cu.shape[0]} entries, cu_seqlens_q {batch + 1}")


def _check_max(op, name, n):
    """n as an int (any integer type: Python's, numpy's, a SymInt). A tensor is refused: reading
    it would sync the host, which a captured CUDA graph cannot do."""
    if isinstance(n, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a Python int, got a tensor (pass int(t), read "
                        "once where the lengths are made)")
    n = validate.integer(op, name, n)
    if not 0 <= n <= MAX_SEQ:
        raise ValueError(f"{op}: {name} must be in [0, {MAX_SEQ}] (the kernels' grid), got {n}")
    return n


def fmha_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                causal=False, scale=None):
    """Attention over a packed batch of variable-length sequences (FlashAttention-2's varlen
    layout, what padding-free training calls).

    q: (Tq, Hq, D), k and v: (Tk, Hkv, D): the tokens of every sequence, one after another (Hq a
    multiple of Hkv: GQA/MQA). cu_seqlens_q / cu_seqlens_k: int32 (B + 1,) on q's device,
    non-decreasing from 0 to Tq (Tk), sequence b owning rows [cu[b], cu[b+1]) (empty sequences
    allowed). max_seqlen_q / max_seqlen_k: Python ints at least every sequence's length (at most
    MAX_SEQ, 2,097,120); B x Hq at most 65535 (ValueError: split the batch). The offsets are
    read on the device only (a call is CUDA-graph capturable), so, as in FlashAttention-2, they
    are not checked against the data: a max_seqlen below one sequence's length leaves that
    sequence's output and gradients (every key's included) unspecified; offsets below 0 or past
    Tq (Tk) are clamped to [0, Tq] ([0, Tk]) in the kernels, so nothing outside o, dq, dk and dv
    is written and the rows of the sequences they bound are unspecified. Buffers longer than
    their sequences (a preallocated cache, a padded batch of static shape) are taken as in
    FlashAttention-2: key rows outside every sequence are never read, and query rows outside
    every sequence get unspecified rows of o and dq (and such key rows of dk and dv), which a
    weight's gradient would sum in: give padding that reaches a backward a sequence of its own.
    Each sequence attends only to its own keys; causal=True aligns the diagonal bottom-right per
    sequence (query i sees key j iff j <= i + Lk - Lq); rows that see no key return 0. dtypes,
    D, scale and numerics as `fmha`. Returns o (Tq, Hq, D) laid out like q; differentiable in q,
    k, v. Tuned per (B x heads, max lengths bucketed to powers of two, D, causal, dtype).
    """
    op = "fmha_varlen"
    for name, t in (("q", q), ("k", k), ("v", v)):
        if isinstance(t, torch.Tensor) and t.dim() != 3:
            raise ValueError(f"{op}: {name} must be 3-D (total_tokens, H, D), got shape "
                             f"{tuple(t.shape)}")
    if isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.shape != v.shape:
        raise ValueError(f"{op}: v shape {tuple(v.shape)} must equal k shape {tuple(k.shape)}")
    scale = _check(op, *(_packed(t) if isinstance(t, torch.Tensor) else t for t in (q, k, v)),
                   scale)
    _check_offsets(op, "cu_seqlens_q", cu_seqlens_q, q)
    _check_offsets(op, "cu_seqlens_k", cu_seqlens_k, q, cu_seqlens_q.shape[0] - 1)
    max_seqlen_q = _check_max(op, "max_seqlen_q", max_seqlen_q)
    max_seqlen_k = _check_max(op, "max_seqlen_k", max_seqlen_k)
    batch = cu_seqlens_q.shape[0] - 1
    if batch * q.shape[1] > MAX_GRID_Y:
        _grid_error(op, "sequences", batch, q.shape[1])
    return _fmha_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                        bool(causal), scale)
