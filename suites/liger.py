"""Liger-Kernel's names and call signatures on tiletune ops, so that code written against
`liger_kernel.transformers` changes one import.

Functions: `liger_rms_norm`, `liger_rotary_pos_emb` (= `liger_rope`), `liger_swiglu`,
`liger_geglu`; `.apply`-style entry points `LigerRMSNormFunction`, `LigerRopeFunction`,
`LigerSiLUMulFunction`, `LigerGELUMulFunction` (plain calls: the ops are differentiable
already); modules `LigerRMSNorm`, `LigerSwiGLUMLP`, `LigerGEGLUMLP` (HF attribute names, so
state_dicts load unchanged); model patching `apply_liger_kernel_to_llama / _mistral / _qwen2 /
_qwen3 / _qwen3_moe`, `MODEL_TYPE_TO_APPLY_LIGER_FN`, `_apply_liger_kernel_to_instance`, which
delegate to `tiletune.suites.hf.apply_tiletune` (attention left as the model has it, as Liger
does).

Differences, each raising ValueError naming the argument where a value asks for something
tiletune does not compute:
- RMSNorm: casting_mode "gemma" (or 1) or "llama" (or 0), not "none"; every mode computes
  Liger's "gemma" casting: float32 statistics and product, one rounding to the input dtype
  (Liger's "llama" rounds the normalized input before the weight product: results differ by
  at most that one rounding). offset (Gemma's `offset + weight`) is added to the weight in
  float32; the module reads offset and casting_mode on every call, so setting them after
  construction (as Liger's model patches do) takes effect.
  in_place and row_mode are accepted and have no effect: tiletune's backward never writes into
  the incoming gradient, so both in_place settings give the same results.
- RoPE: position_ids is accepted and ignored (cos/sin are already per position, as in Liger);
  unsqueeze_dim=2 takes q and k as (B, S, H, D), as transformers means it (Liger reads
  (B, H, S, D) whatever its value); the arithmetic is in torch's promotion of q's and cos's
  dtypes, as HF's code (Liger: cos's dtype where the two differ). A table exactly rotary_dim
  wide is read as HF reads it, each half's columns its own (Liger 0.8.5 takes the first
  rotary_dim / 2 columns for both halves: the same for the duplicated tables HF and Liger
  build, different for a table whose halves differ); other widths are read as Liger reads
  them. q and k come back as new tensors and are left as they were (Liger rotates them in
  place where their (B, S, H, D) layout is contiguous, as HF's transposed views are).
- `LigerSiLUMulFunction`: a gate_multiplier other than 1 scales a in its own dtype before the
  kernel (Liger scales it in float32 inside the kernel): one more rounding of the gate.
- `LigerGEGLUMLP` computes the tanh GELU, as Liger does, and raises ValueError for a config
  whose activation is set to another one (Liger computes the tanh GELU whatever it says).
- The patch functions given `model` patch that model only (Liger also patches the family's
  classes and `apply_rotary_pos_emb`, so models built afterwards are patched too).
- `_apply_liger_kernel_to_instance` on a model type without tiletune kernels warns and leaves
  the model as it is (Liger logs and returns).
- The patch functions have no cross-entropy kernels: cross_entropy and
  fused_linear_cross_entropy default to False here (Liger: fused_linear_cross_entropy=True) and
  True raises.
"""
import inspect
import math
import numbers
import warnings

import torch
from torch import nn

from tiletune import validate
from tiletune.ops.rms_norm import rms_norm
from tiletune.ops.swiglu import geglu, swiglu
from tiletune.suites import hf

# Liger's casting modes by name and number that tiletune serves (its kernel computes "gemma":
# float32 throughout, one rounding; "llama" within one rounding of it).
_CASTING = ("llama", 0, "gemma", 1)


def _check_rms_norm_options(op, offset, casting_mode):
    if isinstance(offset, bool) or not isinstance(offset, numbers.Real) or \
            not math.isfinite(offset):
        raise ValueError(f"{op}: offset={offset!r} must be a finite number")
    if isinstance(casting_mode, bool) or casting_mode not in _CASTING:
        raise ValueError(f"{op}: casting_mode={casting_mode!r} is not supported ('llama' or "
                         "'gemma': float32 statistics and product, output in the input's dtype)")


_swiglu = swiglu          # module-level names: the CPU tests replace them with torch stand-ins


def _geglu_tanh(gate, up):
    return geglu(gate, up, approximate="tanh")


def _rms_norm(op, name, X, W, eps, offset=0.0):
    if W is None:           # elementwise_affine=False: a unit weight (Liger adds no offset)
        if not isinstance(X, torch.Tensor) or X.dim() == 0:     # (X.shape[-1] below)
            validate.is_tensor(op, name, X)
            raise ValueError(f"{op}: {name} must have a last dimension (the hidden size), got "
                             "a 0-dim tensor")
        W = torch.ones(X.shape[-1], device=X.device, dtype=X.dtype)
    elif offset:            # Gemma's (offset + weight), in float32 as Liger computes it
        validate.is_tensor(op, "W", W)      # (the module's weight is a Parameter or None)
        W = W.float() + offset
    return rms_norm(X, W, eps)


def liger_rms_norm(X, W, eps, offset=0.0, casting_mode="llama", in_place=True):
    """RMSNorm of X over its last dim times W (None: no weight). See the module docstring for
    the options tiletune supports."""
    _check_rms_norm_options("liger_rms_norm", offset, casting_mode)
    return _rms_norm("liger_rms_norm", "X", X, W, eps, offset)


class LigerRMSNormFunction:
    """`LigerRMSNormFunction.apply(X, W, eps, offset=0.0, casting_mode="llama", in_place=True,
    row_mode=None)`: `liger_rms_norm`."""

    @staticmethod
    def apply(X, W, eps, offset=0.0, casting_mode="llama", in_place=True, row_mode=None):
        _check_rms_norm_options("LigerRMSNormFunction", offset, casting_mode)
        return _rms_norm("LigerRMSNormFunction", "X", X, W, eps, offset)


class LigerRMSNorm(nn.Module):
    """RMSNorm module with Liger's constructor: `weight` (ones, or zeros with init_fn="zeros";
    None with elementwise_affine=False) and `variance_epsilon`."""

    def __init__(self, hidden_size, eps=1e-6, offset=0.0, casting_mode="llama", init_fn="ones",
                 in_place=True, row_mode=None, elementwise_affine=True):
        super().__init__()
        _check_rms_norm_options("LigerRMSNorm", offset, casting_mode)
        if init_fn not in ("ones", "zeros"):
            raise ValueError(f"LigerRMSNorm: init_fn must be 'ones' or 'zeros', got {init_fn!r}")
        self.elementwise_affine = elementwise_affine
        if elementwise_affine:
            init = torch.ones if init_fn == "ones" else torch.zeros
            self.weight = nn.Parameter(init(hidden_size))
        else:
            self.register_parameter("weight", None)
        self.variance_epsilon = eps
        self.offset, self.casting_mode, self.in_place, self.row_mode = (
            offset, casting_mode, in_place, row_mode)

    def forward(self, hidden_states):
        offset = self.offset
        if offset or self.casting_mode not in _CASTING:     # (may be set after construction)
            _check_rms_norm_options("LigerRMSNorm", offset, self.casting_mode)
        return _rms_norm("LigerRMSNorm", "hidden_states", hidden_states, self.weight,
                         self.variance_epsilon, offset)

    def extra_repr(self):
        shape = None if self.weight is None else tuple(self.weight.shape)
        return (f"weight_shape={shape}, eps={self.variance_epsilon}, offset={self.offset}, "
                f"in_place={self.in_place}, row_mode={self.row_mode}")


def liger_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, rotary_dim=None):
    """RoPE of q (B, Hq, S, D) and k (B, Hkv, S, D), "rotate half" convention; returns new
    (q, k). unsqueeze_dim=2 takes q and k as (B, S, H, D), as transformers means it (Liger's
    kernel reads (B, H, S, D) whatever its value); other values are refused.
    cos/sin: (S, W), (1, S, W), (B, S, W), or 4-D with a singleton at unsqueeze_dim or dim 1.
    As Liger-Kernel 0.8.5 reads them: the rotary width R is rotary_dim (even, at most D), else
    min(W, D); the first R dims of each head rotate, with the first R / 2 columns of cos/sin
    as the angles of both halves (W at least R / 2: GPT-OSS's half-width tables pass
    rotary_dim = D). A table exactly R wide is used as it is, which is the same reading for
    the duplicated `cat(freqs, freqs)` tables transformers builds. position_ids is ignored."""
    op = "liger_rotary_pos_emb"
    if isinstance(unsqueeze_dim, bool) or unsqueeze_dim not in (1, 2):
        raise ValueError(f"{op}: unsqueeze_dim must be 1 ((B, H, S, D) q/k) or 2 ((B, S, H, D)), "
                         f"got {unsqueeze_dim!r}")
    if cos.dim() == 4:
        dim = unsqueeze_dim if cos.shape[unsqueeze_dim] == 1 else 1
        if cos.shape[dim] != 1:
            raise ValueError(f"{op}: 4-D cos/sin need a singleton dim at unsqueeze_dim="
                             f"{unsqueeze_dim} or 1, got {tuple(cos.shape)}")
        cos, sin = cos.squeeze(dim), sin.squeeze(dim)
    head_dim, width = q.shape[-1], cos.shape[-1]
    if rotary_dim is None:
        rotary_dim = min(width, head_dim)
    else:
        rotary_dim = validate.integer(op, "rotary_dim", rotary_dim, "an int or None")
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"{op}: rotary_dim must be even and in (0, head_dim={head_dim}], "
                             f"got {rotary_dim}")
    half = rotary_dim // 2
    if width < half:
        raise ValueError(f"{op}: cos/sin need at least rotary_dim / 2 = {half} columns, got "
                         f"{width}")
    if width != rotary_dim:     # Liger reads the first R / 2 columns as both halves' angles
        cos = torch.cat((cos[..., :half], cos[..., :half]), -1)
        sin = torch.cat((sin[..., :half], sin[..., :half]), -1)
    return hf.hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim, rotary_dim=rotary_dim)


liger_rope = liger_rotary_pos_emb


class LigerRopeFunction:
    """`LigerRopeFunction.apply(q, k, cos, sin, position_ids=None, unsqueeze_dim=1,
    rotary_dim=None)`: `liger_rotary_pos_emb`."""

    @staticmethod
    def apply(q, k, cos, sin, position_ids=None, unsqueeze_dim=1, rotary_dim=None):
        return liger_rotary_pos_emb(q, k, cos, sin, position_ids, unsqueeze_dim, rotary_dim)


def liger_swiglu(a, b):
    """silu(a) * b."""
    return _swiglu(a, b)


class LigerSiLUMulFunction:
    """`LigerSiLUMulFunction.apply(a, b, gate_multiplier=1.0, down_multiplier=1.0)`:
    silu(a * gate_multiplier) * b * down_multiplier (multipliers other than 1 cost an
    elementwise pass each)."""

    @staticmethod
    def apply(a, b, gate_multiplier=1.0, down_multiplier=1.0):
        gate_multiplier, down_multiplier = float(gate_multiplier), float(down_multiplier)
        out = _swiglu(a if gate_multiplier == 1.0 else a * gate_multiplier, b)
        return out if down_multiplier == 1.0 else out * down_multiplier


def liger_geglu(a, b):
    """gelu(a, approximate="tanh") * b."""
    return _geglu_tanh(a, b)


class LigerGELUMulFunction:
    """`LigerGELUMulFunction.apply(a, b)`: `liger_geglu`."""

    @staticmethod
    def apply(a, b):
        return _geglu_tanh(a, b)


class _GatedMLP(nn.Module):
    """`down_proj(act(gate_proj(x)) * up_proj(x))` with bias-free projections, as Liger's MLP
    modules build them."""

    def __init__(self, config, intermediate_size):
        super().__init__()
        self.config = config
        self.hidden_size = config.hidden_size
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.up_proj = nn.Linear(self.hidden_size, self.intermediate_size, bias=False)
        self.down_proj = nn.Linear(self.intermediate_size, self.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(self._gated(self.gate_proj(x), self.up_proj(x)))


class LigerSwiGLUMLP(_GatedMLP):
    """`down_proj(silu(gate_proj(x)) * up_proj(x))` with bias-free projections; config.hidden_act
    must be silu or swish."""

    def __init__(self, config, intermediate_size=None):
        if config.hidden_act not in hf.SWIGLU_ACTIVATIONS:
            raise ValueError(f"LigerSwiGLUMLP: config.hidden_act={config.hidden_act!r} is not "
                             "supported (silu or swish)")
        super().__init__(config, config.intermediate_size if intermediate_size is None
                         else intermediate_size)

    def _gated(self, gate, up):
        return _swiglu(gate, up)


# tanh-approximated GELU under its transformers names
_TANH_GELU_ACTIVATIONS = ("gelu_pytorch_tanh", "gelu_new")


class LigerGEGLUMLP(_GatedMLP):
    """`down_proj(gelu_tanh(gate_proj(x)) * up_proj(x))` with bias-free projections. The
    config's activation (hidden_activation, else hidden_act), if set, must be a tanh GELU."""

    def __init__(self, config):
        act = getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
        if act is not None and act not in _TANH_GELU_ACTIVATIONS:
            raise ValueError(f"LigerGEGLUMLP: activation {act!r} is not supported "
                             f"({', '.join(_TANH_GELU_ACTIVATIONS)})")
        super().__init__(config, config.intermediate_size)

    def _gated(self, gate, up):
        return _geglu_tanh(gate, up)


# ---------------------------------------------------------------------------------------------
# Model patching with Liger's signatures.

def _liger_entry_point(family):
    op = f"apply_liger_kernel_to_{family}"

    def apply(rope=True, cross_entropy=False, fused_linear_cross_entropy=False, rms_norm=True,
              swiglu=True, model=None):
        for name, value in (("cross_entropy", cross_entropy),
                            ("fused_linear_cross_entropy", fused_linear_cross_entropy)):
            if value:
                raise ValueError(f"{op}: {name}=True is not supported (tiletune has no "
                                 "cross-entropy kernel)")
        # (Liger reads its flags as truthy values)
        hf._apply_to_family(op, family, model, rms_norm=bool(rms_norm), rope=bool(rope),
                            attention=False, mlp=bool(swiglu), experts=bool(swiglu))

    experts = " and experts" if family == "qwen3_moe" else ""
    return hf.named(apply, op, f"Liger's `{op}` on tiletune: RMSNorm, RoPE and the SwiGLU MLP"
                    f"{experts} of {family} models, at class level, or on `model` in place (see "
                    "`tiletune.suites.hf.apply_tiletune`). Attention is left as it is.")


(apply_liger_kernel_to_llama, apply_liger_kernel_to_mistral, apply_liger_kernel_to_qwen2,
 apply_liger_kernel_to_qwen3, apply_liger_kernel_to_qwen3_moe) = map(
    _liger_entry_point, ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe"))

MODEL_TYPE_TO_APPLY_LIGER_FN = {
    "llama": apply_liger_kernel_to_llama,
    "mistral": apply_liger_kernel_to_mistral,
    "qwen2": apply_liger_kernel_to_qwen2,
    "qwen3": apply_liger_kernel_to_qwen3,
    "qwen3_moe": apply_liger_kernel_to_qwen3_moe,
}


def _apply_liger_kernel_to_instance(model, **kwargs):
    """Patch `model` in place by its config's model_type; keywords its family's function does not
    take are dropped (as Liger does). Another model type is left as it is, with a warning (Liger
    logs and returns there, and trainers call this on whatever model they hold)."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply is None:
        warnings.warn(f"_apply_liger_kernel_to_instance: model type {model_type!r} has no "
                      f"tiletune kernels ({', '.join(MODEL_TYPE_TO_APPLY_LIGER_FN)}); the model "
                      "is left unpatched", stacklevel=2)
        return
    accepted = inspect.signature(apply).parameters
    apply(model=model, **{k: v for k, v in kwargs.items() if k in accepted})


__all__ = ["LigerGELUMulFunction", "LigerGEGLUMLP", "LigerRMSNorm", "LigerRMSNormFunction",
           "LigerRopeFunction", "LigerSiLUMulFunction", "LigerSwiGLUMLP",
           "MODEL_TYPE_TO_APPLY_LIGER_FN", "apply_liger_kernel_to_llama",
           "apply_liger_kernel_to_mistral", "apply_liger_kernel_to_qwen2",
           "apply_liger_kernel_to_qwen3", "apply_liger_kernel_to_qwen3_moe", "liger_geglu",
           "liger_rms_norm", "liger_rope", "liger_rotary_pos_emb", "liger_swiglu"]
