"""Hugging Face transformers integration.

`RMSNorm` (alias `LlamaRMSNorm`) is an HF-style module on tiletune's rms_norm and needs torch
alone. `apply_tiletune` routes a Llama, Mistral, Qwen2, Qwen3 or Qwen3-MoE model through tiletune
ops: its RMSNorms, rotary embedding, gated MLPs (SwiGLU / GeGLU), Qwen3's per-head QK-norm +
RoPE (one fused kernel), Qwen3-MoE's experts and its attention (registered in transformers as
`attn_implementation="tiletune"`). It imports transformers (>= 5.17, < 6: the `hf` extra) when
called. `revert` undoes it.

Two ways to patch:
- a model class, a config class, a family name ("llama", "mistral", "qwen2", "qwen3",
  "qwen3_moe") or nothing (every family): class level. The family's modeling module gets
  tiletune subclasses of its RMSNorm, MLP, (Qwen3) attention and (Qwen3-MoE) experts classes, so
  models built afterwards use them, and a tiletune `apply_rotary_pos_emb`, which the attention
  looks up at call time, so models of that family that already exist use it too. With
  attention=True, models of the family built afterwards default to "tiletune" attention (an
  explicit `attn_implementation=` still wins).
- a built model: instance level. Its existing modules change class in place to the same
  tiletune subclasses (parameters, buffers and names untouched: state_dict keys, optimizers and
  hooks are unaffected), and with attention=True its config's attention implementation becomes
  "tiletune" (a config shared with other models changes for them too). Nothing outside the
  model changes.

The tiletune subclasses only override `forward`; `isinstance` against the HF class still holds.
Patching twice is harmless; flags add (a second call with a flag off does not undo the first).
"""
import importlib
import inspect
import logging
import weakref
from typing import NamedTuple

import torch
from torch import nn
from torch.nn.modules.module import (_global_forward_hooks,
                                      _global_forward_pre_hooks)

from tiletune.ops.fmha import MAX_GRID_Y, MAX_SEQ, fmha_varlen, scaled_dot_product_attention
from tiletune.ops.gated_mlp import swiglu_linear
from tiletune.ops.moe import MAX_ELEMS, moe_experts
from tiletune.ops.rms_norm import rms_norm
from tiletune.ops.rms_norm_rope import rms_norm_rope
from tiletune.ops.rope import apply_rope, hf_compute_dtype
from tiletune.ops.swiglu import geglu, swiglu

log = logging.getLogger("tiletune")

ATTENTION_NAME = "tiletune"


def _hf_rms_norm(x, weight, eps):
    """rms_norm with the output dtype of transformers' RMSNorms (`weight * normed.to(x.dtype)`):
    torch's promotion of x's and the weight's dtypes, so float32 weights on bfloat16 inputs
    (a float32 model under autocast) give float32 as there. The kernel writes x's dtype; the
    wider dtype is a cast of it (one more rounding than transformers' product at most)."""
    y = rms_norm(x, weight, eps)
    if weight.dtype is not x.dtype:        # (dtypes are singletons: the hot path's one check)
        wider = torch.promote_types(x.dtype, weight.dtype)
        if wider is not x.dtype:
            return y.to(wider)
    return y


class RMSNorm(nn.Module):
    """Like transformers' LlamaRMSNorm: `weight` (ones at init) and `variance_epsilon`.

    Statistics in float32; the output dtype is transformers' (torch's promotion of the input's
    and the weight's dtypes)."""

    def __init__(self, hidden_size, eps=1e-6, device=None, dtype=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, device=device, dtype=dtype))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        return _hf_rms_norm(hidden_states, self.weight, self.variance_epsilon)

    def extra_repr(self):
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


LlamaRMSNorm = RMSNorm


# The gated activations and the experts block, by module-level names (the CPU tests replace
# them with torch stand-ins).

_swiglu = swiglu
_swiglu_linear = swiglu_linear
_moe_experts = moe_experts


def _geglu(gate, up, approximate):
    return geglu(gate, up, approximate=approximate)


# config.hidden_act values whose gated MLP has a tiletune kernel (GeGLU: with its GELU form);
# other activations keep HF's.
SWIGLU_ACTIVATIONS = ("silu", "swish")
GEGLU_ACTIVATIONS = {"gelu_pytorch_tanh": "tanh", "gelu": "none"}

_logged = set()


def _log_once(message):
    # Not while torch.compile traces: a logging call there is a graph break.
    if message not in _logged and not torch.compiler.is_compiling():
        _logged.add(message)
        log.warning("%s", message)


# ---------------------------------------------------------------------------------------------
# Attention: transformers calls `attention_forward(module, query, key, value, attention_mask,
# dropout=, scaling=, is_causal=, ...)` with (B, H, S, D) query and (B, Hkv, Sk, D) key/value
# and expects ((B, S, H, D) output, weights or None). The mask comes from `tiletune_mask`: None
# where plain causal (or, for one query, full) attention is exact, else a 4-D boolean mask.

def tiletune_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, attention_mask=None,
                  local_size=None, allow_is_causal_skip=True, **kwargs):
    """transformers mask function "tiletune": None when no mask is needed, else what
    `transformers.masking_utils.sdpa_mask` builds. No mask is needed when transformers allows
    skipping it (nothing added to the causal pattern: no packed sequences, no overlays), there
    is no 2-D padding mask, no sliding window reaches inside the keys, and the queries are the
    whole sequence (q_length == kv_length, or an empty cache) or one decoding step.
    `sdpa_mask` decides the same, but never while tracing, so under torch.compile every call
    would get a mask. What still needs data to decide is left to `sdpa_mask`: a 2-D padding
    mask (eagerly, an all-ones one needs no mask; under torch.compile it is materialized) and,
    in forwards without a cache (use_cache=False), transformers' packed-sequence check on
    position_ids (a mask under torch.compile)."""
    from transformers.masking_utils import sdpa_mask
    if allow_is_causal_skip and attention_mask is None and \
            (local_size is None or kv_length < local_size) and \
            (q_length == 1 or q_length == kv_length or
             (isinstance(q_offset, int) and q_offset == 0)):
        return None
    return sdpa_mask(batch_size=batch_size, q_length=q_length, kv_length=kv_length,
                     q_offset=q_offset, kv_offset=kv_offset, attention_mask=attention_mask,
                     local_size=local_size, allow_is_causal_skip=allow_is_causal_skip,
                     **kwargs)


class AttentionRoute(NamedTuple):
    use_kernel: bool      # True: tiletune FMHA; False: transformers' sdpa_attention_forward
    causal: bool          # kernel only: causal (diagonal top-left, as torch SDPA)
    key_length: int       # kernel only: keys attended (HF drops the unreachable tail of an
                          # empty static cache at prefill; so do we)
    reason: str           # why the kernel cannot serve the call ("" when it can)


def attention_route(*, q_length, kv_length, head_dim, dtype, on_cuda, has_mask, is_causal,
                    dropout, has_position_bias=False, rows=0, v_head_dim=None, same_dtype=True):
    """Which attention serves one call: tiletune's FMHA where it computes exactly what
    transformers' SDPA attention computes, else SDPA itself. A pure function of the call's
    shapes and flags (no device work). The kernel serves: no attention mask (plain causal or,
    at q_length 1 or is_causal False, full attention), dropout 0, bf16/fp16 CUDA tensors,
    head_dim <= 256 for query, key and value alike (`v_head_dim` where the value's differs:
    multi-head latent attention), no position bias, `rows` (batch, or packed sequences, x query
    heads) and
    q_length and kv_length (a packed batch's longest sequences) within the kernels' grid
    (MAX_GRID_Y rows, MAX_SEQ tokens). Anything else (a padding / sliding-window /
    packed-sequence mask, attention dropout in training, float32, CPU, a larger batch, a longer
    sequence or KV cache) goes to SDPA."""
    if has_mask:
        reason = "an attention mask (padding, sliding window or packed sequences)"
    elif dropout:
        reason = f"attention dropout {dropout}"
    elif has_position_bias:
        reason = "a position bias"
    elif not on_cuda:
        reason = "tensors not on a CUDA device"
    elif dtype not in (torch.bfloat16, torch.float16):
        reason = f"dtype {dtype} (the kernel takes bfloat16/float16)"
    elif not same_dtype:
        reason = "query, key and value of different dtypes"
    elif v_head_dim is not None and v_head_dim != head_dim:
        reason = (f"a value head_dim ({v_head_dim}) other than the query's and key's "
                  f"({head_dim})")
    elif head_dim > 256:
        reason = f"head_dim {head_dim} > 256"
    elif rows > MAX_GRID_Y:
        reason = f"batch x query heads {rows} > {MAX_GRID_Y} (the kernels' grid)"
    elif q_length > MAX_SEQ or kv_length > MAX_SEQ:
        reason = (f"{max(q_length, kv_length)} query or key tokens > {MAX_SEQ} (the kernels' "
                  "grid)")
    else:
        causal = bool(is_causal) and q_length > 1
        keys = q_length if causal and kv_length > q_length else kv_length
        return AttentionRoute(True, causal, keys, "")
    return AttentionRoute(False, False, kv_length, reason)


def packed_lengths(kwargs, batch):
    """(cu_seq_lens_q, cu_seq_lens_k, max_length_q, max_length_k) of a packed (padding-free)
    batch, passed as transformers passes them to flash attention (FlashAttentionKwargs, e.g.
    from DataCollatorWithFlattening(return_flash_attn_kwargs=True)): one row of concatenated
    sequences. None when the call carries no such lengths or more than one row."""
    lengths = tuple(kwargs.get(n) for n in ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q",
                                            "max_length_k"))
    if batch != 1 or any(x is None for x in lengths):
        return None
    cu_q, cu_k, max_q, max_k = lengths
    return cu_q, cu_k, int(max_q), int(max_k)


# Score terms that transformers passes to its attention functions and that neither our kernel nor
# SDPA computes: refused rather than dropped.
_UNSERVED_TERMS = (("s_aux", "attention sinks"), ("sinks", "attention sinks"),
                   ("softcap", "logit softcapping"))


def _packed_mask_is_plain(module, kwargs, longest):
    """Whether a packed batch's mask is the plain block-diagonal causal one, so fmha_varlen on
    its lengths computes it: no sliding window shorter than the longest sequence. A family that
    passes `sliding_window` says it in the call; for one that does not, the module's window
    (Qwen2-MoE sets it on sliding layers), and where the module has none, a window or chunked
    attention in its config (PhiMoE, Llama 4) leaves the decision to the mask."""
    if "sliding_window" in kwargs:
        window = kwargs["sliding_window"]
    else:
        window = getattr(module, "sliding_window", None)
        if window is None:
            config = getattr(module, "config", None)
            if getattr(config, "attention_chunk_size", None) is not None:
                return False
            if getattr(config, "use_sliding_window", True):
                window = getattr(config, "sliding_window", None)
    return window is None or longest <= window


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                      is_causal=None, **kwargs):
    """transformers attention function "tiletune": tiletune FMHA (GQA served directly, no
    repeated key/value heads) where `attention_route` allows it; otherwise transformers'
    `sdpa_attention_forward`, unchanged, with one warning per reason on the `tiletune` logger
    (not while torch.compile traces). Padded batches, attention dropout > 0 in training,
    float32 models, CPU tensors, and under torch.compile the calls `tiletune_mask` must leave a
    mask on, take this path: never a different result, only a different kernel. A packed batch
    with its sequence lengths (`packed_lengths`) runs `fmha_varlen` on them; the mask
    transformers built for it (the same block-diagonal pattern) is not needed, unless a
    sliding window is shorter than the longest sequence (then the mask goes to SDPA).
    Attention sinks (`s_aux` of GPT-OSS, `sinks`) and logit softcapping (`softcap`, Gemma 2)
    raise ValueError. Returns ((B, S, H, D), None)."""
    for name, what in _UNSERVED_TERMS:
        if kwargs.get(name) is not None:
            raise ValueError(f"tiletune attention: {what} ({name}) is not supported (the kernel "
                             "and SDPA have no such term); use attn_implementation='eager' for "
                             "this model")
    if query.dtype == torch.float32 and torch.is_autocast_enabled(query.device.type):
        # a float32 model under autocast (q and k leave float32-weighted norms as float32): the
        # dtype SDPA computes in there, so the kernel serves it too
        dtype = torch.get_autocast_dtype(query.device.type)
        query, key, value = (t.to(dtype) for t in (query, key, value))
    is_causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    packed = packed_lengths(kwargs, query.shape[0])
    if packed is not None and not _packed_mask_is_plain(module, kwargs, packed[3]):
        packed = None            # local attention reaches inside a sequence: the mask decides
    route = attention_route(
        q_length=query.shape[2] if packed is None else packed[2],
        kv_length=key.shape[2] if packed is None else packed[3], head_dim=query.shape[3],
        dtype=query.dtype, on_cuda=query.is_cuda,
        has_mask=attention_mask is not None and packed is None, is_causal=is_causal,
        dropout=dropout, has_position_bias=kwargs.get("position_bias") is not None,
        rows=(query.shape[0] if packed is None else packed[0].shape[0] - 1) * query.shape[1],
        v_head_dim=value.shape[3],
        same_dtype=query.dtype == key.dtype == value.dtype)
    if not route.use_kernel:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward
        _log_once(f"tiletune attention: {route.reason}: using transformers' SDPA attention "
                  "for such calls")
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      dropout=dropout, scaling=scaling, is_causal=is_causal,
                                      **kwargs)
    if packed is not None:
        cu_q, cu_k, max_q, max_k = packed
        q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))     # (tokens, H, D)
        out = fmha_varlen(q, k, v, cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k,
                          causal=bool(is_causal), scale=scaling)
        return out.unsqueeze(0), None
    if route.key_length != key.shape[2]:
        key, value = key[:, :, :route.key_length], value[:, :, :route.key_length]
    out = scaled_dot_product_attention(query, key, value, is_causal=route.causal, scale=scaling,
                                       enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


def register_attention():
    """Register `attention_forward` as attn_implementation "tiletune" and `tiletune_mask` as its
    mask function (without one, transformers would pass no mask at all, padding or not).
    Idempotent; `apply_tiletune` calls it."""
    from transformers import AttentionInterface, AttentionMaskInterface
    AttentionInterface.register(ATTENTION_NAME, attention_forward)
    AttentionMaskInterface.register(ATTENTION_NAME, tiletune_mask)


# ---------------------------------------------------------------------------------------------
# Patched forwards. Each is a mixin placed before the HF class in a generated subclass (see
# `_tiletune_class`), so `super().forward` is HF's and the module's attributes are HF's.

class _RMSNormForward:
    def forward(self, hidden_states):
        return _hf_rms_norm(hidden_states, self.weight, self.variance_epsilon)


class _GatedMLPForward:
    _tiletune_activations = SWIGLU_ACTIVATIONS + tuple(GEGLU_ACTIVATIONS)

    def forward(self, x):
        act = self.config.hidden_act
        if not _is_hf_activation(self.act_fn, act):
            _log_once(f"tiletune MLP: act_fn is a {type(self.act_fn).__name__}, not the module "
                      f"transformers builds for hidden_act {act!r}: using transformers' MLP")
            return super().forward(x)
        if act in SWIGLU_ACTIVATIONS:
            if _fusable(x, self.gate_proj, self.up_proj):
                return self.down_proj(_swiglu_linear(x, self.gate_proj.weight,
                                                     self.up_proj.weight))
            return self.down_proj(_swiglu(self.gate_proj(x), self.up_proj(x)))
        if act in GEGLU_ACTIVATIONS:
            return self.down_proj(_geglu(self.gate_proj(x), self.up_proj(x),
                                         GEGLU_ACTIVATIONS[act]))
        _log_once(f"tiletune MLP: hidden_act {act!r} has no tiletune kernel: using "
                  "transformers' MLP")
        return super().forward(x)


def _is_hf_activation(act_fn, act):
    """act_fn is what transformers builds for hidden_act `act` (the kernels compute that
    activation), not a replacement set on the module."""
    try:
        return type(act_fn) is _hf_activation_type(act)
    except KeyError:          # an activation transformers does not know: the kernels neither
        return act not in SWIGLU_ACTIVATIONS and act not in GEGLU_ACTIVATIONS


_ACTIVATION_TYPES = {}     # hidden_act -> the module type transformers builds for it


def _hf_activation_type(act):
    # a dict, not functools.lru_cache: torch.compile traces through a cache wrapper and warns
    # the user that it does when it compiles a patched MLP
    found = _ACTIVATION_TYPES.get(act)
    if found is None:
        from transformers.activations import ACT2FN
        found = _ACTIVATION_TYPES[act] = type(ACT2FN[act])
    return found


# What a weight read by a kernel without calling its module must be: a plain tensor. A tensor
# subclass (torchao's quantized or float8 weights, which keep nn.Linear and report the
# high-precision dtype) holds other data than its values, which only its own dispatch computes.
_PLAIN_WEIGHTS = (nn.Parameter, torch.Tensor)


def _fusable(x, *projections):
    """The gate and up projections can go through swiglu_linear's one kernel, which reads their
    weights without calling them: plain bias-free nn.Linear layers (not LoRA or quantized
    wrappers, nor quantized weight tensors) of x's dtype and device (not offloaded), bf16 or
    fp16, with no forward hooks of their own or global ones and no forward set on the instance
    (an offloading or calibration hook must see the call), and no autocast (which would change
    the projections' dtype)."""
    if x.dtype not in (torch.bfloat16, torch.float16) or \
            torch.is_autocast_enabled(x.device.type) or \
            _global_forward_hooks or _global_forward_pre_hooks:
        return False
    for p in projections:
        if type(p) is not nn.Linear or p._forward_hooks or p._forward_pre_hooks or \
                "forward" in p.__dict__ or p.bias is not None:
            return False
        w = p.weight                    # (one attribute lookup: host time of every MLP call)
        if type(w) not in _PLAIN_WEIGHTS or w.dtype != x.dtype or w.device != x.device:
            return False
    return True


def experts_supported(hidden_dtype, weight_dtypes):
    """The grouped-GEMM experts serve bf16/fp16 hidden states with weights of that dtype (a
    float32 model, or float32 weights under autocast, keeps transformers' experts)."""
    return hidden_dtype in (torch.bfloat16, torch.float16) and \
        all(d == hidden_dtype for d in weight_dtypes)


EXPERT_WEIGHT_ELEMS = MAX_ELEMS     # moe_experts' limit per weight tensor (the grouped GEMM's)


class _ExpertsForward:
    _tiletune_activations = SWIGLU_ACTIVATIONS

    def forward(self, hidden_states, top_k_index, top_k_weights):
        act = self.config.hidden_act
        if act not in SWIGLU_ACTIVATIONS:
            _log_once(f"tiletune experts: hidden_act {act!r} has no tiletune kernel: using "
                      "transformers' experts")
            return super().forward(hidden_states, top_k_index, top_k_weights)
        act_fn = getattr(self, "act_fn", None)
        if not _is_hf_activation(act_fn, act):
            _log_once(f"tiletune experts: act_fn is a {type(act_fn).__name__}, not the module "
                      f"transformers builds for hidden_act {act!r}: using transformers' experts")
            return super().forward(hidden_states, top_k_index, top_k_weights)
        if not experts_supported(hidden_states.dtype,
                                 (self.gate_up_proj.dtype, self.down_proj.dtype)):
            _log_once(f"tiletune experts: {hidden_states.dtype} hidden states with "
                      f"{self.gate_up_proj.dtype} weights (the kernels take bf16/fp16 of one "
                      "dtype): using transformers' experts")
            return super().forward(hidden_states, top_k_index, top_k_weights)
        if type(self.gate_up_proj) not in _PLAIN_WEIGHTS or \
                type(self.down_proj) not in _PLAIN_WEIGHTS:
            odd = self.down_proj if type(self.gate_up_proj) in _PLAIN_WEIGHTS else \
                self.gate_up_proj
            _log_once(f"tiletune experts: {type(odd).__name__} expert weights (a tensor "
                      "subclass, such as a quantized weight, whose values only its own "
                      "operations compute): using transformers' experts")
            return super().forward(hidden_states, top_k_index, top_k_weights)
        if max(self.gate_up_proj.numel(), self.down_proj.numel()) > EXPERT_WEIGHT_ELEMS:
            _log_once("tiletune experts: an expert weight of more than 2^31 - 1 elements (the "
                      "grouped GEMM's limit; shard the experts): using transformers' experts")
            return super().forward(hidden_states, top_k_index, top_k_weights)
        return _moe_experts(hidden_states, top_k_index, top_k_weights, self.gate_up_proj,
                            self.down_proj)


def _fusable_qk_norm(attn, dtype):
    """(q_weight, k_weight, eps) when attn's q_norm and k_norm are tiletune RMSNorms with one
    eps, weights that keep q's `dtype` (wider ones make transformers' q and k wider, which the
    fused kernel does not write) and nothing that must see their calls (hooks of their own or
    global ones, a forward set on the instance: the fused kernel reads their weights without
    calling them), then norm + RoPE run as one kernel; else None."""
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    if not (isinstance(q_norm, _RMSNormForward) and isinstance(k_norm, _RMSNormForward)):
        return None
    if _global_forward_hooks or _global_forward_pre_hooks or any(
            n._forward_hooks or n._forward_pre_hooks or "forward" in n.__dict__
            for n in (q_norm, k_norm)):
        return None
    if q_norm.variance_epsilon != k_norm.variance_epsilon or \
            q_norm.weight.dtype != k_norm.weight.dtype or \
            torch.promote_types(dtype, q_norm.weight.dtype) != dtype:
        return None
    return q_norm.weight, k_norm.weight, q_norm.variance_epsilon


_UPDATE_TAKES_KWARGS = {}


def _update_takes_kwargs(cache):
    """Whether the cache's `update` takes the attention's kwargs as `kwargs=` (transformers'
    newer caches, the continuous-batching paged cache requiring them), per cache class."""
    cls = type(cache)
    takes = _UPDATE_TAKES_KWARGS.get(cls)
    if takes is None:
        try:
            params = inspect.signature(cls.update).parameters.values()
        except (TypeError, ValueError):
            params = ()
        takes = _UPDATE_TAKES_KWARGS[cls] = any(
            p.name == "kwargs" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)
    return takes


class _AttentionForward:
    """HF's decoder attention (projections, RoPE, cache update, the configured attention
    function, output projection) with tiletune RoPE, fused with the per-head QK-norm where the
    model has one (Qwen3) and its norms are tiletune's. The generated subclass sets
    `_hf_module` (the family's modeling module: its eager attention and attention registry)
    and `_sliding_window_kwarg` (how the family passes sliding_window)."""

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None,
                past_key_values=None, cache=None, **kwargs):
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape)
        key = self.k_proj(hidden_states).view(hidden_shape)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        _check_full_width("attention", cos, self.head_dim)
        fused = _fusable_qk_norm(self, query.dtype)
        if fused is not None:
            q_weight, k_weight, eps = fused
            query, key = rms_norm_rope(query.transpose(1, 2), key.transpose(1, 2), q_weight,
                                       k_weight, cos, sin, eps=eps)
        else:
            if getattr(self, "q_norm", None) is not None:
                query, key = self.q_norm(query), self.k_norm(key)
            query, key = apply_rope(query.transpose(1, 2), key.transpose(1, 2), cos, sin,
                                    compute_dtype=hf_compute_dtype(query, cos))

        cache = past_key_values if cache is None else cache    # `cache`: its newer name
        if cache is not None:
            if _update_takes_kwargs(cache):      # (transformers 5.25's call; 5.17's has none)
                key, value = cache.update(key, value, self.layer_idx, kwargs=kwargs)
            else:
                key, value = cache.update(key, value, self.layer_idx)

        modeling = self._hf_module
        attention_interface = modeling.ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, modeling.eager_attention_forward)
        if self._sliding_window_kwarg == "module":
            kwargs["sliding_window"] = self.sliding_window
        elif self._sliding_window_kwarg == "config":
            kwargs["sliding_window"] = getattr(self.config, "sliding_window", None)
        attn_output, attn_weights = attention_interface(
            self, query, key, value, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling, **kwargs)
        attn_output = attn_output.reshape(*input_shape, -1).contiguous()
        return self.o_proj(attn_output), attn_weights


def _check_full_width(op, cos, head_dim):
    """transformers' rotate-half code multiplies the whole head by cos, so the tables of the
    families patched here are head_dim wide; a narrower or wider table (a partial rotary factor
    with a scaled rope type, which transformers' own code fails on) is refused, not rotated in
    part."""
    if cos.shape[-1] != head_dim:
        raise ValueError(f"tiletune {op}: cos/sin have {cos.shape[-1]} columns, not head_dim "
                         f"{head_dim}: transformers' rotate-half RoPE rotates the whole head "
                         "(a partial rotary factor is not supported for this family)")


def hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1, rotary_dim=None):
    """transformers' `apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)` on tiletune RoPE:
    unsqueeze_dim=1 takes (B, H, S, D) q/k, unsqueeze_dim=2 (B, S, H, D); cos/sin (B, S, D).
    rotary_dim as `apply_rope`'s; without it, cos/sin must be D wide (transformers' code
    multiplies the whole head). The rotation is computed in the dtype transformers' code
    computes it in (torch's promotion of q's and cos's dtypes: bf16 for a bf16 model's tables)."""
    if rotary_dim is None:
        _check_full_width("apply_rotary_pos_emb", cos, q.shape[-1])
    math = hf_compute_dtype(q, cos)
    if unsqueeze_dim == 1:
        return apply_rope(q, k, cos, sin, rotary_dim=rotary_dim, compute_dtype=math)
    if unsqueeze_dim == 2:
        q_out, k_out = apply_rope(q.transpose(1, 2), k.transpose(1, 2), cos, sin,
                                  rotary_dim=rotary_dim, compute_dtype=math)
        return q_out.transpose(1, 2), k_out.transpose(1, 2)
    raise ValueError(f"apply_rotary_pos_emb: unsqueeze_dim must be 1 or 2, got {unsqueeze_dim}")


_generated = {}


def _tiletune_class(original, mixin, **attrs):
    """The tiletune subclass of HF class `original` with `mixin`'s forward (one per class). It
    is also this module's attribute of its name, which is where pickle looks a class up (a
    patched model saved whole with torch.save, or sent to another process)."""
    cls = _generated.get(original)
    if cls is None:
        name = f"Tiletune{original.__name__}"
        cls = type(name, (mixin, original),
                   {"__module__": __name__, "_tiletune_original": original, **attrs})
        _generated[original] = cls
        globals().setdefault(name, cls)
    return cls


def __getattr__(name):
    """A tiletune subclass that this process has not made yet, by name: a patched model
    unpickled before any `apply_tiletune` here. Its modules then run as patched, the
    "tiletune" attention implementation its config names included."""
    if name.startswith("Tiletune"):
        for fam in FAMILIES.values():
            if name.startswith("Tiletune" + fam.prefix):
                try:
                    mod = fam.module()
                except ImportError:
                    continue
                _swaps(fam, mod, rms_norm=True, mlp=True, experts=True, attention_forward=True)
        if name in globals():
            register_attention()
            return globals()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _original_class(cls):
    """HF's class for a tiletune subclass, else None."""
    return cls.__dict__.get("_tiletune_original")


# ---------------------------------------------------------------------------------------------
# The families: where their classes live and what each patch replaces.

class _Family(NamedTuple):
    name: str
    module_name: str
    prefix: str                       # class-name prefix: Llama, Mistral, Qwen2, Qwen3, Qwen3Moe
    qk_norm: bool                     # per-head q_norm/k_norm in the attention
    sliding_window_kwarg: str         # "none", "config" or "module": as HF's attention passes it
    experts: bool

    def module(self):
        return importlib.import_module(self.module_name)


FAMILIES = {f.name: f for f in (
    _Family("llama", "transformers.models.llama.modeling_llama", "Llama", False, "none", False),
    _Family("mistral", "transformers.models.mistral.modeling_mistral", "Mistral", False,
            "config", False),
    _Family("qwen2", "transformers.models.qwen2.modeling_qwen2", "Qwen2", False, "module",
            False),
    _Family("qwen3", "transformers.models.qwen3.modeling_qwen3", "Qwen3", True, "module", False),
    _Family("qwen3_moe", "transformers.models.qwen3_moe.modeling_qwen3_moe", "Qwen3Moe", True,
            "module", True),
)}

_SUPPORTED = ", ".join(FAMILIES)

# Class-level patches: family -> {(owner, attribute): what was there before}; _ABSENT where the
# owner had no attribute of its own (a method inherited from PreTrainedModel).
_class_patches = {}
_ABSENT = object()

# Models patched at instance level -> their attention implementation before patching.
_patched_models = weakref.WeakKeyDictionary()


def _hf_class(fam, mod, kind):
    """HF's own class of `kind` ("RMSNorm", "MLP", "Attention", "Experts") for the family, even
    while the module holds our subclass."""
    cls = getattr(mod, fam.prefix + kind)
    return _original_class(cls) or cls


def _replace(fam, owner, attr, value):
    patches = _class_patches.setdefault(fam.name, {})
    if (owner, attr) in patches:
        return                                    # patched already: keep the first original
    patches[(owner, attr)] = vars(owner).get(attr, _ABSENT)
    setattr(owner, attr, value)


def _default_attention(get_correct_attn_implementation):
    """A PreTrainedModel.get_correct_attn_implementation that reads "no choice" as tiletune's."""
    def get_correct(self, requested_attention, is_init_check=False):
        if requested_attention is None:
            requested_attention = ATTENTION_NAME
        return get_correct_attn_implementation(self, requested_attention, is_init_check)
    return get_correct


def _attention_class(fam, mod):
    return _tiletune_class(_hf_class(fam, mod, "Attention"), _AttentionForward, _hf_module=mod,
                           _sliding_window_kwarg=fam.sliding_window_kwarg)


_MIXINS = {"RMSNorm": _RMSNormForward, "MLP": _GatedMLPForward, "Experts": _ExpertsForward}


def _swaps(fam, mod, *, rms_norm, mlp, experts, attention_forward):
    """{kind: (HF's class, its tiletune subclass)} for the kinds the flags select."""
    kinds = [kind for kind, on in (("RMSNorm", rms_norm), ("MLP", mlp),
                                   ("Experts", experts and fam.experts)) if on]
    swaps = {}
    for kind in kinds:
        cls = _hf_class(fam, mod, kind)
        swaps[kind] = (cls, _tiletune_class(cls, _MIXINS[kind]))
    if attention_forward:
        swaps["Attention"] = (_hf_class(fam, mod, "Attention"), _attention_class(fam, mod))
    return swaps


def _patch_classes(fam, *, rms_norm, rope, attention, mlp, experts):
    mod = fam.module()
    # the attention forward only where norm + RoPE are fused (transformers looks
    # apply_rotary_pos_emb up at call time: replacing it serves the other families)
    swaps = _swaps(fam, mod, rms_norm=rms_norm, mlp=mlp, experts=experts,
                   attention_forward=rope and fam.qk_norm)
    for kind, (_, new) in swaps.items():
        _replace(fam, mod, fam.prefix + kind, new)
    if rope:
        _replace(fam, mod, "apply_rotary_pos_emb", hf_apply_rotary_pos_emb)
    if attention:
        owner = getattr(mod, fam.prefix + "PreTrainedModel")
        _replace(fam, owner, "get_correct_attn_implementation",
                 _default_attention(owner.get_correct_attn_implementation))


def _patch_instance(model, fam, *, rms_norm, rope, attention, mlp, experts):
    mod = fam.module()
    swaps = dict(_swaps(fam, mod, rms_norm=rms_norm, mlp=mlp, experts=experts,
                        attention_forward=rope).values())
    for module in model.modules():
        new = swaps.get(type(module))             # exact type: a user's subclass is left alone
        if new is None:
            continue
        act = getattr(getattr(module, "config", None), "hidden_act", None)
        supported = getattr(new, "_tiletune_activations", None)   # MLPs and experts
        if supported is not None and act not in supported:
            _log_once(f"apply_tiletune: {type(module).__name__} modules keep transformers' "
                      f"forward: hidden_act {act!r} has no tiletune kernel")
            continue
        module.__class__ = new
    top = _top_pretrained(model)
    if attention and top is not None and top.config._attn_implementation != ATTENTION_NAME:
        # the first patch that changes it saves what it was
        _patched_models[model] = top.config._attn_implementation
        top.set_attn_implementation(ATTENTION_NAME)
    elif attention and top is not None and not any(
            attr == "get_correct_attn_implementation"
            for _, attr in _class_patches.get(fam.name, ())):
        # "tiletune" already, and not as the patched class's default: the model's own choice,
        # which revert keeps
        _patched_models.setdefault(model, ATTENTION_NAME)
    else:
        _patched_models.setdefault(model, None)


def _top_pretrained(model):
    from transformers import PreTrainedModel
    return next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)


def _family_of(op, obj):
    """The family a model, model class, config (class) or family name belongs to."""
    from transformers import PreTrainedConfig
    if isinstance(obj, str):
        name = obj.lower().replace("-", "_")
    elif isinstance(obj, PreTrainedConfig) or \
            (isinstance(obj, type) and issubclass(obj, PreTrainedConfig)):
        name = obj.model_type
    elif isinstance(obj, nn.Module):
        top = _top_pretrained(obj)
        name = getattr(getattr(top, "config", None), "model_type", None) or _module_family(obj)
    elif isinstance(obj, type) and issubclass(obj, nn.Module):
        name = _module_family(obj)
    else:
        raise TypeError(f"{op}: expected a model, a model or config class or a family name, got "
                        f"{type(obj).__name__}")
    if name not in FAMILIES:
        what = obj if isinstance(obj, str) else getattr(obj, "__name__", type(obj).__name__)
        raise ValueError(f"{op}: {what!r} (model type {name!r}) is not supported; supported "
                         f"families: {_SUPPORTED}")
    return FAMILIES[name]


def _module_family(obj):
    """Family name from where a class (or a module's class) is defined, else its config's
    model_type, else None."""
    cls = obj if isinstance(obj, type) else type(obj)
    cls = _original_class(cls) or cls
    for fam in FAMILIES.values():
        if cls.__module__ == fam.module_name:
            return fam.name
    return getattr(getattr(cls, "config_class", None), "model_type", None)


def apply_tiletune(model_or_class=None, *, rms_norm=True, rope=True, attention=True, mlp=True,
                   experts=True):
    """Route a transformers model (or every model of a family built afterwards) through
    tiletune ops. Returns the model for a model, else None.

    model_or_class: a built model (instance level: its modules change class in place, nothing
    else changes), or a model class, config (class) or family name ("llama", "mistral", "qwen2",
    "qwen3", "qwen3_moe") (class level: the family's modeling module), or None (class level,
    every family). Another model type raises ValueError listing the supported families.
    rms_norm: every RMSNorm (Qwen3's q_norm/k_norm too). rope: the rotary embedding; in Qwen3
    and Qwen3-MoE, with rms_norm, fused with the per-head QK-norm into one kernel. mlp: the gated
    MLP (`down_proj(act(gate_proj(x)) * up_proj(x))`) for hidden_act silu/swish (SwiGLU),
    gelu_pytorch_tanh and gelu (GeGLU, tanh and erf forms); MLPs with other activations keep
    transformers' forward (logged once). experts: Qwen3-MoE's experts (SiLU) as one tiletune
    MoE op. attention: the model's attention implementation becomes "tiletune"
    (`attention_forward`: tiletune FMHA for unmasked causal or full attention without dropout;
    masks it cannot serve, such as padded batches, and dropout > 0 go to transformers' SDPA,
    logged once per reason; under torch.compile a 2-D attention_mask, or a forward without a
    cache, always brings a mask: see `tiletune_mask`); at class level models built afterwards
    default to it. Patching again is harmless; `revert` undoes it.
    """
    op = "apply_tiletune"
    flags = dict(rms_norm=rms_norm, rope=rope, attention=attention, mlp=mlp, experts=experts)
    for name, value in flags.items():      # ("eager" for attention would read as True)
        if not isinstance(value, bool):
            raise TypeError(f"{op}: {name} must be True or False, got {value!r}")
    if attention:
        register_attention()
    if model_or_class is None:
        for fam in FAMILIES.values():
            _patch_classes(fam, **flags)
        return None
    fam = _family_of(op, model_or_class)
    if isinstance(model_or_class, nn.Module):
        _patch_instance(model_or_class, fam, **flags)
        return model_or_class
    _patch_classes(fam, **flags)
    return None


def _apply_to_family(op, family, model, **flags):
    """`apply_tiletune` for one family: class level without a model, else on `model`, which
    must be a built model of that family."""
    if model is None:
        return apply_tiletune(family, **flags)
    if not isinstance(model, nn.Module):
        raise TypeError(f"{op}: model must be a built model (torch.nn.Module) or None, got "
                        f"{type(model).__name__}")
    fam = _family_of(op, model)
    if fam.name != family:
        raise ValueError(f"{op}: model is a {fam.name} model, not a {family} one")
    return apply_tiletune(model, **flags)


def _family_entry_point(family):
    def apply(model=None, *, rms_norm=True, rope=True, attention=True, mlp=True, experts=True):
        return _apply_to_family(f"apply_tiletune_to_{family}", family, model,
                                rms_norm=rms_norm, rope=rope, attention=attention, mlp=mlp,
                                experts=experts)

    return named(apply, f"apply_tiletune_to_{family}",
                 f"`apply_tiletune` for {family} models: with `model` (a built {family} model) "
                 "at instance level, without it at class level. Same keywords; experts applies "
                 "to Qwen3-MoE only.")


def named(fn, name, doc):
    """fn under a public name and docstring (the per-family entry points)."""
    fn.__name__ = fn.__qualname__ = name
    fn.__doc__ = doc
    return fn


(apply_tiletune_to_llama, apply_tiletune_to_mistral, apply_tiletune_to_qwen2,
 apply_tiletune_to_qwen3, apply_tiletune_to_qwen3_moe) = map(
    _family_entry_point, ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe"))


def _revert_classes(fam):
    for (owner, attr), original in _class_patches.pop(fam.name, {}).items():
        if original is _ABSENT:
            delattr(owner, attr)
        else:
            setattr(owner, attr, original)


def _revert_instance(model):
    for module in model.modules():
        original = _original_class(type(module))
        if original is not None:
            module.__class__ = original
    attention = _patched_models.pop(model, None)
    top = _top_pretrained(model)
    if top is None:
        return
    if attention is not None:
        top.set_attn_implementation(attention)
    elif top.config._attn_implementation == ATTENTION_NAME:
        # no record of what it had (built from a patched class, copied, unpickled):
        # transformers' default
        try:
            top.set_attn_implementation("sdpa")
        except (ValueError, ImportError):
            top.set_attn_implementation("eager")


def revert(model_or_class=None):
    """Undo `apply_tiletune`. A built model: its modules get their HF classes back (those built
    from patched classes too) and its attention implementation what it was before patching.
    A model class, config (class) or family name: that family's modeling module gets back
    exactly the classes and functions it had. None: every family and every model patched at
    instance level that is still alive. Models built while their family was patched keep the
    tiletune modules until reverted themselves. The "tiletune" attention stays registered."""
    if model_or_class is None:
        for fam in FAMILIES.values():
            _revert_classes(fam)
        for model in list(_patched_models.keys()):
            _revert_instance(model)
        return
    fam = _family_of("revert", model_or_class)
    if isinstance(model_or_class, nn.Module):
        _revert_instance(model_or_class)
    else:
        _revert_classes(fam)


# ---------------------------------------------------------------------------------------------
# The patched model of a ModelSpec (tiletune.pretune): what `python -m tiletune tune` builds and
# steps to meet a model's op keys (registered as the model runner by cases/train_step.py).

CONFIG_CLASSES = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config",
                  "qwen3": "Qwen3Config", "qwen3_moe": "Qwen3MoeConfig"}
# The embedding and LM head are plain torch, not tiletune ops: a small vocabulary keeps them cheap.
VOCAB = 512


def model_config(spec, max_seq, layers=1, vocab=VOCAB):
    """The transformers config of `spec`; by default one decoder layer and a small vocabulary
    (what decides the op keys)."""
    import transformers
    kw = dict(hidden_size=spec.hidden, intermediate_size=spec.intermediate,
              num_hidden_layers=layers, num_attention_heads=spec.heads,
              num_key_value_heads=spec.kv_heads, head_dim=spec.head_dim, vocab_size=vocab,
              max_position_embeddings=max_seq, hidden_act="silu", tie_word_embeddings=False)
    if spec.family == "mistral":
        kw["sliding_window"] = None
    if spec.family == "qwen3_moe":
        kw.update(num_experts=spec.experts, num_experts_per_tok=spec.top_k,
                  moe_intermediate_size=spec.moe_intermediate, decoder_sparse_step=1,
                  mlp_only_layers=[])
    return getattr(transformers, CONFIG_CLASSES[spec.family])(**kw)


def build_model(spec, max_seq, dtype):
    """The one-layer model of `spec` on the current CUDA device in `dtype`, patched with
    apply_tiletune."""
    from transformers import AutoModelForCausalLM
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(model_config(spec, max_seq), dtype=dtype)
    apply_tiletune(model)
    return model


def model_step(model, batch, seq, backward):
    """One forward (and backward) at (batch, seq): what a training (or inference) step of this
    shape launches."""
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), device="cuda")
    if backward:
        model.train()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        model.zero_grad(set_to_none=True)
    else:
        model.eval()
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
    torch.cuda.synchronize()


def model_generate(model, batch, seq, lengths):
    """What generating after a `seq`-token prompt launches: the prompt's forward with a KV
    cache, then one decoding step (one new token a sequence) at each cache length of `lengths`
    (ascending, each above `seq`). The cache is filled up to each length with random keys and
    values: a step's op keys depend on the cache's shape, not on what it holds."""
    config = model.config
    kv_heads = config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    weight = next(model.parameters())
    ids = torch.randint(0, config.vocab_size, (batch, seq), device=weight.device)
    # the cache's name: `cache` in transformers' newer forwards (`past_key_values` warns there)
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else \
        "past_key_values"
    model.eval()
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
        cache = out[name] if name in out.keys() else out.past_key_values
        for length in lengths:
            missing = length - 1 - cache.get_seq_length()
            if missing > 0:
                for layer in range(config.num_hidden_layers):
                    k = torch.randn(batch, kv_heads, missing, head_dim, device=weight.device,
                                    dtype=weight.dtype)
                    cache.update(k, torch.randn_like(k), layer)
            model(input_ids=ids[:, -1:], use_cache=True, **{name: cache})
    torch.cuda.synchronize()


__all__ = ["ATTENTION_NAME", "AttentionRoute", "FAMILIES", "LlamaRMSNorm", "RMSNorm",
           "apply_tiletune", "apply_tiletune_to_llama", "apply_tiletune_to_mistral",
           "apply_tiletune_to_qwen2", "apply_tiletune_to_qwen3", "apply_tiletune_to_qwen3_moe",
           "attention_forward", "attention_route", "hf_apply_rotary_pos_emb",
           "register_attention", "revert", "tiletune_mask"]
