"""fp8_mm and quantize_fp8 on the GPU. fp8_mm against a float64 dequantize-then-matmul reference
with DeepGEMM's measure (1 - 2 sum(xy) / sum(x^2 + y^2)) of each output row and each 128x128
tile, under a bound per out dtype (its rounding and the tensor cores' sums) or fast
accumulation's, in every scaling mode, both accumulation modes, odd M and N, K not a multiple of
128, both B layouts, e5m2 on either side, every out dtype (the 16-bit ones the float32 output
rounded once), tuned and DISABLE_AUTOTUNE, outputs poisoned first; every config of every space;
against torch._scaled_mm where it takes the mode. quantize_fp8 bit-exact against its torch
reference for every granularity, format and input dtype, also of an expanded (stride-0) x;
quantize_fp8_pair against it for x and x.t(). fp8_linear's training step against its recipe's
own quantized operands (every input dtype, with and without bias) and against unquantized
float64. out=, torch.compile, the AOT signatures against the JIT's."""
import pytest
import torch

from tiletune.device import sm_count
from tiletune.ops import fp8_gemm as F8
from tiletune.ops.fp8_gemm import fp8_mm, quantize_fp8, quantize_fp8_reference
from tiletune.space import cdiv

from .conftest import (assert_each_cta_loops, assert_rounded_once, disable_autotune, each_config,
                       poison_allocator)

E4M3, E5M2, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
FP16, FP32 = torch.float16, torch.float32
# DeepGEMM's measure of each output row and 128x128 tile (`worst`) against the float64 product
# of the dequantized operands, per out dtype. Exact accumulation has two errors:
# - the output's rounding: about 0.09 * 4^-p for p significant bits (bf16 1.38e-6, fp16
#   2.2e-8, float32 3e-16);
# - the tensor cores' sums: each 128-K slice is four k32 QGMMAs chained from zero, each summing
#   with about 13 mantissa bits, rounded toward zero (published probes of the H100's QGMMA;
#   DeepSeek-V3's report), before the float32 promotion. Emulated with 12 bits (pessimistic:
#   that model puts fast accumulation at 4096^3 at 2.2e-5 where an H200 measured 1.1e-5), they
#   add at most 7e-8 to a row or tile of the suite's shapes (1.7e-7 to a 33-wide row, which is
#   measured by tile); emulated so on the CPU, every exact check here read at most 0.53 of its
#   bound.
# So bf16 keeps 4e-6 (1.4e-6 measured on an H200, every config, K 784 and 1040), and the others
# bound their rounding plus 1e-7 of tensor-core sums, three times over: a bf16 intermediate on
# their path reads about 1.4e-6 in every row. Fast accumulation keeps fewer accumulator bits
# over the whole K, an error that grows with K: DeepGEMM's own bound for FP8 GEMMs.
LIMITS = {BF16: 4e-6, FP16: 4e-7, FP32: 3e-7}
FAST_LIMIT = 1e-3
TILE = 128
# scaling -> (granularity of a, granularity of the (N, K) weight whose transpose is b)
SCALINGS = {"tensorwise": ("tensor", "tensor"), "rowwise": ("row", "row"),
            "block 1x128 x 128x128": ("block1x128", "block128x128"),
            "block 1x128 x 1x128": ("block1x128", "block1x128"),
            "block 128x128 x 1x128": ("block128x128", "block1x128")}
DIFFS = {}                                      # measured accuracies, printed at the end


def diff(x, y):
    """DeepGEMM's accuracy measure; 0 for equal tensors."""
    x, y = x.double(), y.double()
    assert torch.isfinite(x).all()
    return (1 - 2 * (x * y).sum() / (x * x + y * y).sum().clamp_min(1e-300)).item()


def worst(x, y):
    """The largest of DeepGEMM's measure over each row of the 2-D x against y and each 128x128
    tile (edge tiles ragged). A whole-tensor measure dilutes one wrong row or tile among all the
    others: at 999x1999x784 one 128x128 tile missing one of the seven K blocks moves it by 9e-5
    (the 16-deep last block) to 7e-4 and one wrong row by 4e-4, all under fast accumulation's
    1e-3, where that tile reads 0.009-0.09 on its own (its rows 0.001-0.008: rows alone miss
    the short block) and that row about 1. Rows narrower than a tile are measured in their tiles
    only (33 values a row are too few for these bounds); each row's or tile's sum of squares is
    floored at a quarter of the mean one's, so that a sliver of a tile at an edge or a small row
    is held to the scale of its neighbours (as conftest's assert_rows_close does)."""
    x, y = x.double(), y.double()
    assert torch.isfinite(x).all()
    err, squares = (x - y) ** 2, x * x + y * y
    M, N = x.shape

    def tiles(t):
        t = torch.nn.functional.pad(t, (0, -N % TILE, 0, -M % TILE))
        return t.reshape(t.shape[0] // TILE, TILE, t.shape[1] // TILE, TILE).sum((1, 3)).flatten()
    units = [(tiles(err), tiles(squares))]
    if N >= TILE:
        units.append((err.sum(1), squares.sum(1)))
    return max((e / torch.maximum(s, s.mean() / 4).clamp_min(1e-300)).max().item()
               for e, s in units)


def limit(out_dtype, fast=False):
    return FAST_LIMIT if fast else LIMITS[out_dtype]


def assert_one_rounding(outs, what=""):
    """Outputs of one config in each out dtype ({dtype: c}): the float32 one carries more bits
    than a 16-bit float (a bf16 or fp16 intermediate on its path would not, and reads within
    the norm bounds where it is fp16), the 16-bit ones are it rounded once to nearest (the
    kernel's accumulator is the same whatever it stores)."""
    c32 = outs[FP32]
    narrow = (c32 == c32.to(FP16).float()) | (c32 == c32.to(BF16).float())
    assert narrow.double().mean() < 0.01, (what, narrow.double().mean().item())
    for dt, c in outs.items():
        if dt != FP32:
            assert_rounded_once(c, c32, what=f"{what} {dt}")


def expand(s, rows, cols):
    """A scale tensor spread over the (rows, cols) elements it scales (broadcastable)."""
    s = s.double()
    if s.numel() == 1:
        return s.reshape(())
    if s.shape[0] not in (1, rows):                  # one scale per 128 rows
        s = s.repeat_interleave(128, 0)[:rows]
    if s.shape[1] not in (1, cols):                  # one scale per 128 columns
        s = s.repeat_interleave(128, 1)[:, :cols]
    return s


def reference(a, b, sa, sb):
    """(a * scale_a) @ (b * scale_b) in float64."""
    M, K = a.shape
    N = b.shape[1]
    return (a.double() * expand(sa, M, K)) @ (b.double() * expand(sb, K, N))


def operands(M, N, K, scaling, *, b_rowmajor=False, a_dt=E4M3, b_dt=E4M3, seed=0):
    """a (M, K) and b (K, N) quantized with the torch reference from random data with rows of
    different magnitudes; b is the transposed view of an (N, K) weight (column-major) or,
    b_rowmajor, a row-major copy of it."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ga, gb = SCALINGS[scaling]
    x = torch.randn(M, K, device="cuda", generator=gen) * torch.rand(M, 1, device="cuda",
                                                                      generator=gen).add(0.1)
    w = torch.randn(N, K, device="cuda", generator=gen) / K ** 0.5
    a, sa = quantize_fp8_reference(x.to(BF16), ga, a_dt)
    w8, sw = quantize_fp8_reference(w.to(BF16), gb, b_dt)
    b = w8.t().contiguous() if b_rowmajor else w8.t()
    return a, b, sa, sw.t()


def check(M, N, K, scaling, *, fast=False, out_dtype=BF16, label="", **kw):
    a, b, sa, sb = operands(M, N, K, scaling, **kw)
    poison_allocator(torch)
    c = fp8_mm(a, b, sa, sb, out_dtype=out_dtype, fast_accum=fast)
    assert c.shape == (M, N) and c.dtype == out_dtype
    d = worst(c, reference(a, b, sa, sb))
    name = f"{scaling} {M}x{N}x{K} {'fast' if fast else 'exact'} {label}".strip()
    DIFFS[name if out_dtype == BF16 else f"{name} {str(out_dtype)[6:]}"] = d
    assert d < limit(out_dtype, fast), (scaling, M, N, K, fast, out_dtype, d)
    return c


SHAPES = [(999, 1999, 784), (1, 4096, 4096), (4097, 33, 1040), (128, 4096, 4096)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("b_rowmajor", [False, True], ids=["B col-major", "B row-major"])
@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast_accum"])
@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("disable", [False, True], ids=["tuned", "DISABLE_AUTOTUNE"])
def test_modes_layouts_and_odd_sizes(fresh, monkeypatch, scaling, fast, b_rowmajor, shape,
                                     disable):
    """Odd M and N, K not a multiple of 128 (784, 1040: a partial last block), M = 1."""
    if disable:
        disable_autotune(monkeypatch)
    elif shape != SHAPES[0] or b_rowmajor:
        monkeypatch.setenv("DISABLE_AUTOTUNE", "1")  # one tuned key per mode keeps this quick
    check(*shape, scaling, fast=fast, b_rowmajor=b_rowmajor)


@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("dts", [(E4M3, E5M2), (E5M2, E4M3)], ids=["e4m3 x e5m2", "e5m2 x e4m3"])
def test_one_e5m2_operand(fresh, monkeypatch, scaling, dts):
    """The float16 path (cuTile multiplies only equal fp8 formats); fast_accum is ignored."""
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    for fast in (False, True):
        check(999, 1999, 784, scaling, fast=fast, a_dt=dts[0], b_dt=dts[1],
              label=f"{dts[0]} x {dts[1]}".replace("torch.float8_", ""))


def test_out_dtypes(fresh, monkeypatch):
    """Each out dtype within its own bound; with the default config (one for every out dtype)
    the float32 output carries more bits than a 16-bit float and the 16-bit outputs are it
    rounded once to nearest."""
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    for scaling in ("rowwise", "block 1x128 x 128x128"):
        outs = {dt: check(300, 500, 512, scaling, out_dtype=dt) for dt in (BF16, FP16, FP32)}
        assert_one_rounding(outs, scaling)


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast_accum"])
def test_every_config_is_correct(fresh, monkeypatch, fast):
    """Each config of the sm_90 spaces of both kernels, in this accumulation mode (the skinny
    keys' entries included), on a ragged problem (tiles overhanging M, N and a partial last K
    block; persistent grids, clusters).
    Block scaling has one mode: its space runs once, with each of the three scale pairings and
    1x128 scale_a in both of the layouts torch takes (M-major and K-major)."""
    M, N, K = 200, 270, 400
    block_space = lambda arch, *shape, fast: F8.fp8_block_configs(arch, *shape)   # one mode
    runs = [("rowwise", F8._scaled_tuner, F8.fp8_configs)]
    if not fast:
        runs += [(scaling, F8._block_tuner, block_space) for scaling in SCALINGS
                 if scaling.startswith("block")]
    for scaling, tuner, gen in runs:
        a, b, sa, sb = operands(M, N, K, scaling)
        ref = reference(a, b, sa, sb)
        scales_a = [sa, sa.contiguous()] if SCALINGS[scaling][0] == "block1x128" else [sa]
        assert len(scales_a) == 1 or scales_a[0].stride() != scales_a[1].stride()
        cfgs = list(gen("sm_90", 256, N, K, fast=fast))
        cfgs += [c for c in gen("sm_90", 128, N, K, fast=fast) if c not in cfgs]  # skinny's
        for cfg in each_config(monkeypatch, tuner, cfgs):
            for sa_i in scales_a:
                poison_allocator(torch)
                d = worst(fp8_mm(a, b, sa_i, sb, fast_accum=fast), ref)
                assert d < limit(BF16, fast), (scaling, vars(cfg), sa_i.stride(), d)


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast_accum"])
def test_persistent_configs_loop_over_many_tiles(fresh, monkeypatch, fast):
    """Each persistent config of both kernels where every CTA (or cluster) makes at least three
    trips of its tile loop (tileiras 13.4 built TMA loops of other kernels that went wrong only
    there: references/hardware-constraints.md); rowwise, and block scaling in its one mode."""
    M, N, K = 4001, 4999, 1024
    runs = [("rowwise", F8._scaled_tuner, F8.fp8_configs("sm_90", M, N, K, fast=fast))]
    if not fast:
        runs.append(("block 1x128 x 128x128", F8._block_tuner,
                     F8.fp8_block_configs("sm_90", M, N, K)))
    for scaling, tuner, space in runs:
        a, b, sa, sb = operands(M, N, K, scaling)
        ref = reference(a, b, sa, sb)
        cfgs = [c for c in space if c.persistent]
        assert cfgs
        for cfg in each_config(monkeypatch, tuner, cfgs):
            poison_allocator(torch)
            d = worst(fp8_mm(a, b, sa, sb, fast_accum=fast), ref)
            assert d < limit(BF16, fast), (scaling, vars(cfg), d)
            assert_each_cta_loops(cdiv(M, cfg.tm) * cdiv(N, cfg.tn), cfg)


@pytest.mark.parametrize("scaling, fast",            # block scaling has one mode: exact's run
                         [(s, f) for s in SCALINGS for f in (False, True)
                          if not (f and s.startswith("block"))])
def test_split_k_every_split_scaling_and_output(fresh, monkeypatch, scaling, fast):
    """Each split-K config (partials, then their sum, scaled there or, in block mode, block by
    block in the partials) at a skinny shape whose K tiles do not divide evenly among the splits
    (K 1040: 9 tiles, the last partial), with each output dtype (the 16-bit ones the float32
    one rounded once) and a mixed e4m3 x e5m2 pair."""
    M, N, K = 100, 300, 1040
    block = scaling.startswith("block")
    tuner, gen = (F8._block_tuner, F8.fp8_block_configs) if block else (F8._scaled_tuner,
                                                                         F8.fp8_configs)
    shape_cfgs = gen("sm_90", M, N, K) if block else gen("sm_90", M, N, K, fast=fast)
    splits = [c for c in shape_cfgs if F8.split_of(c) > 1]
    assert {c.split for c in splits} == {2, 4}
    for cfg in each_config(monkeypatch, tuner, splits):
        outs = {dt: check(M, N, K, scaling, fast=fast, out_dtype=dt, label=f"split {cfg.split}")
                for dt in (BF16, FP16, FP32)}
        assert_one_rounding(outs, vars(cfg))
        check(M, N, K, scaling, fast=fast, b_dt=E5M2, label=f"split {cfg.split} e5m2")


@pytest.mark.parametrize("scaling", list(SCALINGS))
@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast_accum"])
def test_against_torch_scaled_mm(fresh, monkeypatch, scaling, fast):
    """Both against the float64 reference on torch's own operands (N a multiple of 16, B
    column-major, block scales in torch's layouts); skipped where this torch or card refuses
    the mode."""
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    M, N, K = 1000, 2048, 4096
    a, b, sa, sb = operands(M, N, K, scaling)
    theirs, errors = None, []
    for layout in (lambda t: t, lambda t: t.t().contiguous().t(), lambda t: t.contiguous()):
        try:        # the scales as the reference lays them out, then the other major
            theirs = torch._scaled_mm(a, b, layout(sa), layout(sb), out_dtype=BF16,
                                      use_fast_accum=fast)
            break
        except (RuntimeError, NotImplementedError, ValueError) as e:
            errors.append(str(e).splitlines()[0][:200])
    if theirs is None:
        pytest.skip(f"torch._scaled_mm refuses {scaling}: {errors}")
    ours = fp8_mm(a, b, sa, sb, fast_accum=fast)
    ref = reference(a, b, sa, sb)
    d_ours, d_theirs = diff(ours, ref), diff(theirs, ref)
    worst_ours = worst(ours, ref)
    DIFFS[f"{scaling} {M}x{N}x{K} {'fast' if fast else 'exact'} ours, torch (whole)"] = \
        (worst_ours, d_ours, d_theirs)
    bound = limit(BF16, fast)
    assert worst_ours < bound and d_ours <= 4 * d_theirs + 1e-6, (worst_ours, d_ours, d_theirs)
    assert diff(ours, theirs) < bound


@pytest.mark.parametrize("tuned", [False, True], ids=["fixed", "tuned"])
def test_block_scaling_has_one_accumulation_mode(fresh, monkeypatch, tuned):
    """Every 128-K block is promoted from zero in both modes: fast_accum gives the same bits
    through the same key (one search)."""
    if not tuned:
        monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    a, b, sa, sb = operands(300, 512, 1008, "block 1x128 x 128x128")   # a partial last block
    exact = fp8_mm(a, b, sa, sb)
    assert torch.equal(fp8_mm(a, b, sa, sb, fast_accum=True), exact)
    assert worst(exact, reference(a, b, sa, sb)) < LIMITS[BF16]
    assert len(F8._block_tuner.cache) == 1 and F8._block_tuner.searches == int(tuned)


def test_fast_accumulation_at_long_k_is_measured(fresh, monkeypatch):
    """The accuracy of both modes at K = 16384 (fast accumulation keeps fewer accumulator bits:
    DeepSeek-V3 reports ~2% error at K = 4096 without promotion); the numbers are printed."""
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    for scaling in ("tensorwise", "rowwise", "block 1x128 x 128x128"):
        for fast in (False, True):
            check(512, 512, 16384, scaling, fast=fast, label="long K")
    print("\nfp8_mm accuracy (1 - 2 sum(xy) / sum(x^2 + y^2), the worst row or 128x128 tile):")
    for k, v in sorted(DIFFS.items()):
        print(f"  {k}: {v}")


def test_out_and_second_call(fresh, monkeypatch):
    a, b, sa, sb = operands(300, 256, 512, "rowwise")
    ref = reference(a, b, sa, sb)
    out = torch.empty(256, 300, device="cuda", dtype=BF16).t()     # any strides
    assert fp8_mm(a, b, sa, sb, out=out) is out and worst(out, ref) < LIMITS[BF16]
    assert F8._scaled_tuner.searches == 1
    a2, b2, sa2, sb2 = operands(400, 256, 512, "rowwise", seed=1)    # same M bucket
    assert worst(fp8_mm(a2, b2, sa2, sb2), reference(a2, b2, sa2, sb2)) < LIMITS[BF16]
    assert F8._scaled_tuner.searches == 1
    with pytest.raises(ValueError, match="fp8_mm: out overlaps a in memory"):
        fp8_mm(a, b, sa, sb, out=a.view(BF16))       # (300, 512) fp8 seen as (300, 256) bf16


def test_empty_and_zero_k(fresh, monkeypatch):
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    a, b = torch.zeros(0, 64, device="cuda", dtype=E4M3), torch.zeros(64, 8, device="cuda",
                                                                      dtype=E4M3)
    s = torch.ones((), device="cuda")
    assert fp8_mm(a, b, s, s).shape == (0, 8)
    c = fp8_mm(torch.zeros(5, 0, device="cuda", dtype=E4M3),
               torch.zeros(0, 8, device="cuda", dtype=E4M3), s, s)
    assert c.shape == (5, 8) and not c.any()


def test_compile_fullgraph(fresh, monkeypatch):
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    x = torch.randn(256, 512, device="cuda", dtype=BF16)
    w = torch.randn(384, 512, device="cuda", dtype=BF16)

    def step(x, w):
        a, sa = quantize_fp8(x, "block1x128")
        (w8, sw), (w8_t, sw_t) = F8.quantize_fp8_pair(w, "block128x128")
        return fp8_mm(a, w8.t(), sa, sw.t()), w8_t, sw_t
    eager = step(x, w)
    compiled = torch.compile(step, fullgraph=True)(x, w)
    assert diff(compiled[0], eager[0]) < 1e-12
    assert same_bits(compiled[1], eager[1]) and torch.equal(compiled[2], eager[2])
    assert diff(eager[0], x.double() @ w.double().t()) < 2e-3   # quantization error included


# ---------------------------------------------------------------------------------------------
# Quantizers.

def quant_input(M, K, dt, transposed=False, seed=0):
    """Rows of very different magnitudes, an all-zero row, values near fp8's subnormals."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    shape = (K, M) if transposed else (M, K)
    x = torch.randn(shape, device="cuda", generator=gen)
    scales = torch.logspace(-4, 3, shape[1], device="cuda")     # fp16 stays finite
    x = x * scales[torch.randperm(shape[1], device="cuda", generator=gen)]
    x = x.t() if transposed else x
    if M > 3:
        x[3] = 0
    return x.to(dt)


def same_bits(a, b):
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


QUANT_CASES = ([((1000, 1000), BF16), ((130, 300), BF16), ((1, 4096), BF16), ((4096, 4096), BF16),
                ((257, 14336), BF16), ((64, 16), BF16)]
               + [(shape, dt) for dt in (torch.float16, torch.float32)
                  for shape in ((1000, 1000), (130, 300))])


@pytest.mark.parametrize("shape,xdt", QUANT_CASES, ids=str)
@pytest.mark.parametrize("granularity", F8.GRANULARITIES)
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_is_bit_exact(fresh, monkeypatch, shape, xdt, granularity, dtype):
    if shape != (1000, 1000) or xdt != BF16:
        monkeypatch.setenv("DISABLE_AUTOTUNE", "1")    # one tuned key per granularity
    x = quant_input(*shape, xdt)
    poison_allocator(torch)
    q, s = quantize_fp8(x, granularity, dtype)
    rq, rs = quantize_fp8_reference(x, granularity, dtype)
    assert q.dtype == dtype and q.shape == x.shape and q.is_contiguous()
    assert s.shape == rs.shape and s.dtype == torch.float32
    assert torch.equal(s, rs), (s - rs).abs().max()
    assert same_bits(q, rq), (q.float() != rq.float()).sum()
    if granularity == "block1x128":                 # M-major, columns of 16-byte multiples
        assert s.stride() == (1, -(-shape[0] // 4) * 4)
    if granularity == "block128x128":
        assert (s.stride(0) * 4) % 16 == 0           # 16-byte rows


@pytest.mark.parametrize("expanded", ["rows", "columns"])
@pytest.mark.parametrize("granularity", F8.GRANULARITIES)
def test_quantize_an_expanded_input(fresh, monkeypatch, granularity, expanded):
    """x with a stride-0 dim (one row, or one column, expanded): the bytes and scales of its
    contiguous copy."""
    disable_autotune(monkeypatch)
    M, K = 257, 4096 if granularity == "row" else 1040
    src = quant_input(M, K, BF16)
    x = src[:1].expand(M, K) if expanded == "rows" else src[:, :1].expand(M, K)
    assert 0 in x.stride()
    poison_allocator(torch)
    q, s = quantize_fp8(x, granularity)
    rq, rs = quantize_fp8_reference(x.contiguous(), granularity)
    assert s.shape == rs.shape and torch.equal(s, rs), (s - rs).abs().max()
    assert q.shape == x.shape and q.is_contiguous() and same_bits(q, rq)


@pytest.mark.parametrize("scaling", ["tensorwise", "rowwise"])
def test_expanded_a(fresh, monkeypatch, scaling):
    """fp8_mm of an a whose rows are one row expanded (stride 0), against the float64 product
    of the operands as given."""
    disable_autotune(monkeypatch)
    M, N, K = 999, 1999, 784
    a, b, sa, sb = operands(M, N, K, scaling)
    a = a[5:6].expand(M, K)
    if sa.numel() > 1:
        sa = sa[5:6].expand(M, 1).contiguous()
    poison_allocator(torch)
    c = fp8_mm(a, b, sa, sb)
    d = worst(c, reference(a, b, sa, sb))
    assert d < limit(BF16), d


def every_finite_value(dt):
    """Every finite value of a 16-bit float dtype (both zeros included)."""
    bits = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32, device="cuda")
    values = bits.to(torch.int16).view(dt)
    return values[torch.isfinite(values)]


def same_or_both_nan(q, rq):
    """Bit-equal FP8 outside NaNs, NaN at the same places (a NaN's sign is not specified)."""
    nan, rnan = torch.isnan(q.float()), torch.isnan(rq.float())
    return torch.equal(nan, rnan) and torch.equal(q.view(torch.uint8)[~nan],
                                                  rq.view(torch.uint8)[~rnan])


@pytest.mark.parametrize("xdt", [BF16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_is_bit_exact_for_every_16_bit_value(fresh, monkeypatch, xdt, dtype):
    """Exhaustive for 16-bit inputs: one row per non-negative finite amax a of the dtype, holding
    every finite value clamped to [-a, a], so every scale a 16-bit row can have meets every
    value that can share a row with it; then rows with an infinity (scale inf: zeros of x's
    sign, NaN for the infinity). The cast divides through one reciprocal per scale
    (F8._fp8_cast), which must round as the IEEE division does."""
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")       # the cast is the same in every config
    values = every_finite_value(xdt)
    amaxes = values[(values >= 0) & ~torch.signbit(values)]
    for chunk in amaxes.split(2048):
        x = torch.minimum(torch.maximum(values[None, :], -chunk[:, None]), chunk[:, None])
        q, s = quantize_fp8(x, "row", dtype)
        rq, rs = quantize_fp8_reference(x, "row", dtype)
        assert torch.equal(s, rs)
        wrong = (q.view(torch.uint8) != rq.view(torch.uint8)).sum()
        assert same_bits(q, rq), (chunk[0].item(), wrong)
    x = values[None, :].repeat(3, 1)
    x[0, 5], x[1, 7], x[2, 9] = float("inf"), float("-inf"), float("inf")
    x[2, 11] = float("-inf")
    q, s = quantize_fp8(x, "row", dtype)
    rq, rs = quantize_fp8_reference(x, "row", dtype)
    assert torch.isinf(s).all() and torch.equal(s, rs)
    assert same_or_both_nan(q, rq) and torch.isnan(q.float()).sum() == 4


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_is_bit_exact_for_float32_of_every_exponent(fresh, monkeypatch, dtype):
    """float32 inputs, which cannot be run exhaustively: random signs and mantissas, each row's
    exponents in a window of 40 binades below a random top exponent (normal and subnormal
    values; every scale range), in every granularity."""
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    gen = torch.Generator(device="cuda").manual_seed(7)
    M, K = 2048, 8192
    top = torch.randint(1, 255, (M, 1), device="cuda", generator=gen)
    exponent = (top - torch.randint(0, 41, (M, K), device="cuda", generator=gen)).clamp_min(0)
    mantissa = torch.randint(0, 1 << 23, (M, K), device="cuda", generator=gen)
    sign = torch.randint(0, 2, (M, K), device="cuda", generator=gen)
    bits = (sign << 31) | (exponent << 23) | mantissa
    x = ((bits + (1 << 31)) % (1 << 32) - (1 << 31)).to(torch.int32).view(torch.float32)
    assert torch.isfinite(x).all()
    for granularity in F8.GRANULARITIES:
        q, s = quantize_fp8(x, granularity, dtype)
        rq, rs = quantize_fp8_reference(x, granularity, dtype)
        assert torch.equal(s, rs), granularity
        wrong = (q.view(torch.uint8) != rq.view(torch.uint8)).sum()
        assert same_bits(q, rq), (granularity, wrong)


@pytest.mark.parametrize("granularity", F8.GRANULARITIES)
def test_quantize_every_config_transposed_input_and_nan(fresh, monkeypatch, granularity):
    x = quant_input(300, 1000, BF16, transposed=True)
    rq, rs = quantize_fp8_reference(x, granularity)
    tuners = {"tensor": [F8._tensor_amax, F8._quantize_tensor], "row": [F8._quantize_row],
              "block1x128": [F8._quantize_1x128], "block128x128": [F8._quantize_128x128]}
    for tuner in tuners[granularity]:
        # the rowwise and 1x128 quantizers have a space per layout: both, each on its layout
        per_layout = tuner in F8.LAYOUT_TUNERS
        for xi in [x, x.contiguous()] if per_layout else [x]:
            space = dict(m=512, k=1000, col=xi.stride(0) == 1) if per_layout \
                else dict(m=512, k=1000)
            for cfg in each_config(monkeypatch, tuner, list(tuner.configs("sm_90", **space))):
                poison_allocator(torch)
                q, s = quantize_fp8(xi, granularity)
                assert torch.equal(s, rs) and same_bits(q, rq), vars(cfg)
    x = x.contiguous()
    x[5, 7] = float("nan")
    q, s = quantize_fp8(x, granularity)
    rq, rs = quantize_fp8_reference(x, granularity)
    assert torch.equal(torch.isnan(s), torch.isnan(rs)) and torch.isnan(s).any()
    assert torch.equal(torch.isnan(q.float()), torch.isnan(rq.float()))
    fin = ~torch.isnan(rq.float())
    assert torch.equal(q.float()[fin], rq.float()[fin])


def test_row_quantizer_two_pass_every_config(fresh, monkeypatch):
    """Rows wider than one tile (K 20000: every entry reads each row twice, including the one at
    occupancy 8) give the reference's bits."""
    x = quant_input(300, 20000, BF16)
    rq, rs = quantize_fp8_reference(x, "row")
    cfgs = list(F8._quantize_row.configs("sm_90", m=512, k=20000, col=False))
    assert any(c.occupancy == 8 for c in cfgs) and not any(c.one_pass for c in cfgs)
    for cfg in each_config(monkeypatch, F8._quantize_row, cfgs):
        poison_allocator(torch)
        q, s = quantize_fp8(x, "row")
        assert torch.equal(s, rs) and same_bits(q, rq), vars(cfg)


def _row_major_tiles(granularity, cfg, M, K):
    """The tiles a quantizer's persistent grid strides over, for a row-major (M, K) x."""
    if granularity == "row":
        return cdiv(M, cfg.tr)
    rows = F8.BLOCK if granularity == "block128x128" else cfg.tr
    cols = cfg.tc if granularity == "tensor" else cfg.g * F8.BLOCK
    return cdiv(M, rows) * cdiv(K, cols)


@pytest.mark.parametrize("granularity", F8.GRANULARITIES)
def test_quantize_every_config_strides_over_many_tiles(fresh, monkeypatch, granularity):
    """Every quantizer on persistent grids where each CTA makes many trips of its tile loop
    (tileiras 13.4 built TMA loops of other kernels that went wrong only there:
    references/hardware-constraints.md), ragged on both dims (partial blocks, 128x128 chunks
    past the last row skipped), both layouts, the largest |x| in the last tile (the tensorwise
    amax reduces across CTAs); every config bit-exact, then a NaN in the last tile reaches the
    scales."""
    M, K = 12001, 4100
    xs = [quant_input(M, K, BF16), quant_input(M, K, BF16, transposed=True)]
    tuners = {"tensor": [F8._tensor_amax, F8._quantize_tensor], "row": [F8._quantize_row],
              "block1x128": [F8._quantize_1x128], "block128x128": [F8._quantize_128x128]}
    for x in xs:
        x[-1, -1] = 1e6                                 # above everything quant_input draws
        rq, rs = quantize_fp8_reference(x, granularity)
        col = x.stride(0) == 1
        for tuner in tuners[granularity]:
            space = dict(m=M, k=K, col=col) if tuner in F8.LAYOUT_TUNERS else dict(m=M, k=K)
            for cfg in each_config(monkeypatch, tuner, list(tuner.configs("sm_90", **space))):
                poison_allocator(torch)
                q, s = quantize_fp8(x, granularity)
                assert torch.equal(s, rs) and same_bits(q, rq), (col, vars(cfg))
                if not col:
                    assert_each_cta_loops(_row_major_tiles(granularity, cfg, M, K), cfg)
        x[-1, -1] = float("nan")
        q, s = quantize_fp8(x, granularity)
        rq, rs = quantize_fp8_reference(x, granularity)
        assert torch.equal(torch.isnan(s), torch.isnan(rs)) and torch.isnan(s).any()
        fin = ~torch.isnan(rq.float())
        assert torch.equal(torch.isnan(q.float()), ~fin)
        assert torch.equal(q.float()[fin], rq.float()[fin])


def check_pair(x, granularity, dtype=E4M3):
    """quantize_fp8_pair(x) is quantize_fp8's reference of x and of x.t(), bit for bit, in the
    layouts quantize_fp8 gives each (outputs poisoned first)."""
    poison_allocator(torch)
    (q, s), (q_t, s_t) = F8.quantize_fp8_pair(x, granularity, dtype)
    for (got_q, got_s), xi in [((q, s), x), ((q_t, s_t), x.t())]:
        rq, rs = quantize_fp8_reference(xi, granularity, dtype)
        assert got_q.dtype == dtype and got_q.shape == xi.shape and got_q.is_contiguous()
        assert got_s.shape == rs.shape
        assert torch.equal(torch.isnan(got_s), torch.isnan(rs))
        assert torch.equal(torch.nan_to_num(got_s), torch.nan_to_num(rs))
        fin = ~torch.isnan(rq.float())
        assert torch.equal(torch.isnan(got_q.float()), ~fin)
        if fin.all():
            assert same_bits(got_q, rq), (got_q.float() != rq.float()).sum()
        else:
            assert torch.equal(got_q.float()[fin], rq.float()[fin])
        if granularity == "block128x128":          # 16-byte scale rows, as quantize_fp8's
            assert got_s.stride(1) == 1 and (got_s.stride(0) * 4) % 16 == 0


PAIR_CASES = [((1000, 1000), BF16), ((130, 300), BF16), ((1, 4096), BF16), ((4096, 128), BF16),
              ((257, 14336), BF16), ((1000, 1000), torch.float16), ((130, 300), torch.float32)]


@pytest.mark.parametrize("shape,xdt", PAIR_CASES, ids=str)
@pytest.mark.parametrize("transposed", [False, True], ids=["row-major", "transposed"])
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
def test_quantize_pair_is_bit_exact(fresh, monkeypatch, shape, xdt, transposed, dtype):
    """128x128 through the one-read kernel (both layouts of x); the other granularities
    through two quantize_fp8 calls, checked at one shape."""
    if shape != (1000, 1000) or xdt != BF16:
        monkeypatch.setenv("DISABLE_AUTOTUNE", "1")    # one tuned key per layout
    x = quant_input(*shape, xdt, transposed=transposed)
    check_pair(x, "block128x128", dtype)
    if shape == (130, 300) and xdt == BF16:
        for g in ("tensor", "row", "block1x128"):
            check_pair(x, g, dtype)


def test_quantize_pair_every_config_many_tiles_and_nan(fresh, monkeypatch):
    """Every config on more tiles than CTAs, ragged on both dims, both layouts; then a NaN in
    the last block reaches both scales and no other block."""
    for x in [quant_input(2999, 4100, BF16), quant_input(2999, 4100, BF16, transposed=True)]:
        x[-1, -1] = 1e6
        for cfg in each_config(monkeypatch, F8._quantize_pair,
                               list(F8.pair_configs("sm_90", 4096, 4100))):
            assert 24 * 33 > sm_count(0) * cfg.occupancy
            check_pair(x, "block128x128")
        x[-1, -1] = float("nan")
        check_pair(x, "block128x128")
    assert F8.quantize_fp8_pair(torch.zeros(0, 300, device="cuda"))[1][0].shape == (300, 0)


def test_quantize_then_gemm_matches_bf16(fresh, monkeypatch):
    """DeepSeek-V3's recipe end to end: 1x128 activations, 128x128 weights."""
    x = torch.randn(1024, 2048, device="cuda", dtype=BF16)
    w = torch.randn(1536, 2048, device="cuda", dtype=BF16) / 2048 ** 0.5
    a, sa = quantize_fp8(x, "block1x128")
    w8, sw = quantize_fp8(w, "block128x128")
    assert diff(fp8_mm(a, w8.t(), sa, sw.t()), x.double() @ w.double().t()) < 2e-3


def test_aot_signatures_match_the_jit():
    """The CI compile's signatures (cases/fp8_gemm.py) equal what the JIT infers here."""
    from cuda.tile.compilation import CallingConvention, KernelSignature
    from tiletune.aot import signature
    from tiletune.cases import fp8_gemm as C
    cfg = next(F8.fp8_configs("sm_90", 4096, 4096, 4096))
    a, b, sa, sb = operands(4096, 4096, 4096, "rowwise")
    c = torch.empty(4096, 4096, device="cuda", dtype=BF16)
    va, vb = F8._scale_arrays(sa, sb)
    jit = KernelSignature.from_kernel_args(F8.fp8_mm_kernel,
                                           F8._args(cfg, a, b, va, vb, c, False, False),
                                           CallingConvention.cutile_python_v2())
    assert jit.parameters == signature(C._gemm_params(cfg, 4096, 4096, 4096)).parameters
    bcfg = next(F8.fp8_block_configs("sm_90", 4096, 4096, 4096))
    a, b, sa, sb = operands(4096, 4096, 4096, "block 1x128 x 128x128")
    jit = KernelSignature.from_kernel_args(F8.fp8_mm_block_kernel,
                                           F8._block_args(bcfg, a, b, sa, sb, c, False, False,
                                                          1, 128),
                                           CallingConvention.cutile_python_v2())
    assert jit.parameters == signature(C._block_params(bcfg, 4096, 4096, 4096)).parameters


@pytest.mark.parametrize("transposed", [False, True], ids=["row-major", "transposed"])
def test_quantizer_aot_signatures_match_the_jit(transposed):
    """Each quantizer kernel's CI signature (cases/fp8_gemm.py, default config) equals what the
    JIT infers from the tensors quantize_fp8 passes it."""
    from cuda.tile.compilation import CallingConvention, KernelSignature
    from tiletune.aot import signature
    from tiletune.cases import fp8_gemm as C
    M = K = 4096
    x = quant_input(M, K, BF16, transposed=transposed)
    q = torch.empty(M, K, device="cuda", dtype=E4M3)
    bits = torch.zeros(1, device="cuda", dtype=torch.int32)

    def f32(shape):
        return torch.empty(shape, device="cuda", dtype=torch.float32)
    inputs = {"row": (x, q, f32((M, 1)), 448.0),
              "block1x128": (x, q, f32(F8._scale_storage("block1x128", M, K))[:, :M], 448.0),
              "block128x128": (x, q, f32(F8._block_scale_storage(M, K))[:, :K // 128], 448.0),
              "pair": (x, x.t(), q, f32(F8._block_scale_storage(M, K))[:, :K // 128],
                       torch.empty(K, M, device="cuda", dtype=E4M3),
                       f32(F8._block_scale_storage(K, M))[:, :M // 128], 448.0),
              "amax": (x, bits), "tensor": (x, bits, q, f32((1,)), 448.0)}
    for kind, (tuner, args, gen) in C.QUANT.items():
        if kind == "pair" and transposed:
            continue                    # launched as the row-major x.t()
        col = transposed and tuner in F8.LAYOUT_TUNERS
        cfg = next(gen("sm_90", M, K, col=True) if col else gen("sm_90", M, K))
        jit = KernelSignature.from_kernel_args(tuner.build(cfg), args(cfg, *inputs[kind]),
                                               CallingConvention.cutile_python_v2())
        ci = signature(C._quant_params(kind, cfg, M, K, x_t=transposed))
        assert jit.parameters == ci.parameters, kind


def test_bad_input():
    a = torch.zeros(64, 128, device="cuda", dtype=E4M3)
    b = torch.zeros(32, 128, device="cuda", dtype=E4M3).t()
    s = torch.ones((), device="cuda")
    with pytest.raises(ValueError, match="fp8_mm: scale_a must be a CUDA tensor"):
        fp8_mm(a, b, s.cpu(), s)
    with pytest.raises(ValueError, match="K .* must be a multiple of 16"):
        fp8_mm(a[:, :120], b[:120], s, s)
    with pytest.raises(ValueError, match="match no scaling mode"):
        fp8_mm(a, b, torch.ones(64, 2, device="cuda"), torch.ones(2, 32, device="cuda"))


# ---------------------------------------------------------------------------------------------
# fp8_linear: a training step against its GEMMs on the operands its recipe quantizes, and against
# the same linear in float64.

LINEAR_LIMIT = 2e-3                             # fp8_linear's stated bound (its docstring)
# The recipes as fp8_linear's docstring states them: (forward and input gradient: the
# activation-like operand's groups, the weight's), (weight gradient: both operands' groups),
# every operand quantized along its GEMM's reduction dim.
RECIPES = {"rowwise": (("row", "row"), ("row", "row")),
           "block": (("block1x128", "block128x128"), ("block1x128", "block1x128"))}


def linear_inputs(lead, K, N, dtype, bias=True):
    gen = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(*lead, K, device="cuda", generator=gen).to(dtype).requires_grad_()
    w = (torch.randn(N, K, device="cuda", generator=gen) / K ** 0.5).to(dtype).requires_grad_()
    b = torch.randn(N, device="cuda", generator=gen).to(dtype).requires_grad_()
    dy = torch.randn(*lead, N, device="cuda", generator=gen).to(dtype)
    return x, w, b if bias else None, dy


def linear_step(x, w, b, dy, recipe):
    """fp8_linear's y and its gradients dx, dw, db (None without a bias), outputs poisoned
    first."""
    poison_allocator(torch)
    y = F8.fp8_linear(x, w, b, recipe=recipe)
    grads = torch.autograd.grad(y, (x, w) if b is None else (x, w, b), dy)
    return (y, *grads) if b is not None else (y, *grads, None)


def quantized_products(x, w, dy, recipe):
    """fp8_linear's three GEMMs in float64 on its recipe's quantized operands: x @ w^T,
    dy @ w and dy^T @ x, each operand quantized with quantize_fp8 along the GEMM's reduction
    dim (in the layouts fp8_linear passes, so the keys are those it tuned: no search) and
    dequantized; the weight gradient's token dim padded with zero rows to a multiple of 16,
    which no group's amax sees."""
    N, K = w.shape
    x2, dy2, w = x.detach().reshape(-1, K), dy.reshape(-1, N), w.detach()
    groups, wgrad_groups = RECIPES[recipe]

    def product(a, b_t, granularities):       # a (M, K) @ b_t (N, K)^T
        qa, sa = quantize_fp8(a, granularities[0])
        qb, sb = quantize_fp8(b_t, granularities[1])
        return reference(qa, qb.t(), sa, sb.t())

    def padded(t):
        return torch.cat([t, t.new_zeros(-t.shape[0] % 16, t.shape[1])])
    return (product(x2, w, groups), product(dy2, w.t(), groups),
            product(padded(dy2).t(), padded(x2).t(), wgrad_groups))


def check_linear_exact(x, w, b, dy, y, dx, dw, recipe):
    """y, dx and dw within their dtypes' bounds (fp8_mm's, per row and tile) of the GEMMs on
    the recipe's quantized operands: what is left is fp8_mm's rounding and the tensor cores'
    sums, and for y the bias added after the product's rounding (a second rounding, twice the
    bound). Returns the measures."""
    with torch.no_grad():
        xw, dyw, dyx = quantized_products(x, w, dy, recipe)
    y_ref = xw if b is None else xw + b.double()
    got = {"y": worst(y.reshape(y_ref.shape), y_ref), "dx": worst(dx.reshape(dyw.shape), dyw),
           "dw": worst(dw, dyx)}
    bounds = {"y": LIMITS[y.dtype] * (1 if b is None else 2), "dx": LIMITS[dx.dtype],
              "dw": LIMITS[dw.dtype]}
    assert all(got[k] < bounds[k] for k in got), (got, bounds)
    return got


@pytest.mark.parametrize("shape", [(77, 272, 144), (2, 300, 512, 1024)], ids=str)
@pytest.mark.parametrize("recipe", ["rowwise", "block"])
@pytest.mark.parametrize("disable", [False, True], ids=["tuned", "DISABLE_AUTOTUNE"])
def test_fp8_linear_step_against_float64(fresh, monkeypatch, recipe, shape, disable):
    """Odd token counts (77; 600 in a 3-D batch): the weight gradient pads them; bias; y, dx,
    dw against the GEMMs on the recipe's quantized operands (fp8_mm's bounds) and against
    float64 with DeepGEMM's measure, db exact; no-grad forward equals the step's."""
    if disable:
        disable_autotune(monkeypatch)
    *lead, K, N = shape
    x, w, b, dy = linear_inputs(lead, K, N, BF16)
    y, dx, dw, db = linear_step(x, w, b, dy, recipe)
    assert (y.shape, dx.shape, dw.shape) == ((*lead, N), x.shape, w.shape)
    exact = check_linear_exact(x, w, b, dy, y, dx, dw, recipe)
    x64, w64, dy64 = x.double().reshape(-1, K), w.double(), dy.double().reshape(-1, N)
    got = {"y": diff(y.reshape(-1, N), x64 @ w64.t() + b.double()),
           "dx": diff(dx.reshape(-1, K), dy64 @ w64), "dw": diff(dw, dy64.t() @ x64)}
    for name, d in got.items():
        DIFFS[f"fp8_linear {recipe} {shape} {name}"] = d
        DIFFS[f"fp8_linear {recipe} {shape} {name} on its quantized operands"] = exact[name]
    assert all(d < LINEAR_LIMIT for d in got.values()), got
    torch.testing.assert_close(db, dy.float().reshape(-1, N).sum(0).to(BF16))
    with torch.no_grad():
        assert torch.equal(F8.fp8_linear(x, w, b, recipe=recipe), y)
    print(f"\nfp8_linear {recipe} {shape}: " + ", ".join(f"{k} {v:.2e}" for k, v in got.items()))


@pytest.mark.parametrize("dtype, bias", [(BF16, False), (FP16, True), (FP16, False),
                                         (FP32, True), (FP32, False)], ids=str)
@pytest.mark.parametrize("recipe", ["rowwise", "block"])
def test_fp8_linear_dtypes_and_no_bias(fresh, monkeypatch, recipe, dtype, bias):
    """The input dtypes fp8_linear takes besides bf16 with a bias (the test above), with and
    without a bias, at one small shape: y in x's dtype and each gradient in its input's, within
    that dtype's bound of the GEMMs on the recipe's quantized operands, and within the recipe's
    bound of float64."""
    disable_autotune(monkeypatch)
    M, K, N = 77, 272, 144
    x, w, b, dy = linear_inputs((M,), K, N, dtype, bias)
    y, dx, dw, db = linear_step(x, w, b, dy, recipe)
    assert (y.dtype, dx.dtype, dw.dtype) == (dtype,) * 3
    assert (y.shape, dx.shape, dw.shape) == ((M, N), x.shape, w.shape)
    check_linear_exact(x, w, b, dy, y, dx, dw, recipe)
    x64, w64, dy64 = x.double(), w.double(), dy.double()
    y64 = x64 @ w64.t() + (0 if b is None else b.double())
    assert max(diff(y, y64), diff(dx, dy64 @ w64), diff(dw, dy64.t() @ x64)) < LINEAR_LIMIT
    if bias:
        torch.testing.assert_close(db, dy.float().sum(0).to(dtype))
    else:
        assert db is None
    with torch.no_grad():
        assert torch.equal(F8.fp8_linear(x, w, b, recipe=recipe), y)


def test_example_pair_runs_and_agrees():
    """assets/examples/05: same result; the autotuned launch is not slower (5% timing slack)."""
    from .conftest import assert_pair_agrees, run_example_pair
    fixed, tuned = run_example_pair("05_fp8_block_scaled")
    assert_pair_agrees(fixed, tuned)
    assert float(tuned["us"]) <= float(fixed["us"]) * 1.05, (fixed, tuned)
