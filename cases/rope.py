"""RoPE's benchmark rows (against the Hugging Face reference, its torch.compile, Liger and TileGym
when installed) and its ahead-of-time compile cases."""
import torch

from tiletune.aot import CompileCase, jit_array
from tiletune.bench import BenchCase, grad_step, host_against_torch, leaves
from tiletune.ops import rope as R
from tiletune.space import next_pow2

# ---------------------------------------------------------------------------------------------
# Ahead-of-time compile cases: every config for the headline layout (HF transposed views, GQA
# 32/8, D 128, bf16) in both kernels; the default config for partial rotary + position_ids (fp16,
# D 80), MQA float32, the backward, and the widest position tile over a ragged S.


def _hf_view(dt, B, H, S, D):
    """(B, S, H, D) storage seen as (B, H, S, D)."""
    return jit_array(dt, (B, H, S, D), (S * H * D, D, H * D, 1))


def _shared(dt, B, S, R_):
    """cos/sin expanded over the batch (stride 0)."""
    return jit_array(dt, (B, S, R_), (0, R_, 1))


def _out_params(dt, cdt, B, Hq, Hk, S, D, R_, has_pos, backward, cfg, f32=True):
    """rope_kernel's arguments (see ops/rope.py: _out_args)."""
    q, k = _hf_view(dt, B, Hq, S, D), _hf_view(dt, B, Hk, S, D)
    c = _shared(cdt, B, S, R_)
    pos = jit_array(torch.int32, (B, S), (0, 1)) if has_pos else c
    return [q, k, c, c, pos, _hf_view(dt, B, Hq, S, D), _hf_view(dt, B, Hk, S, D), R_ // 2,
            next_pow2(Hq), next_pow2(Hk), cfg.tile_s, next_pow2(R_ // 2),
            next_pow2(max(D - R_, 1)), has_pos, R_ < D, backward, cfg.latency, f32,
            R._halves_as_tiles(cfg, R_ // 2), R._whole(cfg, Hq, Hk, S, R_ // 2)]


def _inplace_params(p):
    """rope_inplace_kernel's arguments from rope_kernel's: no outputs, TILE_P or COPY_REST."""
    return p[:5] + p[7:12] + [p[13], p[15], p[16], p[17], p[18], p[19]]


def compile_cases():
    B, S = 4, 4096
    for cfg in R.rope_tile_configs("sm_90", 32, 128):
        p = _out_params(torch.bfloat16, torch.bfloat16, B, 32, 8, S, 128, 128, False, False, cfg)
        yield CompileCase("rope", R._rope.build(cfg), p, f"rope 32/8 D128 bf16 {vars(cfg)}")
        yield CompileCase("rope", R._rope_inplace.build(cfg), _inplace_params(p),
                          f"rope_inplace 32/8 D128 bf16 {vars(cfg)}")
        p = _out_params(torch.bfloat16, torch.bfloat16, B, 32, 8, S, 128, 128, False, False, cfg,
                        f32=False)
        yield CompileCase("rope", R._rope_inplace.build(cfg), _inplace_params(p),
                          f"rope_inplace 32/8 D128 bf16, bf16 math {vars(cfg)}")
    for cfg in R.rope_tile_configs("sm_90", 40, 128):   # tiles past the heads: bounds checked
        p = _out_params(torch.bfloat16, torch.bfloat16, B, 40, 8, S, 128, 128, False, False, cfg)
        yield CompileCase("rope", R._rope.build(cfg), p, f"rope 40/8 D128 bf16 {vars(cfg)}")
        yield CompileCase("rope", R._rope_inplace.build(cfg), _inplace_params(p),
                          f"rope_inplace 40/8 D128 bf16 {vars(cfg)}")
    for heads in (64, 128):    # the 8-warp entries of many heads a position
        for cfg in R.rope_tile_configs("sm_90", heads, 128):
            if getattr(cfg, "num_worker_warps", None):
                p = _out_params(torch.bfloat16, torch.bfloat16, 1, heads, 8, S, 128, 128, False,
                                False, cfg)
                yield CompileCase("rope", R._rope.build(cfg), p,
                                  f"rope {heads}/8 D128 bf16 {vars(cfg)}")
                yield CompileCase("rope", R._rope_inplace.build(cfg), _inplace_params(p),
                                  f"rope_inplace {heads}/8 D128 bf16 {vars(cfg)}")
    cfg = next(R.rope_tile_configs("sm_90", 32, 128))
    wide = list(R.rope_tile_configs("sm_90", 8, 64))[-1]       # largest TILE_S, ragged S
    f16, f32, bf16 = torch.float16, torch.float32, torch.bfloat16
    variants = [("fp16 7/1 D80 R40 pos", cfg, (f16, f32, 2, 7, 1, 423, 80, 40, True, False)),
                ("f32 8/1 D64 backward", cfg, (f32, f32, 1, 8, 1, 17, 64, 64, False, True)),
                ("bf16 32/8 D128 pos backward", cfg,
                 (bf16, bf16, B, 32, 8, S, 128, 128, True, True)),
                ("bf16 8/1 D80 R40 S423 widest tile", wide,
                 (bf16, bf16, 2, 8, 1, 423, 80, 40, False, False))]
    for label, c, args in variants:
        yield CompileCase("rope", R._rope.build(c), _out_params(*args, c), f"rope {label} {vars(c)}")
        if args[0] != f32:       # the same in the input dtype's arithmetic
            yield CompileCase("rope", R._rope.build(c), _out_params(*args, c, f32=False),
                              f"rope {label}, {args[0]} math {vars(c)}")


# ---------------------------------------------------------------------------------------------
# Benchmarks. The baseline is the Hugging Face implementation (eager and torch.compile).

def _hf_rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def hf_apply_rotary_pos_emb(q, k, cos, sin):
    """The Hugging Face reference (cos/sin (B, S, D), unsqueezed over heads)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _hf_rotate_half(q) * sin, k * cos + _hf_rotate_half(k) * sin


def bench_inputs(B, Hq, Hk, S, D, dt):
    """Random q, k as HF passes them ((B, S, H, D) storage seen as (B, H, S, D)) and cos/sin
    (B, S, D) as HF's rotary embedding makes them: contiguous, one row per batch and position
    (the same rows in every batch here), on the GPU."""
    q = torch.randn(B, S, Hq, D, device="cuda", dtype=dt).transpose(1, 2)
    k = torch.randn(B, S, Hk, D, device="cuda", dtype=dt).transpose(1, 2)
    ang = torch.rand(S, D // 2, device="cuda") * 6.28
    cos = torch.cat((ang.cos(), ang.cos()), -1)[None].expand(B, S, D).to(dt).contiguous()
    sin = torch.cat((ang.sin(), ang.sin()), -1)[None].expand(B, S, D).to(dt).contiguous()
    return q, k, cos, sin


def _peers():
    peers = {"torch": hf_apply_rotary_pos_emb,
             "torch_compile": torch.compile(hf_apply_rotary_pos_emb)}
    try:
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
        peers["liger"] = liger_rotary_pos_emb
    except Exception:
        pass
    try:    # TileGym's cuTile RoPE (rotates q and k in place: timing only)
        from tilegym.ops.cutile.rope import apply_rope_base
        peers["tilegym"] = apply_rope_base
    except Exception:
        pass
    return peers


SHAPES = ((4, 32, 8, 4096, 128),)     # B, Hq, Hkv, S, D (bf16): the headline
FULL_SHAPES = ((4, 16, 16, 8192, 64), (1, 64, 8, 16384, 128))   # D 64; long, many heads


def bench_cases(full=False):
    """In place (as Liger and TileGym rotate: the headline row), also with the arithmetic in
    bf16 (as Liger, TileGym and HF's eager code compute), and, with `full`, out of place and two
    more shapes, against the same peers and bytes."""
    cases = []
    for B, Hq, Hk, S, D in SHAPES + (FULL_SHAPES if full else ()):
        q, k, cos, sin = bench_inputs(B, Hq, Hk, S, D, torch.bfloat16)
        peers = _peers()
        qc, kc = q.contiguous(), k.contiguous()
        q_out, k_out = torch.empty_like(qc), torch.empty_like(kc)
        qi, ki = q.clone(), k.clone()
        modes = [("fwd inplace", lambda q=qi, k=ki, c=cos, s=sin:
                  R.apply_rope(q, k, c, s, inplace=True)),
                 ("fwd inplace bf16 math", lambda q=qi, k=ki, c=cos, s=sin:
                  R.apply_rope(q, k, c, s, inplace=True, compute_dtype=torch.bfloat16))]
        if full:
            modes.append(("fwd", lambda q=q, k=k, c=cos, s=sin: R.apply_rope(q, k, c, s)))
        # Liger and TileGym rotate q and k in place: each gets a copy of its own, so the others
        # (and the out-of-place row) read the inputs as drawn
        own = {name: (q.clone(), k.clone()) if name in ("liger", "tilegym") else (q, k)
               for name in peers}
        # q and k read and written, every batch's cos/sin rows read; the copy moves q and k
        # alone, so its time is scaled up to the cos/sin bytes too (1.4-3.1% at these shapes)
        qk_bytes = 2 * (q.numel() + k.numel()) * q.element_size()
        nbytes = qk_bytes + (cos.numel() + sin.numel()) * cos.element_size()
        for mode, ours in modes:
            cases.append(BenchCase(
                "rope", f"B{B} Hq{Hq} Hkv{Hk} S{S} D{D} bf16", mode, ours,
                {name: (lambda f=f, q=own[name][0], k=own[name][1], c=cos, s=sin: f(q, k, c, s))
                 for name, f in peers.items()},
                bytes=nbytes,
                ceiling=("copy", lambda qo=q_out, ko=k_out, qc=qc, kc=kc:
                         (qo.copy_(qc), ko.copy_(kc))),
                ceiling_scale=nbytes / qk_bytes))
    return cases


def bench_host():
    """Host microseconds per call at a tiny shape (B1 Hq8 Hkv2 S16 D64 bf16), against the HF
    implementation in eager: the call and one forward+backward step."""
    q, k, cos, sin = bench_inputs(1, 8, 2, 16, 64, torch.bfloat16)
    return host_against_torch(
        lambda: R.apply_rope(q, k, cos, sin), lambda: hf_apply_rotary_pos_emb(q, k, cos, sin),
        grad_step(lambda a, b: R.apply_rope(a, b, cos, sin), leaves(q, k)),
        grad_step(lambda a, b: hf_apply_rotary_pos_emb(a, b, cos, sin), leaves(q, k)))
