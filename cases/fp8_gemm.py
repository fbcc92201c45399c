"""FP8 GEMM's benchmark rows (against torch._scaled_mm in the same scaling and accumulation
mode), the quantizers' rows (against a copy of the input and the torch reference), and the
ahead-of-time compile cases of both."""
import torch

from tiletune.aot import F32, CompileCase, jit_array, space_archs, tightest
from tiletune.bench import BenchCase, host_against_torch
from tiletune.ops import fp8_gemm as F8
from tiletune.ops import matmul as MM

E4M3, E5M2, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
KB = F8.BLOCK

# ---------------------------------------------------------------------------------------------
# Ahead-of-time compile cases. GEMM: every config of both kernel families at 4096^3, rowwise /
# 1x128 x 128x128, e4m3, B column-major, bf16 out: the exact-accumulation spaces of sm_90, sm_100
# and other archs (each config once) and sm_90's fast-accumulation space of the rowwise kernel
# (use_fast_acc changes the kernel; block scaling has one mode); then the exact default in every
# other variant the op launches: tensorwise (one-element scales), row-major B, e4m3 x e5m2 both
# ways (float16 path), fp32 out (fp16 compiles as bf16 does), ragged sizes, decode (M = 1), the
# other two block pairings, K-major scale_a, K not a multiple of 128. The skinny keys' own
# entries (split-K among them) at 128x4096x4096, split-K once more with e4m3 x e5m2, and the
# split-K sum for each split, tensorwise and rowwise scales and each output dtype.
# Quantizers: every config of each kernel at 4096 x 4096 bf16; the other keys with a space of
# their own (the row space at K 14336, where rows are read in chunks, and the transposed-view
# spaces) compile their default and each (tile, warps) pair once, at its highest occupancy:
# occupancy only caps the registers (a tighter cap spills, it does not fail), and the GPU tests
# run every config. Then the defaults for fp32 input (fp16 compiles as bf16 does), e5m2 output,
# ragged and transposed x (the pair quantizer launches a transposed x as its row-major x.t()),
# and a single row. Arguments come from the op's own `args` functions.


def _scale_params(mode, M, N):
    """Tensorwise and rowwise scales as fp8_mm passes them on: as the caller gave them. mode
    "row": (M, 1) and quantize_fp8's (N, 1) weight scales transposed, (1, N) with unit strides;
    "tensor": 0-D (torch's scalar tensors); "tensor (1,)": one-element vectors."""
    if mode == "row":
        return jit_array(torch.float32, (M, 1)), jit_array(torch.float32, (1, N), (1, 1))
    shape = (1,) if mode == "tensor (1,)" else ()
    return jit_array(torch.float32, shape), jit_array(torch.float32, shape)


def _gemm_params(cfg, M, N, K, *, mode="row", a_dt=E4M3, b_dt=E4M3, b_col=True, out=BF16,
                 fast=False):
    a = jit_array(a_dt, (M, K))
    b = jit_array(b_dt, (K, N), (1, K) if b_col else None)
    sa, sb = _scale_params(mode, M, N)
    w = jit_array(torch.float32, (F8.split_of(cfg), M, N))         # split-K's partials
    return list(F8._args(cfg, a, b, sa, sb, jit_array(out, (M, N)), fast and a_dt == b_dt,
                          a_dt != b_dt, w))


def _sum_params(split, M, N, *, mode="row", out=BF16):
    """The split-K sum's arguments: the partials, the scales, the output."""
    return [jit_array(torch.float32, (split, M, N)),
            *_scale_params(mode, M, N),
            jit_array(out, (M, N)), *F8.SUM_TILE, split]


def _block_params(cfg, M, N, K, *, pairing=(1, KB), a_dt=E4M3, b_dt=E4M3, sa_m_major=True):
    """pairing (a_group, b_group): (1, 128) 1x128 x 128x128, (1, 1) 1x128 x 1x128, (128, 1)
    128x128 x 1x128. scale_a M-major as torch wants it (sa_m_major) or K-major."""
    a_group, b_group = pairing
    kb = F8.cdiv(K, KB)
    sa_rows = F8.cdiv(M, a_group)
    sa = jit_array(torch.float32, (sa_rows, kb), (1, sa_rows) if sa_m_major else None)
    sb_cols = F8.cdiv(N, b_group)
    # the transposed weight scales: quantize_fp8's 128x128 (MB, KB) rows or 1x128 (N, KB) M-major
    sb = jit_array(torch.float32, (kb, sb_cols),
                   (1, F8.f32_row(kb)) if b_group > 1 else (F8.f32_row(sb_cols), 1))
    a = jit_array(a_dt, (M, K))
    b = jit_array(b_dt, (K, N), (1, K))
    w = jit_array(torch.float32, (F8.split_of(cfg), M, N))         # split-K's partials
    return list(F8._block_args(cfg, a, b, sa, sb, jit_array(BF16, (M, N)), False,
                                a_dt != b_dt, a_group, b_group, w))


def _each_once(gen, archs, *shape, **kw):
    seen = []
    for arch in archs:
        for cfg in gen(arch, *shape, **kw):
            if cfg not in seen:
                seen.append(cfg)
                yield arch, cfg


def _gemm_cases():
    sq = (4096, 4096, 4096)
    # exact accumulation: every arch's space; fast accumulation: sm_90's (cuTile ignores
    # use_fast_acc elsewhere)
    for fast, archs in ((False, ("sm_90", "sm_100", "sm_120")), (True, ("sm_90",))):
        acc = "fast_accum" if fast else "exact"
        spaces = space_archs(lambda a: F8.fp8_configs(a, *sq, fast=fast))
        for arch, cfg in _each_once(F8.fp8_configs, archs, *sq, fast=fast):
            yield CompileCase("fp8_gemm", F8._scaled_tuner.build(cfg),
                              _gemm_params(cfg, *sq, fast=fast),
                              f"fp8_mm {arch} {acc} space 4096^3 rowwise {vars(cfg)}",
                              spaces=spaces(cfg))
        skinny = (128, 4096, 4096)         # the entries only skinny keys search
        wide = list(F8.fp8_configs("sm_90", *sq, fast=fast))
        for cfg in F8.fp8_configs("sm_90", *skinny, fast=fast):
            if cfg not in wide:        # (split-K's partials take no scales: one mode)
                for mode in ("row", "tensor") if F8.split_of(cfg) == 1 else ("row",):
                    yield CompileCase("fp8_gemm", F8._scaled_tuner.build(cfg),
                                      _gemm_params(cfg, *skinny, mode=mode, fast=fast),
                                      f"fp8_mm sm_90 {acc} skinny 128x4096x4096 {mode}wise "
                                      f"{vars(cfg)}")
    split_cfg = next(c for c in F8.fp8_configs("sm_90", 128, 4096, 4096) if F8.split_of(c) > 1)
    yield CompileCase("fp8_gemm", F8._scaled_tuner.build(split_cfg),
                      _gemm_params(split_cfg, 128, 4096, 4096, b_dt=E5M2),
                      f"fp8_mm split-K e4m3 x e5m2 {vars(split_cfg)}")
    for split in sorted({r[-1] for r in F8.SM90_SPLITK}):
        for mode, out in (("row", BF16), ("tensor", BF16), ("row", torch.float16),
                          ("row", torch.float32)):
            yield CompileCase("fp8_gemm", F8.fp8_splitk_sum_kernel,
                              _sum_params(split, 128, 4096, mode=mode, out=out),
                              f"fp8_mm split-K sum {split} {mode}wise {out}")
    block_spaces = space_archs(lambda a: F8.fp8_block_configs(a, *sq))
    for arch, cfg in _each_once(F8.fp8_block_configs, ("sm_90", "sm_100", "sm_120"), *sq):
        yield CompileCase("fp8_gemm", F8._block_tuner.build(cfg), _block_params(cfg, *sq),
                          f"fp8_mm block {arch} space 4096^3 1x128 x 128x128 {vars(cfg)}",
                          spaces=block_spaces(cfg))
    gemm = list(F8.fp8_configs("sm_90", *sq))
    block = list(F8.fp8_block_configs("sm_90", *sq))
    cfg = gemm[0]
    for label, shape, kw in [("tensorwise", sq, {"mode": "tensor"}),
                             ("tensorwise (1,) scales", sq, {"mode": "tensor (1,)"}),
                             ("row-major b", sq, {"b_col": False}),
                             ("e4m3 x e5m2", sq, {"b_dt": E5M2}),
                             ("e5m2 x e4m3", sq, {"a_dt": E5M2}),
                             ("fp32 out", sq, {"out": torch.float32}),
                             ("ragged 1000x1999x784", (1000, 1999, 784), {}),
                             ("decode 1x4096x4096", (1, 4096, 4096), {})]:
        yield CompileCase("fp8_gemm", F8._scaled_tuner.build(cfg), _gemm_params(cfg, *shape, **kw),
                          f"fp8_mm {label} {vars(cfg)}")
    cfg = block[0]
    for label, shape, kw in [("1x128 x 1x128", sq, {"pairing": (1, 1)}),
                             ("128x128 x 1x128", sq, {"pairing": (KB, 1)}),
                             ("K-major scale_a", sq, {"sa_m_major": False}),
                             ("e4m3 x e5m2", sq, {"b_dt": E5M2}),
                             ("K 4000 (partial last block)", (4096, 4096, 4000), {}),
                             ("ragged 1000x1999x784", (1000, 1999, 784), {}),
                             ("decode 1x4096x4096", (1, 4096, 4096), {})]:
        yield CompileCase("fp8_gemm", F8._block_tuner.build(cfg),
                          _block_params(cfg, *shape, **kw), f"fp8_mm block {label} {vars(cfg)}")
    skinny = (128, 4096, 4096)      # the block split-K entries: each pairing, e4m3 x e5m2
    splits = [c for c in F8.fp8_block_configs("sm_90", *skinny) if F8.split_of(c) > 1]
    for cfg in splits:
        yield CompileCase("fp8_gemm", F8._block_tuner.build(cfg), _block_params(cfg, *skinny),
                          f"fp8_mm block split-K 1x128 x 128x128 {vars(cfg)}")
    for label, kw in [("1x128 x 1x128", {"pairing": (1, 1)}),
                      ("128x128 x 1x128", {"pairing": (KB, 1)}),
                      ("e4m3 x e5m2", {"b_dt": E5M2})]:
        yield CompileCase("fp8_gemm", F8._block_tuner.build(splits[0]),
                          _block_params(splits[0], *skinny, **kw),
                          f"fp8_mm block split-K {label} {vars(splits[0])}")
    for out in (BF16, torch.float16, torch.float32):      # its sum: matmul's
        yield CompileCase("fp8_gemm", MM.splitk_reduce_kernel,
                          [jit_array(torch.float32, (2, 128, 4096)), jit_array(out, (128, 4096)),
                           *F8.SUM_TILE, 2], f"fp8_mm block split-K sum {out}")


# kind -> (tuner, its args function, its config generator)
QUANT = {"row": (F8._quantize_row, F8._row_args, F8.row_configs),
         "block1x128": (F8._quantize_1x128, F8._1x128_args, F8.block1x128_configs),
         "block128x128": (F8._quantize_128x128, F8._128x128_args, F8.block128x128_configs),
         "pair": (F8._quantize_pair, F8._pair_args, F8.pair_configs),
         "amax": (F8._tensor_amax, F8._amax_args, F8.amax_configs),
         "tensor": (F8._quantize_tensor, F8._tensor_args, F8.tensor_configs)}


def _block_scales(M, K):
    """The (cdiv(M, 128), cdiv(K, 128)) view of 128x128 scales in rows padded to 16 bytes."""
    rows = F8._block_scale_storage(M, K)
    return jit_array(torch.float32, (rows[0], F8.cdiv(K, KB)), (rows[1], 1))


def _quant_params(kind, cfg, M, K, *, x_dt=BF16, q_dt=E4M3, x_t=False):
    """The kernel arguments of a quantizer config; x_t: x the transposed view of (K, M)."""
    x = jit_array(x_dt, (M, K), (1, M) if x_t else None)
    q = jit_array(q_dt, (M, K))
    bits = jit_array(torch.int32, (1,))
    fp8_max = float(torch.finfo(q_dt).max)
    kb = F8.cdiv(K, KB)
    args = QUANT[kind][1]
    if kind == "amax":
        params = args(cfg, x, bits)
    elif kind == "tensor":
        params = args(cfg, x, bits, q, jit_array(torch.float32, (1,)), fp8_max)
    elif kind == "row":
        params = args(cfg, x, q, jit_array(torch.float32, (M, 1)), fp8_max)
    elif kind == "block1x128":
        params = args(cfg, x, q, jit_array(torch.float32, (kb, M), (F8.f32_row(M), 1)), fp8_max)
    elif kind == "block128x128":
        params = args(cfg, x, q, _block_scales(M, K), fp8_max)
    else:       # the pair: x and its transposed view, the FP8 and scales of each
        params = args(cfg, x, jit_array(x_dt, (K, M), (1, K)), q, _block_scales(M, K),
                      jit_array(q_dt, (K, M)), _block_scales(K, M), fp8_max)
    return [F32 if isinstance(p, float) else p for p in params]


def _quant_cases():
    for kind, (tuner, _, gen) in QUANT.items():
        seen = list(gen("sm_90", 4096, 4096))
        for cfg in seen:
            yield CompileCase("fp8_gemm", tuner.build(cfg), _quant_params(kind, cfg, 4096, 4096),
                              f"quantize {kind} space 4096x4096 bf16 {vars(cfg)}")
        if kind == "row":                 # rows read in chunks
            for cfg in tightest(c for c in gen("sm_90", 4096, 14336) if c not in seen):
                yield CompileCase("fp8_gemm", tuner.build(cfg),
                                  _quant_params(kind, cfg, 4096, 14336),
                                  f"quantize {kind} space 4096x14336 bf16 {vars(cfg)}")
        per_layout = tuner in F8.LAYOUT_TUNERS
        if per_layout:                    # the transposed view has a space of its own
            for cfg in tightest(gen("sm_90", 4096, 4096, col=True)):
                yield CompileCase("fp8_gemm", tuner.build(cfg),
                                  _quant_params(kind, cfg, 4096, 4096, x_t=True),
                                  f"quantize {kind} space transposed 4096x4096 bf16 {vars(cfg)}")
        for label, (M, K), kw in [("fp32", (4096, 4096), {"x_dt": torch.float32}),
                                  ("e5m2", (4096, 4096), {"q_dt": E5M2}),
                                  ("ragged 1000x1000", (1000, 1000), {}),
                                  ("x transposed", (4096, 4096), {"x_t": True}),
                                  ("M 1", (1, 4096), {})]:
            if kind == "amax" and "q_dt" in kw:
                continue                      # the amax launch writes no fp8
            if kind in ("amax", "tensor") and M == 1:
                continue                      # the same tiles as the ragged case
            if per_layout and "x_t" in kw:
                continue                      # the transposed space's default, compiled above
            if kind == "pair" and "x_t" in kw:
                continue                      # a transposed x is launched as x.t() (row-major)
            cfg = next(gen("sm_90", M, K))
            yield CompileCase("fp8_gemm", tuner.build(cfg), _quant_params(kind, cfg, M, K, **kw),
                              f"quantize {kind} {label} {vars(cfg)}")


def compile_cases():
    yield from _gemm_cases()
    yield from _quant_cases()


# ---------------------------------------------------------------------------------------------
# Benchmarks. Operands are quantized as a training step makes them, with the torch reference (our
# kernels do not make the peer's inputs): a (M, K) and an (N, K) weight, b = w_fp8.t()
# (column-major), scale_b = its scales transposed. torch._scaled_mm runs the same scaling
# and accumulation mode; a mode this torch or card refuses is reported in the row as
# torch_scaled_mm_error, never fatal.

# The four shapes, then two decode-sized ones: 64 rows, and 16 rows with a long K (where
# split-K leads).
SHAPES = ((4096, 4096, 4096), (8192, 8192, 8192), (16384, 4096, 14336), (128, 4096, 4096),
          (64, 4096, 4096), (16, 4096, 14336))
MODES = (("tensorwise", True), ("rowwise", True), ("tensorwise", False), ("rowwise", False),
         ("block", False), ("block", True))
HEADLINE = (((4096, 4096, 4096), "rowwise", False), ((4096, 4096, 4096), "block", False))
GRAN = {"tensorwise": ("tensor", "tensor"), "rowwise": ("row", "row"),
        "block": ("block1x128", "block128x128")}
QUANT_SHAPES = ((16384, 4096), (4096, 14336))


def operands(M, N, K, mode):
    """(a, b, scale_a, scale_b) for `mode`, quantized from random data with the torch
    reference (no kernel of ours runs before the timed rows)."""
    ga, gb = GRAN[mode]
    x = torch.randn(M, K, device="cuda", dtype=BF16)
    w = torch.randn(N, K, device="cuda", dtype=BF16) / K ** 0.5
    a, sa = F8.quantize_fp8_reference(x, ga)
    w8, sw = F8.quantize_fp8_reference(w, gb)
    return a, w8.t(), sa, sw.t()


def _scaled_mm(a, b, sa, sb, fast):
    return torch._scaled_mm(a, b, sa, sb, out_dtype=BF16, use_fast_accum=fast)


def _torch_peer(a, b, sa, sb, fast):
    """torch._scaled_mm on these operands with scales in a layout this torch takes (tried once
    here: its block mode is particular about the scales' majors); where it takes none, a peer
    that raises what it said, which the bench reports as torch_scaled_mm_error."""
    errors = []
    for lay in (lambda t: t, lambda t: t.t().contiguous().t(), lambda t: t.contiguous()):
        ta, tb = lay(sa), lay(sb)
        try:
            _scaled_mm(a, b, ta, tb, fast)
            return lambda: _scaled_mm(a, b, ta, tb, fast)
        except Exception as e:       # a mode this torch or card lacks: reported, not fatal
            errors.append(f"{type(e).__name__}: {str(e).splitlines()[0][:160]}")

    def refused():
        raise RuntimeError("torch._scaled_mm refused every scale layout: " + " | ".join(errors))
    return refused


def _gemm_case(M, N, K, mode, fast):
    a, b, sa, sb = operands(M, N, K, mode)
    peers = {"torch_scaled_mm": _torch_peer(a, b, sa, sb, fast)}
    acc = "fast-acc" if fast else "exact"
    return BenchCase("fp8_gemm", f"{M}x{N}x{K} {mode} {acc} e4m3 bf16", "fwd",
                     lambda: F8.fp8_mm(a, b, sa, sb, fast_accum=fast), peers,
                     flops=2.0 * M * N * K)


def _quant_case(M, K, granularity, transposed=False):
    """transposed: x is the (M, K) transposed view of a row-major (K, M) tensor, as the weight
    gradient of fp8_linear quantizes its operands (and the block recipe's input gradient its
    weight, in 128x128 blocks)."""
    x = torch.randn(K, M, device="cuda", dtype=BF16).t() if transposed else \
        torch.randn(M, K, device="cuda", dtype=BF16)
    copy_out = torch.empty_like(x)
    reference = lambda x=x: F8.quantize_fp8_reference(x, granularity)
    peers = {"torch": reference, "torch_compile": torch.compile(reference)}
    # read bf16, write fp8 (scales are noise): 3 bytes an element against a copy's 4
    view = " transposed view" if transposed else ""
    return BenchCase("fp8_gemm", f"quantize {granularity} {M}x{K} bf16{view}", "fwd",
                     lambda: F8.quantize_fp8(x, granularity), peers, bytes=3.0 * x.numel(),
                     ceiling=("copy", lambda: copy_out.copy_(x)), ceiling_scale=0.75)


def _pair_case(M, K):
    """quantize_fp8_pair's 128x128 kernel (x once, both FP8 tensors out: 4 bytes an element,
    a copy's) against the two quantize_fp8 calls it replaces and the torch reference of both."""
    x = torch.randn(M, K, device="cuda", dtype=BF16)
    copy_out = torch.empty_like(x)
    g = "block128x128"
    peers = {"tiletune_two_calls": lambda: (F8.quantize_fp8(x, g), F8.quantize_fp8(x.t(), g)),
             "torch": lambda: (F8.quantize_fp8_reference(x, g),
                               F8.quantize_fp8_reference(x.t(), g))}
    return BenchCase("fp8_gemm", f"quantize_fp8_pair {g} {M}x{K} bf16", "fwd",
                     lambda: F8.quantize_fp8_pair(x, g), peers, bytes=4.0 * x.numel(),
                     ceiling=("copy", lambda: copy_out.copy_(x)))


LINEAR_SHAPES = ((4096, 4096, 4096), (16384, 4096, 14336))      # tokens, in, out features


def _linear_case(M, K, N, recipe):
    """One training step of fp8_linear (forward, input and weight gradients) against the same
    step of torch's bf16 linear."""
    x = torch.randn(M, K, device="cuda", dtype=BF16, requires_grad=True)
    w = (torch.randn(N, K, device="cuda", dtype=BF16) / K ** 0.5).requires_grad_()
    dy = torch.randn(M, N, device="cuda", dtype=BF16)

    def step(f):                   # grad(): no accumulation into .grad
        return lambda: torch.autograd.grad(f(x, w), (x, w), dy)
    ours = step(lambda x, w: F8.fp8_linear(x, w, recipe=recipe))
    return BenchCase("fp8_gemm", f"fp8_linear {M}x{K}->{N} {recipe} bf16", "fwd+bwd", ours,
                     {"torch_bf16_linear": step(torch.nn.functional.linear)},
                     flops=6.0 * M * N * K)


def bench_cases(full=False):
    if not full:
        return [_gemm_case(*shape, mode, fast) for shape, mode, fast in HEADLINE]
    cases = [_gemm_case(*shape, mode, fast) for shape in SHAPES for mode, fast in MODES]
    cases += [_quant_case(M, K, g) for M, K in QUANT_SHAPES for g in F8.GRANULARITIES]
    cases += [_quant_case(M, K, g, transposed=True) for M, K in QUANT_SHAPES
              for g in ("row", "block1x128", "block128x128")]
    cases += [_pair_case(M, K) for M, K in QUANT_SHAPES]
    cases += [_linear_case(*shape, r) for shape in LINEAR_SHAPES for r in F8.RECIPES]
    return cases


def bench_host():
    """Host microseconds per call at a tiny shape (64x128x256, e4m3, rowwise scales, bf16 out),
    against `torch._scaled_mm` with the same operands (inference: no step)."""
    a = torch.randn(64, 256, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(128, 256, device="cuda").to(torch.float8_e4m3fn).t()
    sa = torch.rand(64, 1, device="cuda") + 0.5
    sb = torch.rand(1, 128, device="cuda") + 0.5
    return host_against_torch(
        lambda: F8.fp8_mm(a, b, sa, sb),
        lambda: torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16))
