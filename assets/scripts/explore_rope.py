"""RoPE kernel exploration on the GPU (headline shape B4 Hq32 Hkv8 S4096 D128 bf16, HF layout).

Times the production kernel and a loads-first variant (all of q and k loaded before any store,
optionally with ct.load latency / allow_tma hints) over grid shapes, against the copy ceiling.
The H200 run of session 3 (BENCHMARKS.md, references/parameter-space-design.md) timed the
production kernel before it took a latency argument ("prod" rows: no hint) and divided by a copy
into HF-strided outputs (a transposing copy, 232 us: its "x copy" column is not the ceiling).
Both are fixed here: "prod latency1" rows, a contiguous copy.
Usage: python assets/scripts/explore_rope.py  (prints one line per variant, best last).
"""
import itertools
import sys

import cuda.tile as ct
import torch

from tiletune.timing import time_us
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


def variant_runner(stream, outputs, refs, copy_us, results):
    """run(label, kernel, args, grid, check=True, **hints): launch once into NaN-filled outputs
    and compare them bit for bit with refs (check=False: in-place kernels), then time it (median,
    L2 flushed); appends (us, label) to results and prints one line."""
    def run(label, kernel, args, grid, check=True, **hints):
        kern = kernel.replace_hints(**hints)
        fn = lambda: ct.launch(stream, (grid,), kern, args)
        try:
            ok = "n/a"
            if check:
                for o in outputs:
                    o.fill_(float("nan"))
                fn()
                torch.cuda.synchronize()
                ok = all(torch.equal(o, r) for o, r in zip(outputs, refs))
            us = time_us(fn)
        except Exception as e:     # noqa: BLE001 - report and go on
            print(f"{label}: FAILED {type(e).__name__}: {str(e)[:200]}", flush=True)
            return
        results.append((us, label))
        print(f"{label}: {us:.1f} us  {copy_us / us:.3f}x copy  exact={ok}", flush=True)
    return run


B, HQ, HK, S, D = 4, 32, 8, 4096, 128    # the headline shape


def headline_setup():
    """Inputs, HF-layout outputs, the reference result, the copy ceiling and a variant runner
    for the headline shape. Returns (q, k, cos, sin, qo, ko, run, results)."""
    q, k, cos, sin = R.bench_inputs(B, HQ, HK, S, D, torch.bfloat16)
    qo, ko = torch.empty_like(q), torch.empty_like(k)          # HF-layout outputs, like apply_rope
    qc, kc = q.contiguous(), k.contiguous()
    qd, kd = torch.empty_like(qc), torch.empty_like(kc)
    ref_q, ref_k = R.apply_rope(q, k, cos, sin)
    nbytes = 2 * (q.numel() + k.numel()) * 2 + 2 * S * D * 2
    copy = time_us(lambda: (qd.copy_(qc), kd.copy_(kc)))       # contiguous copy: the ceiling
    print(f"copy {copy:.1f} us  ({nbytes / copy / 1e3:.0f} GB/s)", flush=True)
    results = []
    run = variant_runner(torch.cuda.current_stream().cuda_stream, (qo, ko), (ref_q, ref_k), copy,
                         results)
    return q, k, cos, sin, qo, ko, run, results


def main():
    q, k, cos, sin, qo, ko, run, results = headline_setup()
    Hq, Hk = HQ, HK
    sms = sm_count(0)
    grids = [(occ, True) for occ in (1, 2, 4, 8)] + [(occ, False) for occ in (4, 8, 16)]
    for (occ, persistent), ts in itertools.product(grids, (1, 2)):
        positions = B * -(-S // ts)
        grid = min(positions, sms * occ) if persistent else positions
        g = f"occ{occ} {'persistent' if persistent else 'per-tile'} ts{ts}"
        args = (q, k, cos, sin, cos, qo, ko, D // 2, Hq, Hk, ts, D // 2, 1, False, False, False, 1)
        run(f"prod latency1 {g}", R.rope_kernel, args, grid, occupancy=occ)
        base = (q, k, cos, sin, qo, ko, D // 2, Hq, Hk, ts, D // 2)
        run(f"loads-first {g}", rope_lf, base, grid, occupancy=occ)
        if persistent and ts == 1:
            for lat, tma in itertools.product((1, 5, 10), (True, False)):
                run(f"loads-first lat{lat} tma{int(tma)} {g}", rope_lf_hint, base + (lat, tma), grid,
                    occupancy=occ)
    results.sort()
    print("best:", *[f"{us:.1f} {label}" for us, label in results[:6]], sep="\n  ")


if __name__ == "__main__":
    sys.exit(main())
