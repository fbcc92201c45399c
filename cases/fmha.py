"""FMHA's benchmark rows (against torch SDPA's flash, cuDNN and efficient backends, and TileGym's
cuTile attention when installed) and its ahead-of-time compile cases."""
import dataclasses
import itertools

import cuda.tile as ct
import torch
from cuda.tile.compilation import ScalarConstraint

from tiletune.aot import F32, CompileCase, jit_array, space_archs
from tiletune.autotune import bucket
from tiletune.bench import BenchCase, grad_step, host_against_torch, leaves
from tiletune.space import f32_row
from tiletune.ops import fmha as FM

# ---------------------------------------------------------------------------------------------
# Ahead-of-time compile cases (CI compiles each for sm_90 and sm_100). Inputs in HF's layout
# ((B, S, H, D) storage seen as (B, H, S, D)), outputs laid out like their input, LSE2/delta
# (B*H, S) float32 (rows padded to 16 bytes). Every sm_90 config of the three kernels at B4 H32 S4096 D128 bf16 causal;
# the sm_100 and fallback configs not already in it; then each kernel's default for non-causal,
# D64 fp16, a ragged Sq/Sk (1000/4097: no 16-divisible shapes), GQA 32/8,
# D256, and the forward for decode (Sq = 1) and D80 (zero-padded to 128); the two-tile forward
# non-causal, at D64 fp16, D256 and an odd number of query tiles.

I32 = ScalarConstraint(ct.int32)     # a Python int argument
TUNERS = {"fwd": FM._fwd, "dq": FM._dq, "dkdv": FM._dkdv}
GENS = {"fwd": FM.fwd_configs, "dq": FM.dq_configs, "dkdv": FM.dkdv_configs}


def stat_rows(n, s):
    """LSE2/delta rows (n, s) float32 as FM._rows lays them out; at s = 1 the JIT makes the
    length a constant 1 (seen on an H100), though its stride is 1."""
    rows = jit_array(torch.float32, (n, s), (f32_row(s), 1))
    if s == 1:
        rows = dataclasses.replace(rows, shape_constant=(None, 1))
    return rows


def hf_array(dt, B, H, S, d, packed=False):
    """(B, H, S, D) as a view of (B, S, H, D) storage (HF's layout); packed: B sequences of S
    tokens in all, a contiguous (S, H, D) tensor seen as (1, H, S, D)."""
    if packed:
        return jit_array(dt, (1, H, S, d), (H * d, d, H * d, 1))
    return jit_array(dt, (B, H, S, d), (S * H * d, d, H * d, 1))


def aot_params(kind, tm, tn, dt, B, hq, hkv, sq, sk, d, causal, packed=False, offset=None,
               fused=False):
    """The signature the JIT specializes `kind`'s kernel on for inputs in HF's layout (outputs
    laid out like their inputs, LSE2/delta (B*Hq, Sq) float32 rows padded to 16 bytes), constants
    in place. packed: a packed batch of B sequences, sq and sk tokens in all, contiguous
    (T, H, D) tensors seen as (1, H, T, D); the unread offsets of a dense launch are (2,).
    offset: the causal diagonal's (None: bottom-right, as `fmha` aligns it). fused: the dK/dV
    kernel as the fused backward launches it, its float32 dQ contiguous."""
    q, kv = hf_array(dt, B, hq, sq, d, packed), hf_array(dt, B, hkv, sk, d, packed)
    rows = stat_rows(hq if packed else B * hq, sq)
    cu = jit_array(torch.int32, (B + 1,) if packed else (2,))
    tail = [tm, tn, FM.head_tile(d), causal]
    if kind == "fwd":
        return [q, kv, kv, q, rows, cu, cu, F32, I32] + tail + [packed]
    offset = sk - sq if offset is None else offset
    if kind == "dq":
        return ([q, kv, kv, q, q, rows, rows, q, cu, cu, F32, F32, I32] + tail
                + [packed, causal and not packed and offset + sq > sk])
    dq = jit_array(torch.float32, (B, hq, sq, d)) if fused else q   # the split kernel's unread
    return ([q, kv, kv, q, rows, rows, kv, kv, cu, cu, F32, F32, I32, dq] + tail
            + [packed, fused, fused and (not causal or offset + sq > sk)])


def fused_helper_params(dt, B, hq, sq, d):
    """The fused backward's prep and cast kernels' signatures (o, dO and dq in HF's layout)."""
    q, rows = hf_array(dt, B, hq, sq, d), stat_rows(B * hq, sq)
    dq32, td = jit_array(torch.float32, (B, hq, sq, d)), FM.head_tile(d)
    return ([q, q, rows, dq32, FM.FUSED_PREP_TM, td],
            [dq32, q, F32, FM.FUSED_PREP_TM, td])


def decode_params(cfg, dt, B, hq, hkv, sq, sk, d, causal, lengths):
    """The decode family's signature for `cfg` (a split config: the decode kernel; "plain": the
    forward's) on HF-layout inputs; with it, for splits > 1, the combine kernel's."""
    if cfg.kind == "plain":
        return aot_params("fwd", cfg.tm, cfg.tn, dt, B, hq, hkv, sq, sk, d, causal), None
    q, kv = hf_array(dt, B, hq, sq, d), hf_array(dt, B, hkv, sk, d)
    rows = stat_rows(B * hq, sq)
    used = jit_array(torch.int32, (B,) if lengths else (2,))
    group = hq // hkv
    tg, tq = FM.decode_rows(group, sq, cfg.keys_m)
    td = FM.head_tile(d)
    o_part = lse_part = kv
    if cfg.splits > 1:
        part_rows, lse_rows = FM.partial_rows(B * hkv, group, sq)
        o_part = jit_array(torch.float32, (cfg.splits, part_rows, td))
        lse_part = jit_array(torch.float32, (cfg.splits, lse_rows))   # after o_part in scratch
    kernel = [q, kv, kv, used, q, rows, o_part, lse_part, F32, I32, group, tg, tq,
              FM.next_pow2(sq), cfg.tn, td, causal, lengths, cfg.splits > 1, cfg.keys_m]
    combine = None
    if cfg.splits > 1:
        combine = [o_part, lse_part, q, rows, group, tg, *FM.combine_tiles(cfg.splits, sq, td)]
    return kernel, combine


def _params(kind, cfg, *shape, packed=False, offset=None):
    return (aot_params(kind, cfg.tm, cfg.tn, *shape, packed=packed, offset=offset,
                       fused=getattr(cfg, "fused", False))
            + list(FM.pair_constants(cfg)))


def compile_cases():
    bf, f16 = torch.bfloat16, torch.float16
    head = (bf, 4, 32, 32, 4096, 4096, 128, True)
    for kind, gen in GENS.items():
        seen, spaces = [], space_archs(lambda a: gen(a, 128, causal=True))
        for arch in ("sm_90", "sm_100", "sm_80"):
            for cfg in gen(arch, 128, causal=True):
                if cfg in seen:
                    continue
                seen.append(cfg)
                yield CompileCase("fmha", TUNERS[kind].build(cfg), _params(kind, cfg, *head),
                                  f"fmha {kind} {arch} space B4 H32 S4096 D128 bf16 causal "
                                  f"{vars(cfg)}",
                                  spaces=spaces(cfg))
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
            cfg = next(GENS[kind]("sm_90", FM.head_tile(d), bucket(sq), bucket(sk)))
            yield CompileCase("fmha", TUNERS[kind].build(cfg), _params(kind, cfg, *shape),
                              f"fmha {kind} {label} default {vars(cfg)}")
    shape = (f16, 2, 8, 2, 4097, 1000, 64, True)       # SDPA's top-left diagonal, Sq > Sk
    cfg = next(GENS["dq"]("sm_90", 64, bucket(4097), bucket(1000), causal=True))
    yield CompileCase("fmha", FM._dq.build(cfg), _params("dq", cfg, *shape, offset=0),
                      f"fmha dq top-left Sq4097 Sk1000 D64 fp16 default {vars(cfg)}")
    for label, shape in [("non-causal", (bf, 4, 32, 32, 4096, 4096, 128, False)),
                         ("D64 fp16 causal", (f16, 8, 16, 16, 2048, 2048, 64, True)),
                         ("ragged Sq4097 Sk1000", (bf, 2, 8, 2, 4097, 1000, 128, True)),
                         ("D256 causal", (bf, 2, 8, 8, 2048, 2048, 256, True))]:
        dt, B, hq, hkv, sq, sk, d, causal = shape
        cfg = next(c for c in FM.fwd_configs("sm_90", FM.head_tile(d), bucket(sq), bucket(sk))
                   if getattr(c, "pair", False))
        yield CompileCase("fmha", FM._fwd.build(cfg), _params("fwd", cfg, *shape),
                          f"fmha fwd {label} pair {vars(cfg)}")
    # the fused backward without a causal mask (keys past Sk masked) and at a ragged GQA
    # shape, fp16; its prep and cast kernels
    for label, shape in [("non-causal", (bf, 4, 32, 32, 4096, 4096, 128, False)),
                         ("ragged GQA Sq1000 fp16", (f16, 2, 8, 2, 1000, 1000, 128, True))]:
        dt, B, hq, hkv, sq, sk, d, causal = shape
        cfg = next(c for c in FM.dkdv_configs("sm_90", 128, bucket(sq), bucket(sk), causal)
                   if getattr(c, "fused", False))
        yield CompileCase("fmha", FM._dkdv.build(cfg), _params("dkdv", cfg, *shape),
                          f"fmha dkdv {label} fused {vars(cfg)}")
    for name, kernel, params in zip(("prep", "cast"),
                                    (FM.fmha_bwd_prep_kernel, FM.fmha_bwd_cast_kernel),
                                    fused_helper_params(bf, *head[1:3], *head[4:5], 128)):
        yield CompileCase("fmha", kernel, params, f"fmha fused backward {name} B4 H32 S4096 D128")
    shape = (f16, 8, 16, 16, 2048, 2048, 64, True)     # the sm_90 entries of D64 alone
    for kind, gen in GENS.items():
        d128 = list(gen("sm_90", 128, causal=True))
        for cfg in gen("sm_90", 64, causal=True):
            if cfg not in d128:
                yield CompileCase("fmha", TUNERS[kind].build(cfg), _params(kind, cfg, *shape),
                                  f"fmha {kind} D64 fp16 causal sm_90 space {vars(cfg)}",
                                  spaces=("sm_90",))
    for label, kinds, shape in [
            ("packed B8 T8000 H32/8 D128 causal", ("fwd", "dq", "dkdv"),
             (bf, 8, 32, 8, 8000, 8000, 128, True)),
            ("packed B3 Tq100 Tk4097 H8 D64 fp16", ("fwd",), (f16, 3, 8, 8, 100, 4097, 64, False))]:
        dt, B, hq, hkv, sq, sk, d, causal = shape
        for kind in kinds:
            cfg = next(GENS[kind]("sm_90", FM.head_tile(d), 4096, 4096, causal=causal))
            yield CompileCase("fmha", TUNERS[kind].build(cfg),
                              _params(kind, cfg, *shape, packed=True),
                              f"fmha {kind} {label} default {vars(cfg)}")
    yield from decode_cases()


def decode_cases():
    """Decode at B32 Hq32/8 Sq1 Sk4096 D128 bf16 with cache lengths: each compile of the sm_90
    space (product form x key tile x split or not: the number of splits is a runtime value),
    the sm_100 default and the combine; then the default (with its combine) and the first
    transposed-product entry for causal Sq 5, MQA 16/1 fp16 D64, and a group of 7 (Qwen2-7B).
    The plain entries are the forward's, compiled above."""
    head = (torch.bfloat16, 32, 32, 8, 1, 4096, 128, False)
    seen, combined = set(), False
    cfgs = list(FM.decode_configs("sm_90", 128, 1, 4096, kv_heads=256, used=True, group=4))
    cfgs.append(next(FM.decode_configs("sm_100", 128, 1, 4096, kv_heads=256, used=True,
                                       group=4)))
    for cfg in cfgs:
        compiled = (cfg.keys_m, cfg.tn, cfg.splits > 1, getattr(cfg, "num_worker_warps", None))
        if compiled in seen:
            continue
        seen.add(compiled)
        kernel, combine = decode_params(cfg, *head, True)
        yield CompileCase("fmha", FM._decode.build(cfg), kernel,
                          f"fmha decode space B32 H32/8 Sq1 Sk4096 D128 bf16 cache lengths "
                          f"{vars(cfg)}")
        if combine is not None and not combined:
            combined = True
            yield CompileCase("fmha", FM.COMBINE, combine,
                              f"fmha decode combine B32 H32/8 Sq1 D128 bf16 {vars(cfg)}")
    for label, shape, lengths in [
            ("causal Sq5 GQA 32/8", (torch.bfloat16, 4, 32, 8, 5, 1000, 128, True), False),
            ("MQA 16/1 fp16 D64", (torch.float16, 8, 16, 1, 1, 777, 64, False), True),
            ("group 7 D128 causal", (torch.bfloat16, 2, 28, 4, 1, 3000, 128, True), True)]:
        dt, B, hq, hkv, sq, sk, d, causal = shape
        space = list(FM.decode_configs("sm_90", FM.head_tile(d), sq, bucket(sk),
                                       kv_heads=bucket(B * hkv), causal=causal, used=lengths,
                                       group=hq // hkv))
        picked = [("default", space[0])]      # and the first split of the other products
        picked += [("transposed" if c.keys_m else "row-major", c) for c in space
                   if c.kind == "split" and c.keys_m != space[0].keys_m][:1]
        for which, cfg in picked:
            kernel, combine = decode_params(cfg, *shape, lengths)
            yield CompileCase("fmha", FM._decode.build(cfg), kernel,
                              f"fmha decode {label} {which} {vars(cfg)}")
            if combine is not None and which == "default":
                yield CompileCase("fmha", FM.COMBINE, combine,
                                  f"fmha decode combine {label} {vars(cfg)}")


# ---------------------------------------------------------------------------------------------
# Benchmarks, forward and forward+backward. FLOPs count the visible (unmasked) pairs:
# 4 * B * Hq * pairs * D forward (causal square ~ half of Sq * Sk), backward 2.5x forward.
# The headline row is HEADLINE; --full runs every shape.

BENCH_SHAPES = (  # B, Hq, Hkv, Sq, Sk, D, causal
    (4, 32, 32, 4096, 4096, 128, False), (4, 32, 32, 4096, 4096, 128, True),
    (8, 16, 16, 2048, 2048, 64, False), (8, 16, 16, 2048, 2048, 64, True),
    (4, 32, 8, 4096, 4096, 128, True),          # GQA 4:1
    (4, 32, 32, 1024, 4096, 128, True),         # Sq != Sk: chunked prefill, bottom-right
    (16, 32, 32, 1024, 1024, 128, True),        # short sequences
    (1, 32, 8, 16384, 16384, 128, True),        # long, GQA 4:1
)
HEADLINE = (4, 32, 32, 4096, 4096, 128, True)


def _tilegym():
    try:
        from tilegym.ops.cutile.attention import tile_fmha, tile_fmha_with_backward
        return tile_fmha, tile_fmha_with_backward
    except Exception:
        return None


def bench_cases(full=False):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.attention.bias import causal_lower_right
    sdpa = torch.nn.functional.scaled_dot_product_attention
    backends = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}
    tg = _tilegym()
    cases = []
    for B, hq, hkv, sq, sk, d, causal in BENCH_SHAPES if full else (HEADLINE,):
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
            if mask is not None and backend == SDPBackend.CUDNN_ATTENTION:
                # a CausalBias under cuDNN alone builds its (Sq, Sk) mask on every call (its
                # lower-right fast paths are flash's and efficient's): built once here instead
                dense = torch.ones(sq, sk, dtype=torch.bool, device="cuda").tril(sk - sq)
                kw = dict(kw, attn_mask=dense)

            def f(q, k, v):
                with sdpa_kernel(backend):
                    return sdpa(q, k, v, **kw)
            return f
        fns = {label: torch_fn(b) for label, b in backends.items()}
        ours = lambda q, k, v, c=causal: FM.fmha(q, k, v, causal=c)
        fwd_peers = dict(fns)
        bwd_peers = dict(fns)
        if tg is not None and sq == sk:        # TileGym's causal assumes Sq == Sk here
            fwd_peers["tilegym"] = lambda q, k, v, c=causal: tg[0](q, k, v, is_causal=c)
            bwd_peers["tilegym"] = lambda q, k, v, c=causal: tg[1](q, k, v, is_causal=c)
        flops = 4.0 * B * hq * d * FM.visible_pairs(sq, sk, causal, sk - sq)
        cases.append(BenchCase("fmha", name, "fwd", lambda f=ours, q=q, k=k, v=v: f(q, k, v),
                               {lb: (lambda f=f, q=q, k=k, v=v: f(q, k, v))
                                for lb, f in fwd_peers.items()}, flops=flops))
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

        def step(f, qg=qg, kg=kg, vg=vg, do=do):   # grad(): no accumulation into .grad
            return lambda: torch.autograd.grad(f(qg, kg, vg), (qg, kg, vg), do)
        cases.append(BenchCase("fmha", name, "fwd+bwd", step(ours),
                               {lb: step(f) for lb, f in bwd_peers.items()},
                               flops=3.5 * flops))
    return cases + _decode_cases(full) + _varlen_cases(full)


# Decode rows (Sq = 1, bf16 D128, KV as (B, S, H, D) storage seen as (B, H, S, D), the layout of
# HF's projections; transformers' KV cache hands decode contiguous (B, H, S, D) tensors, which
# share the key): bytes count K and V once. Peers: SDPA's
# backends (GQA through enable_gqa) and TileGym's split-KV decode where installed. Every
# candidate is also timed replayed from a CUDA graph, as a serving loop runs decode: at the
# small rows an eager call's host time passes its kernels'. A kv_cache
# row with per-sequence lengths of a quarter to all of Sk (seqused_k) runs ours only against the
# same backends on the full cache.
DECODE_SHAPES = (  # B, Hq, Hkv, Sk
    (32, 32, 8, 1024), (32, 32, 8, 4096), (32, 32, 8, 16384), (8, 32, 8, 32768),
    (1, 32, 8, 32768), (32, 32, 1, 4096), (4, 32, 1, 32768))
DECODE_HEADLINE = (32, 32, 8, 4096)
# Packed variable-length rows: B sequences of random lengths up to S (mean about half: the 50%
# fill), causal, H32/8 D128 bf16; peers run the padded (B, H, S, D) batch: SDPA's backends and
# ours (what padding costs). FLOPs count the packed sequences' visible pairs.
VARLEN_SHAPES = ((16, 4096), (64, 1024))     # B, S


def _decode_cases(full):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    sdpa = torch.nn.functional.scaled_dot_product_attention
    backends = {"sdpa_flash": SDPBackend.FLASH_ATTENTION, "sdpa_cudnn": SDPBackend.CUDNN_ATTENTION,
                "sdpa_efficient": SDPBackend.EFFICIENT_ATTENTION}
    try:
        from tilegym.ops.cutile.flash_decode import fmha_decode as tg_decode
    except Exception:
        tg_decode = None
    cases = []
    for B, hq, hkv, sk in DECODE_SHAPES if full else (DECODE_HEADLINE,):
        d, dt = 128, torch.bfloat16
        name = f"decode B{B} H{hq}/{hkv} Sq1 Sk{sk} D{d} bf16"

        def setup(case, B=B, hq=hq, hkv=hkv, sk=sk):
            q = torch.randn(B, 1, hq, d, device="cuda", dtype=dt).transpose(1, 2)
            k = torch.randn(B, sk, hkv, d, device="cuda", dtype=dt).transpose(1, 2)
            v = torch.randn(B, sk, hkv, d, device="cuda", dtype=dt).transpose(1, 2)
            case.ours = lambda: FM.fmha(q, k, v)
            for label, b in backends.items():
                def f(b=b):
                    with sdpa_kernel(b):
                        return sdpa(q, k, v, enable_gqa=hkv != hq)
                case.baselines[label] = f
            if tg_decode is not None:
                case.baselines["tilegym"] = lambda: tg_decode(q, k, v, 1.0 / d ** 0.5)
        cases.append(BenchCase("fmha", name, "fwd", None, {}, setup=setup,
                               bytes=2.0 * B * hkv * sk * d * 2, graph=True))
    if full:
        B, hq, hkv, sk, d, dt = 32, 32, 8, 8192, 128, torch.bfloat16

        def setup_cache(case):
            q = torch.randn(B, 1, hq, d, device="cuda", dtype=dt).transpose(1, 2)
            k = torch.randn(B, sk, hkv, d, device="cuda", dtype=dt).transpose(1, 2)
            v = torch.randn(B, sk, hkv, d, device="cuda", dtype=dt).transpose(1, 2)
            g = torch.Generator().manual_seed(0)
            used = torch.randint(sk // 4, sk + 1, (B,), generator=g, dtype=torch.int32).cuda()
            case.ours = lambda: FM.fmha(q, k, v, seqused_k=used)
            for label, b in backends.items():
                def f(b=b):
                    with sdpa_kernel(b):
                        return sdpa(q, k, v, enable_gqa=True)
                case.baselines[label + "_full_cache"] = f
        cases.append(BenchCase("fmha", f"decode B{B} H{hq}/{hkv} Sq1 Sk{sk} seqused_k 1/4..1 "
                               f"D{d} bf16", "fwd", None, {}, setup=setup_cache, graph=True))
    return cases


def _varlen_cases(full):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    sdpa = torch.nn.functional.scaled_dot_product_attention
    backends = {"sdpa_flash_padded": SDPBackend.FLASH_ATTENTION,
                "sdpa_cudnn_padded": SDPBackend.CUDNN_ATTENTION}
    cases = []
    hq, hkv, d, dt = 32, 8, 128, torch.bfloat16
    for B, S in VARLEN_SHAPES if full else VARLEN_SHAPES[:1]:
        g = torch.Generator().manual_seed(B)
        lens = torch.randint(1, S + 1, (B,), generator=g).tolist()
        name = f"varlen B{B} max{S} fill {sum(lens) / (B * S):.0%} H{hq}/{hkv} D{d} bf16 causal"
        pairs = sum(L * (L + 1) // 2 for L in lens)
        for mode in ("fwd", "fwd+bwd") if full else ("fwd+bwd",):   # training: headline
            def setup(case, B=B, S=S, lens=lens, mode=mode):
                T = sum(lens)
                cu = torch.tensor([0] + list(itertools.accumulate(lens)), dtype=torch.int32,
                                  device="cuda")
                q, k, v = (torch.randn(T, h, d, device="cuda", dtype=dt, requires_grad=True)
                           for h in (hq, hkv, hkv))
                qp = torch.randn(B, S, hq, d, device="cuda", dtype=dt).transpose(1, 2)
                kp, vp = (torch.randn(B, S, hkv, d, device="cuda", dtype=dt).transpose(1, 2)
                          for _ in range(2))
                qp, kp, vp = (t.detach().requires_grad_() for t in (qp, kp, vp))
                do, dop = torch.randn_like(q), torch.randn(B, hq, S, d, device="cuda", dtype=dt)

                def run(f, args, grad):
                    if mode == "fwd":
                        return _no_grad(lambda: f(*args))
                    return lambda: torch.autograd.grad(f(*args), args, grad)

                def with_backend(b):
                    def f(q, k, v):
                        with sdpa_kernel(b):
                            return sdpa(q, k, v, is_causal=True, enable_gqa=True)
                    return f
                case.ours = run(lambda q, k, v: FM.fmha_varlen(q, k, v, cu, cu, S, S,
                                                               causal=True), (q, k, v), do)
                padded = {label: with_backend(b) for label, b in backends.items()}
                padded["tiletune_padded"] = lambda q, k, v: FM.fmha(q, k, v, causal=True)
                for label, f in padded.items():
                    case.baselines[label] = run(f, (qp, kp, vp), dop)
            flops = 4.0 * hq * d * pairs * (3.5 if mode == "fwd+bwd" else 1.0)
            cases.append(BenchCase("fmha", name, mode, None, {}, setup=setup, flops=flops))
    return cases


def _no_grad(fn):
    def f():
        with torch.no_grad():
            return fn()
    return f


def bench_host():
    """Host microseconds per call at a tiny shape (B1 H4 S64 D64 bf16, causal), against
    `scaled_dot_product_attention` (torch picks its backend): the call and one
    forward+backward step."""
    q, k, v = (torch.randn(1, 4, 64, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))

    def ours(q, k, v):
        return FM.fmha(q, k, v, causal=True)

    def torch_fn(q, k, v):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return host_against_torch(lambda: ours(q, k, v), lambda: torch_fn(q, k, v),
                              grad_step(ours, leaves(q, k, v)),
                              grad_step(torch_fn, leaves(q, k, v)))
