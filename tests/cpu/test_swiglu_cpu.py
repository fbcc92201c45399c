"""SwiGLU/GeGLU without a GPU: the config spaces, input checks (fake CUDA tensors), the custom
ops' fake implementations, and the host side (flattening, chunk() views passed in place, copies,
int32-safe row chunks, autograd and torch.compile wiring) with ct.launch stubbed by a torch
emulation of the kernels."""
import math
from types import SimpleNamespace

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tiletune import autotune, device
from tiletune.autotune import MAX_CONFIGS
from tiletune.ops import swiglu as S
from tiletune.space import row_chunks
from tests.cpu.stand_ins import kernel_rows, resolve_misses_to_default

BF16 = torch.bfloat16
ARCHS = ("sm_90", "sm_100", "sm_120", "sm_80")
WIDTHS = (1, 2, 7, 64, 100, 1001, 4096, 5000, 11008, 14336, 65536)


# ---------------------------------------------------------------------------------------------
# Config spaces.

@pytest.mark.parametrize("arch", ARCHS)
def test_space(arch):
    for n in WIDTHS:
        cfgs = list(S.configs(arch, n))
        assert 1 <= len(cfgs) <= min(21, MAX_CONFIGS)
        assert len({tuple(sorted(vars(c).items())) for c in cfgs}) == len(cfgs), "repeated config"
        row = min(S.next_pow2(n), 2048)
        assert cfgs[0] == SimpleNamespace(tile_m=2048 // row, tile_n=row, occupancy=2,
                                          num_worker_warps=4, persistent=False)
        for c in cfgs:
            for v in (c.tile_m, c.tile_n):
                assert v >= 1 and v & (v - 1) == 0, vars(c)
            assert c.tile_n <= S.MAX_TILE_N and c.tile_m * c.tile_n in (1024, 2048, 4096)
            assert c.tile_n <= S.next_pow2(n)                  # no tile wider than the row
            assert (c.occupancy, c.num_worker_warps) in ((4, 4), (2, 4), (2, 8), (1, 8), (8, 4))
        assert {c.persistent for c in cfgs} == {True, False}
        # occupancy 8 (63 registers on sm_90) only for the first tile, one tile per CTA
        assert [vars(c) for c in cfgs if c.occupancy == 8] == \
            [dict(vars(cfgs[0]), occupancy=8)]
        if n >= 32:
            assert len(cfgs) == 21 and len({(c.tile_m, c.tile_n) for c in cfgs}) == 4


def test_space_is_the_same_on_every_arch():
    """Nothing in the kernels depends on the arch (no shared memory, no clusters)."""
    for n in WIDTHS:
        assert list(S.configs("sm_90", n)) == list(S.configs("sm_100", n))
        assert list(S.configs("sm_90", n)) == list(S.configs("sm_120", n))


def test_both_tuners_search_the_space():
    assert S._fwd.configs is S.configs and S._bwd.configs is S.configs


# ---------------------------------------------------------------------------------------------
# Input checks: CPU tensors are refused before anything else; the rest on fake CUDA tensors.

def test_cpu_tensors_are_refused():
    g = torch.randn(4, 8)
    with pytest.raises(ValueError, match="swiglu: gate must be a CUDA tensor"):
        S.swiglu(g, g)
    with pytest.raises(ValueError, match="geglu: gate must be a CUDA tensor"):
        S.geglu(g, g)
    with pytest.raises(TypeError, match="swiglu: gate must be a torch.Tensor"):
        S.swiglu([1.0], g)
    with FakeTensorMode():
        cuda = torch.empty(4, 8, device="cuda")
        with pytest.raises(ValueError, match="swiglu: up must be a CUDA tensor"):
            S.swiglu(cuda, torch.empty(4, 8))
        with pytest.raises(TypeError, match="swiglu: up must be a torch.Tensor"):
            S.swiglu(cuda, 2.0)


@pytest.mark.parametrize("op", ["swiglu", "geglu"])
def test_bad_inputs_name_the_function_and_argument(op):
    fn = getattr(S, op)
    with FakeTensorMode():
        g = torch.empty(4, 8, device="cuda", dtype=BF16)
        with pytest.raises(TypeError, match=rf"{op}: up dtype torch.float16 differs from gate "
                                            r"dtype torch.bfloat16"):
            fn(g, g.half())
        with pytest.raises(ValueError, match=rf"{op}: up shape \(4, 9\) differs from gate shape "
                                             r"\(4, 8\)"):
            fn(g, torch.empty(4, 9, device="cuda", dtype=BF16))
        with pytest.raises(ValueError, match=rf"{op}: up shape \(8, 4\) differs"):
            fn(g, torch.empty(8, 4, device="cuda", dtype=BF16))
        with pytest.raises(TypeError, match=rf"{op}: gate dtype torch.float64 is not supported"):
            fn(g.double(), g.double())
        with pytest.raises(TypeError, match=rf"{op}: gate dtype torch.int32 is not supported"):
            fn(g.int(), g.int())
        with pytest.raises(ValueError, match=rf"{op}: gate must have at least one dimension"):
            s = torch.empty((), device="cuda", dtype=BF16)
            fn(s, s)
        with pytest.raises(ValueError, match=rf"{op}: up is on cuda:1 but the other inputs are "
                                             "on cuda:0"):
            fn(torch.empty(4, 8, device="cuda:0"), torch.empty(4, 8, device="cuda:1"))


def test_geglu_approximate_is_checked():
    with FakeTensorMode():
        g = torch.empty(4, 8, device="cuda", dtype=BF16)
        for bad in ("erf", "Tanh", "", None, 1, True):
            with pytest.raises(ValueError, match=r"geglu: approximate must be 'tanh' or 'none'"):
                S.geglu(g, g, approximate=bad)


def test_rows_wider_than_int32_are_refused(monkeypatch):
    monkeypatch.setattr(S, "_MAX_SPAN", 100)
    with FakeTensorMode():
        g = torch.empty(2, 101, device="cuda", dtype=BF16)
        with pytest.raises(ValueError, match=r"swiglu: rows of 101 elements are not supported"):
            S.swiglu(g, g)


# ---------------------------------------------------------------------------------------------
# Fake implementations (what torch.compile traces): contiguous results shaped like gate.

def test_fake_implementations():
    with FakeTensorMode():
        gu = torch.empty(2, 6, 20, device="cuda", dtype=BF16)
        g, u = gu.chunk(2, dim=-1)
        y = S._glu._fwd_op(g, u, S.SILU)
        assert y.shape == g.shape and y.dtype == BF16 and y.is_contiguous() and y.is_cuda
        dg, du = S._glu._bwd_op([True, True], y, g, u, S.GELU_ERF)
        for d in (dg, du):
            assert d.shape == g.shape and d.dtype == BF16 and d.is_contiguous()
        e = torch.empty(0, 5, device="cuda", dtype=torch.float32)
        assert S._glu._fwd_op(e, e, S.GELU_TANH).shape == (0, 5)


# ---------------------------------------------------------------------------------------------
# The host side with the kernels emulated in torch: ct.launch stubbed (tests/cpu/conftest.py),
# each miss resolved to the shape's default config.

def _act(g, act):
    g = g.double()
    if act == S.SILU:
        return g * torch.sigmoid(g)
    if act == S.GELU_TANH:
        return torch.nn.functional.gelu(g, approximate="tanh")
    return torch.nn.functional.gelu(g)


def _act_grad(g, act):
    """act'(g) in closed form (the kernels' formulas; the tests check them against autograd)."""
    g = g.double()
    if act == S.SILU:
        s = torch.sigmoid(g)
        return s * (1 + g * (1 - s))
    if act == S.GELU_TANH:
        k = math.sqrt(2 / math.pi)
        s = torch.sigmoid(2 * k * (g + 0.044715 * g ** 3))
        return s + g * s * (1 - s) * 2 * k * (1 + 3 * 0.044715 * g * g)
    return 0.5 * torch.special.erfc(-g / math.sqrt(2)) + g * torch.exp(-0.5 * g * g) / math.sqrt(
        2 * math.pi)


def _autograd_act_grad(g, act):
    g = g.double().detach().requires_grad_()
    (d,) = torch.autograd.grad(_act(g, act).sum(), g)
    return d


@pytest.fixture
def emulated(launches, monkeypatch):
    """The kernels, run by torch on the arrays they are given; records each launch's arrays."""
    resolve_misses_to_default(monkeypatch, lambda tuner, dev: tuner.name)
    monkeypatch.setitem(device._SM_COUNT, -1, 132)      # a CPU tensor's device index
    calls = []

    rows = kernel_rows

    def launch(stream, grid, kernel, args):
        calls.append((kernel, args))
        if kernel == "swiglu_fwd":
            gate, up, out, act = *map(rows, args[:3]), args[3]
            out.copy_(_act(gate, act) * up.double())
        else:
            dy, gate, up, dgate, dup, act = *map(rows, args[:5]), args[5]
            dup.copy_(dy.double() * _act(gate, act))
            dgate.copy_(dy.double() * up.double() * _act_grad(gate, act))
    monkeypatch.setattr(S.ct, "launch", launch)
    autotune.clear_cache()
    yield calls
    autotune.clear_cache()


def _reference(gate, up, act):
    return _act(gate, act) * up.double()


@pytest.mark.parametrize("act", [S.SILU, S.GELU_TANH, S.GELU_ERF])
def test_forward_and_backward_wiring(emulated, act):
    g = torch.randn(3, 5, 17, requires_grad=True)
    u = torch.randn(3, 5, 17, requires_grad=True)
    y = S._glu(g, u, act)
    assert y.shape == g.shape and y.dtype == g.dtype and y.is_contiguous()
    dy = torch.randn_like(y)
    dg, du = torch.autograd.grad(y, (g, u), dy)
    g64, u64 = g.detach().double().requires_grad_(), u.detach().double().requires_grad_()
    rg, ru = torch.autograd.grad(_reference(g64, u64, act), (g64, u64), dy.double())
    torch.testing.assert_close(y.double(), _reference(g, u, act).detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(dg.double(), rg, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(du.double(), ru, rtol=1e-6, atol=1e-6)
    kernels = [k for k, _ in emulated]
    assert kernels == ["swiglu_fwd", "swiglu_bwd"]
    for kernel, args in emulated:      # (3, 5, 17) reaches both kernels as it is
        assert all(a.shape == (3, 5, 17) for a in args if isinstance(a, torch.Tensor))
        assert args[3 if kernel == "swiglu_fwd" else 5] == act


def test_backward_keeps_gate_and_up_not_the_product(emulated):
    g, u = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8, requires_grad=True)
    y = S._glu(g, u, S.SILU)
    saved = [t for t in (y.grad_fn.saved_tensors)]
    assert len(saved) == 2 and saved[0] is not None
    assert {t.data_ptr() for t in saved} == {g.data_ptr(), u.data_ptr()}


def test_no_grad_call_runs_only_the_forward(emulated):
    g = torch.randn(4, 8)
    y = S._glu(g, g, S.SILU)
    assert y.grad_fn is None and [k for k, _ in emulated] == ["swiglu_fwd"]


@pytest.mark.parametrize("shape", [(40, 1, 2 * 64), (2, 64, 2 * 64)], ids=str)
def test_merged_rows_reach_the_kernels_without_a_view(emulated, shape):
    """(B, S, N) gate and up (here the chunk() halves of one tensor) and decode's (B, 1, N) go
    to both kernels as they are (the kernels view them as rows)."""
    gu = torch.randn(shape, requires_grad=True)
    g, u = gu.chunk(2, dim=-1)
    y = S._glu(g, u, S.SILU)
    torch.testing.assert_close(y.double(), _reference(g, u, S.SILU).detach())
    y.backward(torch.randn_like(y))
    (_, fwd), (_, bwd) = emulated
    assert fwd[0] is g and fwd[1] is u and fwd[2] is y
    assert all(a.dim() == 3 for a in bwd[:5]) and bwd[1] is g and bwd[2] is u


@pytest.mark.parametrize("shape", [(64,), (300,), (2, 1, 3, 16)], ids=str)
def test_one_dim_and_unmerged_inputs(emulated, shape):
    """A 1-D gate (one row) and a (B, 1, S, N) slice of a longer buffer, whose rows do not
    merge across the size-1 dim: each array reaches the kernels as rows it can view, and the
    results are right, forward and backward."""
    full = [s + 4 if i == len(shape) - 2 else s for i, s in enumerate(shape)]
    index = tuple(slice(0, s) for s in shape)
    g = torch.randn(full)[index].requires_grad_()
    u = torch.randn(full)[index].requires_grad_()
    y = S._glu(g, u, S.SILU)
    assert y.shape == g.shape
    torch.testing.assert_close(y.double(), _reference(g, u, S.SILU).detach())
    dy = torch.randn_like(y)
    dg, du = torch.autograd.grad(y, (g, u), dy)
    g64, u64 = g.detach().double().requires_grad_(), u.detach().double().requires_grad_()
    rg, ru = torch.autograd.grad(_reference(g64, u64, S.SILU), (g64, u64), dy.double())
    torch.testing.assert_close(dg.double(), rg)
    torch.testing.assert_close(du.double(), ru)


def test_chunk_halves_are_read_in_place(emulated):
    """gate, up = gate_up.chunk(2, -1): (..., N) arrays with row stride 2N, no copy (2-D, and
    3-D halves of a (B, S, 2N) tensor, which the kernels view as rows)."""
    for shape in ((6, 2 * 33), (2, 3, 2 * 64)):
        gu = torch.randn(shape, requires_grad=True)
        g, u = gu.chunk(2, dim=-1)
        emulated.clear()
        y = S._glu(g, u, S.SILU)
        torch.testing.assert_close(y.double(), _reference(g, u, S.SILU).detach())
        (_, (ag, au, out, *_)), = emulated
        n = shape[-1] // 2
        assert ag.stride()[-2:] == (2 * n, 1) and au.stride()[-2:] == (2 * n, 1)
        assert ag.data_ptr() == gu.data_ptr() and au.data_ptr() == gu.data_ptr() + n * 4
        dy = torch.randn_like(y)
        (dgu,) = torch.autograd.grad(y, gu, dy)
        gu64 = gu.detach().double().requires_grad_()
        (ref,) = torch.autograd.grad(_reference(*gu64.chunk(2, -1), S.SILU), gu64, dy.double())
        torch.testing.assert_close(dgu.double(), ref)
        (_, (_, bg, bu, *_)) = emulated[-1]
        assert bg.data_ptr() == gu.data_ptr() and bu.stride()[-2:] == (2 * n, 1)


def test_other_layouts_are_copied_once(emulated):
    """A last dim of stride != 1 (a transpose, a step) is copied; the result is still right."""
    base = torch.randn(16, 12)
    for g in (base.t(), base[:, ::2]):
        u = torch.randn(g.shape)
        emulated.clear()
        y = S._glu(g, u, S.GELU_TANH)
        torch.testing.assert_close(y.double(), _reference(g, u, S.GELU_TANH))
        (_, (ag, au, *_)), = emulated
        assert ag.is_contiguous() and au.data_ptr() == u.data_ptr()


def test_expanded_upstream_gradient(emulated):
    """y.sum().backward() hands the backward a stride-0 dy: copied to rows, right gradients."""
    g = torch.randn(5, 9, requires_grad=True)
    u = torch.randn(5, 9, requires_grad=True)
    S._glu(g, u, S.SILU).sum().backward()
    torch.testing.assert_close(u.grad.double(), _act(g.detach(), S.SILU))


def test_empty_inputs_launch_nothing(emulated):
    for shape in ((0, 8), (3, 0), (2, 0, 5)):
        g = torch.randn(shape, requires_grad=True)
        u = torch.randn(shape, requires_grad=True)
        y = S._glu(g, u, S.SILU)
        assert y.shape == shape
        dg, du = torch.autograd.grad(y, (g, u), torch.randn(shape))
        assert dg.shape == du.shape == shape
    assert emulated == []


def test_int32_row_chunks(emulated, monkeypatch):
    """Arrays reaching past 2^31 - 1 elements go in row chunks (a multiple of 16 rows) whose
    every array spans at most that many elements; here with the bound made small."""
    monkeypatch.setattr(S, "_MAX_SPAN", 40 * 64)
    gu = torch.randn(100, 64)
    g, u = gu.chunk(2, dim=-1)               # row stride 64: 40 rows span 39 * 64 + 32
    y = S._glu(g, u, S.SILU)
    torch.testing.assert_close(y.double(), _reference(g, u, S.SILU))
    rows = [args[0].shape[0] for _, args in emulated]
    assert rows == [32, 32, 32, 4]
    for _, args in emulated:
        for a in args[:3]:
            assert (a.shape[0] - 1) * a.stride(0) + a.shape[1] <= S._MAX_SPAN
    # (B, S, 2N) halves, forward and backward: the chunks are (M, N) rows of them
    emulated.clear()
    gu3 = torch.randn(4, 25, 64, requires_grad=True)
    g3, u3 = gu3.chunk(2, dim=-1)
    y3 = S._glu(g3, u3, S.SILU)
    assert y3.shape == (4, 25, 32)
    torch.testing.assert_close(y3.double(), _reference(g3, u3, S.SILU).detach())
    dy = torch.randn_like(y3)
    (dgu,) = torch.autograd.grad(y3, gu3, dy)
    gu64 = gu3.detach().double().requires_grad_()
    (ref,) = torch.autograd.grad(_reference(*gu64.chunk(2, -1), S.SILU), gu64, dy.double())
    torch.testing.assert_close(dgu.double(), ref)
    for _, args in emulated:
        arrays = [a for a in args if isinstance(a, torch.Tensor)]
        assert all(a.dim() == 2 and (a.shape[0] - 1) * a.stride(0) + a.shape[1] <= S._MAX_SPAN
                   for a in arrays)
    assert sum(args[0].shape[0] for k, args in emulated if k == "swiglu_fwd") == 100


def test_row_chunks():
    L = S._MAX_SPAN
    assert row_chunks(10, 100, 100) == ((0, 10),)
    assert row_chunks(2**16 - 1, 2**15, 2**15) == ((0, 2**16 - 1),)
    chunks = row_chunks(2**16 + 1, 2**15, 2**16)         # chunk() halves of 2^16-wide rows
    assert chunks[0] == (0, 2**15) and chunks[-1] == (2**16, 2**16 + 1)
    for s, e in chunks:
        assert (e - s - 1) * 2**16 + 2**15 <= L and ((e - s) % 16 == 0 or e == 2**16 + 1)
    assert row_chunks(3, 2**30, 2**31 - 1) == ((0, 1), (1, 2), (2, 3))


def test_keys_separate_aligned_and_unaligned_layouts(emulated):
    """Rows whose base or stride is not a multiple of 16 bytes (a view one column in) get launch
    keys of their own: the JIT compiles narrower accesses there, which keep their own winner.
    The chunk() halves of an aligned width share the contiguous key (and JIT signature)."""
    g = torch.randn(8, 4096, dtype=BF16)
    S._glu(g, g.clone(), S.SILU)
    S._glu(*torch.randn(8, 2 * 4096, dtype=BF16).chunk(2, -1), S.SILU)
    shifted = torch.randn(8, 4097, dtype=BF16)[:, 1:]
    S._glu(shifted, g, S.SILU)
    assert [k[4] for k in S._fwd.cache] == [True, False]


def test_torch_compile_fullgraph_forward_and_backward(emulated):
    """The custom ops and their fake implementations under torch.compile(fullgraph=True) (the
    aot_eager backend: the graphs run here, the launches emulated), chunk() halves included."""
    def f(gu, act):
        g, u = gu.chunk(2, dim=-1)
        return S._glu(g * 2, u, act).float().sum()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    for act in (S.SILU, S.GELU_ERF):
        gu = torch.randn(3, 7, 2 * 24, requires_grad=True)
        eager = f(gu, act)
        (ge,) = torch.autograd.grad(eager, gu)
        out = compiled(gu, act)
        (gc,) = torch.autograd.grad(out, gu)
        torch.testing.assert_close(out, eager)
        torch.testing.assert_close(gc, ge)


def test_gelu_tanh_is_a_sigmoid():
    """The kernels' tanh-free gelu: 0.5 * (1 + tanh(u)) = sigmoid(2u), and its derivative."""
    x = torch.linspace(-12, 12, 2001, dtype=torch.float64, requires_grad=True)
    k = math.sqrt(2 / math.pi)
    s = torch.sigmoid(x * (2 * k + 2 * k * 0.044715 * x * x))
    torch.testing.assert_close(x * s, torch.nn.functional.gelu(x, approximate="tanh"))
    grad = s + x * s * (1 - s) * (2 * k + 6 * k * 0.044715 * x * x)
    torch.testing.assert_close(grad, _autograd_act_grad(x, S.GELU_TANH))
    assert math.isclose(2 * k, 1.5957691216057308) and math.isclose(2 * k * 0.044715,
                                                                      0.0713548162726009)
    assert math.isclose(6 * k * 0.044715, 0.2140644488178027)


def test_normal_cdf_fit():
    """The erfc fit the kernels use for gelu(approximate='none'), evaluated in float32 as they do:
    Phi within 1e-6 relative of float64 for x >= -4 and 1e-5 out to -12 (torch's own float32
    0.5 * (1 + erf(x / sqrt(2))) cancels to 0 there)."""
    x = torch.linspace(-12, 12, 20001, dtype=torch.float32)
    z = x.abs() * 0.7071067811865476
    t = 1.0 / (1.0 + 0.5 * z)
    p = torch.full_like(t, 0.17087277)
    for c in (-0.82215223, 1.48851587, -1.13520398, 0.27886807, -0.18628806, 0.09678418,
              0.37409196, 1.00002368, -1.26551223):
        p = c + t * p
    half_erfc = 0.5 * t * torch.exp(p - 0.5 * x * x)
    cdf = torch.where(x >= 0, 1.0 - half_erfc, half_erfc)
    ref = 0.5 * torch.special.erfc(-x.double() / math.sqrt(2))
    err = (cdf.double() - ref).abs() / ref
    assert err[x >= -4].max() < 1e-6 and err.max() < 1e-5
