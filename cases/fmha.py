"""FMHA's benchmark rows (against torch SDPA's flash, cuDNN and efficient backends, and TileGym's
cuTile attention when installed) and its ahead-of-time compile cases."""
import cuda.tile as ct
import torch
from cuda.tile.compilation import ScalarConstraint

from tiletune.aot import F32, CompileCase, jit_array
from tiletune.autotune import bucket
from tiletune.bench import BenchCase
from tiletune.space import f32_row
from tiletune.ops import fmha as FM

# ---------------------------------------------------------------------------------------------
# Ahead-of-time compile cases (CI compiles each for sm_90 and sm_100). Inputs in HF's layout
# ((B, S, H, D) storage seen as (B, H, S, D)), outputs laid out like their input, LSE2/delta
# (B*H, S) float32 (rows padded to 16 bytes). Every sm_90 config of the three kernels at B4 H32 S4096 D128 bf16 causal;
# the sm_100 and fallback configs not already in it; then each kernel's default for non-causal,
# D64 fp16, a ragged Sq/Sk (1000/4097: no 16-divisible shapes), GQA 32/8,
# D256, and the forward for decode (Sq = 1) and D80 (zero-padded to 128).

TUNERS = {"fwd": FM._fwd, "dq": FM._dq, "dkdv": FM._dkdv}
GENS = {"fwd": FM.fwd_configs, "dq": FM.dq_configs, "dkdv": FM.dkdv_configs}


def aot_params(kind, tm, tn, dt, B, hq, hkv, sq, sk, d, causal, heavy_first=False):
    """The signature the JIT specializes `kind`'s kernel on for inputs in HF's layout (outputs
    laid out like their inputs, LSE2/delta (B*Hq, Sq) float32 rows padded to 16 bytes), constants
    in place."""
    i32 = ScalarConstraint(ct.int32)

    def hf(H, S):
        return jit_array(dt, (B, H, S, d), (S * H * d, d, H * d, 1))
    q, kv = hf(hq, sq), hf(hkv, sk)
    rows = jit_array(torch.float32, (B * hq, sq), (f32_row(sq), 1))   # as FM._rows
    tail = [tm, tn, FM.head_tile(d), causal]
    if kind == "fwd":
        return [q, kv, kv, q, rows, F32, i32] + tail + [heavy_first]
    if kind == "dq":
        return [q, kv, kv, q, q, rows, rows, q, F32, F32, i32] + tail
    return [q, kv, kv, q, rows, rows, kv, kv, F32, F32, i32] + tail


def _params(kind, cfg, *shape):
    return aot_params(kind, cfg.tm, cfg.tn, *shape, getattr(cfg, "heavy_first", False))


def compile_cases():
    bf, f16 = torch.bfloat16, torch.float16
    head = (bf, 4, 32, 32, 4096, 4096, 128, True)
    for kind, gen in GENS.items():
        seen = []
        for arch in ("sm_90", "sm_100", "sm_80"):
            for cfg in gen(arch, 128, causal=True):
                if cfg in seen:
                    continue
                seen.append(cfg)
                yield CompileCase("fmha", TUNERS[kind].build(cfg), _params(kind, cfg, *head),
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
            cfg = next(GENS[kind]("sm_90", FM.head_tile(d), bucket(sq), bucket(sk)))
            yield CompileCase("fmha", TUNERS[kind].build(cfg), _params(kind, cfg, *shape),
                              f"fmha {kind} {label} default {vars(cfg)}")


# ---------------------------------------------------------------------------------------------
# Benchmarks, forward and forward+backward. FLOPs count the visible (unmasked) pairs:
# 4 * B * Hq * pairs * D forward (causal square ~ half of Sq * Sk), backward 2.5x forward.
# The headline row is HEADLINE; --full runs every shape.

BENCH_SHAPES = (  # B, Hq, Hkv, Sq, Sk, D, causal
    (4, 32, 32, 4096, 4096, 128, False), (4, 32, 32, 4096, 4096, 128, True),
    (8, 16, 16, 2048, 2048, 64, False), (8, 16, 16, 2048, 2048, 64, True),
    (4, 32, 8, 4096, 4096, 128, True),          # GQA 4:1
    (4, 32, 32, 1024, 4096, 128, True),         # Sq != Sk: chunked prefill, bottom-right
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
    return cases
