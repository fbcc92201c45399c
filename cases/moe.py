"""MoE routing's benchmark rows (moe_permute + moe_unpermute against a torch argsort /
index_select / index_add implementation and its torch.compile; with --full the whole experts
block against transformers' Qwen3MoeExperts loop and its torch._grouped_mm path) and its
ahead-of-time compile cases. Liger and TileGym have no permute/unpermute pair to compare with
(TileGym's MoE is an inference-only fused kernel over vLLM-style padded blocks)."""
import torch

from tiletune.aot import CompileCase, jit_array
from tiletune.bench import BenchCase, grad_step, host_against_torch, leaves
from tiletune.ops import moe as M

# ---------------------------------------------------------------------------------------------
# Ahead-of-time compile cases: every config of every kernel variant (permute's scatter,
# unpermute's weighted gather, permute's backward gather, unpermute's backward scatter with and
# without the weights' gradient) for bf16 at H 2048 (k 8, T 16384) and a ragged H 1000 (k 6,
# T 4097: padded slots, a partial token block); the default config for fp16 and float32, float32
# routing weights with bf16 rows, int64 indices, and k 1 and 2.

VARIANTS = ("permute", "permute_bwd", "unpermute", "unpermute_bwd", "unpermute_bwd_dw")


def _params(variant, cfg, dt, T, k, H, idx_dt=torch.int32, w_dt=None):
    """The variant's kernel and its arguments from the tuner's own `args`."""
    rows, idx = jit_array(dt, (T, H)), jit_array(idx_dt, (T, k))
    srt, w = jit_array(dt, (T * k, H)), jit_array(w_dt or dt, (T, k))
    tuner, inputs = {
        "permute": (M._permute_fwd, (rows, idx, srt)),
        "permute_bwd": (M._permute_bwd, (srt, idx, rows)),
        "unpermute": (M._unpermute_fwd, (srt, idx, w, rows)),
        "unpermute_bwd": (M._unpermute_bwd, (rows, idx, w, srt, srt, w, False)),
        "unpermute_bwd_dw": (M._unpermute_bwd, (rows, idx, w, srt, srt, w, True)),
    }[variant]
    return tuner.build(cfg), list(tuner._args(cfg, *inputs))


def compile_cases():
    bf, f16, f32 = torch.bfloat16, torch.float16, torch.float32
    seen = []
    for T, k, H in ((16384, 8, 2048), (4097, 6, 1000)):
        for cfg in M.configs("sm_90", H, k):
            if cfg in seen:          # each config once (the spaces of the two shapes overlap)
                continue
            seen.append(cfg)
            for v in VARIANTS:
                kernel, params = _params(v, cfg, bf, T, k, H)
                yield CompileCase("moe", kernel, params, f"{v} T{T} k{k} H{H} bf16 {vars(cfg)}")
    extra = [("fp16", f16, 16384, 8, 2048, {}), ("f32", f32, 4097, 6, 1000, {}),
             ("bf16 f32 weights", bf, 16384, 8, 2048, {"w_dt": f32}),
             ("bf16 int64 indices", bf, 4097, 6, 1000, {"idx_dt": torch.int64}),
             ("bf16 k1", bf, 8192, 1, 4096, {}), ("fp16 k2", f16, 4097, 2, 1000, {})]
    for label, dt, T, k, H, kw in extra:
        cfg = next(M.configs("sm_90", H, k))
        for v in VARIANTS:
            kernel, params = _params(v, cfg, dt, T, k, H, **kw)
            yield CompileCase("moe", kernel, params, f"{v} T{T} k{k} H{H} {label} {vars(cfg)}")


# ---------------------------------------------------------------------------------------------
# Benchmarks. Routing: uniform random top-k experts per token (distinct per token), softmax
# weights in the model dtype as transformers' routers return them.

ROUTING = (16384, 4096, 128, 8)                 # T, H, E, k
EXPERTS = (8192, 2048, 768, 128, 8)             # Qwen3-MoE-30B-A3B: T, H, I, E, k


def routing(T, E, k, dt, seed=0):
    """(topk_ids int64, topk_weights) as a top-k router makes them."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(T, E, device="cuda", generator=g)
    w, ids = torch.topk(logits.softmax(-1), k, dim=-1)
    return ids, (w / w.sum(-1, keepdim=True)).to(dt)


def torch_permute_unpermute(x, ids, w, E):
    """The torch reference: stable argsort of the ids, index_select of the rows, counts by
    searchsorted (no host sync), and index_add of the weighted rows back into float32."""
    T, k = ids.shape
    order = torch.argsort(ids.reshape(-1), stable=True)
    token = order // k
    x_sorted = x.index_select(0, token)
    offs = torch.searchsorted(ids.reshape(-1)[order],
                              torch.arange(E, device=x.device, dtype=ids.dtype), right=True)
    out = torch.zeros(T, x.shape[1], device=x.device, dtype=torch.float32)
    out.index_add_(0, token, x_sorted.float() * w.reshape(-1)[order, None].float())
    return out.to(x.dtype), offs


def _ours(x, ids, w, E):
    x_sorted, offs, inverse = M.moe_permute(x, ids, E)
    return M.moe_unpermute(x_sorted, inverse, w), offs


def hf_experts(impl, gate_up, down, k):
    """transformers' Qwen3MoeExperts ("eager": its loop; "grouped_mm": torch._grouped_mm) on
    copies of these weights, on their device in their dtype."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts
    E, H, I = down.shape
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E,
                         num_experts_per_tok=k, hidden_act="silu", experts_implementation=impl)
    m = Qwen3MoeExperts(cfg).to(device=gate_up.device, dtype=gate_up.dtype)
    with torch.no_grad():
        m.gate_up_proj.copy_(gate_up)
        m.down_proj.copy_(down)
    return m


def _routing_cases(dt=torch.bfloat16):
    T, H, E, k = ROUTING
    x = torch.randn(T, H, device="cuda", dtype=dt)
    ids, w = routing(T, E, k, dt)
    name = f"T{T} H{H} E{E} k{k} {str(dt).replace('torch.', '')}"
    peers = {"torch": torch_permute_unpermute,
             "torch_compile": torch.compile(torch_permute_unpermute)}
    # bytes in units of T*H elements: forward (1 + k) each way; backward 1 + 2k (unpermute:
    # dout in, dy_sorted out, y_sorted in for the weights' gradient) and k + 1 (permute)
    unit = T * H * x.element_size()
    src = torch.empty(T * k, H, device="cuda", dtype=dt)
    dst = torch.empty_like(src)
    ceiling = ("copy", lambda: dst.copy_(src))       # moves 2k units
    cases = [BenchCase("moe", name, "fwd", lambda: _ours(x, ids, w, E),
                       {n: (lambda f=f: f(x, ids, w, E)) for n, f in peers.items()},
                       bytes=2 * (1 + k) * unit, ceiling=ceiling, ceiling_scale=(1 + k) / k)]
    xg, wg = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    dy = torch.randn(T, H, device="cuda", dtype=dt)

    def train(f):
        return grad_step(lambda a, b: f(a, ids, b, E)[0], (xg, wg), dy)
    cases.append(BenchCase("moe", name, "fwd+bwd", train(_ours),
                           {n: train(f) for n, f in peers.items()},
                           bytes=(4 + 5 * k) * unit, ceiling=ceiling,
                           ceiling_scale=(4 + 5 * k) / (2 * k)))
    return cases


def _experts_cases(dt=torch.bfloat16):
    T, H, I, E, k = EXPERTS
    x = torch.randn(T, H, device="cuda", dtype=dt)
    ids, w = routing(T, E, k, dt)
    gate_up = torch.randn(E, 2 * I, H, device="cuda", dtype=dt) / H ** 0.5
    down = torch.randn(E, H, I, device="cuda", dtype=dt) / I ** 0.5
    loop = hf_experts("eager", gate_up, down, k)
    grouped = hf_experts("grouped_mm", gate_up, down, k)
    name = f"Qwen3-MoE experts T{T} H{H} I{I} E{E} k{k} {str(dt).replace('torch.', '')}"
    flops = 2.0 * T * k * (3 * H * I)
    ours = lambda x, w, gu, dn: M.moe_experts(x, ids, w, gu, dn)

    def no_grad(m):          # the modules' parameters require grad: no graph in the fwd rows
        def run(x, w, gu, dn):
            with torch.no_grad():
                return m(x, ids, w)
        return run
    hf = {"hf_loop": no_grad(loop), "hf_grouped_mm": no_grad(grouped)}
    cases = [BenchCase("moe", name, "fwd", lambda: ours(x, w, gate_up, down),
                       {n: (lambda f=f: f(x, w, gate_up, down)) for n, f in hf.items()},
                       flops=flops)]
    # gradients for the activations, the routing weights and both expert weights
    xg, wg = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    gug, dng = gate_up.detach().clone().requires_grad_(), down.detach().clone().requires_grad_()
    dy = torch.randn(T, H, device="cuda", dtype=dt)
    mods = {"hf_loop": loop, "hf_grouped_mm": grouped}

    def hf_step(m):
        params = (xg, wg, m.gate_up_proj, m.down_proj)
        return lambda: torch.autograd.grad(m(xg, ids, wg), params, dy)
    cases.append(BenchCase("moe", name, "fwd+bwd", grad_step(ours, (xg, wg, gug, dng), dy),
                           {n: hf_step(m) for n, m in mods.items()}, flops=3 * flops))
    return cases


def bench_cases(full=False):
    cases = _routing_cases()
    if full:
        cases += _experts_cases()
    return cases


def bench_host():
    """Host microseconds per call at a tiny shape (64 tokens, H 256, 8 experts, top-2 bf16):
    permute then unpermute against the torch reference of the rows above, the call and one
    forward+backward step."""
    T, H, E, k = 64, 256, 8, 2
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    ids, w = routing(T, E, k, torch.bfloat16)

    def step(f):
        return grad_step(lambda a, b: f(a, ids, b, E)[0], leaves(x, w))
    return host_against_torch(lambda: _ours(x, ids, w, E),
                              lambda: torch_permute_unpermute(x, ids, w, E),
                              step(_ours), step(torch_permute_unpermute))
