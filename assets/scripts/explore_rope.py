"""RoPE kernel exploration on the GPU (headline shape B4 Hq32 Hkv8 S4096 D128 bf16, HF layout).

Times the production kernel and a loads-first variant (all of q and k loaded before any store,
optionally with ct.load latency / allow_tma hints) over grid shapes, against the copy ceiling.
Usage: python assets/scripts/explore_rope.py  (prints one line per variant, best last).
"""
import itertools
import sys

import cuda.tile as ct
import torch

from tiletune.bench import time_us
from tiletune.device import sm_count
from tiletune.ops import rope as R

ZERO = ct.PaddingMode.ZERO
F32 = ct.float32


def _halves(x, b, st, half, TH, TS, TR):
    shape = (1, TH, TS, TR)
    x1 = ct.load(x.slice(3, 0, half), (b, 0, st, 0), shape, padding_mode=ZERO).astype(F32)
    x2 = ct.load(x.slice(3, half, 2 * half), (b, 0, st, 0), shape, padding_mode=ZERO).astype(F32)
    return x1, x2


def _halves_hint(x, b, st, half, TH, TS, TR, LAT, TMA):
    shape = (1, TH, TS, TR)
    x1 = ct.load(x.slice(3, 0, half), (b, 0, st, 0), shape, padding_mode=ZERO, latency=LAT,
                 allow_tma=TMA).astype(F32)
    x2 = ct.load(x.slice(3, half, 2 * half), (b, 0, st, 0), shape, padding_mode=ZERO, latency=LAT,
                 allow_tma=TMA).astype(F32)
    return x1, x2


def _put(out, b, st, half, x1, x2, c1, c2, s1, s2):
    ct.store(out.slice(3, 0, half), (b, 0, st, 0), (x1 * c1 - x2 * s1).astype(out.dtype))
    ct.store(out.slice(3, half, 2 * half), (b, 0, st, 0), (x2 * c2 + x1 * s2).astype(out.dtype))


@ct.kernel
def rope_lf(q, k, cos, sin, q_out, k_out, half: ct.Constant[int], TH: ct.Constant[int],
            TK: ct.Constant[int], TS: ct.Constant[int], TR: ct.Constant[int]):
    S = q.shape[2]
    tiles = ct.cdiv(S, TS)
    for t in range(ct.bid(0), q.shape[0] * tiles, ct.num_blocks(0)):
        b = t // tiles
        st = t - b * tiles
        q1, q2 = _halves(q, b, st, half, TH, TS, TR)
        k1, k2 = _halves(k, b, st, half, TK, TS, TR)
        c1, c2, s1, s2 = R._cos_sin_rows(cos, sin, b, st, half, TS, TR, False)
        _put(q_out, b, st, half, q1, q2, c1, c2, s1, s2)
        _put(k_out, b, st, half, k1, k2, c1, c2, s1, s2)


@ct.kernel
def rope_lf_hint(q, k, cos, sin, q_out, k_out, half: ct.Constant[int], TH: ct.Constant[int],
                 TK: ct.Constant[int], TS: ct.Constant[int], TR: ct.Constant[int],
                 LAT: ct.Constant[int], TMA: ct.Constant[bool]):
    S = q.shape[2]
    tiles = ct.cdiv(S, TS)
    for t in range(ct.bid(0), q.shape[0] * tiles, ct.num_blocks(0)):
        b = t // tiles
        st = t - b * tiles
        q1, q2 = _halves_hint(q, b, st, half, TH, TS, TR, LAT, TMA)
        k1, k2 = _halves_hint(k, b, st, half, TK, TS, TR, LAT, TMA)
        c1, c2, s1, s2 = R._cos_sin_rows(cos, sin, b, st, half, TS, TR, False)
        _put(q_out, b, st, half, q1, q2, c1, c2, s1, s2)
        _put(k_out, b, st, half, k1, k2, c1, c2, s1, s2)


def main():
    B, Hq, Hk, S, D = 4, 32, 8, 4096, 128
    dt = torch.bfloat16
    q = torch.randn(B, S, Hq, D, device="cuda", dtype=dt).transpose(1, 2)
    k = torch.randn(B, S, Hk, D, device="cuda", dtype=dt).transpose(1, 2)
    ang = torch.rand(S, D // 2, device="cuda") * 6.28
    cos = torch.cat((ang.cos(), ang.cos()), -1)[None].expand(B, S, D).to(dt)
    sin = torch.cat((ang.sin(), ang.sin()), -1)[None].expand(B, S, D).to(dt)
    qo, ko = torch.empty_like(q), torch.empty_like(k)
    qc, kc = q.contiguous(), k.contiguous()
    ref_q, ref_k = R.apply_rope(q, k, cos, sin)
    nbytes = 2 * (q.numel() + k.numel()) * 2 + 2 * S * D * 2
    copy = time_us(lambda: (qo.copy_(qc), ko.copy_(kc)))
    print(f"copy {copy:.1f} us  ({nbytes / copy / 1e3:.0f} GB/s)", flush=True)
    stream = torch.cuda.current_stream().cuda_stream
    sms = sm_count(0)
    results = []

    def run(label, kernel, args, grid, occ):
        kern = kernel.replace_hints(occupancy=occ)
        fn = lambda: ct.launch(stream, (grid,), kern, args)
        try:
            qo.fill_(float("nan")); ko.fill_(float("nan"))
            fn(); torch.cuda.synchronize()
            ok = torch.equal(qo, ref_q) and torch.equal(ko, ref_k)
            us = time_us(fn)
        except Exception as e:     # noqa: BLE001 - report and go on
            print(f"{label}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            return
        results.append((us, label))
        print(f"{label}: {us:.1f} us  {copy / us:.3f}x copy  exact={ok}", flush=True)

    grids = [(occ, True) for occ in (1, 2, 4, 8)] + [(occ, False) for occ in (4, 8, 16)]
    for (occ, persistent), ts in itertools.product(grids, (1, 2)):
        positions = B * -(-S // ts)
        grid = min(positions, sms * occ) if persistent else positions
        g = f"occ{occ} {'persistent' if persistent else 'per-tile'} ts{ts}"
        prod = R._rope.build(SimpleNamespace(occupancy=occ, persistent=persistent, tile_s=ts))
        args = (q, k, cos, sin, cos, qo, ko, D // 2, Hq, Hk, ts, D // 2, 1, False, False, False)
        run(f"prod {g}", prod, args, grid, occ)
        base = (q, k, cos, sin, qo, ko, D // 2, Hq, Hk, ts, D // 2)
        run(f"loads-first {g}", rope_lf, base, grid, occ)
        if persistent and ts == 1:
            for lat, tma in itertools.product((1, 5, 10), (True, False)):
                run(f"loads-first lat{lat} tma{int(tma)} {g}", rope_lf_hint, base + (lat, tma), grid, occ)
    results.sort()
    print("best:", *[f"{us:.1f} {label}" for us, label in results[:6]], sep="\n  ")


from types import SimpleNamespace  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
