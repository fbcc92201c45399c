"""FP8 GEMM and quantizers without a GPU: the config spaces; the scaling mode read off the scales'
shapes, against torch._scaled_mm's own shape check; the input checks (everything but the device
on CPU tensors, then CPU tensors and old archs refused); what the host side hands the engine
(layouts, scale vectors, keys) and what a cached launch passes to ct.launch; the torch reference
of the quantizers (true float32 division, saturation, layouts, NaN, partial groups); the AOT
cases cover every config of each space at 4096 x 4096, and each (tile, warps) pair of the
quantizers' other keys."""
import inspect

import pytest
import torch
from torch._meta_registrations import _check_scaled_mm_sizes

from tiletune.aot import tightest
from tiletune.autotune import MAX_CONFIGS, default_hints
from tiletune.cases import fp8_gemm as CASES
from tiletune.ops import fp8_gemm as F8
from tiletune.ops.fp8_gemm import fp8_mm, quantize_fp8, quantize_fp8_reference
from tiletune.ops.matmul import splitk_reduce_kernel

E4M3, E5M2, BF16 = torch.float8_e4m3fn, torch.float8_e5m2, torch.bfloat16
ARCHS = ("sm_90", "sm_100", "sm_120", "sm_80")

# ---------------------------------------------------------------------------------------------
# Config spaces.

# (generator, whether it takes the accumulation mode): block scaling has one space
GEMM_GENS = (F8.fp8_configs, lambda arch, *shape, fast: F8.fp8_block_configs(arch, *shape))
GEMM_SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (16384, 4096, 14336), (128, 4096, 4096),
               (1, 4096, 4096), (1000, 1999, 784)]


@pytest.mark.parametrize("fast", [False, True], ids=["exact", "fast_accum"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("gen", GEMM_GENS, ids=["rowwise", "block"])
def test_gemm_spaces_are_small_valid_and_default_first(gen, arch, fast):
    default = next(gen(arch, 4096, 4096, 4096, fast=fast))
    for shape in GEMM_SHAPES:
        cfgs = list(gen(arch, *shape, fast=fast))
        assert 1 <= len(cfgs) <= 16 <= MAX_CONFIGS         # CI compiles every one of them
        assert cfgs[0] == default
        assert len({tuple(sorted(vars(c).items())) for c in cfgs}) == len(cfgs)
        for c in cfgs:
            h = default_hints(c)
            assert 1 <= h["occupancy"] <= 32 and h["num_ctas"] in (1, 2, 4, 8)
            assert h.get("num_worker_warps", 4) in (4, 8)
            # K tiles of 128 (exact mode's promotion boundary); fast skinny keys also 256
            assert c.tk == 128 or (fast and shape[0] <= 128 and c.tk == 256)
            assert c.group_m >= 1 and isinstance(c.persistent, bool)
            assert all(v >= 16 and v & (v - 1) == 0 for v in (c.tm, c.tn))
            # float32 accumulators in registers: 128x128 per 4 worker warps, per cluster CTA
            assert arch != "sm_90" or \
                c.tm * c.tn <= 128 * 128 * h.get("num_worker_warps", 4) // 4 * c.num_ctas
        if shape[0] <= 64:         # tiles taller than the rows are left out (the default stays)
            assert all(c.tm <= 64 for c in cfgs[1:])


def test_the_accumulation_modes_have_their_own_spaces():
    """Exact accumulation spills 128x256 per CTA on sm_90 (its own promotion tile), fast mode
    does not. Block scaling has one space (each block promoted from zero in either mode), led
    by the overlapped 8-warp 128x128. Off sm_90 fast is ignored."""
    exact = list(F8.fp8_configs("sm_90", 4096, 4096, 4096))
    fast = list(F8.fp8_configs("sm_90", 4096, 4096, 4096, fast=True))
    assert not any(c.tm * c.tn // c.num_ctas > 128 * 128 for c in exact)
    assert any(c.tm * c.tn // c.num_ctas == 128 * 256 for c in fast)
    block = list(F8.fp8_block_configs("sm_90", 4096, 4096, 4096))
    assert (block[0].tm, block[0].tn, block[0].num_worker_warps, block[0].overlap) == \
        (128, 128, 8, True)
    assert "fast" not in inspect.signature(F8.fp8_block_configs).parameters
    assert list(F8.fp8_configs("sm_100", 4096, 4096, 4096)) == \
        list(F8.fp8_configs("sm_100", 4096, 4096, 4096, fast=True))


def test_skinny_entries_only_for_skinny_keys_in_their_mode():
    """Up to 128 rows sm_90 searches a 256-deep K tile in fast mode, and in exact mode a
    latency-6 64x64 and a 64x32 (exact keeps 128-element K tiles: its promotion boundary)."""
    for fast in (False, True):
        skinny = list(F8.fp8_configs("sm_90", 128, 4096, 4096, fast=fast))
        wide = list(F8.fp8_configs("sm_90", 129, 4096, 4096, fast=fast))
        new = [c for c in skinny if c not in wide and F8.split_of(c) == 1]
        assert [(c.tm, c.tn, c.tk, getattr(c, "latency", 0)) for c in new] == \
            ([(64, 64, 256, 0)] if fast else [(64, 64, 128, 6), (64, 32, 128, 4)])
        assert skinny[0] == wide[0] and not any(c.tk != 128 for c in wide)
        assert all(c.tk == 128 for c in skinny) != fast
    assert not any(c.tk != 128 for c in F8.fp8_configs("sm_100", 16, 4096, 4096, fast=True))


QUANT_GENS = (F8.row_configs, F8.block1x128_configs, F8.block128x128_configs,
              F8.pair_configs, F8.tensor_configs, F8.amax_configs)
LAYOUT_GENS = (F8.row_configs, F8.block1x128_configs, F8.block128x128_configs)
QUANT_SHAPES = [(4096, 4096), (16384, 14336), (1, 16), (1000, 1000), (7, 200), (128, 65536)]


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("gen", QUANT_GENS, ids=lambda g: g.__name__)
@pytest.mark.parametrize("col", [False, True], ids=["row-major", "transposed"])
def test_quantizer_spaces(gen, arch, col):
    if col and gen not in LAYOUT_GENS:
        pytest.skip("one space for both layouts")
    for m, k in QUANT_SHAPES:
        cfgs = list(gen(arch, m, k, col=True) if col else gen(arch, m, k))
        assert 1 <= len(cfgs) <= 24
        assert len({tuple(sorted(vars(c).items())) for c in cfgs}) == len(cfgs)
        for c in cfgs:
            for name in ("tr", "tc", "g"):
                v = getattr(c, name, 1)
                assert v >= 1 and v & (v - 1) == 0
            # every quantizer runs on a persistent grid: occupancy and warps in every config;
            # occupancy 8 only at 4 warps: the two-pass rowwise 1 x 2048 tile (no spill) and the
            # tensorwise quantize launch's 4k-element tiles
            assert c.num_worker_warps in (4, 8)
            assert c.occupancy in (2, 4) or (
                gen is F8.row_configs and not col and c.occupancy == 8 and not c.one_pass
                and (c.tr, c.tc, c.num_worker_warps) == (1, 2048, 4)) or (
                gen is F8.tensor_configs and c.occupancy == 8 and c.num_worker_warps == 4
                and c.tr * c.tc <= 4096)
            if gen is F8.row_configs:
                assert c.one_pass == (k <= c.tc)
                assert c.tr * c.tc <= 16384 or c.tr == 1
            if gen is F8.row_configs and col:     # two-pass entries left out for their builds
                assert c.one_pass or not any(slow.items() <= vars(c).items()
                                             for slow in F8.SLOW_COL_BUILDS)


@pytest.mark.parametrize("col", [False, True], ids=["row-major", "transposed"])
def test_128x128_space(col):
    """Tiles of 128 rows read once (tr 128) or in 16-64-row chunks; 6-12 configs; one-pass
    tiles at 8 warps and occupancy 2 (16k floats: 64 a thread), 4 warps only on chunks; the
    transposed view's default is 32-row chunks at 4 warps (the 1x128 transposed winner)."""
    for m, k in QUANT_SHAPES:
        cfgs = list(F8.block128x128_configs("sm_90", m, k, col=col))
        assert 6 <= len(cfgs) <= 12
        assert (cfgs[0].tr, cfgs[0].num_worker_warps) == ((32, 4) if col else (128, 8))
        for c in cfgs:
            assert c.g == 1 and c.tr in (16, 32, 64, 128)
            if c.tr == 128:
                assert (c.occupancy, c.num_worker_warps) == (2, 8)
        assert {c.tr for c in cfgs} >= {32, 64, 128}
        assert {c.occupancy for c in cfgs} == {2, 4} and {c.num_worker_warps for c in cfgs} \
            == {4, 8}
        # the latency hint only on a chunked transposed entry (where it measured faster); 2-D
        # tiles on row-major x only (where they measured faster)
        assert all(c.latency == 0 or (col and c.tr < 128) for c in cfgs)
        assert all(c.flat == (not col) for c in cfgs)


@pytest.mark.parametrize("gen", (F8.tensor_configs, F8.amax_configs), ids=lambda g: g.__name__)
def test_tensorwise_spaces(gen):
    """6-12 configs; the default first and kept where K is narrow; tiles no wider than the row
    (next power of two, at least 128) otherwise; more than one occupancy, 4 warps for the
    transposed view's 32 x 128 tile. The default: 4 warps at occupancy 4 on an 8k-element tile
    (the amax launch's running max then holds 64 floats a thread: 64 registers, no stack in its
    sm_90 build)."""
    default = next(gen("sm_90", 4096, 4096))
    assert (default.num_worker_warps, default.occupancy, default.tr * default.tc) == (4, 4, 8192)
    for m, k in QUANT_SHAPES:
        cfgs = list(gen("sm_90", m, k))
        assert cfgs[0] == default and len(cfgs) <= 12
        assert len(cfgs) >= (6 if k >= 1024 else 2)
        assert len({tuple(sorted(vars(c).items())) for c in cfgs}) == len(cfgs)
        whole = max(F8.next_pow2(k), 128)
        assert all(c.tc <= whole for c in cfgs[1:])
        assert any(c.num_worker_warps == 4 and (c.tr, c.tc) == (32, 128) for c in cfgs)
        if k >= 1024:
            assert len({c.occupancy for c in cfgs}) >= 2
            assert {c.num_worker_warps for c in cfgs} == {4, 8}


# ---------------------------------------------------------------------------------------------
# Scaling modes from the scales' shapes.

def f32(*shape):
    return torch.ones(shape, dtype=torch.float32)


# M, N, K = 256, 512, 1000: 8 K blocks, 2 M blocks, 4 N blocks
MODES = [((), (), ("tensor", 1, 1)), ((1,), (1, 1), ("tensor", 1, 1)),
         ((1, 1, 1), (), ("tensor", 1, 1)), ((256, 1), (1, 512), ("row", 1, 1)),
         ((256, 8), (8, 4), ("block", 1, 128)), ((256, 8), (8, 512), ("block", 1, 1)),
         ((2, 8), (8, 512), ("block", 128, 1))]


@pytest.mark.parametrize("sa,sb,mode", MODES, ids=str)
def test_scaling_modes(sa, sb, mode):
    assert F8._scaling(256, 512, 1000, f32(*sa), f32(*sb)) == mode
    if len(sa) == 2:          # an M-major scale_a (what torch wants) and a K-major one alike
        assert F8._scaling(256, 512, 1000, f32(*sa[::-1]).t(), f32(*sb)) == mode


def test_shapes_two_modes_share_read_as_torch_reads_them():
    """Where shapes coincide the meanings do too; the first mode torch tries is taken."""
    assert F8._scaling(256, 512, 128, f32(256, 1), f32(1, 512)) == ("row", 1, 1)  # 1 K block
    assert F8._scaling(1, 512, 1000, f32(1, 8), f32(8, 512)) == ("block", 1, 1)   # 1 row
    assert F8._scaling(256, 100, 1000, f32(256, 8), f32(8, 1)) == ("block", 1, 128)
    assert F8._scaling(1, 1, 16, f32(1, 1), f32(1, 1)) == ("tensor", 1, 1)


def _torch_accepts(M, N, K, sa_shape, sb_shape):
    a = torch.empty(M, K, dtype=E4M3, device="meta")
    b = torch.empty(N, K, dtype=E4M3, device="meta").t()
    try:
        _check_scaled_mm_sizes(a, b, torch.empty(sa_shape, device="meta"),
                               torch.empty(sb_shape, device="meta"), out_dtype=BF16)
        return True
    except RuntimeError:
        return False


def _ours_accepts(M, N, K, sa_shape, sb_shape):
    try:
        F8._scaling(M, N, K, f32(*sa_shape), f32(*sb_shape))
        return True
    except ValueError:
        return False


@pytest.mark.parametrize("M,N,K", [(256, 512, 1024), (128, 128, 128), (16, 256, 4096),
                                   (640, 384, 1280), (144, 16, 272)])
def test_scale_shapes_accepted_exactly_as_torch_scaled_mm_accepts_them(M, N, K):
    """torch's own shape check (its meta function, which runs the CUDA checks for meta
    tensors) and ours agree on every candidate pair of scale shapes."""
    kb, mb, nb = -(-K // 128), -(-M // 128), -(-N // 128)
    dims = sorted({1, M, N, K, kb, mb, nb, kb + 1, M + 1})
    shapes = [()] + [(d,) for d in (1, M, N)] + [(r, c) for r in dims for c in dims]
    agree = 0
    for sa in shapes:
        for sb in shapes:
            assert _ours_accepts(M, N, K, sa, sb) == _torch_accepts(M, N, K, sa, sb), (sa, sb)
            agree += 1
    assert agree > 100


def test_bad_scale_shapes_name_every_mode():
    with pytest.raises(ValueError, match=r"fp8_mm: scale_a \(100, 1\) and scale_b \(1, 50\) "
                                         r"match no scaling mode.*rowwise \(100, 1\) and "
                                         r"\(1, 300\).*block \(100, 8\) with \(8, 3\)"):
        F8._scaling(100, 300, 1000, f32(100, 1), f32(1, 50))


# ---------------------------------------------------------------------------------------------
# Input checks: everything but the device on CPU tensors, then CPU tensors refused.

def t(*shape, dtype=E4M3):
    return torch.zeros(shape, dtype=dtype)


A, B, S = t(64, 128), t(128, 32), f32()
BAD = [
    (([1.0], B, S, S), {}, TypeError, "a must be a torch.Tensor"),
    ((A, B, 1.0, S), {}, TypeError, "scale_a must be a torch.Tensor"),
    ((A, B, S, None), {}, TypeError, "scale_b must be a torch.Tensor"),
    ((t(2, 64, 128), B, S, S), {}, ValueError, "a and b must be 2-D"),
    ((t(64, 128, dtype=BF16), B, S, S), {}, TypeError, "a dtype torch.bfloat16 is not supported"),
    ((A, t(128, 32, dtype=torch.float16), S, S), {}, TypeError, "b dtype torch.float16"),
    ((A, t(128, 32, dtype=torch.float8_e4m3fnuz), S, S), {}, TypeError, "b dtype"),
    ((t(64, 128, dtype=E5M2), t(128, 32, dtype=E5M2), S, S), {}, TypeError,
     "both float8_e5m2"),
    ((A, t(96, 32), S, S), {}, ValueError, "inner dims differ"),
    ((t(64, 100), t(100, 32), S, S), {}, ValueError, "K .* must be a multiple of 16, got 100"),
    ((A, B, S.double(), S), {}, TypeError, "scale_a must be float32, got torch.float64"),
    ((A, B, S, S.half()), {}, TypeError, "scale_b must be float32"),
    ((A, B, S, S), {"out_dtype": E4M3}, TypeError, "out_dtype torch.float8_e4m3fn is not"),
    # a dtype's name is no dtype: refused as a str, not as the (supported) dtype it prints as
    ((A, B, S, S), {"out_dtype": "bfloat16"}, TypeError,
     r"out_dtype must be a torch.dtype \(bfloat16, float16 or float32\), got str 'bfloat16'"),
    ((A, B, S, S), {"fast_accum": 1}, TypeError, "fast_accum must be a bool"),
    ((A, B, f32(64), f32(32)), {}, ValueError, "match no scaling mode"),
    ((A, B, f32(64, 1), S), {}, ValueError, "match no scaling mode"),
]


@pytest.mark.parametrize("args,kw,error,message", BAD, ids=[b[3] for b in BAD])
def test_bad_input_is_refused_naming_the_argument(args, kw, error, message):
    with pytest.raises(error, match="^fp8_mm: .*" + message):
        fp8_mm(*args, **kw)


def test_cpu_tensors_are_refused_after_every_other_check():
    for args in [(A, B, S, S), (A, B, f32(64, 1), f32(1, 32)), (A, t(32, 128).t(), S, S),
                 (t(64, 256), t(256, 32), f32(64, 2), f32(2, 1))]:
        with pytest.raises(ValueError, match="fp8_mm: a must be a CUDA tensor"):
            fp8_mm(*args)


def test_archs_below_sm90_are_refused_before_any_work(monkeypatch):
    """Checked where the kernels launch (the eager path, or the custom op under torch.compile),
    before anything is allocated; sm_89 too: cuTile 1.7 compiles no float8 below sm_90."""
    monkeypatch.setattr(F8, "device_arch", lambda dev: "sm_89")
    with pytest.raises(ValueError, match=r"^fp8_mm: FP8 needs compute capability 9.0 .*sm_89"):
        F8._fp8_mm(A, B, S, S, BF16, False, None, ("tensor", 1, 1))
    monkeypatch.setattr(F8, "device_arch", lambda dev: "sm_80")
    with pytest.raises(ValueError, match="^quantize_fp8: FP8 needs .* x is on cpu, sm_80"):
        F8._quantize_raw(torch.zeros(4, 8), "row", E4M3)
    monkeypatch.setattr(F8, "device_arch", lambda dev: "sm_90")
    F8._check_arch("fp8_mm", "a", A)


def test_inputs_that_require_grad_are_refused_under_grad_mode(monkeypatch):
    """The FP8 GEMM and the quantizers have no gradient: an input that requires grad would
    silently cut the graph, so it is refused by name (under no_grad it is fine)."""
    from tiletune import validate
    monkeypatch.setattr(validate, "tensor", lambda op, name, t, **kw: t)
    a, b = t(64, 128), t(128, 32)
    scale = torch.ones((), requires_grad=True)
    with pytest.raises(ValueError, match="^fp8_mm: scale_b requires grad, but fp8_mm is not "
                                         "differentiable"):
        fp8_mm(a, b, torch.ones(()), scale)
    x = torch.randn(64, 128, dtype=BF16, requires_grad=True)
    for op, call in (("quantize_fp8", lambda: quantize_fp8(x, "row")),
                     ("quantize_fp8_pair", lambda: F8.quantize_fp8_pair(x))):
        with pytest.raises(ValueError, match=f"^{op}: x requires grad, but {op} is not"):
            call()
    monkeypatch.setattr(F8, "_check_arch", lambda *a: None)
    monkeypatch.setattr(F8, "_fp8_mm", lambda *a: "ran")
    with torch.no_grad():
        assert fp8_mm(a, b, torch.ones(()), scale) == "ran"


def test_out_is_checked():
    a, b = t(64, 128), t(128, 32)
    inputs = {"a": a, "b": b}
    with pytest.raises(TypeError, match="fp8_mm: out must be a torch.Tensor"):
        F8._check_out([], 64, 32, BF16, a, inputs)
    with pytest.raises(ValueError, match=r"fp8_mm: out has shape \(64, 31\) but the result is "
                                         r"\(64, 32\)"):
        F8._check_out(torch.empty(64, 31, dtype=BF16), 64, 32, BF16, a, inputs)
    with pytest.raises(TypeError, match="fp8_mm: out dtype torch.float16 differs from out_dtype"):
        F8._check_out(torch.empty(64, 32, dtype=torch.float16), 64, 32, BF16, a, inputs)
    with pytest.raises(ValueError, match="share memory"):
        F8._check_out(torch.empty(1, 32, dtype=BF16).expand(64, 32), 64, 32, BF16, a, inputs)
    buf = torch.empty(64 * 128, dtype=torch.uint8)
    over = buf[:64 * 32 * 2].view(BF16).view(64, 32)
    with pytest.raises(ValueError, match="fp8_mm: out overlaps a in memory"):
        F8._check_out(over, 64, 32, BF16, a, {"a": buf.view(E4M3).view(64, 128)})
    F8._check_out(torch.empty(64, 32, dtype=BF16), 64, 32, BF16, a, inputs)
    # the kernel writes out behind autograd's back: no out that requires grad, leaf or not
    p = torch.ones(64, 32, dtype=BF16, requires_grad=True)
    for out in (p, p * 2):
        with pytest.raises(ValueError, match="fp8_mm: out is a tensor that requires grad"):
            F8._check_out(out, 64, 32, BF16, a, inputs)
    with torch.no_grad():
        F8._check_out(p, 64, 32, BF16, a, inputs)


QBAD = [
    (([1.0],), TypeError, "x must be a torch.Tensor"),
    ((torch.zeros(2, 3, 4),), ValueError, r"x must be 2-D \(M, K\), got shape \(2, 3, 4\)"),
    ((torch.zeros(4, 8, dtype=torch.int32),), TypeError, "x dtype torch.int32 is not supported"),
    ((torch.zeros(4, 8, dtype=E4M3),), TypeError, "x dtype torch.float8_e4m3fn"),
    ((torch.zeros(4, 8), "col"), ValueError, "granularity must be one of tensor, row, "
                                             "block1x128, block128x128; got 'col'"),
    ((torch.zeros(4, 8), None), TypeError, "granularity must be a str, got NoneType"),
    ((torch.zeros(4, 8), "row", torch.int8), TypeError, "dtype must be float8_e4m3fn or "
                                                        "float8_e5m2, got torch.int8"),
    ((torch.zeros(4, 8), "row", torch.float8_e4m3fnuz), TypeError, "dtype must be"),
    ((torch.zeros(4, 8), "row", "float8_e4m3fn"), TypeError,
     r"dtype must be a torch.dtype \(float8_e4m3fn or float8_e5m2\), got str 'float8_e4m3fn'"),
    ((torch.zeros(4, 8, dtype=BF16), "block1x128"), ValueError, "x must be a CUDA tensor"),
]


@pytest.mark.parametrize("args,error,message", QBAD, ids=[b[2] for b in QBAD])
def test_quantize_bad_input(args, error, message):
    with pytest.raises(error, match="^quantize_fp8: " + message):
        quantize_fp8(*args)
    with pytest.raises(error, match="^quantize_fp8_pair: " + message):
        F8.quantize_fp8_pair(*args)


def test_quantize_pair_launches_the_row_major_side(monkeypatch):
    """The pair kernel reads x through both majors; a transposed view is launched as its
    row-major x.t() with the outputs swapped, so x^T's FP8 lands in q_t either way; the scales
    are each side's quantize_fp8 storage. Other granularities are two quantize_fp8 calls."""
    monkeypatch.setattr(F8, "device_arch", lambda dev: "sm_90")
    seen = []
    monkeypatch.setattr(F8._quantize_pair, "launch", lambda key, dev, *a: seen.append((key, a)))
    for x in (torch.zeros(300, 1000, dtype=BF16), torch.zeros(1000, 300, dtype=BF16).t()):
        (q, s), (q_t, s_t) = F8._quantize_pair_raw(x, E5M2)
        key, (xa, xb, qa, sa, qb, sb, fp8_max) = seen[-1]
        assert xa.stride(-1) == 1 and xb.data_ptr() == xa.data_ptr()
        assert xb.shape == xa.t().shape
        assert key[1:-1] == (*xa.shape, BF16, "row", E5M2) and fp8_max == 57344.0
        assert (q.shape, q_t.shape) == ((300, 1000), (1000, 300)) and q.dtype == E5M2
        assert (s.shape, s_t.shape) == (F8._block_scale_storage(300, 1000),
                                        F8._block_scale_storage(1000, 300))
        row_major_side = (qa, sa) if x.stride(-1) == 1 else (qb, sb)
        assert row_major_side[0] is q and row_major_side[1].data_ptr() == s.data_ptr()
    calls = []
    monkeypatch.setattr(F8, "_check_quantize", lambda *a, **kw: None)      # CPU tensors
    monkeypatch.setattr(F8, "quantize_fp8", lambda x, g, dt: calls.append((x.shape, g)) or g)
    assert F8.quantize_fp8_pair(torch.zeros(8, 16, dtype=BF16), "row") == ("row", "row")
    assert calls == [((8, 16), "row"), ((16, 8), "row")]


# ---------------------------------------------------------------------------------------------
# The host side with the engine stubbed: what reaches each tuner.

@pytest.fixture
def tuners(monkeypatch):
    seen = []
    monkeypatch.setattr(F8, "device_arch", lambda dev: "sm_90")
    monkeypatch.setattr(F8._scaled_tuner, "launch",
                        lambda key, dev, *inputs: seen.append(("scaled", key, inputs)))
    monkeypatch.setattr(F8._block_tuner, "launch",
                        lambda key, dev, *inputs: seen.append(("block", key, inputs)))
    return seen


def test_tensorwise_and_rowwise_reach_one_kernel_with_the_scales_as_given(tuners):
    a, b = t(100, 256), t(48, 256).t()
    scale_a, scale_b = f32(), f32(1)
    c = F8._fp8_mm(a, b, scale_a, scale_b, BF16, False, None, ("tensor", 1, 1))
    (_, key, (a2, b2, sa, sb, c2, fast, widen)), = tuners
    assert c2 is c and c.shape == (100, 48) and c.dtype == BF16
    assert a2 is a and b2 is b                      # row-major a, column-major b: no copies
    assert sa is scale_a and sb is scale_b          # no views; the kernel clamps indices to 0
    assert key == ("tensor", 100, 48, 256, E4M3, E4M3, "col", BF16, False, -1)
    assert F8._scaled_tuner.tune_key(key)[1] == 128       # tuning buckets M
    assert (fast, widen) == (False, False)
    tuners.clear()
    sa_row, sb_row = f32(100, 1), f32(1, 48)
    F8._fp8_mm(a, b, sa_row, sb_row, torch.float32, True, None, ("row", 1, 1))
    (_, key, (a2, b2, sa, sb, c2, fast, widen)), = tuners
    assert sa is sa_row and sb is sb_row
    tuners.clear()
    F8._fp8_mm(a, b, f32(1, 1, 1), f32(1, 1), BF16, False, None, ("tensor", 1, 1))
    (_, _, (_, _, sa, sb, *_)), = tuners
    assert sa.shape == (1,) and sb.shape == (1, 1)  # past 2-D: a (1,) view
    assert key[0] == "row" and key[-3:] == (torch.float32, True, -1) and fast is True


def test_layouts_served_and_copied(tuners):
    a_col = t(256, 100).t()                         # an M-major a: copied to row-major
    b_row = t(256, 48)                              # a row-major b: served as it is
    F8._fp8_mm(a_col, b_row, f32(), f32(), BF16, False, None, ("tensor", 1, 1))
    (_, key, (a2, b2, *_)), = tuners
    assert a2.is_contiguous() and b2 is b_row and key[6] == "row"
    tuners.clear()
    b_strided = t(256, 96)[:, ::2]                  # neither major: copied to column-major
    F8._fp8_mm(t(100, 256), b_strided, f32(), f32(), BF16, False, None, ("tensor", 1, 1))
    (_, key, (a2, b2, *_)), = tuners
    assert b2.stride() == (1, 256) and torch.equal(b2.float(), b_strided.float())
    assert key[6] == "col"


def test_mixed_formats_widen_and_drop_fast_accum(tuners):
    F8._fp8_mm(t(100, 256), t(256, 48, dtype=E5M2), f32(), f32(), BF16, True, None,
               ("tensor", 1, 1))
    (_, key, (*_, fast, widen)), = tuners
    assert widen is True and fast is False and key[4:6] == (E4M3, E5M2) and key[-2] is False


def test_block_scaling_passes_2d_scales_and_groups(tuners):
    a, b = t(300, 992), t(200, 992).t()             # K = 992: a partial last block
    sa, sb = f32(8, 300).t(), f32(2, 8).t()         # M-major scale_a, 128x128 scale_b
    mode = F8._scaling(300, 200, 992, sa, sb)
    assert mode == ("block", 1, 128)
    F8._fp8_mm(a, b, sa, sb, BF16, False, None, mode)
    (kind, key, inputs), = tuners
    assert kind == "block" and inputs[2] is sa and inputs[3] is sb
    assert inputs[5:] == (False, False, 1, 128)
    assert key[:6] == ("block", 1, 128, 300, 200, 992)
    assert F8._block_tuner.tune_key(key)[:6] == ("block", 1, 128, 512, 200, 992)


def test_empty_problems_launch_nothing(tuners):
    assert F8._fp8_mm(t(0, 256), t(256, 8), f32(), f32(), BF16, False, None,
                      ("tensor", 1, 1)).shape == (0, 8)
    z = F8._fp8_mm(t(5, 0), t(0, 8), f32(), f32(), BF16, False, None, ("tensor", 1, 1))
    assert z.shape == (5, 8) and z.abs().sum() == 0  # K = 0: zeros
    assert tuners == []


def test_a_cached_launch_passes_the_config_and_the_mode(launches, monkeypatch):
    a, b, sa, sb, c = t(1000, 512), t(512, 300), f32(1000), f32(300), torch.empty(1000, 300)
    for cfg in F8.fp8_configs("sm_90", 1024, 300, 512):
        if F8.split_of(cfg) > 1:
            continue                   # test_split_k_launches_partials_then_their_scaled_sum
        monkeypatch.setitem(F8._scaled_tuner.cache, ("k", 1024), (cfg, "kernel"))
        launches.clear()
        F8._scaled_tuner.launch(("k", 1000), 0, a, b, sa, sb, c, True, False)
        (grid, kernel, args), = launches
        tiles = -(-1000 // cfg.tm) * -(-300 // cfg.tn)
        assert grid == ((min(tiles, 132 * cfg.occupancy // cfg.num_ctas),) if cfg.persistent
                        else (tiles,))
        assert args == (a, b, sa, sb, c, cfg.tm, cfg.tn, 128, cfg.group_m, True, False,
                        getattr(cfg, "latency", 0), cfg.persistent)
    cfg = next(F8.fp8_block_configs("sm_90", 1024, 300, 512))
    monkeypatch.setitem(F8._block_tuner.cache, ("k", 1, 1, 1024), (cfg, "kernel"))
    launches.clear()
    F8._block_tuner.launch(("k", 1, 1, 1000), 0, a, b, sa, sb, c, False, True, 128, 1)
    assert launches[0][2] == (a, b, sa, sb, c, cfg.tm, cfg.tn, cfg.group_m, 128, 1, False, True,
                              cfg.overlap, getattr(cfg, "latency", 0), cfg.persistent)


def test_split_k_launches_partials_then_their_scaled_sum(launches, monkeypatch):
    """A split-K config launches its unscaled float32 partials into the scratch buffer, then
    their sum, scaled, into the output; the search leaves the sum to the final round."""
    a, b, sa, sb, c = t(16, 1024), t(1024, 300), f32(16), f32(300), torch.empty(16, 300)
    cfgs = list(F8.fp8_configs("sm_90", 16, 300, 1024))
    splits = [cfg for cfg in cfgs if F8.split_of(cfg) > 1]
    assert {(cfg.tm, cfg.tn, cfg.tk, cfg.split) for cfg in splits} == set(F8.SM90_SPLITK)
    assert not any(F8.split_of(cfg) > 1 for cfg in F8.fp8_configs("sm_90", 4096, 4096, 4096))
    assert not any(F8.split_of(cfg) > 1 for cfg in F8.fp8_configs("sm_100", 16, 300, 1024))
    for cfg in splits:
        assert F8._scaled_tuner._partly_timed(cfg)
        assert F8._scaled_kernel(cfg) is F8.fp8_mm_splitk_kernel
        monkeypatch.setitem(F8._scaled_tuner.cache, ("s", 16), (cfg, "kernel"))
        monkeypatch.setattr(F8._scaled_tuner, "_plans", {})
        launches.clear()
        w = F8._scaled_tuner.launch(("s", 16), "cpu", a, b, sa, sb, c, False, False)
        assert w.shape == (cfg.split, 16, 300) and w.dtype == torch.float32
        (g1, k1, args1), (g2, k2, args2) = launches
        assert g1 == (F8.cdiv(16, cfg.tm) * F8.cdiv(300, cfg.tn), cfg.split) and k1 == "kernel"
        assert args1 == (a, b, w, cfg.tm, cfg.tn, cfg.tk, cfg.group_m, False, False, 0,
                         cfg.split)
        assert k2 is F8.fp8_splitk_sum_kernel and g2 == (F8.cdiv(16, 8) * F8.cdiv(300, 64),)
        assert args2 == (w, sa, sb, c, *F8.SUM_TILE, cfg.split)
    assert not F8._scaled_tuner._partly_timed(cfgs[0])


def test_block_split_k_launches_scaled_partials_then_matmuls_sum(launches, monkeypatch):
    """Block scaling's split-K configs (the same entries, on sm_90 keys with few output tiles
    only) write partials already promoted with their scales, which matmul's reduce kernel sums
    into the 2-D output; the search leaves the sum to the final round."""
    M, N, K = 16, 300, 1024
    a, b, c = t(M, K), t(K, N), torch.empty(M, N)
    sa, sb = f32(8, M).t(), f32(3, 8).t()             # 1x128 scale_a (M-major), 128x128 scale_b
    cfgs = list(F8.fp8_block_configs("sm_90", M, N, K))
    splits = [cfg for cfg in cfgs if F8.split_of(cfg) > 1]
    assert {(cfg.tm, cfg.tn, cfg.tk, cfg.split) for cfg in splits} == set(F8.SM90_SPLITK)
    assert all(cfg.overlap is False for cfg in splits) and F8.split_of(cfgs[0]) == 1
    assert not any(F8.split_of(c) > 1 for c in F8.fp8_block_configs("sm_90", 4096, 4096, 4096))
    assert not any(F8.split_of(c) > 1 for c in F8.fp8_block_configs("sm_100", M, N, K))
    for cfg in splits:
        assert F8._block_tuner._partly_timed(cfg)
        assert F8._block_kernel(cfg) is F8.fp8_mm_block_splitk_kernel
        monkeypatch.setitem(F8._block_tuner.cache, ("b", 1, 128, 16), (cfg, "kernel"))
        monkeypatch.setattr(F8._block_tuner, "_plans", {})
        launches.clear()
        w = F8._block_tuner.launch(("b", 1, 128, 16), "cpu", a, b, sa, sb, c, False, False, 1,
                                   128)
        assert w.shape == (cfg.split, M, N) and w.dtype == torch.float32
        (g1, k1, args1), (g2, k2, args2) = launches
        assert g1 == (F8.cdiv(M, cfg.tm) * F8.cdiv(N, cfg.tn), cfg.split) and k1 == "kernel"
        assert args1 == (a, b, sa, sb, w, cfg.tm, cfg.tn, cfg.group_m, 1, 128, False, False, 0,
                         cfg.split)
        assert k2 is splitk_reduce_kernel and g2 == (F8.cdiv(M, 8) * F8.cdiv(N, 64), 1)
        assert args2 == (w, c, *F8.SUM_TILE, cfg.split)
    assert not F8._block_tuner._partly_timed(cfgs[0])


def test_quantizer_launches(launches, monkeypatch):
    x = torch.randn(300, 1000, dtype=BF16)
    q, s = torch.empty(300, 1000, dtype=E4M3), torch.empty(300, 1)
    cfg = next(F8.row_configs("sm_90", 512, 1000))
    monkeypatch.setitem(F8._quantize_row.cache, ("k", 512), (cfg, "kernel"))
    F8._quantize_row.launch(("k", 300), 0, x, q, s, 448.0)
    # persistent grids: at most SMs x occupancy CTAs striding over the tiles
    ctas = F8.persistent_ctas(-(-300 // cfg.tr), 0, cfg.occupancy)
    assert launches[-1] == ((ctas,), "kernel", (x, q, s, 448.0, cfg.tr, cfg.tc, True))
    s_t = torch.empty(8, 300)
    cfg = next(F8.block1x128_configs("sm_90", 512, 1000))
    monkeypatch.setitem(F8._quantize_1x128.cache, ("k", 512), (cfg, "kernel"))
    F8._quantize_1x128.launch(("k", 300), 0, x, q, s_t, 448.0)
    tiles = -(-300 // cfg.tr) * -(-1000 // (cfg.g * 128))
    assert launches[-1][0] == (F8.persistent_ctas(tiles, 0, cfg.occupancy),)
    s_b = torch.empty(3, 8)
    for cfg in F8.block128x128_configs("sm_90", 512, 1000):
        monkeypatch.setitem(F8._quantize_128x128.cache, ("k", 512), (cfg, "kernel"))
        F8._quantize_128x128.launch(("k", 300), 0, x, q, s_b, 448.0)
        tiles = 3 * -(-1000 // (cfg.g * 128))
        assert launches[-1] == ((F8.persistent_ctas(tiles, 0, cfg.occupancy),), "kernel",
                                (x, q, s_b, 448.0, cfg.tr, cfg.g, cfg.latency, cfg.flat))
    # the tensorwise launches: SMs x occupancy CTAs once the tiles outnumber them
    big = torch.randn(4096, 4096, dtype=BF16)
    bits, s1 = torch.zeros(1, dtype=torch.int32), torch.empty(1)
    for tuner, args in [(F8._tensor_amax, (big, bits)),
                        (F8._quantize_tensor, (big, bits, q, s1, 448.0))]:
        for cfg in tuner.configs("sm_90", 4096, 4096):
            monkeypatch.setitem(tuner.cache, ("k", 4096), (cfg, "kernel"))
            tuner.launch(("k", 4096), 0, *args)
            assert launches[-1][0] == (132 * cfg.occupancy,)
            assert launches[-1][2] == (*args, cfg.tr, cfg.tc)
        cfg = next(tuner.configs("sm_90", 4, 100))
        monkeypatch.setitem(tuner.cache, ("k", 4), (cfg, "kernel"))
        tuner.launch(("k", 4), 0, big[:4, :100], *args[1:])
        assert launches[-1][0] == (1,)                      # one tile: one CTA


def test_empty_quantize_returns_the_references_scales_in_storage(monkeypatch):
    monkeypatch.setattr(F8, "device_arch", lambda dev: "sm_90")
    for g in F8.GRANULARITIES:
        for shape in [(0, 300), (130, 0)]:
            x = torch.zeros(shape)
            q, raw = F8._quantize_raw(x, g, E4M3)
            assert raw.shape == F8._scale_storage(g, *shape) and raw.is_contiguous()
            ref_q, ref_s = quantize_fp8_reference(x, g)
            assert q.shape == shape and torch.equal(F8._scales_view(g, raw, *shape), ref_s)


def test_quantize_scales_views_and_storage():
    """The custom op returns fresh storage; the public scales are views of it: () for tensor,
    an M-major (M, KB) for 1x128 (columns padded to 16 bytes), (MB, KB) rows padded to 16
    bytes for 128x128: fp8_mm loads 16-byte-aligned scale rows with TMA."""
    assert F8._scales_view("tensor", torch.ones(1), 1, 100).shape == ()
    assert F8._scale_storage("block1x128", 300, 1000) == (8, 300)
    s = F8._scales_view("block1x128", torch.ones(8, 300), 300, 1000)
    assert s.shape == (300, 8) and s.stride() == (1, 300)
    assert F8._scale_storage("block1x128", 77, 272) == (3, 80)
    s = F8._scales_view("block1x128", torch.ones(3, 80), 77, 272)
    assert s.shape == (77, 3) and s.stride() == (1, 80)
    assert F8._block_scale_storage(300, 1000) == (3, 8)
    assert F8._block_scale_storage(300, 1300) == (3, 12)
    s = F8._scales_view("block128x128", torch.ones(3, 12), 300, 1300)
    assert s.shape == (3, 11) and s.stride() == (12, 1)


def test_fake_implementations_match_the_result_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        a, b = torch.empty(100, 256, dtype=E4M3), torch.empty(48, 256, dtype=E4M3).t()
        c = F8._fp8_mm_op(a, b, torch.empty(()), torch.empty(()), torch.float16, False)
        assert c.shape == (100, 48) and c.dtype == torch.float16
        x = torch.empty(300, 1000, dtype=BF16)
        for g, shape in [("tensor", (1,)), ("row", (300, 1)), ("block1x128", (8, 300)),
                         ("block128x128", (3, 8))]:
            q, s = F8._quantize_op(x, g, E5M2)
            assert q.shape == (300, 1000) and q.dtype == E5M2 and s.shape == shape
        q, s, q_t, s_t = F8._quantize_pair_op(x, E4M3)
        assert (q.shape, s.shape, q_t.shape, s_t.shape) == ((300, 1000), (3, 8), (1000, 300),
                                                            (8, 4))


# ---------------------------------------------------------------------------------------------
# The quantizers' torch reference (what the kernels are tested against bit for bit on the GPU).

def _groups(x, granularity):
    """[(row slice, column slice)] of each scale group."""
    M, K = x.shape
    if granularity == "tensor":
        return [(slice(0, M), slice(0, K))]
    if granularity == "row":
        return [(slice(r, r + 1), slice(0, K)) for r in range(M)]
    rows = 1 if granularity == "block1x128" else 128
    return [(slice(r, r + rows), slice(c, c + 128)) for r in range(0, M, rows)
            for c in range(0, K, 128)]


def _scale_of(s, granularity, r, c):
    if granularity == "tensor":
        return s
    if granularity == "row":
        return s[r.start, 0]
    if granularity == "block1x128":
        return s[r.start, c.start // 128]
    return s[r.start // 128, c.start // 128]


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("granularity", F8.GRANULARITIES)
@pytest.mark.parametrize("xdt", [torch.float32, BF16, torch.float16], ids=str)
def test_reference_definition(granularity, dtype, xdt):
    """Per group: scale = max(amax, 1e-12) / fp8_max as a correctly rounded float32 division
    (what float64 division rounded to float32 gives), q = clamp(x / scale) rounded to nearest,
    |q| reaching fp8_max at the group's largest element, partial groups at the edges; the
    scales in fp8_mm's layouts."""
    torch.manual_seed(0)
    M, K = 130, 300                                  # partial row and column blocks
    x = (torch.randn(M, K) * torch.logspace(-3, 3, K)).to(xdt)
    x[5, :] = 0                                      # all-zero rows / groups
    q, s = quantize_fp8_reference(x, granularity, dtype)
    fp8_max = torch.finfo(dtype).max
    assert q.shape == x.shape and q.dtype == dtype and s.dtype == torch.float32
    kb, mb = -(-K // 128), -(-M // 128)
    shape = {"tensor": (), "row": (M, 1), "block1x128": (M, kb), "block128x128": (mb, kb)}
    assert tuple(s.shape) == shape[granularity]
    if granularity == "block1x128":
        assert s.stride() == (1, M)                  # M-major, as torch._scaled_mm wants
    xd = x.double()
    for r, c in _groups(x, granularity):
        scale = _scale_of(s, granularity, r, c)
        amax = xd[r, c].abs().max()
        expect = (max(amax.float().double().item(), float(torch.tensor(1e-12))) / fp8_max)
        assert scale.item() == torch.tensor(expect, dtype=torch.float64).float().item()
        y = (xd[r, c] / scale.double()).float().clamp(-fp8_max, fp8_max).to(dtype)
        assert torch.equal(q[r, c].view(torch.uint8), y.view(torch.uint8))
        if amax > 1e-12:
            assert q[r, c].float().abs().max() == fp8_max


def test_reference_saturates_nan_propagates_and_reconstructs():
    torch.manual_seed(1)
    x = torch.randn(256, 512)
    q, s = quantize_fp8_reference(x, "row")
    err = (q.float() * s - x).abs() / x.abs().amax(1, keepdim=True)
    assert err.max() < 2 ** -4                      # e4m3: 3 mantissa bits
    x[3, 7] = float("nan")
    q, s = quantize_fp8_reference(x, "block1x128")
    assert torch.isnan(s[3, 0]) and not torch.isnan(s[3, 1]) and not torch.isnan(s[4, 0])
    q, s = quantize_fp8_reference(torch.full((4, 16), 1e6), "tensor", E5M2)
    assert (q.float() == torch.finfo(E5M2).max).all()


def test_reference_divides_as_true_division():
    """Scales and quotients are correctly rounded float32 divisions (tensor / tensor), not the
    multiplication by a rounded reciprocal that torch uses on CUDA for a Python-number divisor,
    which differs in the last bit for some amax."""
    amax = torch.rand(10000) * torch.logspace(-6, 6, 10000)
    s = F8._reference_scale(amax, 448.0)
    exact = (amax.double().clamp(min=float(torch.tensor(1e-12))) / 448.0).float()
    assert torch.equal(s, exact)
    by_reciprocal = amax.clamp(min=1e-12) * torch.tensor(1 / 448.0, dtype=torch.float32)
    assert not torch.equal(by_reciprocal, exact)


REFERENCE_BAD = [
    (([1.0],), TypeError, "x must be a torch.Tensor, got list"),
    ((torch.zeros(256),), ValueError, r"x must be 2-D \(M, K\), got shape \(256,\)"),
    ((torch.zeros(4, 8), "row", torch.int8), TypeError, "dtype must be float8_e4m3fn or "
                                                        "float8_e5m2, got torch.int8"),
    # a non-FP8 float dtype would return its own rounding, quietly
    ((torch.zeros(4, 8), "row", torch.float16), TypeError, "dtype .*, got torch.float16"),
    ((torch.zeros(4, 8), "row", "float8_e5m2"), TypeError, "dtype must be a torch.dtype"),
    ((torch.zeros(4, 8), "col"), ValueError, "granularity must be one of"),
]


@pytest.mark.parametrize("args,error,message", REFERENCE_BAD, ids=[b[2] for b in REFERENCE_BAD])
def test_reference_bad_input_is_refused_naming_the_argument(args, error, message):
    with pytest.raises(error, match="^quantize_fp8_reference: " + message):
        quantize_fp8_reference(*args)


def test_reference_empty_inputs():
    for g in F8.GRANULARITIES:
        q, s = quantize_fp8_reference(torch.zeros(0, 256), g)
        assert q.shape == (0, 256)
        q, s = quantize_fp8_reference(torch.zeros(4, 0), g)
        assert q.shape == (4, 0)


# ---------------------------------------------------------------------------------------------
# AOT cases: every config of every space, both accumulation modes, every quantizer.

def test_aot_cases_cover_every_config():
    labels = [c.label for c in CASES.compile_cases()]
    for fast, archs in ((False, ("sm_90", "sm_100", "sm_120")), (True, ("sm_90",))):
        acc = "fast_accum" if fast else "exact"
        for arch in archs:
            for cfg in F8.fp8_configs(arch, 4096, 4096, 4096, fast=fast):
                assert any(lab.startswith("fp8_mm ") and f" {acc} space " in lab
                           and lab.endswith(str(vars(cfg))) for lab in labels), (arch, cfg)
        for cfg in F8.fp8_configs("sm_90", 128, 4096, 4096, fast=fast):     # skinny entries
            assert any(lab.startswith("fp8_mm ") and f" {acc} " in lab
                       and lab.endswith(str(vars(cfg))) for lab in labels), cfg
    for arch in ("sm_90", "sm_100", "sm_120"):
        for cfg in F8.fp8_block_configs(arch, 4096, 4096, 4096):
            assert any(lab.startswith("fp8_mm block ") and " space " in lab
                       and lab.endswith(str(vars(cfg))) for lab in labels), (arch, cfg)
    pairs = lambda cfgs: {tuple(sorted((k, v) for k, v in vars(c).items() if k != "occupancy"))
                          for c in cfgs}
    for kind, (tuner, _, gen) in CASES.QUANT.items():
        for cfg in gen("sm_90", 4096, 4096):
            assert f"quantize {kind} space 4096x4096 bf16 {vars(cfg)}" in labels
        # the other keys: the default and each (tile, warps) pair at its highest occupancy
        others = {"transposed 4096x4096": list(gen("sm_90", 4096, 4096, col=True))} \
            if tuner in F8.LAYOUT_TUNERS else {}
        if kind == "row":
            others["4096x14336"] = list(gen("sm_90", 4096, 14336))
        for key, cfgs in others.items():
            compiled = tightest(cfgs)
            assert compiled[0] == cfgs[0] and pairs(compiled) == pairs(cfgs)
            for cfg in compiled:
                top = max(c.occupancy for c in cfgs if pairs([c]) == pairs([cfg]))
                assert cfg is cfgs[0] or cfg.occupancy == top
                assert any(lab.startswith(f"quantize {kind} space") and
                           lab.endswith(str(vars(cfg))) for lab in labels), (kind, key, cfg)
    assert len(labels) == len(set(labels))
    for want in ("tensorwise", "row-major b", "e4m3 x e5m2", "1x128 x 1x128", "128x128 x 1x128",
                 "K-major scale_a", "partial last block", "decode"):
        assert any(want in lab for lab in labels), want


def test_bench_rows():
    assert len(CASES.HEADLINE) == 2
    assert {m for m, _ in CASES.MODES} == {"tensorwise", "rowwise", "block"}
    assert [s for s in CASES.SHAPES][:4] == [(4096, 4096, 4096), (8192, 8192, 8192),
                                             (16384, 4096, 14336), (128, 4096, 4096)]
    assert all(m <= 64 for m, _, _ in CASES.SHAPES[4:])      # decode-sized rows after them


# ---------------------------------------------------------------------------------------------
def test_forward_mode_ad_and_torch_func_transforms_are_refused_by_name(monkeypatch):
    """A dual tensor does not require grad, so the grad-mode refusal above would let it through
    and the kernels would drop its tangent (torch._scaled_mm raises there too): refused by name,
    as are vmap and grad."""
    import torch.autograd.forward_ad as fwAD
    from tiletune import validate
    monkeypatch.setattr(validate, "tensor", lambda op, name, t, **kw: t)
    monkeypatch.setattr(F8, "_check_arch", lambda *a: None)
    monkeypatch.setattr(F8, "_fp8_mm", lambda *a: pytest.fail("the GEMM ran"))
    monkeypatch.setattr(F8, "_linear_forward", lambda *a: pytest.fail("the linear ran"))
    a, b = t(64, 128), t(128, 32)
    x, w = torch.randn(64, 128, dtype=BF16), torch.randn(32, 128, dtype=BF16)
    message = "forward-mode AD and torch.func transforms"
    with fwAD.dual_level():
        scale = fwAD.make_dual(torch.ones(()), torch.ones(()))
        with pytest.raises(TypeError, match=f"^fp8_mm: {message}"):
            fp8_mm(a, b, scale, torch.ones(()))
        dual_x = fwAD.make_dual(x, torch.ones_like(x))
        for op, call in (("quantize_fp8", lambda: quantize_fp8(dual_x, "row")),
                         ("quantize_fp8_pair", lambda: F8.quantize_fp8_pair(dual_x)),
                         ("fp8_linear", lambda: F8.fp8_linear(dual_x, w))):
            with pytest.raises(TypeError, match=f"^{op}: {message}"):
                call()
    with pytest.raises(TypeError, match=f"^fp8_linear: {message}"):
        torch.func.grad(lambda x: F8.fp8_linear(x, w).float().sum())(x)
    with pytest.raises(TypeError, match=f"^quantize_fp8: {message}"):
        torch.func.vmap(lambda x: quantize_fp8(x, "row")[0])(x[None])
    # under grad and jacrev the input requires grad too: the transform is what is named
    with pytest.raises(TypeError, match=f"^quantize_fp8: {message}"):
        torch.func.grad(lambda x: quantize_fp8(x, "row")[1].sum())(x.float())
    with pytest.raises(TypeError, match=f"^fp8_mm: {message}"):
        torch.func.jacrev(lambda s: fp8_mm(a, b, s, torch.ones(())).float())(torch.ones(()))


# fp8_linear: checks, and its autograd on CPU with the quantizer and the GEMM replaced by their
# torch references (what each GEMM quantizes, along which dim, in which groups).

def _expand(s, rows, cols):
    s = s.double()
    if s.numel() == 1:
        return s.reshape(())
    if s.shape[0] not in (1, rows):
        s = s.repeat_interleave(128, 0)[:rows]
    if s.shape[1] not in (1, cols):
        s = s.repeat_interleave(128, 1)[:, :cols]
    return s


@pytest.fixture
def reference_fp8(monkeypatch):
    """quantize_fp8 / fp8_mm as float64 references on CPU; records (shape, granularity) of each
    quantization."""
    seen = []

    def quantize(x, granularity):
        seen.append((tuple(x.shape), granularity))
        return quantize_fp8_reference(x, granularity)

    def mm(a, b, sa, sb, out_dtype):
        (M, K), N = a.shape, b.shape[1]
        assert K % 16 == 0 and F8._scaling(M, N, K, sa, sb)
        return ((a.double() * _expand(sa, M, K)) @ (b.double() * _expand(sb, K, N))).to(out_dtype)
    monkeypatch.setattr(F8, "quantize_fp8", quantize)
    monkeypatch.setattr(F8, "fp8_mm", mm)
    return seen


def _measure(x, y):
    x, y = x.double(), y.double()
    return (1 - 2 * (x * y).sum() / (x * x + y * y).sum()).item()


@pytest.mark.parametrize("recipe", ["rowwise", "block"])
def test_fp8_linear_autograd_quantizes_each_gemm_along_its_reduction(reference_fp8, recipe):
    M, K, N = 77, 272, 144                     # tokens not a multiple of 16: wgrad pads to 80
    x = torch.randn(M, K, dtype=BF16, requires_grad=True)
    w = (torch.randn(N, K) / K ** 0.5).to(BF16).requires_grad_()
    b = torch.randn(N, dtype=BF16, requires_grad=True)
    y = F8._FP8Linear.apply(x, w, b, recipe)
    dy = torch.randn(M, N, dtype=BF16)
    dx, dw, db = torch.autograd.grad(y, (x, w, b), dy)
    (act, wt), _ = F8.RECIPES[recipe]
    grad_act = "block1x128" if recipe == "block" else act
    assert reference_fp8 == [((M, K), act), ((N, K), wt),          # forward
                             ((M, N), act), ((K, N), wt),          # dgrad: dy, w^T along N
                             ((N, 80), grad_act), ((K, 80), grad_act)]   # wgrad: along tokens
    xd, wd, dyd = x.double(), w.double(), dy.double()
    assert (y.dtype, dx.dtype, dw.dtype, db.dtype) == (BF16,) * 4
    assert _measure(y, xd @ wd.t() + b.double()) < 2e-3
    assert _measure(dx, dyd @ wd) < 2e-3
    assert _measure(dw, dyd.t() @ xd) < 2e-3
    torch.testing.assert_close(db, dy.float().sum(0).to(BF16))


def test_fp8_linear_computes_only_the_gradients_asked_for(reference_fp8):
    x = torch.randn(32, 64, dtype=BF16)
    w = torch.randn(16, 64, dtype=BF16, requires_grad=True)
    (dw,) = torch.autograd.grad(F8._FP8Linear.apply(x, w, None, "rowwise"), (w,),
                                torch.ones(32, 16, dtype=BF16))
    assert dw.shape == w.shape and len(reference_fp8) == 4        # forward 2 + wgrad 2
    # each operand is kept only for the other one's gradient (a frozen weight keeps no x)
    for x_grad in (False, True):
        y = F8._FP8Linear.apply(x.clone().requires_grad_(x_grad), w.detach().requires_grad_(
            not x_grad), None, "rowwise")
        saved_x, saved_w = y.grad_fn.saved_tensors
        assert (saved_x is None) is x_grad and (saved_w is None) is (not x_grad)


def test_fp8_linear_copies_an_expanded_gradient_once(reference_fp8, monkeypatch):
    """The gradient of a .sum() arrives expanded (stride 0), which the quantizers' tiled loads
    do not take: the backward makes it real once, for both GEMMs that read it."""
    strides = []
    quantize = F8.quantize_fp8

    def recording(x, granularity):
        strides.append(x.stride())
        return quantize(x, granularity)
    monkeypatch.setattr(F8, "quantize_fp8", recording)
    x = torch.randn(32, 64, dtype=BF16, requires_grad=True)
    w = torch.randn(16, 64, dtype=BF16, requires_grad=True)
    y = F8._FP8Linear.apply(x, w, None, "rowwise")
    dx, dw = torch.autograd.grad(y.sum(), (x, w))
    assert len(strides) == 6 and all(0 not in s for s in strides)
    ones = torch.ones(32, 16, dtype=torch.float64)
    assert _measure(dx, ones @ w.double()) < 2e-3
    assert _measure(dw, ones.t() @ x.double()) < 2e-3


def test_fp8_linear_second_differentiation_raises(reference_fp8):
    """A gradient penalty through fp8_linear: the first-order gradients come back, and a
    second differentiation (here toward the weight, which only the saved tensors tie dx to)
    raises instead of missing its second-order term."""
    x = torch.randn(32, 64, dtype=BF16, requires_grad=True)
    w = torch.randn(16, 64, dtype=BF16, requires_grad=True)
    (dx,) = torch.autograd.grad(F8._FP8Linear.apply(x, w, None, "rowwise").float().sum(), x,
                                create_graph=True)
    assert dx.requires_grad
    with pytest.raises(RuntimeError, match="no double backward"):
        torch.autograd.grad(dx.float().pow(2).sum(), w)


X, W = torch.zeros(8, 64, dtype=BF16), torch.zeros(32, 64, dtype=BF16)
BAD_LINEAR = [
    (([1.0], W), {}, TypeError, "x must be a torch.Tensor"),
    ((X, W, 0.5), {}, TypeError, "bias must be a torch.Tensor"),
    ((X, W), {"recipe": "tensorwise"}, ValueError, "recipe must be one of"),
    ((X, W), {"recipe": ["rowwise"]}, ValueError, "recipe must be one of"),
    ((torch.zeros(8, 0, dtype=BF16), torch.zeros(32, 0, dtype=BF16)), {}, ValueError,
     r"K \(0\) and N \(32\) must be multiples of 16, K at least 16"),
    ((X, torch.zeros(32, 48, dtype=BF16)), {}, ValueError, "must share K"),
    ((X, W, torch.zeros(31, dtype=BF16)), {}, ValueError, r"bias must be \(N,\) = \(32,\)"),
    ((torch.zeros(8, 40, dtype=BF16), torch.zeros(32, 40, dtype=BF16)), {}, ValueError,
     r"K \(40\) and N \(32\) must be multiples of 16"),
    ((X, torch.zeros(24, 64, dtype=BF16)), {}, ValueError, r"K \(64\) and N \(24\)"),
    # dtypes before the device (checkable on CPU tensors): a pre-quantized weight is named
    ((X.double(), W), {}, TypeError, "x dtype torch.float64 is not supported"),
    ((X, W.to(E4M3)), {}, TypeError, "weight dtype torch.float8_e4m3fn is not supported"),
    ((X, W, torch.zeros(32, dtype=torch.int32)), {}, TypeError, "bias dtype torch.int32"),
    ((X, W), {}, ValueError, "x must be a CUDA tensor"),
]


@pytest.mark.parametrize("args,kw,error,message", BAD_LINEAR, ids=[b[3] for b in BAD_LINEAR])
def test_fp8_linear_bad_input_is_refused_naming_the_argument(args, kw, error, message):
    with pytest.raises(error, match="^fp8_linear: .*" + message):
        F8.fp8_linear(*args, **kw)


def test_one_launch_key_has_one_quantizer_space():
    """The quantizers' key holds x's layout; the space follows the same reading, so a (1, K)
    row whose size-1 dim has stride 1 (`randn(K, 1).t()`) and a contiguous (1, K) row, one
    key, get one space (the first call's x decided which), and a transposed view its own."""
    unit = torch.randn(256, 1, dtype=BF16).t()                 # (1, 256), strides (1, 1)
    plain = torch.randn(1, 256, dtype=BF16)
    transposed = torch.randn(256, 64, dtype=BF16).t()           # (64, 256), strides (1, 64)
    assert F8.layout(unit) == F8.layout(plain) == "row" and F8.layout(transposed) == "col"
    assert F8._layout_space(unit) == F8._layout_space(plain)
    assert F8._layout_space(plain)["col"] is False and F8._layout_space(transposed)["col"] is True


def test_inputs_and_out_that_require_grad_are_taken_in_inference_mode(monkeypatch):
    """torch.inference_mode() records no graph, even under enable_grad: there is no graph for
    the FP8 GEMM or a quantizer to cut, so inputs that require grad (an nn.Module's weight) and
    an out that does are taken there, as under no_grad; outside it they are still refused."""
    monkeypatch.setattr(F8.validate, "tensor", lambda op, name, t, **kw: t)    # CPU tensors
    monkeypatch.setattr(F8, "_check_arch", lambda *a: None)
    monkeypatch.setattr(F8, "_fp8_mm", lambda *a: "ran")
    monkeypatch.setattr(F8, "_quantize_raw", lambda x, g, dtype: (
        x.new_empty(x.shape, dtype=dtype), f32(*F8._scale_storage(g, *x.shape))))
    a, b = t(64, 128), t(128, 32)
    scale = torch.ones((), requires_grad=True)
    out = torch.empty(64, 32, dtype=BF16, requires_grad=True)
    x = torch.randn(64, 128, dtype=BF16, requires_grad=True)
    calls = (("fp8_mm", lambda: fp8_mm(a, b, torch.ones(()), scale)),
             ("fp8_mm", lambda: fp8_mm(a, b, S, S, out=out)),
             ("quantize_fp8", lambda: quantize_fp8(x, "row")),
             ("quantize_fp8_pair", lambda: F8.quantize_fp8_pair(x, "row")))
    with torch.inference_mode(), torch.enable_grad():
        assert calls[0][1]() == "ran" and calls[1][1]() == "ran"
        q, s = calls[2][1]()
        assert q.shape == (64, 128) and s.shape == (64, 1)
        (q, s), (q_t, s_t) = calls[3][1]()
        assert q_t.shape == (128, 64) and s_t.shape == (128, 1)
    for op, call in calls:
        with pytest.raises(ValueError, match=f"^{op}: "):
            call()


def test_fp8_linear_records_no_graph_in_inference_mode(reference_fp8, monkeypatch):
    """Under torch.inference_mode() with enable_grad, as torch's ops there: a weight that
    requires grad takes the plain forward (no autograd Function applied, nothing saved for a
    backward that cannot run), and the output requires no grad."""
    monkeypatch.setattr(F8.validate, "tensor", lambda op, name, t, **kw: t)    # CPU tensors
    monkeypatch.setattr(F8, "_check_arch", lambda *a: None)
    applied = []
    apply = F8._FP8Linear.apply
    monkeypatch.setattr(F8._FP8Linear, "apply", lambda *a: applied.append(1) or apply(*a))
    x = torch.randn(2, 32, 64, dtype=BF16)
    w = torch.randn(16, 64, dtype=BF16, requires_grad=True)
    with torch.inference_mode(), torch.enable_grad():
        y = F8.fp8_linear(x, w)
    assert y.shape == (2, 32, 16) and not y.requires_grad and applied == []
    assert len(reference_fp8) == 2                             # the forward's two quantizations
    assert F8.fp8_linear(x, w).requires_grad and applied == [1]     # outside it: a graph
