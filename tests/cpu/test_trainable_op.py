"""`TrainableOp`, the autograd glue every differentiable op uses, on CPU tensors with a torch
forward and backward standing in for kernels: gradients in eager, and no silent second order."""
import contextlib

import pytest
import torch

from tiletune.torch_op import TrainableOp

_scale3 = TrainableOp(
    "tiletune_test::scale3", forward=lambda x: x * 3,
    forward_schema="(Tensor x) -> Tensor", forward_fake=lambda x: torch.empty_like(x),
    backward=lambda needs, dy, x: (dy * 3,),
    backward_schema="(bool[] needs, Tensor dy, Tensor x) -> Tensor[]",
    backward_fake=lambda needs, dy, x: [torch.empty_like(x)])


def test_plain_call_and_gradient():
    x = torch.randn(5, dtype=torch.float64)
    assert torch.equal(_scale3(x), x * 3)
    x.requires_grad_()
    y = _scale3(x)
    assert y.requires_grad
    (g,) = torch.autograd.grad((y * y).sum(), x)
    torch.testing.assert_close(g, 18 * x.detach())


def test_double_backward_raises_instead_of_dropping_second_order_terms():
    """The backward runs kernels outside autograd: with create_graph=True the first-order
    gradient comes back, and a loss built on it (a gradient penalty) raises on backward instead
    of silently losing its second-order term."""
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    y = _scale3(x).pow(2).sum()
    (g,) = torch.autograd.grad(y, x, create_graph=True)
    torch.testing.assert_close(g.detach(), 18 * x.detach())
    with pytest.raises(RuntimeError, match="once_differentiable"):
        (y + g.pow(2).sum()).backward()          # a gradient penalty


_square = TrainableOp(       # a backward that reads a saved input, as the kernels' do
    "tiletune_test::square", forward=lambda x: x * x,
    forward_schema="(Tensor x) -> Tensor", forward_fake=lambda x: torch.empty_like(x),
    backward=lambda needs, dy, x: (2 * x * dy,),
    backward_schema="(bool[] needs, Tensor dy, Tensor x) -> Tensor[]",
    backward_fake=lambda needs, dy, x: [torch.empty_like(x)])


@pytest.mark.parametrize("how", ["backward", "grad"])
def test_double_backward_through_saved_inputs_raises_too(how):
    """The gradient depends on a saved input (x) while the incoming gradient needs none (a loss
    linear in the output, such as .sum()): the penalty's second-order term would be lost, so
    its backward raises, also through autograd.grad(..., inputs), which only walks the graph
    that reaches its inputs."""
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    y = _square(x).sum()
    (g,) = torch.autograd.grad(y, x, create_graph=True)
    torch.testing.assert_close(g.detach(), 2 * x.detach())
    assert g.requires_grad
    penalty = y + g.pow(2).sum()
    with pytest.raises(RuntimeError, match="no double backward"):
        penalty.backward() if how == "backward" else torch.autograd.grad(penalty, x)


def test_a_gradient_taken_with_create_graph_can_be_changed_in_place():
    """As a torch op's gradient can (a scale, a clamp): the gradient is a tensor of its own to
    autograd, not a view made inside a Function (which autograd forbids writing in place), and
    after the write a second differentiation still raises."""
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(_square(x).sum(), x, create_graph=True)
    g.mul_(0.5)
    torch.testing.assert_close(g.detach(), x.detach())
    with pytest.raises(RuntimeError, match="no double backward"):
        g.pow(2).sum().backward()


_halved = TrainableOp(
    "tiletune_test::halved", forward=lambda x: (x / 2, x.sum()),
    forward_schema="(Tensor x) -> (Tensor, Tensor)",
    forward_fake=lambda x: (torch.empty_like(x), x.new_empty(())),
    save=lambda args, results: ((args[0],), ()),
    backward=lambda needs, dy, x: (dy / 2,),
    backward_schema="(bool[] needs, Tensor dy, Tensor x) -> Tensor[]",
    backward_fake=lambda needs, dy, x: [torch.empty_like(x)],
    inference=lambda x: x * 0.5)


def test_inference_runs_where_no_gradient_can_reach(monkeypatch):
    """The inference function (which skips what only the backward reads) runs for an eager call
    without a gradient: under no_grad or on inputs that need none; with one, the forward."""
    calls = []
    monkeypatch.setattr(_halved, "_eager", lambda x: calls.append("inference") or x * 0.5)
    x = torch.randn(4, dtype=torch.float64)
    assert torch.equal(_halved(x), x / 2) and calls == ["inference"]
    with torch.no_grad():
        _halved(x.requires_grad_())
    assert calls == ["inference"] * 2
    y = _halved(x)
    assert calls == ["inference"] * 2 and y.requires_grad
    (g,) = torch.autograd.grad(y.sum(), x)
    assert torch.equal(g, torch.full_like(x, 0.5))


def test_inference_mode_records_no_graph_even_under_enable_grad(monkeypatch):
    """Inside torch.inference_mode(), enable_grad() turns grad mode on but torch's own ops
    record no graph there; the op runs its inference function too, on an input that requires
    grad, instead of saving tensors for a backward nothing can run."""
    calls = []
    monkeypatch.setattr(_halved, "_eager", lambda x: calls.append("inference") or x * 0.5)
    x = torch.randn(4, dtype=torch.float64, requires_grad=True)
    with torch.inference_mode(), torch.enable_grad():
        assert torch.is_grad_enabled()
        expected = x * 0.5                       # what torch gives there
        y = _halved(x)
    assert calls == ["inference"]
    assert torch.equal(y, expected)
    assert not y.requires_grad and y.grad_fn is None and not expected.requires_grad


_axpy = TrainableOp(
    "tiletune_test::axpy", forward=lambda x, a, y=None: x * a if y is None else x * a + y,
    forward_schema="(Tensor x, float a, Tensor? y=None) -> Tensor",
    forward_fake=lambda x, a, y=None: torch.empty_like(x),
    save=lambda args, results: ((args[0],), (args[1], len(args) > 2 and args[2] is not None)),
    backward=lambda needs, g, x, a, has_y: [g * a, None, g.clone() if has_y else None],
    backward_schema="(bool[] needs, Tensor g, Tensor x, float a, bool has_y) -> Tensor?[]",
    backward_fake=lambda needs, g, x, a, has_y: [torch.empty_like(x), None,
                                                 torch.empty_like(g) if has_y else None])


def test_only_the_schemas_tensor_arguments_are_asked_for_a_gradient():
    """The call looks for `requires_grad` at the schema's Tensor and Tensor? positions only (a
    host-time matter), including an optional tensor left out or passed, at any position."""
    assert _axpy._tensor_args == (0, 2)
    x = torch.randn(3, dtype=torch.float64)
    y = torch.randn(3, dtype=torch.float64)
    assert not _axpy(x, 2.0).requires_grad and not _axpy(x, 2.0, y).requires_grad
    assert _axpy(x.requires_grad_(), 2.0).requires_grad
    x.requires_grad_(False)
    out = _axpy(x, 2.0, y.requires_grad_())
    assert out.requires_grad
    (gy,) = torch.autograd.grad(out.sum(), y)
    torch.testing.assert_close(gy, torch.ones_like(y))
    assert not gy.requires_grad          # no create_graph: a plain tensor, no error node


def test_functorch_transforms_are_refused_by_name_where_a_gradient_is_taken():
    """Under torch.func.grad the input requires grad, so the call takes the autograd route;
    there, too, a TypeError naming the op (torch's route would fail inside the Function,
    which has no setup_context, without naming it)."""
    x = torch.randn(5, dtype=torch.float64)
    with pytest.raises(TypeError, match=r"^tiletune_test::scale3: forward-mode AD and "
                                        r"torch.func transforms"):
        torch.func.grad(lambda x: _scale3(x).sum())(x)
    with pytest.raises(TypeError, match=r"^tiletune_test::scale3: .*torch.func transforms"):
        torch.func.vmap(lambda x: _scale3(x))(x.reshape(1, 5).requires_grad_())


def test_a_dead_functorch_wrapper_is_unwrapped_as_torch_does():
    """A tensor leaked from an exited transform, passed where a gradient could reach: the same
    result as torch's `Function.apply` gives (unwrapped, not tracked)."""
    leaked = []
    torch.func.grad(lambda x: (leaked.append(x), x.sum())[1])(torch.randn(3, dtype=torch.float64))
    dead = leaked[0].requires_grad_()
    assert torch._C._functorch.is_functorch_wrapped_tensor(dead)
    ours, torchs = _scale3(dead), _scale3._function.apply(dead)
    assert not torch._C._functorch.is_functorch_wrapped_tensor(ours)
    assert torch.equal(ours, torchs) and ours.requires_grad == torchs.requires_grad


def test_a_backward_binds_the_threads_cuda_context_once_per_thread(monkeypatch):
    """Every backward asks for a current CUDA context (autograd's thread for a device may have
    none); the driver is asked once per thread, later backwards read one attribute."""
    import threading

    from tiletune import device
    bound = []
    monkeypatch.setattr(device, "_thread", threading.local())
    monkeypatch.setattr(device, "_bind_primary_context",
                        lambda: bound.append(threading.get_ident()))
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    for _ in range(3):
        torch.autograd.grad(_scale3(x).sum(), x)
    assert bound == [threading.get_ident()]       # (a CPU backward runs on the calling thread)
    other = threading.Thread(target=lambda: torch.autograd.grad(_scale3(x).sum(), x))
    other.start()
    other.join()
    assert len(bound) == 2 and bound[1] != bound[0]


def test_bind_context_without_a_gpu_does_nothing():
    from tiletune import device
    device._bind_primary_context()      # no libcuda here, or no current context: no error


def test_compiled_fullgraph_gradients_equal_eager():
    """Under torch.compile(fullgraph=True) the custom op and its registered backward run (the
    backward pads its gradients to the op's arguments, an optional one left out included)."""
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    y = torch.randn(5, dtype=torch.float64, requires_grad=True)
    f = torch.compile(lambda x, y: (_scale3(x) * _axpy(x, 2.0, y)).sum(), fullgraph=True,
                      backend="aot_eager")
    gx, gy = torch.autograd.grad(f(x, y), (x, y))
    ex, ey = torch.autograd.grad((_scale3(x) * _axpy(x, 2.0, y)).sum(), (x, y))
    torch.testing.assert_close(gx, ex)
    torch.testing.assert_close(gy, ey)
    g2 = torch.autograd.grad(torch.compile(lambda x: _axpy(x, 2.0).sum(), fullgraph=True,
                                           backend="aot_eager")(x), x)[0]
    torch.testing.assert_close(g2, torch.full_like(x, 2.0))


def test_a_compiled_backward_binds_the_context_each_time_it_runs(monkeypatch):
    """A compiled step's backward runs the backward's custom op on autograd's thread for the
    device, which may have no CUDA context yet: it makes one current each time it runs (once a
    thread in the device module), not only while torch.compile traces it."""
    from tiletune import device
    calls = []
    monkeypatch.setattr(device, "bind_context", lambda: calls.append(1))
    x = torch.randn(5, dtype=torch.float64, requires_grad=True)
    f = torch.compile(lambda x: _scale3(x).sum(), fullgraph=True, backend="aot_eager")
    for step in range(3):
        torch.autograd.grad(f(x), x)
    assert len(calls) == 3


def test_forward_mode_and_transforms_are_refused_by_name():
    """Dual tensors (forward-mode AD) and torch.func transforms carry tangents or batch dims the
    kernels never see: a call without a gradient to take refuses them instead of dropping them."""
    import torch.autograd.forward_ad as fwAD
    x = torch.randn(5, dtype=torch.float64)
    with fwAD.dual_level():
        dual = fwAD.make_dual(x, torch.ones_like(x))
        with pytest.raises(TypeError, match="tiletune_test::square: forward-mode AD"):
            _square(dual)
    with pytest.raises(TypeError, match="torch.func transforms"):
        torch.func.vmap(_square)(torch.randn(3, 5, dtype=torch.float64))
    with pytest.raises(TypeError, match="torch.func transforms"):
        torch.func.jvp(_square, (x,), (torch.ones_like(x),))
    assert torch.equal(_square(x), x * x)           # outside them: the plain call


def test_records_graph_agrees_with_torch_and_asks_inference_mode_only_under_grad_mode(
        monkeypatch):
    """records_graph() is True exactly where a torch op on a leaf that requires grad records a
    graph: not under no_grad, not inside inference mode even under enable_grad. The no-grad
    path never asks for inference mode, nor does a torch.compile trace (the question breaks
    its graph: fullgraph=True would raise)."""
    from tiletune import torch_op
    leaf = torch.randn(3, requires_grad=True)
    modes = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad,
             "inference_mode": torch.inference_mode,
             "inference_mode + enable_grad": lambda: _nested(torch.inference_mode(),
                                                             torch.enable_grad()),
             "inference_mode(False)": lambda: torch.inference_mode(False)}
    for name, mode in modes.items():
        with mode():
            assert torch_op.records_graph() is (leaf * 2).requires_grad, name
    asked = []
    real = torch_op._is_inference_mode
    monkeypatch.setattr(torch_op, "_is_inference_mode", lambda: asked.append(1) or real())
    with torch.no_grad():
        assert torch_op.records_graph() is False
    assert asked == []
    compiled = torch.compile(lambda x: x * (2 if torch_op.records_graph() else 3),
                             backend="eager", fullgraph=True)
    assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0)) and asked == []


@contextlib.contextmanager
def _nested(*contexts):
    with contextlib.ExitStack() as stack:
        for c in contexts:
            stack.enter_context(c)
        yield


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_gives_the_plain_gradients(reentrant):
    """Under torch.utils.checkpoint (as `gradient_checkpointing_enable` runs a model's layers)
    the forward runs again in the backward, without a gradient first where reentrant (the
    inference function), then with one: the gradients equal those of the plain graph, with a
    saved input (square), a multi-output forward with an inference function (halved) and an
    optional argument (axpy)."""
    from torch.utils.checkpoint import checkpoint

    def block(x, y):
        h = _halved(_square(x))
        return (_axpy(h, 3.0, y) * _halved(x)).sum()

    x = torch.randn(6, dtype=torch.float64, requires_grad=True)
    y = torch.randn(6, dtype=torch.float64, requires_grad=True)
    want = torch.autograd.grad(block(x, y), (x, y))
    checkpoint(block, x, y, use_reentrant=reentrant).backward()   # (reentrant: no .grad())
    for g, w in zip((x.grad, y.grad), want):
        torch.testing.assert_close(g, w)
