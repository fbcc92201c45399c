"""SwiGLU/GeGLU on the GPU against a float64 torch reference on fresh random data: forward and
backward, every dtype, odd and large shapes, chunk() halves of a fused projection and other
layouts, tuned and DISABLE_AUTOTUNE=1, every config, torch.compile and CUDA graphs.

Tolerances (`TOL`, per dtype): the kernels compute in float32 and round once to the dtype, so
bfloat16/float16 results are within a few of their rounding steps (2^-9, 2^-11 relative) of the
float64 reference; float32 results within the float32 exp/division error. Each result is checked
per row (relative to the row's norm: a whole-tensor norm hides one wrong row or tile among
thousands) and element by element (rtol TOL, atol TOL x the mean |ref|, for values where terms
cancel). SwiGLU's bfloat16/float16 results are also checked for the one rounding itself
(`assert_rounded_once`), which the relative tolerances pass for a kernel that truncates."""
import cuda.tile as ct
import pytest
import torch
import torch.nn.functional as F

import tiletune
from tiletune import timing
from tiletune.ops import swiglu as S
from tiletune.ops.swiglu import geglu, swiglu

from .conftest import (assert_rounded_once, assert_rows_close, disable_autotune, each_config,
                       poison_allocator)

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32
DTYPES = [F32, F16, BF16]
TOL = {F32: 2e-5, F16: 2e-3, BF16: 8e-3}

ACTS = {"swiglu": (swiglu, F.silu),
        "geglu_tanh": (lambda g, u: geglu(g, u, approximate="tanh"),
                       lambda g: F.gelu(g, approximate="tanh")),
        "geglu_none": (lambda g, u: geglu(g, u, approximate="none"), F.gelu)}


def pair(*tensors):
    return tensors


def close(out, ref, dt, what, once=False):
    """out against the float64 ref per row and element by element; with `once`, also that out
    is ref rounded once to dt (bfloat16/float16 only: a float32 result carries the float32
    exp/reciprocal error itself). For `once`, ref must be exact (silu's float64 is; torch's
    float64 gelu forms cancel in the negative tail, which only the tolerances absorb)."""
    assert out.shape == ref.shape, what
    assert torch.isfinite(out).all(), f"{what}: non-finite values (unwritten output?)"
    if not ref.numel():
        return
    assert_rows_close(out, ref, TOL[dt], what)
    if once and dt != F32:
        # The approximate exp and reciprocal move the float32 value by a few of its ulps: up to
        # about 0.1% of the elements land on the other side of a rounding boundary (truncation:
        # 50%); a tensor of a few elements may have one or two of them.
        assert_rounded_once(out, ref, max_off=max(0.01, 4 / out.numel()), what=what)
    out, ref = out.double(), ref.double()
    torch.testing.assert_close(out, ref, rtol=TOL[dt], atol=TOL[dt] * ref.abs().mean().item(),
                               msg=lambda m: f"{what}: {m}")


def make(shape, dt, seed=0):
    """gate ~ 3 N(0, 1) (reaching both tails of the activation), up ~ N(0, 1)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    g = (torch.randn(shape, device="cuda", generator=gen) * 3).to(dt)
    u = torch.randn(shape, device="cuda", generator=gen).to(dt)
    return g, u


def check(act, leaves, split=pair, grad=True):
    """Run the op on `split(*leaves)` (views of the leaves: chunk(), transposes, ...), forward
    and backward into the leaves, against float64 torch on the same values."""
    ours, torch_act = ACTS[act]
    dt = leaves[0].dtype
    xs = [t.detach().clone().requires_grad_(grad) for t in leaves]
    poison_allocator(torch)
    gate, up = split(*xs)
    y = ours(gate, up)
    assert y.shape == gate.shape and y.dtype == dt and y.is_contiguous()
    refs = [t.detach().double().requires_grad_(grad) for t in leaves]
    rgate, rup = split(*refs)
    ref = torch_act(rgate) * rup
    close(y, ref, dt, f"{act} forward", once=act == "swiglu")
    if grad:
        dy = torch.randn_like(y)
        grads = torch.autograd.grad(y, xs, dy)
        ref_grads = torch.autograd.grad(ref, refs, dy.double())
        for i, (a, b) in enumerate(zip(grads, ref_grads)):
            assert a.dtype == dt
            # With the leaves passed as they are, leaf 0's gradient is the kernel's dgate and
            # leaf 1's its dup, each rounded once. Not float16's dgate: silu'(g) = s (1 + g (1 -
            # s)) cancels near its zero (g = -1.2785), and the float16 gate -1.2783 sits so
            # close that the float32 sum there can be off by two float16 ulps (bfloat16's
            # error there is a hundredth of its ulp)
            once = act == "swiglu" and split is pair and (i == 1 or dt == BF16)
            close(a, b, dt, f"{act} gradient of leaf {i}", once=once)
    for x, leaf in zip(xs, leaves):
        assert torch.equal(x.detach(), leaf)      # inputs untouched
    return y


# (..., N) inputs whose leading dims merge into rows reach the kernels as they are (viewed as rows
# in the kernel): (B, S, N), decode's (B, 1, N) and (B, S, H, D) heads among them.
SHAPES = [(1, 1), (3, 1001), (257, 4097), (4096, 14336), (2, 3, 8), (5, 64), (7, 2, 1001),
          (4, 1, 1000), (1, 1, 4096), (3, 64, 1024), (2, 5, 4096), (2, 3, 5, 128)]


# Default configs (DISABLE_AUTOTUNE=1): every shape x every dtype (swiglu), and the gelu forms.
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_disable_autotune_swiglu(fresh, monkeypatch, shape, dt):
    disable_autotune(monkeypatch)
    check("swiglu", make(shape, dt))
    assert all(t.searches == 0 for t in tiletune.tuners().values())


@pytest.mark.parametrize("shape", [(1, 1), (3, 1001), (257, 4097), (6, 5, 64)], ids=str)
@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("act", ["geglu_tanh", "geglu_none"])
def test_disable_autotune_geglu(fresh, monkeypatch, act, shape, dt):
    disable_autotune(monkeypatch)
    check(act, make(shape, dt))


# Tuned (a search per key and direction): a few shapes, dtypes and activations.
@pytest.mark.parametrize("act,shape,dt", [("swiglu", (257, 4097), BF16),
                                          ("swiglu", (4096, 14336), BF16),
                                          ("geglu_tanh", (3, 1001), F16),
                                          ("geglu_none", (64, 11008), F32),
                                          ("swiglu", (2, 50, 1001), F32),
                                          ("swiglu", (3, 64, 1024), BF16)], ids=str)
def test_tuned(fresh, act, shape, dt):
    check(act, make(shape, dt))
    assert S._fwd.searches == 1 and S._bwd.searches == 1
    assert all(r.source == "search" for t in S.TUNERS for r in t.records.values())


@pytest.mark.parametrize("N", [14336, 1001, 64], ids=str)
@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("tuned", [False, True], ids=["default", "tuned"])
def test_chunk_halves_are_read_in_place(fresh, monkeypatch, N, dt, tuned):
    """gate, up = gate_up.chunk(2, -1) of a (T, 2N) tensor (HF's fused projections, MoE experts):
    the kernels read the halves where they are (row stride 2N, `up` 2N bytes into the row)."""
    if not tuned:
        disable_autotune(monkeypatch)
    seen = []
    real = S.launch_fwd

    def spy(g, u, out, act, aligned, M, N):
        seen.append((g, u))
        real(g, u, out, act, aligned, M, N)
    monkeypatch.setattr(S, "launch_fwd", spy)
    gu = make((300, 2 * N), dt)[0]
    check("swiglu", [gu], split=lambda t: t.chunk(2, dim=-1))
    (g, u), = seen
    assert g.stride() == (2 * N, 1) and u.stride() == (2 * N, 1)
    assert u.data_ptr() - g.data_ptr() == N * gu.element_size()


def test_merged_rows_reach_the_kernels_without_a_view(fresh, monkeypatch):
    """Contiguous (B, S, N) and (B, S, H, D) tensors and the chunk() halves of a (B, S, 2N)
    projection are the very tensors the kernels get, forward and backward; a (B, S, N) tensor
    whose leading dims do not merge (S and B swapped) goes as (M, N) rows."""
    disable_autotune(monkeypatch)
    seen = []
    for name in ("launch_fwd", "launch_bwd"):
        real = getattr(S, name)

        def spy(*args, real=real):
            seen.append(args[:-4])
            real(*args)
        monkeypatch.setattr(S, name, spy)
    for shape, split in (((2, 33, 1024), pair), ((2, 5, 4, 64), pair),
                         ((3, 17, 2 * 1001), lambda t: t.chunk(2, dim=-1))):
        seen.clear()
        leaves = make(shape, BF16) if split is pair else make(shape, BF16)[:1]
        check("swiglu", leaves, split=split)
        fwd, bwd = seen
        assert all(a.dim() == len(shape) for a in fwd + bwd), shape
    seen.clear()
    check("swiglu", make((48, 2, 256), BF16), split=lambda a, b: (a.transpose(0, 1),
                                                                  b.transpose(0, 1)))
    assert seen[0][0].dim() == 2 and seen[0][2].dim() == 3      # gate copied as rows, out not


@pytest.mark.parametrize("dt", [BF16, F32], ids=str)
def test_chunk_halves_of_3d_and_unaligned_views(fresh, monkeypatch, dt):
    disable_autotune(monkeypatch)
    for shape in ((2, 33, 2 * 1024), (9, 1, 2 * 1001)):
        gu = make(shape, dt)[0]       # as rows, then one position (its up half unaligned)
        check("geglu_tanh", [gu], split=lambda t: t.chunk(2, dim=-1))
    wide = make((77, 2 * 4096 + 3), dt)[0]      # views one element in: unaligned bases
    check("swiglu", [wide], split=lambda t: (t[:, 1:4097], t[:, 4098:8194]))
    check("geglu_none", [wide], split=lambda t: (t[:, 3:4099], t[:, 4099:8195]))


def test_other_layouts(fresh, monkeypatch):
    """Transposed and stepped gates are copied once; a stride-0 (expanded) up is read as is."""
    disable_autotune(monkeypatch)
    g, u = make((1001, 257), BF16)
    check("swiglu", [g, u], split=lambda a, b: (a.t(), b.t().contiguous()))
    g, u = make((64, 2 * 4096), F16)
    check("geglu_none", [g, u], split=lambda a, b: (a[:, ::2], b[:, 1::2]))
    g, _ = make((33, 4096), F32)
    _, u = make((1, 4096), F32, seed=1)
    check("swiglu", [g, u], split=lambda a, b: (a, b.expand(33, 4096)))


@pytest.mark.parametrize("tuned", [False, True], ids=["default", "tuned"])
def test_one_dim_and_rows_that_do_not_merge(fresh, monkeypatch, tuned):
    """A 1-D gate and up (one row; the outputs are 1-D too), and (B, 1, S, N) slices of a longer
    buffer, whose rows do not merge across the size-1 dim."""
    if not tuned:
        disable_autotune(monkeypatch)
    for n in (64, 4097):
        check("swiglu", make((n,), BF16))
    g, u = make((3, 1, 9, 1001), BF16)
    check("swiglu", [g, u], split=lambda a, b: (a[:, :, :5], b[:, :, :5]))


@pytest.mark.parametrize("shape", [(0, 4096), (3, 0), (2, 0, 64)], ids=str)
def test_empty_input(fresh, shape):
    g = torch.randn(shape, device="cuda", requires_grad=True)
    u = torch.randn(shape, device="cuda", requires_grad=True)
    y = swiglu(g, u)
    assert y.shape == g.shape
    y.sum().backward()
    assert g.grad.shape == u.grad.shape == shape


def test_gradient_of_only_one_input(fresh, monkeypatch):
    disable_autotune(monkeypatch)
    g, u = make((65, 1001), BF16)
    gr = g.clone().requires_grad_()
    y = swiglu(gr, u)
    (dg,) = torch.autograd.grad(y, gr, torch.ones_like(y))
    g64 = g.double().requires_grad_()
    (ref,) = torch.autograd.grad((F.silu(g64) * u.double()).sum(), g64)
    close(dg, ref, BF16, "dgate", once=True)


@pytest.mark.slow
@pytest.mark.parametrize("kind,act,shape", [("fwd", "swiglu", (257, 1001)),
                                            ("fwd", "geglu_none", (33, 4097)),
                                            ("bwd", "swiglu", (33, 4097)),
                                            ("bwd", "geglu_tanh", (257, 1001)),
                                            ("fwd", "swiglu", (4099, 4097)),
                                            ("bwd", "swiglu", (4099, 4097)),
                                            ("fwd", "swiglu", (4099, 1, 4097)),
                                            ("bwd", "swiglu", (3, 1366, 4097))], ids=str)
def test_every_config_is_correct(fresh, monkeypatch, kind, act, shape):
    """Each sm_90 config of one kernel (the other on its default), not only the searches'
    winners: ragged rows, several column tiles per row, persistent and one-tile-per-CTA grids
    (at 4099 x 4097 each persistent CTA makes 15 or more trips of its loop, where tileiras 13.4
    built a TMA variant of this kernel that went wrong: references/hardware-constraints.md)."""
    tuner = S._fwd if kind == "fwd" else S._bwd
    space = list(S.configs("sm_90", shape[-1]))
    leaves = make(shape, BF16)
    for cfg in each_config(monkeypatch, tuner, space):
        check(act, leaves, grad=kind == "bwd")
        (key_cfg, _), = tuner.cache.values()
        assert key_cfg is cfg, vars(cfg)


def test_second_call_does_not_search(fresh, monkeypatch):
    g, u = make((64, 2048), BF16)
    swiglu(g, u)
    assert S._fwd.searches == 1
    monkeypatch.setattr(ct.kernel, "replace_hints", lambda *a, **k: pytest.fail("replace_hints"))
    monkeypatch.setattr(timing, "search_kernels", lambda *a, **k: pytest.fail("search"))
    swiglu(g, u)
    swiglu(*make((60, 2048), BF16, seed=1))     # same row bucket
    assert S._fwd.searches == 1


@pytest.mark.parametrize("act", ["swiglu", "geglu_tanh", "geglu_none"])
def test_torch_compile_fullgraph(fresh, act):
    """The compiled graph runs the same kernels: the op's output and gradient are bit-equal to
    eager (compared as tensors: a float sum of them would differ by inductor's reduction order)."""
    ours, _ = ACTS[act]
    gu = torch.randn(4, 50, 2 * 1024, device="cuda", dtype=BF16, requires_grad=True)
    dy = torch.randn(4, 50, 1024, device="cuda", dtype=BF16)

    def f(gu):
        g, u = (gu * 2).chunk(2, dim=-1)
        return ours(g, u)
    eager = f(gu)
    (ge,) = torch.autograd.grad(eager, gu, dy)
    compiled = torch.compile(f, fullgraph=True)
    out = compiled(gu)
    (gc,) = torch.autograd.grad(out, gu, dy)
    assert torch.equal(out, eager)
    assert torch.equal(gc, ge)


def test_cuda_graph_replay(fresh):
    g, u = make((256, 4096), BF16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        swiglu(g, u)               # warm-up tunes outside the capture
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = swiglu(g, u)
    g.copy_(make((256, 4096), BF16, seed=1)[0])
    graph.replay()
    torch.cuda.synchronize()
    close(y, F.silu(g.double()) * u.double(), BF16, "replayed forward", once=True)


def test_bad_input():
    g = torch.randn(4, 64, device="cuda")
    with pytest.raises(ValueError, match="swiglu: gate must be a CUDA tensor"):
        swiglu(g.cpu(), g)
    with pytest.raises(ValueError, match="swiglu: up must be a CUDA tensor"):
        swiglu(g, g.cpu())
    with pytest.raises(TypeError, match="geglu: up dtype"):
        geglu(g, g.half())
    with pytest.raises(ValueError, match="swiglu: up shape"):
        swiglu(g, g[:, :63])
    with pytest.raises(TypeError, match="swiglu: gate dtype"):
        swiglu(g.double(), g.double())
    with pytest.raises(ValueError, match="geglu: approximate must be"):
        geglu(g, g, approximate="erf")


def test_more_than_2_31_elements(fresh, monkeypatch):
    """chunk() halves spanning more than 2^31 - 1 elements go in int32-safe row chunks."""
    disable_autotune(monkeypatch)
    M, N = 33000, 32768                 # gate_up: 2.16e9 elements; each half spans as much
    gu = torch.randn(M, 2 * N, device="cuda", dtype=BF16)
    g, u = gu.chunk(2, dim=-1)
    y = swiglu(g, u)
    for rows in (slice(0, 8), slice(M // 2 - 4, M // 2 + 4), slice(M - 8, M)):
        close(y[rows], F.silu(g[rows].double()) * u[rows].double(), BF16, f"rows {rows}",
              once=True)
    del gu, g, u, y


def test_aot_signature_matches_jit():
    """The CI compile's signatures (cases/swiglu.py) equal what the JIT infers on the GPU, the
    chunk() halves (aligned and not) included."""
    from cuda.tile.compilation import CallingConvention, KernelSignature
    from tiletune.aot import jit_array, signature
    from tiletune.cases.swiglu import _arrays
    for M, N, dt, chunked in [(4096, 14336, BF16, False), (4096, 14336, BF16, True),
                              (4096, 1001, BF16, True), (1, 1001, F16, False),
                              (7, 4097, F32, True)]:
        if chunked:
            g, u = torch.randn(M, 2 * N, device="cuda", dtype=dt).chunk(2, dim=-1)
        else:
            g, u = torch.randn(M, N, device="cuda", dtype=dt), torch.randn(M, N, device="cuda",
                                                                           dtype=dt)
        o = torch.empty(M, N, device="cuda", dtype=dt)
        for kernel, arrays, kind in ((S.glu_fwd, (g, u, o), "fwd"),
                                     (S.glu_bwd, (o, g, u, o, o), "bwd")):
            jit = KernelSignature.from_kernel_args(kernel, (*arrays, S.SILU, 1, 1024),
                                                   CallingConvention.cutile_python_v2())
            mine = signature([*_arrays(kind, dt, M, N, chunked), S.SILU, 1, 1024])
            assert jit.parameters == mine.parameters, (M, N, dt, chunked, kind)
    # (B, S, N) and decode's (B, 1, N) cases: chunk() halves of one tensor, contiguous others
    for shape in ((4, 1024, 14336), (4096, 1, 14336)):
        g, u = torch.randn(*shape[:-1], 2 * shape[-1], device="cuda", dtype=BF16).chunk(2, -1)
        o = torch.empty(shape, device="cuda", dtype=BF16)
        half = jit_array(BF16, shape, (shape[1] * 2 * shape[-1], 2 * shape[-1], 1))
        whole = jit_array(BF16, shape)
        for kernel, arrays, params in ((S.glu_fwd, (g, u, o), [half, half, whole]),
                                       (S.glu_bwd, (o, g, u, o, o), [whole, half, half, whole,
                                                                     whole])):
            jit = KernelSignature.from_kernel_args(kernel, (*arrays, S.SILU, 1, 1024),
                                                   CallingConvention.cutile_python_v2())
            assert jit.parameters == signature([*params, S.SILU, 1, 1024]).parameters, shape
