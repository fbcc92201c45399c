"""Grouped GEMM's benchmark rows (against torch._grouped_mm, a loop of cuBLAS calls, and
TileGym's group_gemm when installed) and its ahead-of-time compile cases."""
from types import SimpleNamespace

import cuda.tile as ct
import torch

from tiletune.aot import CompileCase, jit_array, space_archs
from tiletune.bench import BenchCase, grad_step, host_against_torch, leaves
from tiletune.ops import grouped_gemm as GG

# ---------------------------------------------------------------------------------------------
# Ahead-of-time compile cases: every config of both kernels (sm_90, sm_100 and pre-Hopper
# spaces, each config once) at the Mixtral gate key (E 8, T 16384, K 4096, N 14336, w an
# (E, N, K) weight seen transposed; the K-grouped kernel as the weight gradient dW^T = dY^T x);
# then each kernel's default in both load styles for the row-major weight, fp16, odd K and N
# (4095 x 1000), E 256, T 1 and a transposed x. Arguments come from the kernels' `_args`.


def _m_params(cfg, dt, E, T, K, N, w_t=True, x_t=False):
    """cfg's M-grouped arguments: x (T, K) (x_t: a transposed view), w (E, K, N) (w_t: the
    transposed view of (E, N, K)), offs (E,) int32, out (T, N)."""
    x = jit_array(dt, (T, K), (1, T) if x_t else None)
    w = jit_array(dt, (E, K, N), (N * K, 1, K) if w_t else None)
    table = jit_array(torch.int32, (5, _most_items(cfg, E, T, N)))
    return list(GG._args(cfg, x, w, jit_array(torch.int32, (E,)), jit_array(dt, (T, N)), table))


def _most_items(cfg, E, T, N):
    return (GG.cdiv(T, cfg.tm) + E + 1) * GG.cdiv(N, cfg.tn)


def _schedule_params(cfg, E, T, N):
    """The schedule kernel's arguments for cfg's table at E groups of T rows, N columns."""
    return [jit_array(torch.int32, (E,)), jit_array(torch.int32, (5, _most_items(cfg, E, T, N))),
            T, cfg.tm, GG.cdiv(N, cfg.tn), GG.next_pow2(E + 1), GG.SCHEDULE_CHUNK]


def _k_params(cfg, dt, E, T, M, N):
    """cfg's K-grouped arguments as the weight gradient passes them: a (M, T) the transposed
    view of a (T, M) activation, b (T, N), offs (E,), out (E, M, N)."""
    a = jit_array(dt, (M, T), (1, M))
    return list(GG._k_args(cfg, a, jit_array(dt, (T, N)), jit_array(torch.int32, (E,)),
                         jit_array(dt, (E, M, N))))


def _both_styles(gen, *shape):
    """The default config and its twin in the other load style."""
    cfg = next(gen("sm_90", *shape))
    return [cfg, SimpleNamespace(**{**vars(cfg), "gather": not cfg.gather})]


def compile_cases():
    bf, f16 = torch.bfloat16, torch.float16
    key = (bf, 8, 16384, 4096, 14336)
    spaces = [("grouped_mm", GG._grouped,
               lambda arch: GG.grouped_configs(arch, 16384, 8, 4096, 14336),
               lambda cfg: _m_params(cfg, *key), "E8 16384x4096x14336 w^T bf16"),
              ("grouped_mm dW", GG._k_grouped,
               lambda arch: GG.k_grouped_configs(arch, 16384, 8, 14336, 4096),
               lambda cfg: _k_params(cfg, bf, 8, 16384, 14336, 4096),
               "E8 T16384 14336x4096 bf16")]
    small = (bf, 128, 2048, 2048, 1536)      # 16 rows a group: the space's short tiles
    spaces.insert(1, ("grouped_mm", GG._grouped,
                      lambda arch: GG.grouped_configs(arch, 2048, 128, 2048, 1536),
                      lambda cfg: _m_params(cfg, *small), "E128 2048x2048x1536 w^T bf16"))
    seen = {}
    for name, tuner, gen, params, label in spaces:
        archs_of = space_archs(gen)
        for arch in ("sm_90", "sm_100", "sm_80"):      # each config once, under its first arch
            for cfg in gen(arch):
                if cfg not in seen.setdefault(tuner, []):
                    seen[tuner].append(cfg)
                    yield CompileCase("grouped_gemm", tuner.build(cfg), params(cfg),
                                      f"{name} {arch} space {label} {vars(cfg)}",
                                      spaces=archs_of(cfg))
    for label, shape, kw in [("row-major w", key, {"w_t": False}),
                             ("fp16", (f16, 8, 16384, 4096, 14336), {}),
                             ("odd K N 4095x1000", (bf, 8, 4096, 4095, 1000), {}),
                             ("E256", (bf, 256, 32768, 2048, 1536), {}),
                             ("T1", (bf, 8, 1, 4096, 14336), {}),
                             ("x transposed (2-D x 2-D's db)", key, {"x_t": True})]:
        dt, E, T, K, N = shape
        for cfg in _both_styles(GG.grouped_configs, T, E, K, N):
            yield CompileCase("grouped_gemm", GG._grouped.build(cfg),
                              _m_params(cfg, *shape, **kw), f"grouped_mm {label} {vars(cfg)}")
    # the table walk: its kernels at fp16 with odd K and N, and the schedule kernel at the
    # group counts whose tiles differ in size
    tables = {cfg.tm: cfg for arch in ("sm_90", "sm_100")
              for cfg in GG.grouped_configs(arch, 32768, 256, 2048, 1536) if cfg.walk == GG.TABLE}
    for cfg in GG.grouped_configs("sm_90", 4096, 8, 4095, 1000):
        if cfg.walk == GG.TABLE:
            yield CompileCase("grouped_gemm", GG._grouped.build(cfg),
                              _m_params(cfg, f16, 8, 4096, 4095, 1000),
                              f"grouped_mm table fp16 odd K N 4095x1000 {vars(cfg)}")
    for cfg in tables.values():
        for E in (1, 8, 128, 256, GG.TABLE_MAX_GROUPS):
            yield CompileCase("grouped_gemm", GG.grouped_schedule_kernel,
                              _schedule_params(cfg, E, 32768, 1536),
                              f"grouped_mm schedule E{E} {vars(cfg)}")
    for label, shape in [("fp16 odd 4095x1000", (f16, 8, 4096, 4095, 1000)),
                         ("E256", (bf, 256, 32768, 2048, 1536)),
                         ("T1", (bf, 8, 1, 4096, 14336))]:
        dt, E, T, M, N = shape
        for cfg in _both_styles(GG.k_grouped_configs, T, E, M, N):
            style = "gathers (pre-Hopper only) " if cfg.gather else ""
            yield CompileCase("grouped_gemm", GG._k_grouped.build(cfg), _k_params(cfg, *shape),
                              f"grouped_mm dW {label} {style}{vars(cfg)}")


# ---------------------------------------------------------------------------------------------
# Benchmarks: MoE expert projections, weights (E, N, K) passed transposed as torchtitan does,
# tokens split evenly or Zipf-like (expert i gets a share ~ 1 / (i + 1), the last none). Peers:
# torch._grouped_mm (CUTLASS), a loop of cuBLAS calls over the groups (counts read on the host
# once, at setup), TileGym's group_gemm (lists of tensors, forward only) when installed.

SHAPES = [  # name, E, T, K, N, zipf
    ("Mixtral gate", 8, 16384, 4096, 14336, False),
    ("Mixtral down", 8, 16384, 14336, 4096, False),
    ("Qwen3-MoE gate_up", 128, 32768, 2048, 1536, False),
    ("Qwen3-MoE down", 128, 32768, 768, 2048, False),
    ("DeepSeek-like gate_up", 32, 16384, 7168, 4096, False),
    ("DeepSeek-like down", 32, 16384, 2048, 7168, False),
    ("Mixtral gate", 8, 16384, 4096, 14336, True),
    ("Qwen3-MoE gate_up", 128, 32768, 2048, 1536, True),
    ("Mixtral gate", 8, 64, 4096, 14336, False),             # small groups: 8 rows a group
    ("Qwen3-MoE gate_up", 128, 1024, 2048, 1536, False),
]
HEADLINE = [(SHAPES[0], "fwd"), (SHAPES[2], "fwd+bwd")]


def split(T, E, zipf):
    """Rows per group: even (the remainder to the first groups), or Zipf-like with the last
    group empty."""
    if not zipf:
        return [T // E + (g < T % E) for g in range(E)]
    weights = [1.0 / (g + 1) for g in range(E - 1)] + [0.0]
    counts = [int(T * w / sum(weights)) for w in weights]
    counts[0] += T - sum(counts)
    return counts


def _tilegym():
    try:
        from tilegym.ops.cutile.group_gemm import group_gemm
    except Exception:
        return None

    def call(xs, ws):
        """TileGym's search caps each compile at 5 s, which its 128-wide tiles exceed on a
        16-core H100 host: every config failed and the row had no TileGym time. Its calls run
        with the cap at 120 s (it matters only in its search), so the row times its tuned
        kernel."""
        real = ct.compiler_timeout
        ct.compiler_timeout = lambda seconds: real(max(seconds, 120))
        try:
            return group_gemm(xs, ws, transpose_b=True)
        finally:
            ct.compiler_timeout = real
    return call


def _loop(x, w, counts):
    """The cuBLAS loop: one torch.mm per non-empty group into its rows of one output (no copy
    after), or under autograd (whose mm takes no `out=`) concatenated. Under autograd the
    groups are x.split and w.unbind views, whose backwards assemble dx and dW in one pass each
    (a cat, a stack): x[s:s + c] and w[g] would make autograd build a zero-filled gradient of
    the whole x and the whole w for every group and add them up, E passes over each."""
    if torch.is_grad_enabled() and (x.requires_grad or w.requires_grad):
        groups = zip(x.split(counts), w.unbind(0), counts)
        return torch.cat([torch.mm(xg, wg) for xg, wg, c in groups if c])
    out, s = x.new_empty(x.shape[0], w.shape[2]), 0
    for g, c in enumerate(counts):
        if c:
            torch.mm(x[s:s + c], w[g], out=out[s:s + c])
        s += c
    return out


def bench_cases(full=False):
    tg = _tilegym()
    rows = [(s, m) for s in SHAPES for m in ("fwd", "fwd+bwd")] if full else HEADLINE
    cases = []
    for (name, E, T, K, N, zipf), mode in rows:
        dt = torch.bfloat16
        counts = split(T, E, zipf)
        offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
        x = torch.randn(T, K, device="cuda", dtype=dt)
        w_nk = torch.randn(E, N, K, device="cuda", dtype=dt) / K ** 0.5
        w = w_nk.transpose(-2, -1)
        label = f"{name} E{E} {T}x{K}x{N}{' zipf' if zipf else ''} bf16"
        flops = 2.0 * T * K * N
        peers = {"torch_grouped_mm": lambda x, w, offs=offs: torch._grouped_mm(x, w, offs=offs),
                 "cublas_loop": lambda x, w, counts=counts: _loop(x, w, counts)}
        if mode == "fwd":
            fns = {k: (lambda f=f, x=x, w=w: f(x, w)) for k, f in peers.items()}
            if tg is not None:    # (N, K) weights with transpose_b, as TileGym takes them
                xs = [x[s - c:s] for c, s in zip(counts, offs.tolist()) if c]
                ws = [w_nk[g] for g, c in enumerate(counts) if c]
                fns["tilegym"] = lambda xs=xs, ws=ws: tg(xs, ws)
            cases.append(BenchCase("grouped_gemm", label, "fwd",
                                   lambda x=x, w=w, offs=offs: GG.grouped_mm(x, w, offs), fns,
                                   flops=flops))
            continue
        xg, wg = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
        dy = torch.randn(T, N, device="cuda", dtype=dt)

        def step(f, xg=xg, wg=wg, dy=dy):     # grad(): no accumulation into .grad
            return lambda: torch.autograd.grad(f(xg, wg), (xg, wg), dy)
        ours = lambda x, w, offs=offs: GG.grouped_mm(x, w, offs)
        cases.append(BenchCase("grouped_gemm", label, "fwd+bwd", step(ours),
                               {k: step(f) for k, f in peers.items()}, flops=3 * flops))
    return cases


def bench_host():
    """Host microseconds per call at a tiny shape (64 rows over 4 groups, K 128, N 256 bf16),
    against `torch._grouped_mm`: the call and one forward+backward step."""
    x = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4, 256, 128, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    offs = torch.tensor([16, 32, 48, 64], device="cuda", dtype=torch.int32)

    def torch_fn(x, w):
        return torch._grouped_mm(x, w, offs=offs)

    def ours(x, w):
        return GG.grouped_mm(x, w, offs)
    return host_against_torch(lambda: ours(x, w), lambda: torch_fn(x, w),
                              grad_step(ours, leaves(x, w)), grad_step(torch_fn, leaves(x, w)))
