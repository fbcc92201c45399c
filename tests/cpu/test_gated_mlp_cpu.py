"""swiglu_linear without a GPU: the config space, input checks (fake CUDA tensors), the custom
ops' fake implementations, and the host side (what each launch gets, the pre-activations kept
only for training, the backward's GEMMs on the right views and only for the gradients needed,
autograd and torch.compile wiring) with ct.launch stubbed by a torch emulation of the kernels.
The kernels themselves compile in test_aot_compile.py (cases/gated_mlp.py)."""
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from tiletune import autotune, device
from tiletune.autotune import MAX_CONFIGS, default_hints
from tiletune.ops import gated_mlp as G
from tiletune.ops.gated_mlp import swiglu_linear
from tiletune.ops.matmul import matmul_configs, split_of
from tests.cpu.stand_ins import resolve_misses_to_default

BF16 = torch.bfloat16
ARCHS = ("sm_90", "sm_100", "sm_120", "sm_80")
SHAPES = ((1, 14336, 4096), (16384, 14336, 4096), (1000, 1001, 1000), (7, 64, 4095))


# ---------------------------------------------------------------------------------------------
# Config space.

@pytest.mark.parametrize("arch", ARCHS)
def test_space(arch):
    for m, n, k in SHAPES:
        cfgs = list(G.configs(arch, m, n, k))
        assert cfgs == list(G.configs(arch, 64, 64, 64)), "the space depends on the shape"
        assert 2 <= len(cfgs) <= min(10, MAX_CONFIGS)
        assert len({tuple(sorted(vars(c).items())) for c in cfgs}) == len(cfgs), "repeated"
        for c in cfgs:
            assert set(vars(c)) <= {*G.FIELDS, "group_m"} and c.group_m == 8
            for v in (c.tm, c.tn, c.tk):
                assert v >= 16 and v & (v - 1) == 0, vars(c)
            h = default_hints(c)
            assert h.get("num_worker_warps", 4) in (4, 8) and h["num_ctas"] in (1, 2)
            assert h["occupancy"] in (1, 2)
            if arch == "sm_90":
                # two float32 accumulators of (tm / num_ctas) x tn per CTA: at most 128x128 of
                # float32 per 4 worker warps (matmul's measured register budget)
                per_cta = 2 * c.tm * c.tn // c.num_ctas
                assert per_cta <= 128 * 128 * h.get("num_worker_warps", 4) // 4, vars(c)


def test_space_sizes_and_defaults():
    sm90, sm100, other = (list(G.configs(a, 4096, 14336, 4096)) for a in ("sm_90", "sm_100",
                                                                           "sm_80"))
    assert (len(sm90), len(sm100), len(other)) == (10, 8, 2)
    assert sm90[0] == SimpleNamespace(tm=128, tn=128, tk=64, occupancy=1, num_ctas=1,
                                      num_worker_warps=8, persistent=False, group_m=8)
    assert G._gated.default == sm90[0]          # the fallback is the sm_90 default
    assert {c.persistent for c in sm90} == {True, False}
    assert any(c.num_ctas == 2 for c in sm90) and any(c.tm == 64 for c in sm90)
    assert not any(hasattr(c, "num_worker_warps") for c in sm100 + other)
    assert sm100[0] == SimpleNamespace(tm=128, tn=128, tk=64, occupancy=1, num_ctas=1,
                                       persistent=False, group_m=8)
    assert list(G.configs("sm_120", 1, 2, 3)) == other and all(c.tk == 32 for c in other)


@pytest.mark.parametrize("arch", ARCHS)
def test_input_gradient_space_is_matmuls_without_split_k(arch):
    """One float32 accumulator per tile, as matmul's: its whole-K entries, default first; the
    skinny keys where matmul's space splits K (M = 16) get none of those."""
    for m, n, k in ((4096, 4096, 14336), (16, 4096, 14336)):
        dx = list(G.dx_configs(arch, m, n, k))
        whole_k = [c for c in matmul_configs(arch, m, n, k) if split_of(c) == 1]
        assert dx == whole_k and 2 <= len(dx) <= MAX_CONFIGS
        assert not any(hasattr(c, "split") for c in dx)
    assert any(split_of(c) > 1 for c in matmul_configs("sm_90", 16, 4096, 14336))


def test_persistent_configs_launch_the_persistent_walk():
    for c in G.configs("sm_90", 4096, 14336, 4096):
        assert G._args(c, *range(6), 0, True)[-1] is c.persistent
    for c in G.dx_configs("sm_90", 4096, 14336, 4096):
        assert G._dx._args(c, *range(5))[-1] is c.persistent


# ---------------------------------------------------------------------------------------------
# Input checks: CPU tensors first; the rest on fake CUDA tensors.

def test_cpu_tensors_are_refused():
    x, w = torch.randn(4, 8, dtype=BF16), torch.randn(6, 8, dtype=BF16)
    with pytest.raises(ValueError, match="swiglu_linear: x must be a CUDA tensor"):
        swiglu_linear(x, w, w)
    with pytest.raises(TypeError, match="swiglu_linear: x must be a torch.Tensor"):
        swiglu_linear([1.0], w, w)
    with FakeTensorMode():
        cx = torch.empty(4, 8, device="cuda", dtype=BF16)
        cw = torch.empty(6, 8, device="cuda", dtype=BF16)
        with pytest.raises(ValueError, match="swiglu_linear: w_gate must be a CUDA tensor"):
            swiglu_linear(cx, torch.empty(6, 8, dtype=BF16), cw)
        with pytest.raises(ValueError, match="swiglu_linear: w_up must be a CUDA tensor"):
            swiglu_linear(cx, cw, torch.empty(6, 8, dtype=BF16))
        with pytest.raises(TypeError, match="swiglu_linear: w_up must be a torch.Tensor"):
            swiglu_linear(cx, cw, None)


def test_bad_inputs_name_the_function_and_argument():
    with FakeTensorMode():
        x = torch.empty(3, 5, 8, device="cuda", dtype=BF16)
        w = torch.empty(6, 8, device="cuda", dtype=BF16)
        with pytest.raises(TypeError, match=r"swiglu_linear: w_gate dtype torch.float16 differs "
                                            r"from x dtype torch.bfloat16"):
            swiglu_linear(x, w.half(), w)
        with pytest.raises(TypeError, match=r"swiglu_linear: w_up dtype torch.float16 differs"):
            swiglu_linear(x, w, w.half())
        with pytest.raises(TypeError, match=r"swiglu_linear: x dtype torch.float32 is not "
                                            r"supported \(bfloat16, float16\)"):
            swiglu_linear(x.float(), w.float(), w.float())
        with pytest.raises(TypeError, match=r"swiglu_linear: w_gate dtype torch.float32 is not"):
            swiglu_linear(x, w.float(), w)
        with pytest.raises(ValueError, match=r"swiglu_linear: w_up shape \(7, 8\) differs from "
                                             r"w_gate shape \(6, 8\)"):
            swiglu_linear(x, w, torch.empty(7, 8, device="cuda", dtype=BF16))
        with pytest.raises(ValueError, match=r"swiglu_linear: w_gate is \(N, K\) = \(6, 9\) but "
                                             r"x's last dim is 8: K must match"):
            w9 = torch.empty(6, 9, device="cuda", dtype=BF16)
            swiglu_linear(x, w9, w9)
        with pytest.raises(ValueError, match=r"swiglu_linear: w_gate must be 2-D \(N, K\)"):
            w3 = torch.empty(2, 6, 8, device="cuda", dtype=BF16)
            swiglu_linear(x, w3, w3)
        with pytest.raises(ValueError, match=r"swiglu_linear: x must have at least one dim"):
            swiglu_linear(torch.empty((), device="cuda", dtype=BF16), w, w)
        with pytest.raises(ValueError, match=r"swiglu_linear: w_up is on cuda:1 but the other "
                                             "inputs are on cuda:0"):
            swiglu_linear(x.to("cuda:0"), w.to("cuda:0"), w.to("cuda:1"))


# ---------------------------------------------------------------------------------------------
# Fake implementations (what torch.compile traces).

def test_fake_implementations():
    with FakeTensorMode():
        x = torch.empty(2, 3, 8, device="cuda", dtype=BF16)
        w = torch.empty(6, 8, device="cuda", dtype=BF16)
        y, g, u = G._op._fwd_op(x, w, w, G.SILU, True)
        assert y.shape == (2, 3, 6) and y.dtype == BF16 and y.is_contiguous()
        assert g.shape == u.shape == (6, 6)
        y, g, u = G._op._fwd_op(x, w, w, G.SILU, False)
        assert y.shape == (2, 3, 6) and g.numel() == u.numel() == 0
        dx, dwg, dwu = G._op._bwd_op([True, False, True, False, False], y, x, w, w, g, u, G.SILU)
        assert dx.shape == x.shape and dx.is_contiguous() and dwg is None and dwu.shape == w.shape


# ---------------------------------------------------------------------------------------------
# The host side with the kernels emulated in torch (float64): ct.launch stubbed
# (tests/cpu/conftest.py), each miss resolved to the shape's default config; matmul, the input
# gradient's two-product kernel and swiglu's backward emulated too.

def _silu(t):
    return t * torch.sigmoid(t)


@pytest.fixture
def emulated(launches, monkeypatch):
    resolve_misses_to_default(monkeypatch, lambda tuner, dev: tuner.name)
    monkeypatch.setitem(device._SM_COUNT, -1, 132)      # a CPU tensor's device index
    calls = []

    def launch(stream, grid, kernel, args):
        calls.append((kernel, args))
        if kernel == "gated_mlp":
            x3, wg3, wu3, y3, g3, u3, act, *_, save, persistent = args
            g, u = x3.double() @ wg3.double(), x3.double() @ wu3.double()
            y3.copy_(_silu(g) * u)
            if save:
                g3.copy_(g)
                u3.copy_(u)
        elif kernel == "matmul":
            a3, b3, c3 = args[:3]
            c3.copy_(a3.double() @ b3.double())
        elif kernel == "gated_mlp_dx":
            a1, b1, a2, b2, c = args[:5]
            c.copy_(a1.double() @ b1.double() + a2.double() @ b2.double())
        elif kernel == "swiglu_bwd":
            # (..., N) arrays: the kernel views them as rows
            dy, gate, up, dgate, dup = (a.double().reshape(-1, a.shape[-1]) for a in args[:5])
            s = torch.sigmoid(gate)
            args[4].copy_(dy * gate * s)
            args[3].copy_(dy * up * s * (1 + gate * (1 - s)))
        else:
            raise AssertionError(f"unexpected kernel {kernel}")
    monkeypatch.setattr(G.ct, "launch", launch)
    autotune.clear_cache()
    yield calls
    autotune.clear_cache()


def _reference(x, wg, wu):
    x, wg, wu = x.double(), wg.double(), wu.double()
    return _silu(x @ wg.T) * (x @ wu.T)


def _leaves(*shapes, grad=True):
    return [torch.randn(s, dtype=torch.float64).to(torch.float32).requires_grad_(grad)
            for s in shapes]


def test_forward_launch_reads_weights_transposed_in_place(emulated):
    x, wg, wu = _leaves((3, 5, 16), (12, 16), (12, 16), grad=False)
    y = G._op(x, wg, wu, G.SILU, False)
    assert y.shape == (3, 5, 12) and y.is_contiguous()
    torch.testing.assert_close(y.double(), _reference(x, wg, wu))
    (kernel, args), = emulated
    x3, wg3, wu3, y3, g3, u3, act, tm, tn, tk, group_m, save, persistent = args
    assert kernel == "gated_mlp" and act == G.SILU and save is False
    assert x3.shape == (1, 15, 16) and x3.data_ptr() == x.data_ptr()
    assert wg3.shape == (1, 16, 12) and wg3.stride()[1:] == (1, 16)      # w_gate.t(): no copy
    assert wg3.data_ptr() == wg.data_ptr() and wu3.data_ptr() == wu.data_ptr()
    assert g3 is y3 and u3 is y3          # inference: the pre-activations are not written
    assert (tm, tn, tk, group_m) == (128, 128, 64, 8)


def test_the_public_function_keeps_pre_activations_only_for_training(emulated, monkeypatch):
    seen = []
    real = G._forward
    monkeypatch.setattr(G._op, "_eager", lambda *a: seen.append(a[-1]) or real(*a))
    x, wg, wu = (t.to(BF16) for t in _leaves((4, 16), (8, 16), (8, 16), grad=False))
    monkeypatch.setattr(G.validate, "tensor", lambda op, name, t, **kw: t)   # CPU tensors
    swiglu_linear(x, wg, wu)
    with torch.no_grad():
        swiglu_linear(x, wg, wu.requires_grad_())
    assert seen == [False, False]
    assert G._gated.cache and all(k[8] is False for k in G._gated.cache)
    y = swiglu_linear(x, wg, wu)
    assert y.requires_grad
    saved = [a[11] for k, a in emulated if k == "gated_mlp"]   # the save flag
    assert saved == [False, False, True]
    assert sorted(k[8] for k in G._gated.cache) == [False, True]   # tuned apart


def test_non_contiguous_x_is_read_with_its_strides(emulated):
    """A 2-D x is passed as it is (transposed, stepped): the kernel reads any strides; a 3-D x
    whose leading dims do not flatten is copied once."""
    wg, wu = _leaves((5, 16), (5, 16), grad=False)
    for x in (torch.randn(16, 9).t(), torch.randn(9, 32)[:, ::2]):
        emulated.clear()
        y = G._op(x, wg, wu, G.SILU, False)
        torch.testing.assert_close(y.double(), _reference(x, wg, wu))
        (_, (x3, *_)), = emulated
        assert x3.data_ptr() == x.data_ptr() and x3.stride()[1:] == x.stride()
    x = torch.randn(4, 3, 16).transpose(0, 1)          # (3, 4, 16): rows do not flatten
    emulated.clear()
    y = G._op(x, wg, wu, G.SILU, False)
    assert y.shape == (3, 4, 5)
    torch.testing.assert_close(y.double(), _reference(x, wg, wu))
    (_, (x3, *_)), = emulated
    assert x3.is_contiguous()


@pytest.mark.parametrize("needs", [(True, True, True), (True, False, False),
                                   (False, True, False), (False, False, True),
                                   (False, True, True)], ids=str)
def test_backward_computes_only_the_gradients_needed(emulated, needs):
    x, wg, wu = _leaves((2, 3, 16), (12, 16), (12, 16), grad=False)
    for t, n in zip((x, wg, wu), needs):
        t.requires_grad_(n)
    y = G._op(x, wg, wu, G.SILU, True)
    # x is read only by the weight gradients: kept only where a weight needs one
    assert (y.grad_fn.saved_tensors[0] is None) is (not (needs[1] or needs[2]))
    dy = torch.randn_like(y)
    emulated.clear()
    wanted = [t for t in (x, wg, wu) if t.requires_grad]
    grads = torch.autograd.grad(y, wanted, dy)
    refs = [t.detach().double().requires_grad_(t.requires_grad) for t in (x, wg, wu)]
    ref_grads = torch.autograd.grad(_reference(*refs), [r for r in refs if r.requires_grad],
                                    dy.double())
    for g, r, t in zip(grads, ref_grads, wanted):
        assert g.shape == t.shape and g.dtype == t.dtype
        torch.testing.assert_close(g.double(), r, rtol=1e-5, atol=1e-5)
    kernels = [k for k, _ in emulated]
    assert kernels[0] == "swiglu_bwd" and "gated_mlp" not in kernels
    # dx is one launch of both products (dgate @ w_gate + dup @ w_up), each weight gradient a
    # matmul
    assert kernels.count("gated_mlp_dx") == needs[0]
    assert kernels.count("matmul") == needs[1] + needs[2]
    for kernel, args in emulated[1:]:
        a, b = args[:2]
        assert a.shape[-1] == b.shape[-2] and (a.dim() == 2) == (kernel == "matmul")


def test_each_operand_is_kept_only_where_the_other_needs_a_gradient(emulated):
    """x is read only by the weight gradients, the weights only by dx: a frozen x keeps no
    weights (they may be tensors made for the call, a merged or dequantized weight), frozen
    weights keep no x; eager and under torch.compile (whose fake backward then has neither)."""
    for x_grad, w_grad in ((False, True), (True, False)):
        x, base = _leaves((2, 3, 16), (24, 16), grad=False)
        x.requires_grad_(x_grad)
        base.requires_grad_(w_grad)
        wg, wu = (base * 2).chunk(2)                    # non-leaf weights, made for the call
        y = G._op(x, wg, wu, G.SILU, True)
        kept = y.grad_fn.saved_tensors
        assert (kept[0] is None) is (not w_grad)
        assert (kept[1] is None) is (kept[2] is None) is (not x_grad)
        leaf = x if x_grad else base
        dy = torch.randn_like(y)
        (grad,) = torch.autograd.grad(y, leaf, dy)
        refs = [t.detach().double().requires_grad_(t is leaf) for t in (x, base)]
        ref_y = _reference(refs[0], *(refs[1] * 2).chunk(2))
        (ref,) = torch.autograd.grad(ref_y, [r for r in refs if r.requires_grad], dy.double())
        torch.testing.assert_close(grad.double(), ref, rtol=1e-5, atol=1e-5)

        def f(x, base):
            return G._op(x, *(base * 2).chunk(2), G.SILU, True).float().sum()
        torch._dynamo.reset()
        (compiled,) = torch.autograd.grad(torch.compile(f, fullgraph=True,
                                                         backend="aot_eager")(x, base), leaf)
        (eager,) = torch.autograd.grad(f(x, base), leaf)
        torch.testing.assert_close(compiled, eager)


def test_backward_gemms_use_views(emulated):
    """dx reads dgate, dup and the weights as they are and is written into x's gradient, dW reads
    dgate / dup transposed (no copies)."""
    x, wg, wu = _leaves((2, 3, 16), (12, 16), (12, 16))
    y = G._op(x, wg, wu, G.SILU, True)
    emulated.clear()
    y.backward(torch.randn_like(y))
    (_, bwd), (dx_kernel, dx_args), *mms = emulated
    dgate, dup = bwd[3], bwd[4]
    a1, b1, a2, b2, c = dx_args[:5]
    assert dx_kernel == "gated_mlp_dx"
    assert a1.data_ptr() == dgate.data_ptr() and a2.data_ptr() == dup.data_ptr()
    assert b1.shape == (1, 12, 16) and b1.data_ptr() == wg.data_ptr()
    assert b2.data_ptr() == wu.data_ptr()
    assert c.shape == (1, 6, 16) and c.is_contiguous() and torch.equal(c.view(x.shape), x.grad)
    (dwg, dwu) = [args[:2] for _, args in mms]
    assert dwg[0].data_ptr() == dgate.data_ptr() and dwg[0].stride() == (1, 12)   # 2-D
    assert dwu[0].data_ptr() == dup.data_ptr() and dwg[1].data_ptr() == x.data_ptr()


def test_backward_keeps_the_pre_activations(emulated):
    x, wg, wu = _leaves((5, 16), (12, 16), (12, 16))
    y = G._op(x, wg, wu, G.SILU, True)
    g, u = [args for k, args in emulated if k == "gated_mlp"][0][4:6]
    saved = {t.data_ptr() for t in y.grad_fn.saved_tensors}
    assert {x.data_ptr(), wg.data_ptr(), wu.data_ptr(), g.data_ptr(), u.data_ptr()} == saved
    torch.testing.assert_close(g[0].double(), x.double() @ wg.double().T)


def test_stacked_weight_chunks(emulated):
    """A fused (2N, K) gate_up weight: its chunk(2) halves are read in place and its gradient
    gathers both halves."""
    x, w = _leaves((7, 16), (24, 16))
    wg, wu = w.chunk(2)
    y = G._op(x, wg, wu, G.SILU, True)
    (_, (_, wg3, wu3, *_)), = emulated
    assert wu3.data_ptr() == w.data_ptr() + 12 * 16 * w.element_size()
    dy = torch.randn_like(y)
    (dw,) = torch.autograd.grad(y, w, dy)
    w64, x64 = w.detach().double().requires_grad_(), x.detach().double()
    (ref,) = torch.autograd.grad(_reference(x64, *w64.chunk(2)), w64, dy.double())
    torch.testing.assert_close(dw.double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape", [(0, 16), (3, 0), (2, 0, 16)], ids=str)
def test_empty_inputs(emulated, shape):
    K = shape[-1]
    x, wg, wu = _leaves(shape, (5, K), (5, K))
    y = G._op(x, wg, wu, G.SILU, True)
    assert y.shape == (*shape[:-1], 5)
    assert not y.numel() or torch.equal(y, torch.zeros_like(y))     # K = 0: act(0) * 0
    dx, dwg, dwu = torch.autograd.grad(y, (x, wg, wu), torch.randn_like(y))
    assert dx.shape == x.shape and dwg.shape == dwu.shape == (5, K)
    assert not dwg.count_nonzero() and not dx.count_nonzero()
    assert "gated_mlp" not in [k for k, _ in emulated]
    empty_n = G._op(x, torch.randn(0, K), torch.randn(0, K), G.SILU, False)
    assert empty_n.shape == (*shape[:-1], 0)


def test_torch_compile_fullgraph_forward_and_backward(emulated):
    """The custom ops and fake implementations under torch.compile(fullgraph=True) (aot_eager:
    the graphs run here, the launches emulated), 3-D input."""
    def f(x, wg, wu):
        return G._op(x * 2, wg, wu, G.SILU, True).float().sum()
    compiled = torch.compile(f, fullgraph=True, backend="aot_eager")
    leaves = _leaves((2, 3, 16), (12, 16), (12, 16))
    eager = f(*leaves)
    ge = torch.autograd.grad(eager, leaves)
    out = compiled(*leaves)
    gc = torch.autograd.grad(out, leaves)
    torch.testing.assert_close(out, eager)
    for a, b in zip(gc, ge):
        torch.testing.assert_close(a, b)


def test_reference_matches_torch():
    """The emulation's formula is torch's unfused MLP half."""
    x, wg, wu = _leaves((4, 16), (8, 16), (8, 16), grad=False)
    x, wg, wu = x.double(), wg.double(), wu.double()
    torch.testing.assert_close(_reference(x, wg, wu), F.silu(F.linear(x, wg)) * F.linear(x, wu))


def test_inference_mode_keeps_no_pre_activations_even_under_enable_grad(emulated, monkeypatch):
    """torch.inference_mode() records no graph, even under enable_grad, so no backward can read
    the two (M, N) pre-activations: weights that require grad (an nn.Module's) run the
    inference build there, which writes neither."""
    monkeypatch.setattr(G.validate, "tensor", lambda op, name, t, **kw: t)   # CPU tensors
    x, wg, wu = (t.to(BF16).requires_grad_() for t in _leaves((4, 16), (8, 16), (8, 16),
                                                               grad=False))
    with torch.inference_mode(), torch.enable_grad():
        y = swiglu_linear(x, wg, wu)
    assert not y.requires_grad and y.grad_fn is None
    torch.testing.assert_close(y.double(), _reference(x, wg, wu).detach(), rtol=1e-2, atol=1e-2)
    (kernel, args), = emulated
    assert kernel == "gated_mlp" and args[11] is False      # the save flag
    assert args[4] is args[3] and args[5] is args[3]        # no pre-activations written
