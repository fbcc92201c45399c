"""Input checks shared by the op wrappers: clear TypeError/ValueError naming the function and the
argument; and what a tensor written in place must satisfy (no leaf that requires grad, no
overlapping memory)."""
import numbers
import operator

import torch

from .torch_op import records_graph, tracing

FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_Tensor = torch.Tensor


def tensor(op, name, t, device=None, dtypes=FLOAT_DTYPES, like=None):
    """`t` is a CUDA tensor (on `device`, or on the device of the tensor `like`, if given) of one
    of `dtypes`; returns it. (Every call of an op runs this: the checks are written out, not
    delegated, and `like` is compared by device index, no device objects, to save host time.)"""
    if not isinstance(t, torch.Tensor):
        is_tensor(op, name, t)
    if not t.is_cuda:
        raise ValueError(f"{op}: {name} must be a CUDA tensor, got device {t.device}")
    if like is not None and t.get_device() != like.get_device():
        device = like.device
    if device is not None and t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device} but the other inputs are on {device}")
    if t.dtype not in dtypes:
        dtype(op, name, t, dtypes)
    return t


def pair(op, name, t, other_name, other, dtypes=FLOAT_DTYPES):
    """`tensor(op, name, t)` and `tensor(op, other_name, other, like=t)` in one call: the
    passing case in one expression (host time of every call), the checks with their
    messages where it fails."""
    if (isinstance(t, _Tensor) and isinstance(other, _Tensor) and t.is_cuda and other.is_cuda
            and t.dtype in dtypes and other.dtype in dtypes
            and t.get_device() == other.get_device()):
        return
    tensor(op, name, t, dtypes=dtypes)
    tensor(op, other_name, other, dtypes=dtypes, like=t)


def integer(op, name, value, what="an int"):
    """value as a Python int: any integer type (Python's, numpy's, a SymInt). A bool, a float or
    a tensor (reading it would sync the host) is a TypeError naming `op` and the argument."""
    if value.__class__ is int:
        return value
    if isinstance(value, (bool, torch.Tensor)) or not hasattr(type(value), "__index__"):
        raise TypeError(f"{op}: {name} must be {what}, got {type(value).__name__}")
    return operator.index(value)


def is_tensor(op, name, t):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")


def not_nested(op, tensors, instead="dense tensors"):
    """A TypeError naming `op` and the argument where one of `tensors` ({name: value}) is a
    nested (jagged) tensor: its ragged size fails shape checks and allocations inside torch with
    errors that name neither. For the failure path of a call's checks (a valid call need not pay
    for it): call it where a check raised, then re-raise."""
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor) and t.is_nested:
            raise TypeError(f"{op}: {name} is a nested tensor, which is not supported: pass "
                            f"{instead}") from None


def dtype(op, name, t, dtypes):
    """t's dtype is one of `dtypes`."""
    if t.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise TypeError(f"{op}: {name} dtype {t.dtype} is not supported ({names})")


def same_dtype(op, ref_name, ref, others):
    """Every tensor of `others` ({name: tensor}) has ref's dtype."""
    for name, t in others.items():
        if t.dtype != ref.dtype:
            raise TypeError(f"{op}: {name} dtype {t.dtype} differs from {ref_name} dtype "
                            f"{ref.dtype}")


def dims(op, name, t, n, layout):
    """t has n dims; `layout` names them for the message, e.g. "(tokens, hidden)"."""
    if t.dim() != n:
        raise ValueError(f"{op}: {name} must be {n}-D {layout}, got shape {tuple(t.shape)}")


_INF = float("inf")


def eps(op, value):
    if value.__class__ is float and 0.0 <= value < _INF:     # the common case, first
        return value
    if isinstance(value, bool) or not isinstance(value, numbers.Real):    # (numpy's too)
        raise TypeError(f"{op}: eps must be a float, got {type(value).__name__}")
    if not value >= 0.0 or value == _INF:
        raise ValueError(f"{op}: eps must be a finite number >= 0, got {value}")
    return float(value)


def _leaf_or_view_of_one(t):
    """What torch refuses to write in place when it requires grad: "a leaf tensor", "a view of
    a leaf tensor", or "" for anything else."""
    if t.is_leaf:
        return "a leaf tensor"
    return "a view of a leaf tensor" if t._is_view() and t._base.is_leaf else ""


def out(op, t, shape, dtype, device, dtype_of="the inputs'", inputs=None, kept=None):
    """An `out=` tensor: exactly `shape`, `dtype` and `device`, and writable. An op that copies
    its result into `out` (inputs None) refuses, where autograd records a graph (grad mode on,
    outside inference mode: `records_graph`), a leaf that requires grad or a view of one, as
    torch's copy_ does, and, where an input in `kept` ({name: tensor}, what its backward may
    keep) requires grad, memory shared with them (the copy would change what the backward
    reads); an op whose kernel writes `out` directly while reading `inputs` ({name: tensor})
    refuses any `out` that requires grad where autograd records a graph (autograd would not
    see the write), and always memory shared with the inputs and an inference tensor outside
    inference mode (as torch refuses to write one). Neither takes elements that share memory (an
    expanded, stride-0 dim would be written twice). The memory checks read addresses, which
    torch.compile does not trace: they run eagerly (a compiled op writes a fresh tensor, then
    copies it).
    A nested tensor is refused (TypeError). TypeError / ValueError naming `op`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: out must be a torch.Tensor, got {type(t).__name__}")
    try:
        got = tuple(t.shape)
    except RuntimeError:        # (a strided nested tensor has no sizes)
        got = None
    if got != tuple(shape):
        not_nested(op, {"out": t})
        raise ValueError(f"{op}: out has shape {got} but the result is {tuple(shape)}")
    if t.dtype != dtype:
        raise TypeError(f"{op}: out dtype {t.dtype} differs from {dtype_of} {dtype}")
    if t.device != device:
        raise ValueError(f"{op}: out is on {t.device} but the inputs are on {device}")
    grad = records_graph()
    if grad and t.requires_grad:
        what = "a tensor" if inputs is not None else _leaf_or_view_of_one(t)
        if what:
            raise ValueError(f"{op}: out is {what} that requires grad, which cannot be written "
                             "in place")
    if tracing():
        return t
    if inputs is not None and t.is_inference() and not torch.is_inference_mode_enabled():
        # (a copy into out meets torch's own refusal; a kernel's write would not)
        raise ValueError(f"{op}: out is an inference tensor, which cannot be written in place "
                         "outside inference mode")
    if self_overlaps(t):
        raise ValueError(f"{op}: out {tuple(t.shape)} with strides {t.stride()} has elements "
                         "that share memory (an expanded, stride-0 dim?)")
    if kept and grad and any(other.requires_grad for other in kept.values()):
        inputs = kept
    for name, other in (inputs or {}).items():
        if overlaps(t, other):
            raise ValueError(f"{op}: out overlaps {name} in memory" + (
                ", which the backward reads" if inputs is kept else ""))
    return t

# ---------------------------------------------------------------------------------------------
# Tensors written in place: memory overlap. Pure functions of (address, shape,
# strides, element size): no device work, any device. Conservative: "may overlap" is refused.

def _span(t):
    """(first byte, end byte, element size, [(size, stride in bytes) of the dims of size > 1])
    of t's elements, or None when t is empty."""
    es = t.element_size()
    dims = []
    reach = es
    for n, st in zip(t.shape, t.stride()):
        if n > 1:
            dims.append((n, st * es))
            reach += (n - 1) * st * es
        elif n == 0:
            return None
    start = t.data_ptr()
    return start, start + reach, es, dims


def _self_overlaps(span):
    if span is None:
        return False
    reach = 0
    for n, st in sorted(span[3], key=lambda d: d[1]):
        if st <= reach:
            return True
        reach += (n - 1) * st
    return False


def self_overlaps(t):
    """True if two elements of t may share memory (an expanded, stride-0 dim of size > 1, or
    as_strided dims that interleave); False if every element has its own memory: with the dims
    sorted by stride, each stride exceeds the reach of the dims below it."""
    return _self_overlaps(_span(t))


def _arc(span, m):
    """The byte residues mod m that a span's elements occupy, as an arc of the circle Z/m:
    (start, length - 1), or None when it may be the whole circle. Dims whose stride is a
    multiple of m leave the residue alone; the others (and the element's own bytes) move it by
    at most the sum of their reaches."""
    reach = span[2] - 1
    for n, st in span[3]:
        if st % m:
            reach += (n - 1) * st
    return (span[0] % m, reach) if reach < m - 1 else None


def _overlap(sa, sb):
    if sa is None or sb is None or sa[1] <= sb[0] or sb[1] <= sa[0]:
        return False                     # empty, or disjoint byte ranges [start, end)
    for m in {st for _, st in sa[3] + sb[3] if st > 1}:
        arc_a, arc_b = _arc(sa, m), _arc(sb, m)
        if arc_a is not None and arc_b is not None and \
                (arc_b[0] - arc_a[0]) % m > arc_a[1] and (arc_a[0] - arc_b[0]) % m > arc_b[1]:
            return False                 # neither arc starts inside the other: disjoint
    return True


def overlaps(a, b):
    """True if tensors a and b may share memory (a byte of one element of a is a byte of an
    element of b); False only when provably disjoint. Tensors of different allocations, or
    empty ones, never overlap. Views that interleave within one buffer (the q and k columns of a
    fused qkv projection, the halves of a (B, 2, H, S, D) buffer) are told apart by their bytes'
    residues modulo a stride of theirs: each occupies its own arc of that period."""
    return _overlap(_span(a), _span(b))


def inplace(op, tensors):
    """Refuse an in-place write to `tensors` ({name: tensor}, in argument order) that torch or
    a kernel cannot do: a leaf that requires grad, or a view of one (where autograd records a
    graph, per tensor, as torch refuses: not under no_grad nor in inference mode); a tensor
    whose elements overlap (an expanded, stride-0 dim), which the kernel would write twice;
    two tensors sharing memory (the same tensor, overlapping views), which would race; an
    inference tensor outside inference mode (torch refuses that write too). ValueError naming
    `op` and the argument."""
    items = list(tensors.items())
    if not torch.is_inference_mode_enabled():
        for name, t in items:
            if t.is_inference():
                raise ValueError(f"{op}: inplace=True on {name}, an inference tensor, which "
                                 "cannot be written in place outside inference mode (call it "
                                 "under torch.inference_mode() or use inplace=False)")
    if records_graph():
        for name, t in items:
            what = t.requires_grad and _leaf_or_view_of_one(t)
            if what:
                raise ValueError(f"{op}: inplace=True on {name}, {what} that requires grad")
    spans = [_span(t) for _, t in items]
    for (name, t), span in zip(items, spans):
        if _self_overlaps(span):
            raise ValueError(f"{op}: inplace=True needs {name} whose elements do not share "
                             f"memory; {name} {tuple(t.shape)} with strides {t.stride()} has "
                             "overlapping elements (an expanded, stride-0 dim?): pass a "
                             "contiguous copy or use inplace=False")
    for i, (a, ta) in enumerate(items):
        for j in range(i + 1, len(items)):
            b, tb = items[j]
            if _overlap(spans[i], spans[j]):
                what = f"{b} is {a}" if tb is ta else f"{a} and {b} overlap in memory"
                raise ValueError(f"{op}: inplace=True needs {a} and {b} in separate memory, "
                                 f"but {what}: use inplace=False")
