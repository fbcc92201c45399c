"""RMSNorm's benchmark rows (against torch, torch.compile, Liger and TileGym when installed) and
its ahead-of-time compile cases."""
import warnings

import cuda.tile as ct
import torch

from tiletune.aot import F32, CompileCase, jit_array, tightest
from tiletune.bench import BenchCase, grad_step, host_against_torch, host_in_turns, leaves
from tiletune.device import current_stream
from tiletune.ops import partials
from tiletune.ops import rms_norm as R
from tiletune.space import next_pow2

# ---------------------------------------------------------------------------------------------
# Ahead-of-time compile cases: every config of every kernel, for row widths that reach each
# variant; aligned and ragged widths; the default config for the other dtype combinations.

# 4096 and 16384 bracket the whole-row tiles (8192's tile shapes lie between theirs), 1001 is
# ragged, 20000 takes the chunked kernels. Every config compiles at 4096; at the other widths
# the default and each config differing in more than occupancy once (aot.tightest); the
# forward's and the backward's also compile for (..., N) arrays the kernels view as rows: (B, S,
# N) so, decode's (B, 1, N) and (B, S, H, D) heads at the defaults (the view is the same code
# at every tile).
AOT_WIDTHS = (4096, 1001, 16384, 20000)
BATCHED = ((4, 1024, 4096), (4096, 1, 4096), (2, 2048, 32, 128))


def _at(N, cfgs):
    return list(cfgs) if N == AOT_WIDTHS[0] else tightest(cfgs)


def compile_cases():
    f32, bf16 = torch.float32, torch.bfloat16
    M, G = 4096, 264
    for N in (4096, 1001):
        for cfg in partials.column_sum_configs("sm_90", N):
            for od in (bf16, f32):
                yield CompileCase("rms_norm", partials._column_sum.build(cfg),
                                  [jit_array(f32, (G, N)), jit_array(od, (N,)), cfg.tile_g,
                                   cfg.tile_n], f"column_sum N={N} {od} {vars(cfg)}")
    for N in AOT_WIDTHS:
        # every config in bf16; the other dtype pairs at their own space's default (the space
        # depends on x's and the weight's element sizes)
        fwd = [(cfg, bf16, bf16) for cfg in _at(N, R.fwd_configs("sm_90", N))]
        fwd += [(next(R.fwd_configs("sm_90", N, xd.itemsize, wd.itemsize)), xd, wd)
                for xd, wd in ((f32, f32), (torch.float16, torch.float16), (bf16, f32))]
        for cfg, xd, wd in fwd:
            params = [jit_array(xd, (M, N)), jit_array(wd, (N,)), jit_array(xd, (M, N)),
                      jit_array(f32, (M,)), F32, F32, cfg.tile_m, cfg.tile_n]
            yield CompileCase("rms_norm", R._fwd.build(cfg), params,
                              f"rms_norm_fwd N={N} {xd} w={wd} {vars(cfg)}")
        x, w, r = jit_array(bf16, (M, N)), jit_array(bf16, (N,)), jit_array(f32, (M,))
        part = jit_array(f32, (G, N))
        if next_pow2(N) <= R.MAX_ROW_TILE:
            for cfg in _at(N, R.bwd_configs("sm_90", N)):
                yield CompileCase("rms_norm", R._bwd.build(cfg),
                                  [x, x, w, r, x, part, F32, cfg.tile_m, cfg.tile_n],
                                  f"rms_norm_bwd N={N} {vars(cfg)}")
        else:
            for cfg in _at(N, R.bwd_coef_configs("sm_90", N)):
                yield CompileCase("rms_norm", R._bwd_coef.build(cfg), [x, x, w, r, r, F32, cfg.tile_n],
                                  f"rms_norm_bwd_coef N={N} {vars(cfg)}")
            for cfg in _at(N, R.bwd_cols_configs("sm_90", N)):
                yield CompileCase("rms_norm", R._bwd_cols.build(cfg),
                                  [x, x, w, r, r, x, part, cfg.tile_m, cfg.tile_n],
                                  f"rms_norm_bwd_cols N={N} {vars(cfg)}")
    for i, shape in enumerate(BATCHED):      # the first shape at every tile, the others' defaults
        N = shape[-1]
        x, w = jit_array(bf16, shape), jit_array(bf16, (N,))
        r, part = jit_array(f32, (M,)), jit_array(f32, (G, N))
        fwd, bwd = tightest(R.fwd_configs("sm_90", N)), tightest(R.bwd_configs("sm_90", N))
        for cfg in fwd if i == 0 else fwd[:1]:
            yield CompileCase("rms_norm", R._fwd.build(cfg),
                              [x, w, x, r, F32, F32, cfg.tile_m, cfg.tile_n],
                              f"rms_norm_fwd {shape} {vars(cfg)}")
        for cfg in bwd if i == 0 else bwd[:1]:
            yield CompileCase("rms_norm", R._bwd.build(cfg),
                              [x, x, w, r, x, part, F32, cfg.tile_m, cfg.tile_n],
                              f"rms_norm_bwd {shape} {vars(cfg)}")


# ---------------------------------------------------------------------------------------------
# Benchmarks. The headline row is the first shape; --full runs them all.

SHAPES = ((16384, 4096, torch.bfloat16), (4096, 8192, torch.bfloat16),
          (32768, 2048, torch.bfloat16), (8192, 5120, torch.float16),
          (2048, 32768, torch.bfloat16))


def _peers(eps):
    peers = {}
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        peers["liger"] = lambda x, w: LigerRMSNormFunction.apply(x, w, eps)
    except Exception:
        pass
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from tilegym.ops.cutile.rms_norm import rms_norm as tilegym_rms_norm
        peers["tilegym"] = lambda x, w: tilegym_rms_norm(x, None, w, eps)
    except Exception:
        pass
    return peers


def bench_cases(full=False):
    eps = 1e-6
    cases = []
    for M, N, dt in SHAPES if full else SHAPES[:1]:
        x = torch.randn(M, N, device="cuda", dtype=dt)
        w = torch.rand(N, device="cuda", dtype=dt) + 0.5
        copy_out = torch.empty_like(x)
        torch_fn = lambda x, w, N=N: torch.nn.functional.rms_norm(x, (N,), w, eps)
        fns = {"torch": torch_fn, "torch_compile": torch.compile(torch_fn), **_peers(eps)}
        name = f"{M}x{N} {str(dt).replace('torch.', '')}"
        nbytes = 2 * x.numel() * x.element_size()
        copy = ("copy", lambda x=x, o=copy_out: o.copy_(x))
        cases.append(BenchCase(
            "rms_norm", name, "fwd", lambda x=x, w=w: R.rms_norm(x, w, eps),
            {k: (lambda f=f, x=x, w=w: f(x, w)) for k, f in fns.items()},
            bytes=nbytes, ceiling=copy))

        xg, wg = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        dy = torch.randn_like(x)

        def train_step(f, xg=xg, wg=wg, dy=dy):   # grad(): no accumulation into .grad
            return lambda: torch.autograd.grad(f(xg, wg), (xg, wg), dy)
        # Liger writes dx into the dy it is given (its in_place default): a dy of its own
        cases.append(BenchCase(
            "rms_norm", name, "fwd+bwd", train_step(lambda a, b: R.rms_norm(a, b, eps)),
            {k: train_step(f, dy=dy.clone()) if k == "liger" else train_step(f)
             for k, f in fns.items()},
            bytes=2.5 * nbytes,   # fwd: read x, write y; bwd: read x and dy, write dx
            ceiling=copy, ceiling_scale=2.5))
    return cases


def bench_host():
    """Host microseconds per call at a tiny shape: a bare ct.launch of the tuned kernel, the
    engine's fast path (key, lookup, grid, arguments, launch), then the whole op (checks,
    output allocation, dispatch) and one training step through autograd against torch's and
    the peers', timed in turns."""
    x = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(1024, device="cuda", dtype=torch.bfloat16)
    y, rstd = torch.empty_like(x), torch.empty(64, device="cuda", dtype=torch.float32)
    eps = 1e-6
    R.launch_fwd(x, w, y, rstd, eps, 64, 1024)
    cfg, kernel = R._fwd.cache[(1024, 64, x.dtype, w.dtype, x.get_device())]
    grid = R._fwd_grid(cfg, 0, x, w, y, rstd, eps, 64, 1024)
    args = R._fwd_args(cfg, x, w, y, rstd, eps, 64, 1024)
    stream = current_stream(0)
    out = host_in_turns({"bare_launch": lambda: ct.launch(stream, grid, kernel, args),
                         "engine_fast_path": lambda: R.launch_fwd(x, w, y, rstd, eps, 64,
                                                                  1024)})
    out["fast_path_over_bare"] = out["engine_fast_path"] / out["bare_launch"]
    xw = leaves(x, w)

    def torch_fn(a, b):
        return torch.nn.functional.rms_norm(a, (1024,), b, eps)
    out.update(host_against_torch(
        lambda: R.rms_norm(x, w), lambda: torch_fn(x, w), grad_step(R.rms_norm, xw),
        grad_step(torch_fn, xw),
        others={f"{name}_step": grad_step(f, xw) for name, f in _peers(eps).items()}))
    return out
