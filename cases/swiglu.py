"""SwiGLU/GeGLU's benchmark rows (against torch, torch.compile, Liger and TileGym when installed)
and their ahead-of-time compile cases."""
import warnings

import torch

from tiletune.aot import CompileCase, jit_array, tightest
from tiletune.bench import BenchCase, grad_step, host_against_torch, leaves
from tiletune.ops import swiglu as S

# ---------------------------------------------------------------------------------------------
# Ahead-of-time compile cases: every config of both kernels (silu) for an aligned and a ragged
# width in bf16; the default config for the gelu forms, float16/float32, one row, and the
# chunk() halves of a fused (M, 2N) projection at the ragged width, whose `up` half starts
# 2N bytes into the row (not 16-byte aligned: the JIT compiles that layout apart). At the aligned
# width the halves' signature is the contiguous one (row stride 2N is as divisible as N).

AOT_WIDTHS = (14336, 1001)
M = 4096


def _case(kind, cfg, arrays, act, label):
    tuner = S._fwd if kind == "fwd" else S._bwd
    return CompileCase("swiglu", tuner.build(cfg), [*arrays, act, cfg.tile_m, cfg.tile_n],
                       f"swiglu_{kind} {label} act={act} {vars(cfg)}")


def _arrays(kind, dt, rows, N, chunked=False):
    """The kernel's array arguments: gate and up (chunk() halves of a (rows, 2N) tensor when
    `chunked`), then the contiguous ones (out; or dy first and dgate, dup last)."""
    c = jit_array(dt, (rows, N))
    if chunked:
        g = jit_array(dt, (rows, N), (2 * N, 1))
        u = jit_array(dt, (rows, N), (2 * N, 1), base_aligned=N * dt.itemsize % 16 == 0)
    else:
        g = u = c
    return [g, u, c] if kind == "fwd" else [c, g, u, c, c]


def compile_cases():
    bf16 = torch.bfloat16
    for N in AOT_WIDTHS:       # every config at the first width; aot.tightest at the other
        cfgs = list(S.configs("sm_90", N))
        if N != AOT_WIDTHS[0]:
            cfgs = tightest(cfgs)
        for kind in ("fwd", "bwd"):
            for cfg in cfgs:
                yield _case(kind, cfg, _arrays(kind, bf16, M, N), S.SILU, f"N={N} bf16")
            default = cfgs[0]
            for act in (S.GELU_TANH, S.GELU_ERF):
                yield _case(kind, default, _arrays(kind, bf16, M, N), act, f"N={N} bf16")
            for dt in (torch.float16, torch.float32):
                yield _case(kind, default, _arrays(kind, dt, M, N), S.SILU, f"N={N} {dt}")
            yield _case(kind, default, _arrays(kind, bf16, 1, N), S.SILU, f"N={N} bf16 one row")
            if N * bf16.itemsize % 16:
                yield _case(kind, default, _arrays(kind, bf16, M, N, chunked=True), S.SILU,
                            f"N={N} bf16 chunk() halves")
    # Both kernels on (..., N) tensors they view as rows: (B, S, N) (gate and up the chunk()
    # halves of one tensor) at each config differing in more than occupancy, decode's (B, 1, N)
    # at the default (the view is the same code at every tile).
    N = AOT_WIDTHS[0]
    for shape in ((4, M // 4, N), (M, 1, N)):
        whole = jit_array(bf16, shape)
        half = jit_array(bf16, shape, (shape[1] * 2 * N, 2 * N, 1))
        cfgs = tightest(S.configs("sm_90", N))
        for cfg in cfgs if shape[1] > 1 else cfgs[:1]:
            yield _case("fwd", cfg, [half, half, whole], S.SILU, f"{shape} bf16")
            yield _case("bwd", cfg, [whole, half, half, whole, whole], S.SILU, f"{shape} bf16")


# ---------------------------------------------------------------------------------------------
# Benchmarks. The headline rows: swiglu at Llama-3-8B's MLP (16384 tokens x 14336), gate and up
# from separate projections. --full adds GeGLU, other widths and the chunk() halves of a fused
# gate_up projection (read in place by ours and torch; Liger and TileGym copy them).

# (activation, M, N, dtype, fused): fused takes gate, up = gate_up.chunk(2, -1)
ROWS = (("swiglu", 16384, 14336, torch.bfloat16, False),
        ("swiglu", 8192, 11008, torch.bfloat16, False),
        ("swiglu", 4096, 14336, torch.bfloat16, True),
        ("geglu_tanh", 16384, 14336, torch.bfloat16, True),
        ("geglu_none", 8192, 11008, torch.float16, False))

_OURS = {"swiglu": S.swiglu, "geglu_tanh": lambda g, u: S.geglu(g, u, "tanh"),
         "geglu_none": lambda g, u: S.geglu(g, u, "none")}


def _torch_fn(act):
    F = torch.nn.functional
    if act == "swiglu":
        return lambda g, u: F.silu(g) * u
    approximate = act.split("_")[1]
    return lambda g, u: F.gelu(g, approximate=approximate) * u


def _peers(act):
    """act -> {label: fn(gate, up)} of the peers installed here."""
    peers = {}
    try:
        if act == "swiglu":
            from liger_kernel.ops.swiglu import LigerSiLUMulFunction
            peers["liger"] = LigerSiLUMulFunction.apply
        elif act == "geglu_tanh":
            from liger_kernel.ops.geglu import LigerGELUMulFunction
            peers["liger"] = LigerGELUMulFunction.apply
    except Exception:
        pass
    if act == "swiglu":
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                from tilegym.ops.cutile.swiglu import swiglu as tilegym_swiglu
            peers["tilegym"] = tilegym_swiglu
        except Exception:
            pass
    return peers


def bench_cases(full=False):
    cases = []
    for act, M_, N, dt, fused in ROWS if full else ROWS[:1]:
        if fused:
            leaves = (torch.randn(M_, 2 * N, device="cuda", dtype=dt),)
            split = lambda gu: gu.chunk(2, dim=-1)
        else:
            leaves = (torch.randn(M_, N, device="cuda", dtype=dt),
                      torch.randn(M_, N, device="cuda", dtype=dt))
            split = lambda g, u: (g, u)
        gate, up = split(*leaves)
        torch_fn = _torch_fn(act)
        fns = {"torch": torch_fn, "torch_compile": torch.compile(torch_fn), **_peers(act)}
        ours = _OURS[act]
        name = f"{act} {M_}x{N} {str(dt).replace('torch.', '')}{' chunk()' if fused else ''}"
        nbytes = 3 * M_ * N * gate.element_size()       # read gate and up, write the product
        src, copy_out = torch.randn(M_, N, device="cuda", dtype=dt), torch.empty(
            M_, N, device="cuda", dtype=dt)
        copy = ("copy", lambda o=copy_out, s=src: o.copy_(s))    # moves 2 x M x N elements
        cases.append(BenchCase(
            "swiglu", name, "fwd", lambda f=ours, g=gate, u=up: f(g, u),
            {k: (lambda f=f, g=gate, u=up: f(g, u)) for k, f in fns.items()},
            bytes=nbytes, ceiling=copy, ceiling_scale=1.5))

        grads = tuple(t.detach().clone().requires_grad_() for t in leaves)
        dy = torch.randn(M_, N, device="cuda", dtype=dt)

        def train_step(f, grads=grads, dy=dy, split=split):   # grad(): no accumulation
            return lambda: torch.autograd.grad(f(*split(*grads)), grads, dy)
        # Liger's backward writes the gradients into the inputs it saved: inputs of its own
        cases.append(BenchCase(
            "swiglu", name, "fwd+bwd", train_step(ours),
            {k: train_step(f, grads=tuple(t.detach().clone().requires_grad_() for t in leaves))
             if k == "liger" else train_step(f) for k, f in fns.items()},
            bytes=nbytes * 8 / 3,   # fwd: read gate, up, write y; bwd: read dy, gate, up, write 2
            ceiling=copy, ceiling_scale=4.0))
    return cases


def bench_host():
    """Host microseconds per call at a tiny shape (64x1024 bf16), against torch's
    `silu(gate) * up` in eager: the call and one forward+backward step."""
    gate = torch.randn(64, 1024, device="cuda", dtype=torch.bfloat16)
    up = torch.randn_like(gate)

    def torch_fn(g, u):
        return torch.nn.functional.silu(g) * u
    return host_against_torch(lambda: S.swiglu(gate, up), lambda: torch_fn(gate, up),
                              grad_step(S.swiglu, leaves(gate, up)),
                              grad_step(torch_fn, leaves(gate, up)))
