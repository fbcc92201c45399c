"""Matmul's benchmark rows (against cuBLAS and TileGym when installed) and its ahead-of-time
compile cases."""
import torch

from tiletune.aot import CompileCase, jit_array
from tiletune.bench import BenchCase, grad_step, host_against_torch, leaves
from tiletune.ops import matmul as MM

# ---------------------------------------------------------------------------------------------
# Ahead-of-time compile cases (2-D operands, as a 2-D call passes them, except the batched
# ones): every sm_90 and sm_100 config for 4096^3 row-major bf16; the default config for the
# other three layouts, fp16, ragged sizes, batched (Z 8, and Z 1 as 3-D) and decode (M = 1); a
# persistent config batched and ragged; every skinny-only entry, split-K config and sum of a
# skinny key, and one batched ragged fp16 split-K config; the pre-Hopper space. Arguments come
# from the tuner's own `args`.


def _params(cfg, dt, Z, M, N, K, ta=False, tb=False):
    """The kernel arguments of cfg for (Z, M, K) @ (Z, K, N), or for Z None the 2-D (M, K) @
    (K, N) of a 2-D call; ta / tb: column-major A / B."""
    lead, zs = ((), 1) if Z is None else ((Z,), Z)
    batch_a, batch_b = ((), ()) if Z is None else ((M * K,), (K * N,))   # column-major strides
    a = jit_array(dt, (*lead, M, K), (*batch_a, 1, M) if ta else None)
    b = jit_array(dt, (*lead, K, N), (*batch_b, 1, K) if tb else None)
    w = jit_array(torch.float32, (MM.split_of(cfg) * zs, M, N))
    return list(MM._args(cfg, a, b, jit_array(dt, (*lead, M, N)), w))


def _sum_params(cfg, dt, Z, M, N):
    lead, zs = ((), 1) if Z is None else ((Z,), Z)
    return list(MM._sum_args(MM.split_of(cfg), jit_array(dt, (*lead, M, N)),
                             jit_array(torch.float32, (MM.split_of(cfg) * zs, M, N))))


def compile_cases():
    bf, f16 = torch.bfloat16, torch.float16
    for arch in ("sm_90", "sm_100"):
        for cfg in MM.matmul_configs(arch, 4096, 4096, 4096):
            yield CompileCase("matmul", MM._matmul.build(cfg),
                              _params(cfg, bf, None, 4096, 4096, 4096),
                              f"matmul {arch} space 4096^3 bf16 {vars(cfg)}", spaces=(arch,))
    cfg = next(MM.matmul_configs("sm_90", 4096, 4096, 4096))
    for label, shape in [("A^T", (bf, None, 4096, 4096, 4096, True, False)),
                         ("B^T", (bf, None, 4096, 4096, 4096, False, True)),
                         ("A^T B^T", (bf, None, 4096, 4096, 4096, True, True)),
                         ("fp16 ragged 1000x1999x777", (f16, None, 1000, 1999, 777)),
                         ("batched 8x512x1024x4096", (bf, 8, 512, 1024, 4096)),
                         ("batched 1x4096^3 A^T", (bf, 1, 4096, 4096, 4096, True, False)),
                         ("decode 1x4096x4096", (bf, None, 1, 4096, 4096))]:
        yield CompileCase("matmul", MM._matmul.build(cfg), _params(cfg, *shape), f"matmul {label}")
    persistent = next(c for c in MM.matmul_configs("sm_90", 512, 1024, 4096) if c.persistent)
    yield CompileCase("matmul", MM._matmul.build(persistent),
                      _params(persistent, f16, 8, 1000, 1999, 777, True, False),
                      f"matmul persistent batched fp16 ragged A^T {vars(persistent)}")
    sums = set()
    square = list(MM.matmul_configs("sm_90", 4096, 4096, 4096))
    for cfg in MM.matmul_configs("sm_90", 16, 4096, 4096):
        split = MM.split_of(cfg) > 1
        if not split and cfg in square:       # compiled above; the rest is for skinny keys only
            continue
        yield CompileCase("matmul", MM._matmul.build(cfg), _params(cfg, bf, None, 16, 4096, 4096),
                          f"matmul {'split-K partials' if split else 'skinny'} 16x4096x4096 bf16 "
                          f"{vars(cfg)}")
        if split and cfg.split not in sums:
            sums.add(cfg.split)
            yield CompileCase("matmul", MM.splitk_reduce_kernel,
                              _sum_params(cfg, bf, None, 16, 4096),
                              f"matmul split-K sum of {cfg.split} 16x4096 bf16")
    cfg = next(c for c in MM.matmul_configs("sm_90", 128, 270, 2000) if MM.split_of(c) > 1)
    yield CompileCase("matmul", MM._matmul.build(cfg),
                      _params(cfg, f16, 3, 100, 270, 2000, False, True),
                      f"matmul split-K partials batched fp16 ragged B^T {vars(cfg)}")
    yield CompileCase("matmul", MM.splitk_reduce_kernel, _sum_params(cfg, f16, 3, 100, 270),
                      f"matmul split-K sum of {cfg.split} batched fp16 ragged")
    for cfg in MM.matmul_configs("sm_80", 4096, 4096, 4096):
        yield CompileCase("matmul", MM._matmul.build(cfg), _params(cfg, bf, None, 4096, 4096, 4096),
                          f"matmul pre-Hopper default space {vars(cfg)}")


# ---------------------------------------------------------------------------------------------
# Benchmarks, against cuBLAS (torch.matmul) in the same run. Rows: (M, N, K, B column-major).
# The headline rows are a large square GEMM and a skinny one where split-K can win; --full runs
# them all.

HEADLINE = ((4096, 4096, 4096, False), (16, 4096, 4096, False))
SHAPES = ((4096, 4096, 4096, False), (8192, 8192, 8192, False), (16384, 4096, 14336, False),
          (4096, 14336, 4096, False), (4096, 4096, 4096, True), (4096, 14336, 4096, True),
          (16, 4096, 4096, False), (128, 4096, 4096, False), (512, 4096, 4096, False))


def _tilegym_matmul():
    try:
        from tilegym.ops.cutile.matmul import matmul as tg_matmul
        return tg_matmul
    except Exception:
        return None


def bench_cases(full=False):
    tg = _tilegym_matmul()
    cases = []
    for M, N, K, b_t in SHAPES if full else HEADLINE:
        a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
        b = (torch.randn(N, K, device="cuda", dtype=torch.bfloat16).t() if b_t
             else torch.randn(K, N, device="cuda", dtype=torch.bfloat16))
        peers = {"cublas": lambda a=a, b=b: torch.matmul(a, b)}
        if tg is not None:     # TileGym refuses trans_b: it gets B copied to row-major, untimed
            peers["tilegym"] = lambda a=a, b=b.contiguous(): tg(a, b)
        cases.append(BenchCase("matmul", f"{M}x{N}x{K}{' B^T' if b_t else ''} bf16", "fwd",
                               lambda a=a, b=b: MM.matmul(a, b), peers, flops=2.0 * M * N * K))
    return cases


def bench_host():
    """Host microseconds per call at a tiny shape (64x256 @ 256x128 bf16), against `a @ b`: the
    call and one forward+backward step."""
    a = torch.randn(64, 256, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(256, 128, device="cuda", dtype=torch.bfloat16)
    return host_against_torch(lambda: MM.matmul(a, b), lambda: a @ b,
                              grad_step(MM.matmul, leaves(a, b)),
                              grad_step(torch.matmul, leaves(a, b)))
