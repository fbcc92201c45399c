"""One differentiable op, three ways in: a plain call when no gradient is needed, a
`torch.autograd.Function` in eager training (the least host time per step), and a
`torch.library` custom op with fake implementations under `torch.compile(fullgraph=True)`.
An op module defines its forward and backward once and gets all three from `TrainableOp`."""
import torch

from . import device as _device

_Tensor = torch.Tensor
_is_compiling = torch.compiler.is_compiling
_is_grad_enabled = torch.is_grad_enabled
_is_inference_mode = torch.is_inference_mode_enabled
_transforms_active = torch._C._are_functorch_transforms_active
_forward_ad = torch.autograd.forward_ad
_dispatch_mode = torch._C._get_dispatch_mode
_FAKE_MODE = torch._C._TorchDispatchModeKey.FAKE


def tracing():
    """True while torch.compile traces, or under a fake-tensor mode (make_fx, aot_function, a
    memory estimator): the ops then call their custom ops, whose fake implementations give the
    outputs, instead of launching kernels on tensors that have no memory, and skip the host
    checks that read addresses or values."""
    return _is_compiling() or _dispatch_mode(_FAKE_MODE) is not None


def records_graph():
    """True if autograd would record a graph now: grad mode on, outside inference mode (which
    records none even under torch.enable_grad(), and lets a leaf that requires grad be written
    in place). Inference mode is asked only when grad mode is on (no cost under no_grad), and
    not while torch.compile traces (the question breaks its graph): there, grad mode alone."""
    return _is_grad_enabled() and (_is_compiling() or not _is_inference_mode())


class TrainableOp:
    """name: "tiletune::<op>" (the custom ops are "<name>_fwd" and "<name>_bwd").

    forward(*args) -> a tensor, or a tuple of tensors: the op's `outputs` results, then the
        tensors only the backward needs (rstd, lse). An output that is an input (in place) is
        marked dirty.
    forward_schema / forward_fake: the custom op's schema (without the name) and shape function.
    save(args, results) -> (tensors to save, constants): what the backward receives; by
        default every input (all tensors) and no constants.
    backward(needs_input_grad, *grads, *saved tensors, *constants) -> gradients of the leading
        args, in order (None where not needed); the rest of the args get None.
    backward_schema / backward_fake: likewise for the backward's custom op (its first argument
        is `bool[] needs`).
    inference(*args) -> the op's result(s), optional: what an eager call that no gradient can
        reach runs instead of forward (it skips what only the backward reads).
    The backward runs kernels, so it is differentiable once: `create_graph=True` gives the
    gradients, and differentiating those gradients raises instead of silently giving zero.
    """

    def __init__(self, name, *, forward, forward_schema, forward_fake, backward,
                 backward_schema, backward_fake, save=None, outputs=1, inference=None):
        save = save or _save_inputs
        self.name = name
        self.forward, self.backward, self.outputs, self._save = forward, backward, outputs, save
        self._eager = inference or forward     # an eager call that needs no gradient
        self._fwd_op = torch.library.custom_op(f"{name}_fwd", forward, mutates_args=(),
                                               schema=forward_schema)
        self._fwd_op.register_fake(forward_fake)

        def run_backward(needs, *a):
            # (here, not in the autograd formula: a compiled backward runs this on autograd's
            # thread for the device; the formula runs only while torch.compile traces it)
            _device.bind_context()
            return backward(tuple(needs), *a)

        self._bwd_op = torch.library.custom_op(f"{name}_bwd", run_backward, mutates_args=(),
                                               schema=backward_schema)
        self._bwd_op.register_fake(backward_fake)
        self._fwd_op.register_autograd(self._compiled_backward, setup_context=self._setup)
        self._function = _autograd_function(name, forward, save, backward, outputs)
        self._apply = _fast_apply(self._function, name)
        self._tensor_args = _tensor_positions(forward_schema)

    def __call__(self, *args):
        # (a fake-tensor mode is asked only where x is not a plain tensor, as its fakes are not:
        # the host time of every call)
        if _is_compiling() or (type(args[0]) is not _Tensor and tracing()):
            results = self._fwd_op(*args)
        else:
            if _is_grad_enabled():
                # the schema's Tensor arguments only, in a loop (not any(<generator>), not every
                # argument): the host time of every call
                n = len(args)
                for i in self._tensor_args:
                    if i < n:
                        a = args[i]
                        if isinstance(a, _Tensor) and a.requires_grad:
                            # (inference mode records no graph, even under enable_grad, as
                            # torch's own ops do: asked only where a gradient would be taken)
                            if _is_inference_mode():
                                break
                            return self._apply(*args)
            if _forward_ad._current_level >= 0 or _transforms_active():    # (inline: host time)
                refuse_transforms(self.name)
            results = self._eager(*args)
        if isinstance(results, torch.Tensor):
            return results
        return results[0] if self.outputs == 1 else results[:self.outputs]

    def _setup(self, ctx, inputs, output):
        tensors, ctx.constants = self._save(inputs, _as_tuple(output))
        ctx.save_for_backward(*tensors)

    def _compiled_backward(self, ctx, *grads):
        needs = [bool(n) for n in ctx.needs_input_grad]
        result = self._bwd_op(needs, *grads[:self.outputs], *ctx.saved_tensors, *ctx.constants)
        return _pad(result, len(ctx.needs_input_grad))


def refuse_transforms(op):
    """TypeError naming op under forward-mode AD (inside a dual level) or a torch.func transform
    (vmap, grad, jvp, ...): the kernels read the plain values, so tangents and batch dims would
    be dropped. Nothing while torch.compile traces (its custom ops take that path)."""
    # (the two plain reads first: every FP8 call passes here several times)
    if (_forward_ad._current_level >= 0 or _transforms_active()) and not _is_compiling():
        raise TypeError(f"{op}: forward-mode AD and torch.func transforms (vmap, grad, jvp, "
                        "jacfwd, ...) are not supported (no jvp, no batching rule)")


def _fast_apply(function, name):
    """`function.apply` without the Python layer of `torch.autograd.Function.apply` (a closure,
    a super object and a generator per call: 1.7 of RMSNorm's 12.4 us forward with a gradient
    on a 2-core CPU host, launch stubbed). Under a functorch transform, where torch's route
    would fail inside the Function without naming the op (it has no setup_context, vmap or
    jvp): a TypeError naming it. (Dual inputs that require grad meet torch's own refusal of a
    Function without jvp.)"""
    apply_in_c = super(torch.autograd.Function, function).apply
    transforms_active = torch._C._are_functorch_transforms_active
    unwrap_if_dead = torch._C._functorch.unwrap_if_dead

    def apply(*args):
        if transforms_active():
            refuse_transforms(name)
        # as torch does: a tensor left over from an exited transform is unwrapped
        return apply_in_c(*[unwrap_if_dead(a) if isinstance(a, _Tensor) else a for a in args])
    return apply


def _tensor_positions(schema):
    """The positions of a schema's `Tensor` and `Tensor?` arguments."""
    params = schema[schema.index("(") + 1:schema.index(")")].split(",")
    return tuple(i for i, p in enumerate(params) if p.split()[0] in ("Tensor", "Tensor?"))


def _save_inputs(args, results):
    return tuple(args), ()


def _as_tuple(results):
    return (results,) if isinstance(results, torch.Tensor) else results


def _pad(grads, n):
    grads = tuple(grads)
    return grads + (None,) * (n - len(grads))


def no_second_order(op, gradients, inputs):
    """A backward's `gradients` (a tuple, None for those not computed), computed outside
    autograd under create_graph=True, joined to every tensor of `inputs` (its incoming
    gradients and saved tensors) that requires grad through a node whose backward raises: a
    second differentiation fails instead of silently missing its second-order term (torch's
    once_differentiable looks at the incoming gradients only)."""
    deps = [t for t in inputs if isinstance(t, _Tensor) and t.requires_grad]
    present = [g for g in gradients if g is not None]
    if not deps or not present:
        return gradients
    joined = iter(_NoSecondOrder.apply(op, len(present), *present, *deps))
    return tuple(None if g is None else next(joined) for g in gradients)


class _NoSecondOrder(torch.autograd.Function):
    """(op, n, *gradients, *what they depend on) -> the n gradients, joined to all of it: its
    backward, reached by any second differentiation of them, raises."""

    @staticmethod
    def forward(ctx, op, n, *tensors):
        ctx.op = op
        # (aliases, not views: autograd forbids writing in place a view made inside a
        # Function, and a gradient may be scaled or clamped in place)
        return tuple(t.detach() for t in tensors[:n])

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError(f"tiletune {ctx.op}: its backward runs kernels that have no backward "
                           "themselves (no double backward): a gradient of its gradient is not "
                           "supported (as torch's once_differentiable functions)")


def _autograd_function(name, forward, save, backward, outputs):
    _bind_context = _device.bind_context       # (autograd's thread for the device: see there)

    def run_backward(ctx, *grads):
        result = backward(tuple(ctx.needs_input_grad), *grads, *ctx.saved_tensors,
                          *ctx.constants)
        return _pad(result, len(ctx.needs_input_grad))     # (one entry per input)

    op = name.split("::")[-1]

    def run_backward_once(ctx, *grads):
        with torch.no_grad():
            result = run_backward(ctx, *grads)
        return no_second_order(op, result, (*grads, *ctx.saved_tensors))

    class Function(torch.autograd.Function):
        @staticmethod
        def forward(ctx, *args):
            results = _as_tuple(forward(*args))
            tensors, ctx.constants = save(args, results)
            ctx.save_for_backward(*tensors)
            dirty = [r for r in results[:outputs] for a in args if r is a]   # (no generators)
            if dirty:
                ctx.mark_dirty(*dirty)
            return results[0] if outputs == 1 else tuple(results[:outputs])

        @staticmethod
        def backward(ctx, *grads):
            _bind_context()
            # Grad mode is on in a backward only under create_graph=True: there the gradients
            # must refuse a second differentiation (once_differentiable). Elsewhere its no_grad
            # context and checks would only cost host time (several us a step).
            if _is_grad_enabled():
                return run_backward_once(ctx, *grads)
            return run_backward(ctx, *grads)

    Function.__name__ = Function.__qualname__ = name.split("::")[-1] + "_function"
    return Function
