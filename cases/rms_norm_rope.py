"""Fused RMSNorm+RoPE's benchmark rows (against torch.compile of the Hugging Face Qwen3 code and
tiletune's rms_norm per head then apply_rope, run separately) and its ahead-of-time compile
cases."""
import torch

from tiletune.aot import F32, CompileCase, jit_array
from tiletune.bench import BenchCase, grad_step, host_against_torch, leaves
from tiletune.cases.rope import hf_apply_rotary_pos_emb
from tiletune.ops import rms_norm_rope as RNR
from tiletune.ops.rms_norm import rms_norm
from tiletune.ops.rope import apply_rope
from tiletune.space import next_pow2

# ---------------------------------------------------------------------------------------------
# Ahead-of-time compile cases: every config, forward and backward, for the Qwen3-like layout
# (GQA 32/8, D 128, bf16, HF views); the default config for partial rotary + position_ids.


def _params(dt, B, Hq, Hk, S, D, R_, has_pos):
    """The forward's and the backward's arguments, without the latency hint (see ops/
    rms_norm_rope.py: _fwd_args, _bwd_args). The dweight partials are the two (G, D) halves of
    the (2, G, D) scratch buffer."""
    f32 = torch.float32
    q = jit_array(dt, (B, Hq, S, D), (S * Hq * D, D, Hq * D, 1))
    k = jit_array(dt, (B, Hk, S, D), (S * Hk * D, D, Hk * D, 1))
    w, c = jit_array(dt, (D,)), jit_array(dt, (B, S, R_), (0, R_, 1))
    pos = jit_array(torch.int32, (B, S), (0, 1)) if has_pos else c
    qo, ko = jit_array(dt, (B, Hq, S, D)), jit_array(dt, (B, Hk, S, D))
    rq = jit_array(f32, (B, Hq, S), (S * Hq, 1, Hq))       # (B, S, H) storage, as the op
    rk = jit_array(f32, (B, Hk, S), (S * Hk, 1, Hk))       # lays rstd out
    tiles = [next_pow2(Hq), next_pow2(Hk), next_pow2(R_ // 2), next_pow2(max(D - R_, 1)),
             has_pos, R_ < D]
    part = jit_array(f32, (264, D))
    fwd = [q, k, w, w, c, c, pos, qo, ko, rq, rk, R_ // 2, F32, F32] + tiles
    bwd = [qo, ko, q, k, w, w, c, c, pos, rq, rk, qo, ko, part, part, R_ // 2, F32] + tiles
    return fwd, bwd


def compile_cases():
    fwd, bwd = _params(torch.bfloat16, 4, 32, 8, 4096, 128, 128, False)
    for cfg in RNR.fused_configs("sm_90", 40, 128):
        yield CompileCase("rms_norm_rope", RNR._fwd.build(cfg), fwd + [cfg.latency],
                          f"rms_norm_rope_fwd {vars(cfg)}")
    for cfg in RNR.fused_configs("sm_90", 40, 128, backward=True):
        yield CompileCase("rms_norm_rope", RNR._bwd.build(cfg), bwd + [cfg.latency],
                          f"rms_norm_rope_bwd {vars(cfg)}")
    fwd, bwd = _params(torch.float16, 2, 7, 1, 423, 80, 40, True)
    cfg = next(RNR.fused_configs("sm_90", 8, 40))
    yield CompileCase("rms_norm_rope", RNR._fwd.build(cfg), fwd + [cfg.latency],
                      "rms_norm_rope_fwd fp16 D80 R40 pos")
    yield CompileCase("rms_norm_rope", RNR._bwd.build(cfg), bwd + [cfg.latency],
                      "rms_norm_rope_bwd fp16 D80 R40 pos")


# ---------------------------------------------------------------------------------------------
# Benchmarks: fused against torch.compile of the Hugging Face Qwen3 code (q_norm and k_norm on
# the (B, S, H, D) projections, then apply_rotary_pos_emb on the transposed views) and against
# tiletune's rms_norm per head then apply_rope, forward and forward+backward.

SHAPES = ((4, 32, 8, 4096, 128),)     # B, Hq, Hkv, S, D (bf16): the headline
FULL_SHAPES = ((4, 16, 16, 8192, 64), (1, 64, 8, 16384, 128))   # D 64; long, many heads
EPS = 1e-6


def hf_qk_norm_rope(q, k, wq, wk, cos, sin):
    """Qwen3's attention prologue in HF's code: q, k (B, S, H, D); cos/sin (S, D)."""
    def norm(x, w):
        xf = x.float()
        return w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)).to(x.dtype)
    return hf_apply_rotary_pos_emb(norm(q, wq).transpose(1, 2), norm(k, wk).transpose(1, 2),
                                   cos[None], sin[None])


def _inputs(B, Hq, Hk, S, D, dt):
    q = torch.randn(B, S, Hq, D, device="cuda", dtype=dt)
    k = torch.randn(B, S, Hk, D, device="cuda", dtype=dt)
    wq, wk = torch.rand(D, device="cuda", dtype=dt), torch.rand(D, device="cuda", dtype=dt)
    ang = torch.rand(S, D // 2, device="cuda") * 6.28
    cos = torch.cat((ang.cos(), ang.cos()), -1).to(dt)
    sin = torch.cat((ang.sin(), ang.sin()), -1).to(dt)
    return q, k, wq, wk, cos, sin


def bench_cases(full=False):
    """The headline shape; `full` adds D 64 and a long sequence with many heads. Inputs as HF
    holds them: q and k (B, S, H, D) storage, seen as (B, H, S, D) views by the tiletune ops."""
    cases = []
    dt = torch.bfloat16
    for B, Hq, Hk, S, D in SHAPES + (FULL_SHAPES if full else ()):
        q, k, wq, wk, cos, sin = _inputs(B, Hq, Hk, S, D, dt)
        # one compiled function per shape: a shared one would recompile with dynamic shapes
        compiled = torch.compile(hf_qk_norm_rope, dynamic=False)

        def fused(q, k, wq, wk, cos=cos, sin=sin):
            return RNR.rms_norm_rope(q.transpose(1, 2), k.transpose(1, 2), wq, wk, cos, sin)

        def separate(q, k, wq, wk, cos=cos, sin=sin):
            return apply_rope(rms_norm(q, wq, EPS).transpose(1, 2),
                              rms_norm(k, wk, EPS).transpose(1, 2), cos, sin)

        def torch_compile(q, k, wq, wk, cos=cos, sin=sin, compiled=compiled):
            return compiled(q, k, wq, wk, cos, sin)
        name = f"B{B} Hq{Hq} Hkv{Hk} S{S} D{D} bf16"
        io_bytes = 2 * (q.numel() + k.numel()) * q.element_size()
        cases.append(BenchCase(
            "rms_norm_rope", name, "fwd", lambda f=fused, a=(q, k, wq, wk): f(*a),
            {label: (lambda f=f, a=(q, k, wq, wk): f(*a))
             for label, f in (("torch_compile", torch_compile), ("separate", separate))},
            bytes=io_bytes))
        inputs = leaves(q, k, wq, wk)
        cases.append(BenchCase(
            "rms_norm_rope", name, "fwd+bwd", grad_step(fused, inputs),
            {"torch_compile": grad_step(torch_compile, inputs),
             "separate": grad_step(separate, inputs)},
            bytes=2.5 * io_bytes))    # fwd: read q, k, write; bwd: read q, k, dy, write dx
    return cases


def bench_host():
    """Host microseconds per call at a tiny shape (B1 Hq8 Hkv2 S16 D64 bf16), against HF's code
    in eager (torch's rms_norm per head of the (B, S, H, D) projections, then the transposed
    views rotated): the call and one forward+backward step."""
    dt, D = torch.bfloat16, 64
    qs = torch.randn(1, 16, 8, D, device="cuda", dtype=dt)
    ks = torch.randn(1, 16, 2, D, device="cuda", dtype=dt)
    q, k = qs.transpose(1, 2), ks.transpose(1, 2)
    wq, wk = torch.rand(D, device="cuda", dtype=dt), torch.rand(D, device="cuda", dtype=dt)
    ang = torch.rand(16, D // 2, device="cuda") * 6.28
    cos = torch.cat((ang.cos(), ang.cos()), -1).to(dt)
    sin = torch.cat((ang.sin(), ang.sin()), -1).to(dt)

    def ours(q, k, wq, wk):
        return RNR.rms_norm_rope(q, k, wq, wk, cos, sin)

    def torch_fn(qs, ks, wq, wk):
        return hf_apply_rotary_pos_emb(
            torch.nn.functional.rms_norm(qs, (D,), wq, 1e-6).transpose(1, 2),
            torch.nn.functional.rms_norm(ks, (D,), wk, 1e-6).transpose(1, 2),
            cos[None], sin[None])
    return host_against_torch(lambda: ours(q, k, wq, wk), lambda: torch_fn(qs, ks, wq, wk),
                              grad_step(ours, leaves(q, k, wq, wk)),
                              grad_step(torch_fn, leaves(qs, ks, wq, wk)))
