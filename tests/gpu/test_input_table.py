"""Every public op against one table of inputs: for each tensor argument, the same mutations
(on the CPU, float64, int32, not a tensor, one dim more, a size that does not match) are refused
with a TypeError/ValueError that names the function and the argument, and the GPU is still
usable afterwards; strided views, inputs that are one tensor twice, and an `out` that is an input
give the float32 reference's result; NaN and inf propagate as the reference propagates them.
(In-place RoPE's aliasing rules, matmul's `out`, CausalBias sizes and int32 limits:
tests/gpu/test_bad_input.py.)"""
import dataclasses
from typing import Callable

import pytest
import torch
import torch.nn.functional as F

from tiletune.ops.fmha import fmha, scaled_dot_product_attention
from tiletune.ops.grouped_gemm import grouped_mm
from tiletune.ops.matmul import matmul
from tiletune.ops.rms_norm import rms_norm
from tiletune.ops.rms_norm_rope import rms_norm_rope
from tiletune.ops.rope import apply_rope

from .conftest import disable_autotune, rotate_half

B, HQ, HK, S, D = 2, 4, 2, 33, 64
dev = "cuda"



def _rope_ref(q, cos, sin):
    return q * cos + rotate_half(q) * sin


def _norm_ref(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _grouped_ref(x, w, offs):
    """x's rows of group g times w[g]; offs arrives as float with the other arguments."""
    out = torch.zeros(x.shape[0], w.shape[2], device=dev)
    start = 0
    for g, end in enumerate(offs.long().tolist()):
        out[start:end] = x[start:end] @ w[g]
        start = end
    return out


def _qk(dt):
    return (torch.randn(B, S, HQ, D, device=dev, dtype=dt).transpose(1, 2),
            torch.randn(B, S, HK, D, device=dev, dtype=dt).transpose(1, 2))


def _cos_sin():
    ang = torch.rand(S, D // 2, device=dev, dtype=torch.float64) * 6.3
    ang = torch.cat((ang, ang), -1)
    return ang.cos().float(), ang.sin().float()


# q, k: 5-D or a head_dim unlike the other's; cos/sin: a batch of 3 (B is 2) or an odd width /
# unlike the other's.
ROPE_MISSHAPEN = {"one dim more": ("q", "k", "cos", "sin"),
                  "one element short": ("q", "k", "cos", "sin")}


@dataclasses.dataclass
class Op:
    name: str                     # the name errors must carry
    call: Callable                # call(**args) -> tensor or tuple
    make: Callable                # make(dtype) -> {argument: value}, valid
    ref: Callable                 # ref(**float32 args) -> tensor or tuple
    checked: tuple                # the tensor arguments type and device mutations are tried on
    misshapen: dict               # shape mutation -> the arguments it makes invalid
    tol: float = 2e-2


def _rope_call(inplace):
    def call(q, k, cos, sin):
        if inplace and isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor):
            q, k = q.clone(), k.clone()
        return apply_rope(q, k, cos, sin, inplace=inplace)
    return call


OPS = [
    Op("rms_norm", lambda x, weight: rms_norm(x, weight),
       lambda dt: dict(x=torch.randn(3, 5, 257, device=dev, dtype=dt),
                       weight=torch.rand(257, device=dev, dtype=dt)),
       lambda x, weight: _norm_ref(x, weight), ("x", "weight"),
       {"one dim more": ("weight",), "one element short": ("x", "weight")}),
    Op("apply_rope", _rope_call(False),
       lambda dt: dict(zip(("q", "k"), _qk(dt))) | dict(zip(("cos", "sin"), _cos_sin())),
       lambda q, k, cos, sin: (_rope_ref(q, cos, sin), _rope_ref(k, cos, sin)),
       ("q", "k", "cos", "sin"), ROPE_MISSHAPEN),
    Op("apply_rope", _rope_call(True),
       lambda dt: dict(zip(("q", "k"), _qk(dt))) | dict(zip(("cos", "sin"), _cos_sin())),
       lambda q, k, cos, sin: (_rope_ref(q, cos, sin), _rope_ref(k, cos, sin)),
       ("q", "k", "cos", "sin"), ROPE_MISSHAPEN),
    Op("rms_norm_rope",
       lambda q, k, q_weight, k_weight, cos, sin: rms_norm_rope(q, k, q_weight, k_weight, cos,
                                                                sin),
       lambda dt: dict(zip(("q", "k"), _qk(dt))) | dict(zip(("cos", "sin"), _cos_sin()))
       | dict(q_weight=torch.rand(D, device=dev, dtype=dt),
              k_weight=torch.rand(D, device=dev, dtype=dt)),
       lambda q, k, q_weight, k_weight, cos, sin: (
           _rope_ref(_norm_ref(q, q_weight), cos, sin), _rope_ref(_norm_ref(k, k_weight), cos, sin)),
       ("q", "k", "q_weight", "k_weight", "cos", "sin"),
       {m: (*names, "q_weight", "k_weight") for m, names in ROPE_MISSHAPEN.items()}),
    Op("matmul", lambda a, b: matmul(a, b),
       lambda dt: dict(a=torch.randn(77, 130, device=dev, dtype=dt) / 8,
                       b=torch.randn(130, 95, device=dev, dtype=dt) / 8),
       lambda a, b: a @ b, ("a", "b"), {"one dim more": ("a", "b"), "one element short": ("a",)}),
    Op("fmha", lambda q, k, v: fmha(q, k, v, causal=True),
       lambda dt: dict(q=torch.randn(B, HQ, S, D, device=dev, dtype=dt),
                       k=torch.randn(B, HK, S + 8, D, device=dev, dtype=dt),
                       v=torch.randn(B, HK, S + 8, D, device=dev, dtype=dt)),
       lambda q, k, v: F.scaled_dot_product_attention(
           q, k.repeat_interleave(HQ // HK, 1), v.repeat_interleave(HQ // HK, 1),
           attn_mask=torch.ones(S, S + 8, dtype=torch.bool, device=dev).tril(8)),
       ("q", "k", "v"), {"one dim more": ("q", "k", "v"), "one element short": ("q", "k", "v")}),
    Op("scaled_dot_product_attention",
       lambda query, key, value: scaled_dot_product_attention(query, key, value, is_causal=True,
                                                              enable_gqa=True),
       lambda dt: dict(query=torch.randn(B, HQ, S, D, device=dev, dtype=dt),
                       key=torch.randn(B, HK, S, D, device=dev, dtype=dt),
                       value=torch.randn(B, HK, S, D, device=dev, dtype=dt)),
       lambda query, key, value: F.scaled_dot_product_attention(
           query, key, value, is_causal=True, enable_gqa=True),
       ("query", "key", "value"), {"one dim more": ("query", "key", "value"),
                                   "one element short": ("query", "key", "value")}),
    Op("grouped_mm", lambda x, w, offs: grouped_mm(x, w, offs),
       lambda dt: dict(x=torch.randn(50, 130, device=dev, dtype=dt) / 8,
                       w=(torch.randn(4, 95, 130, device=dev, dtype=dt) / 8).transpose(-2, -1),
                       offs=torch.tensor([10, 10, 35, 50], device=dev, dtype=torch.int32)),
       _grouped_ref, ("x", "w"), {"one dim more": ("x", "w"), "one element short": ("x",)}),
]
IDS = [f"{op.name}{'_inplace' if i == 2 else ''}" for i, op in enumerate(OPS)]
DTYPES = {"rms_norm": (torch.float32, torch.bfloat16), "apply_rope": (torch.float32,
          torch.bfloat16), "rms_norm_rope": (torch.float32, torch.bfloat16)}


def _dtype(op):
    return DTYPES.get(op.name, (torch.bfloat16,))[-1]


def _as_tuple(r):
    return r if isinstance(r, tuple) else (r,)


def _reference(op, args):
    return _as_tuple(op.ref(**{n: v.float() if isinstance(v, torch.Tensor) else v
                               for n, v in args.items()}))


def _assert_close(op, got, want):
    for g, w in zip(_as_tuple(got), want):
        assert g.shape == w.shape
        torch.testing.assert_close(g.float(), w, atol=op.tol, rtol=op.tol)


MUTATIONS = {
    "on the CPU": lambda t: t.cpu(),
    "float64": lambda t: t.double(),
    "int32": lambda t: t.to(torch.int32),
    "not a tensor": lambda t: t.tolist(),
    "one dim more": lambda t: t[None].expand(3, *t.shape),
    "one element short": lambda t: t[..., :-1],
}


@pytest.mark.parametrize("mutation", list(MUTATIONS))
@pytest.mark.parametrize("op", OPS, ids=IDS)
def test_bad_argument_is_refused_by_name(op, mutation, monkeypatch):
    disable_autotune(monkeypatch)
    for name in op.misshapen.get(mutation, op.checked):
        args = op.make(_dtype(op))
        args[name] = MUTATIONS[mutation](args[name])
        with pytest.raises((TypeError, ValueError)) as info:
            op.call(**args)
        message = str(info.value)
        assert message.startswith(f"{op.name}:"), message
        if mutation in ("on the CPU", "float64", "int32", "not a tensor"):
            assert name in message, (name, message)
    torch.cuda.synchronize()          # no kernel ran into a fault


def _strided(t):
    """The same values in a non-contiguous layout: every other element of a wider buffer along
    the last dim."""
    wide = torch.empty(*t.shape[:-1], 2 * t.shape[-1], device=t.device, dtype=t.dtype)
    view = wide[..., ::2]
    view.copy_(t)
    return view


@pytest.mark.parametrize("op", OPS, ids=IDS)
def test_strided_inputs_match_the_reference(op, monkeypatch):
    disable_autotune(monkeypatch)
    for dt in DTYPES.get(op.name, (torch.bfloat16,)):
        args = op.make(dt)
        want = _reference(op, args)
        _assert_close(op, op.call(**{n: _strided(v) for n, v in args.items()}), want)


def test_one_tensor_passed_twice(monkeypatch):
    disable_autotune(monkeypatch)
    a = torch.randn(96, 96, device=dev, dtype=torch.bfloat16) / 8
    torch.testing.assert_close(matmul(a, a).float(), a.float() @ a.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(matmul(a, a.t()).float(), a.float() @ a.float().t(), atol=2e-2,
                               rtol=2e-2)
    q = torch.randn(B, HQ, S, D, device=dev, dtype=torch.bfloat16)
    want = F.scaled_dot_product_attention(q.float(), q.float(), q.float(), is_causal=True)
    torch.testing.assert_close(fmha(q, q, q, causal=True).float(), want, atol=2e-2, rtol=2e-2)
    cos, sin = _cos_sin()
    x = torch.randn(B, HQ, S, D, device=dev, dtype=torch.float32)
    qo, ko = apply_rope(x, x, cos, sin)       # out of place: reading one tensor twice is fine
    torch.testing.assert_close(qo, _rope_ref(x, cos, sin))
    torch.testing.assert_close(ko, qo)


def test_matmul_out_may_be_an_input(monkeypatch):
    """The result is computed first and copied into `out`, so out=a is A @ B, not garbage."""
    disable_autotune(monkeypatch)
    a = torch.randn(64, 64, device=dev, dtype=torch.bfloat16) / 8
    b = torch.randn(64, 64, device=dev, dtype=torch.bfloat16) / 8
    want = a.float() @ b.float()
    assert matmul(a, b, out=a) is a
    torch.testing.assert_close(a.float(), want, atol=2e-2, rtol=2e-2)


def _poison(t, positions, value):
    flat = t.reshape(-1)
    flat[positions] = value
    return t


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("op", OPS, ids=IDS)
def test_nan_and_inf_propagate_as_in_torch(op, value, monkeypatch):
    """A non-finite value in the first input lands where the float32 reference puts NaN and
    inf; everything else stays finite and close. (The poisoned attention rows see many keys; a
    row whose every score is -inf is the documented exception: 0, as FlashAttention gives.)"""
    disable_autotune(monkeypatch)
    args = op.make(_dtype(op))
    first = op.checked[0]
    t = args[first].contiguous()
    last = t.numel() - 1
    args[first] = _poison(t, torch.tensor([last, last - 4 * t.shape[-1]], device=dev), value)
    want = _reference(op, args)
    got = _as_tuple(op.call(**args))
    for g, w in zip(got, want):
        g = g.float()
        assert torch.equal(g.isnan(), w.isnan()), (g.isnan().sum(), w.isnan().sum())
        assert torch.equal(g.isposinf(), w.isposinf()) and torch.equal(g.isneginf(), w.isneginf())
        finite = w.isfinite()
        torch.testing.assert_close(g[finite], w[finite], atol=op.tol, rtol=op.tol)
