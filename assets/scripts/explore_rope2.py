"""RoPE exploration, round 2 (headline shape B4 Hq32 Hkv8 S4096 D128 bf16, HF layout, H200 winner
so far: persistent, occupancy 4, latency 1, 104.9 us = 0.83x copy). Not yet run.

Variants timed against the production winner and a contiguous copy of the same bytes:
  - worker warps 8 (same tiles, half the registers per thread) at occupancy 2 and 4;
  - head-split tiles (16 q heads per tile, two passes per position) at occupancy 4 and 8, which
    fits occupancy 8 without the 56 B spill of 32-head tiles;
  - software prefetch: the next position's q/k loaded before this position's stores;
  - the production in-place kernel (Liger and TileGym rotate in place).
Registers / spill (sm_90 `cuobjdump -res-usage`, this shape, latency 1): production kernel at
occupancy 4: 128 regs, no spill (the whole register file); 8 warps at occupancy 2: 90, none;
8 warps at occupancy 4: 64 + 40 B spill; occupancy 8: 64 + 144 B. Head-split 16 at occupancy 4:
106, none; at 8: 64 + 104 B; head-split 8 at occupancy 8: 64, none. Prefetch at occupancy 2: 160,
none; at 4: 128 + 128 B. The spilling ones stay in as controls.
Usage: python assets/scripts/explore_rope2.py
"""
import cuda.tile as ct

from explore_rope import B as BATCH, D as HEAD_DIM, HQ, HK, S as SEQ, headline_setup  # same folder
from tiletune.device import sm_count
from tiletune.ops import rope as R

ZERO = ct.PaddingMode.ZERO
F32 = ct.float32


def _halves(x, b, s, h, half, TH, TR, LAT):
    shape = (1, TH, 1, TR)
    x1 = ct.load(x.slice(3, 0, half), (b, h, s, 0), shape, padding_mode=ZERO, latency=LAT)
    x2 = ct.load(x.slice(3, half, 2 * half), (b, h, s, 0), shape, padding_mode=ZERO, latency=LAT)
    return x1.astype(F32), x2.astype(F32)


def _put(out, b, s, h, half, x1, x2, c1, c2, s1, s2):
    ct.store(out.slice(3, 0, half), (b, h, s, 0), (x1 * c1 - x2 * s1).astype(out.dtype))
    ct.store(out.slice(3, half, 2 * half), (b, h, s, 0), (x2 * c2 + x1 * s2).astype(out.dtype))


@ct.kernel
def rope_head_split(q, k, cos, sin, q_out, k_out, half: ct.Constant[int], TH: ct.Constant[int],
                    TK: ct.Constant[int], TR: ct.Constant[int], LAT: ct.Constant[int]):
    """TH q heads per tile (TH < Hq): ct.cdiv(Hq, TH) passes per position."""
    S = q.shape[2]
    for bs in range(ct.bid(0), q.shape[0] * S, ct.num_blocks(0)):
        b = bs // S
        s = bs - b * S
        c1, c2, s1, s2 = R._cos_sin_rows(cos, sin, b, s, half, 1, TR, False)
        for h in range(ct.cdiv(q.shape[1], TH)):
            x1, x2 = _halves(q, b, s, h, half, TH, TR, LAT)
            _put(q_out, b, s, h, half, x1, x2, c1, c2, s1, s2)
        y1, y2 = _halves(k, b, s, 0, half, TK, TR, LAT)
        _put(k_out, b, s, 0, half, y1, y2, c1, c2, s1, s2)


@ct.kernel
def rope_prefetch(q, k, cos, sin, q_out, k_out, half: ct.Constant[int], TH: ct.Constant[int],
                  TK: ct.Constant[int], TR: ct.Constant[int], LAT: ct.Constant[int]):
    """Persistent loop with the next position's q/k loads issued before this one's stores (the
    last prefetch wraps to position 0 and is discarded)."""
    S = q.shape[2]
    total = q.shape[0] * S
    bs = ct.bid(0)
    b = bs // S
    s = bs - b * S
    q1, q2 = _halves(q, b, s, 0, half, TH, TR, LAT)
    k1, k2 = _halves(k, b, s, 0, half, TK, TR, LAT)
    for it in range(ct.bid(0), total, ct.num_blocks(0)):
        b = it // S
        s = it - b * S
        nxt = (it + ct.num_blocks(0)) % total
        nb = nxt // S
        ns = nxt - nb * S
        nq1, nq2 = _halves(q, nb, ns, 0, half, TH, TR, LAT)
        nk1, nk2 = _halves(k, nb, ns, 0, half, TK, TR, LAT)
        c1, c2, s1, s2 = R._cos_sin_rows(cos, sin, b, s, half, 1, TR, False)
        _put(q_out, b, s, 0, half, q1, q2, c1, c2, s1, s2)
        _put(k_out, b, s, 0, half, k1, k2, c1, c2, s1, s2)
        q1, q2, k1, k2 = nq1, nq2, nk1, nk2


def main():
    q, k, cos, sin, qo, ko, run, results = headline_setup()
    B, Hq, Hk, S, D = BATCH, HQ, HK, SEQ, HEAD_DIM
    q2, k2 = q.clone(), k.clone()                              # in-place target (HF strides kept)
    sms = sm_count(0)

    def prod_args(lat, out=True):
        if out:
            return (q, k, cos, sin, cos, qo, ko, D // 2, Hq, Hk, 1, D // 2, 1, False, False, False, lat)
        return (q2, k2, cos, sin, cos, D // 2, Hq, Hk, 1, D // 2, False, False, lat)

    for occ, warps, lat in ((4, None, 1), (2, 8, 1), (2, 8, 5), (4, 8, 1)):
        hints = dict(occupancy=occ) | ({} if warps is None else dict(num_worker_warps=warps))
        run(f"prod occ{occ} warps{warps} lat{lat}", R.rope_kernel, prod_args(lat),
            min(B * S, sms * occ), **hints)
    for th, occ, lat in ((16, 4, 1), (8, 8, 1), (8, 8, 5), (16, 8, 1)):
        run(f"head-split {th} occ{occ} lat{lat}", rope_head_split,
            (q, k, cos, sin, qo, ko, D // 2, th, Hk, D // 2, lat), min(B * S, sms * occ), occupancy=occ)
    for occ, lat in ((2, 1), (2, 5), (4, 1)):
        run(f"prefetch occ{occ} lat{lat}", rope_prefetch,
            (q, k, cos, sin, qo, ko, D // 2, Hq, Hk, D // 2, lat), min(B * S, sms * occ), occupancy=occ)
    run("prod in-place occ4 lat1", R.rope_inplace_kernel, prod_args(1, out=False), min(B * S, sms * 4),
        check=False, occupancy=4)
    results.sort()
    print("best:", *[f"{us:.1f} {label}" for us, label in results[:6]], sep="\n  ")


if __name__ == "__main__":
    main()
