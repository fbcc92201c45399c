"""The fused gate/up projection with the SwiGLU epilogue (swiglu_linear): its benchmark rows
(against torch, cuBLAS with our swiglu, and Liger's SwiGLU on torch's projections when installed)
and its ahead-of-time compile cases."""
import torch
import torch.nn.functional as F

from tiletune.aot import CompileCase, jit_array, space_archs
from tiletune.bench import BenchCase, grad_step, host_against_torch, leaves
from tiletune.ops import gated_mlp as G
from tiletune.ops.swiglu import SILU, swiglu

# ---------------------------------------------------------------------------------------------
# Ahead-of-time compile cases: every sm_90 config for M = K = 4096, N = 14336 bf16, inference and
# training (gate and up stored) kernels; the sm_100 entries that sm_90 lacks; the default config
# for fp16, a ragged key (M = K = 1000, N = 1001, both kernels), decode (M = 1: a constant dim);
# the pre-Hopper pair. The same for the backward's input gradient kernel (dual_product_kernel).
# Arguments come from the tuner's own `args`; the forward's weights are nn.Linear's (N, K)
# tensors seen transposed, with the strides torch gives w.t()[None].

ALIGNED = (4096, 14336, 4096)      # M, N, K


def _weight(dt, N, K):
    return jit_array(dt, (1, K, N), torch.empty(N, K, device="meta").t()[None].stride())


def params(cfg, dt, M, N, K, save, act=SILU):
    """The kernel arguments of cfg for x (M, K) contiguous and (N, K) weights; without `save` y
    stands in for gate and up, as the launch passes it."""
    x, w, y = jit_array(dt, (1, M, K)), _weight(dt, N, K), jit_array(dt, (1, M, N))
    gate, up = (jit_array(dt, (1, M, N)), jit_array(dt, (1, M, N))) if save else (y, y)
    return list(G._args(cfg, x, w, w, y, gate, up, act, save))


def _case(cfg, dt, M, N, K, save, label, spaces=()):
    kind = "training" if save else "inference"
    return CompileCase("gated_mlp", G._gated.build(cfg), params(cfg, dt, M, N, K, save),
                       f"gated_mlp {kind} {label} {vars(cfg)}", spaces=spaces)


def dx_params(cfg, dt, M, N, K):
    """The input gradient kernel's arguments: dgate and dup (M, N) contiguous, the (N, K)
    weights as they are, dx (M, K)."""
    d, w, dx = jit_array(dt, (1, M, N)), jit_array(dt, (1, N, K)), jit_array(dt, (1, M, K))
    return list(G._dx._args(cfg, d, w, d, w, dx))


def _dx_case(cfg, dt, M, N, K, label, spaces=()):
    return CompileCase("gated_mlp", G._dx.build(cfg), dx_params(cfg, dt, M, N, K),
                       f"gated_mlp dx {label} {vars(cfg)}", spaces=spaces)


def _dx_cases(M, N, K):
    """The input gradient kernel: every config of both archs' spaces, then the default at
    fp16, a ragged key, one row (and the entries only one-row keys are offered) and the
    pre-Hopper pair."""
    bf, f16 = torch.bfloat16, torch.float16
    sm90 = list(G.dx_configs("sm_90", M, N, K))
    spaces = space_archs(lambda arch: G.dx_configs(arch, M, N, K))
    for cfg in sm90:
        yield _dx_case(cfg, bf, M, N, K, f"sm_90 space {M}x{N}x{K} bf16", spaces(cfg))
    for cfg in G.dx_configs("sm_100", M, N, K):
        if cfg not in sm90:
            yield _dx_case(cfg, bf, M, N, K, f"sm_100 space {M}x{N}x{K} bf16", spaces(cfg))
    yield _dx_case(sm90[0], f16, M, N, K, f"{M}x{N}x{K} fp16")
    yield _dx_case(sm90[0], bf, 1000, 1001, 1000, "ragged 1000x1001x1000 bf16")
    yield _dx_case(sm90[0], bf, 1, N, K, f"one row 1x{N}x{K} bf16")
    for cfg in G.dx_configs("sm_90", 1, N, K):     # the entries offered to skinny keys only
        if cfg not in sm90:
            yield _dx_case(cfg, bf, 1, N, K, f"sm_90 skinny space 1x{N}x{K} bf16")
    for cfg in G.dx_configs("sm_80", M, N, K):
        yield _dx_case(cfg, bf, M, N, K, "pre-Hopper space bf16")


def compile_cases():
    bf, f16 = torch.bfloat16, torch.float16
    M, N, K = ALIGNED
    yield from _dx_cases(M, N, K)
    sm90 = list(G.configs("sm_90", M, N, K))
    spaces = space_archs(lambda arch: G.configs(arch, M, N, K))
    for cfg in sm90:
        for save in (False, True):
            yield _case(cfg, bf, M, N, K, save, f"sm_90 space {M}x{N}x{K} bf16", spaces(cfg))
    for cfg in G.configs("sm_100", M, N, K):
        if cfg not in sm90:
            yield _case(cfg, bf, M, N, K, False, f"sm_100 space {M}x{N}x{K} bf16", spaces(cfg))
    default = sm90[0]
    yield _case(default, f16, M, N, K, False, f"{M}x{N}x{K} fp16")
    for save in (False, True):
        yield _case(default, bf, 1000, 1001, 1000, save, "ragged 1000x1001x1000 bf16")
    yield _case(default, bf, 1, N, K, False, f"decode 1x{N}x{K} bf16")
    for cfg in G.configs("sm_80", M, N, K):
        yield _case(cfg, bf, M, N, K, False, "pre-Hopper space bf16")


# ---------------------------------------------------------------------------------------------
# Benchmarks. The headline rows: Llama-3-8B's MLP (16384 tokens, hidden 4096, intermediate
# 14336) in bf16, forward and forward + backward (gradients of x and both weights); --full adds
# Llama-2-7B's widths in fp16 and a decode batch of 16 tokens. Peers: torch eager
# (F.silu(F.linear(x, w_gate)) * F.linear(x, w_up)), cuBLAS for the two projections with our
# swiglu kernel, and Liger's SiLU-mul on torch's projections when installed. FLOPs: the two
# projections (2 x 2MNK forward; the backward's four GEMMs twice that).

ROWS = ((16384, 14336, 4096, torch.bfloat16), (8192, 11008, 4096, torch.float16),
        (16, 14336, 4096, torch.bfloat16))     # M, N, K, dtype


def _torch(x, wg, wu):
    return F.silu(F.linear(x, wg)) * F.linear(x, wu)


def _cublas_swiglu(x, wg, wu):
    return swiglu(F.linear(x, wg), F.linear(x, wu))


def _peers():
    peers = {"torch": _torch, "cublas+swiglu": _cublas_swiglu}
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        peers["cublas+liger"] = lambda x, wg, wu: LigerSiLUMulFunction.apply(F.linear(x, wg),
                                                                             F.linear(x, wu))
    except Exception:
        pass
    return peers


def bench_cases(full=False):
    cases = []
    for M, N, K, dt in ROWS if full else ROWS[:1]:
        x = torch.randn(M, K, device="cuda", dtype=dt)
        wg = torch.randn(N, K, device="cuda", dtype=dt) * K ** -0.5
        wu = torch.randn(N, K, device="cuda", dtype=dt) * K ** -0.5
        peers = _peers()
        name = f"{M}x{N}x{K} {str(dt).replace('torch.', '')}"
        flops = 4.0 * M * N * K
        def call(f, args=(x, wg, wu)):
            return lambda: f(*args)
        cases.append(BenchCase(
            "gated_mlp", name, "fwd", call(G.swiglu_linear),
            {k: call(f) for k, f in peers.items()}, flops=flops))

        leaves = tuple(t.detach().clone().requires_grad_() for t in (x, wg, wu))
        dy = torch.randn(M, N, device="cuda", dtype=dt)

        def train_step(f, leaves=leaves, dy=dy):    # grad(): no accumulation into .grad
            return lambda: torch.autograd.grad(f(*leaves), leaves, dy)
        cases.append(BenchCase(
            "gated_mlp", name, "fwd+bwd", train_step(G.swiglu_linear),
            {k: train_step(f) for k, f in peers.items()}, flops=3 * flops))
    return cases


def bench_host():
    """Host microseconds per call at a tiny shape (16 tokens, 512 -> 1024 bf16), against torch's
    `silu(x @ w_gate.T) * (x @ w_up.T)` in eager: the call and one forward+backward step."""
    x = torch.randn(16, 512, device="cuda", dtype=torch.bfloat16)
    wg = torch.randn(1024, 512, device="cuda", dtype=torch.bfloat16) / 512 ** 0.5
    wu = torch.randn_like(wg)

    def torch_fn(x, wg, wu):
        return F.silu(F.linear(x, wg)) * F.linear(x, wu)
    return host_against_torch(lambda: G.swiglu_linear(x, wg, wu), lambda: torch_fn(x, wg, wu),
                              grad_step(G.swiglu_linear, leaves(x, wg, wu)),
                              grad_step(torch_fn, leaves(x, wg, wu)))
