"""tiletune.suites.hf on CPU: what apply_tiletune replaces (class and instance level), that
parameters and names stay, idempotence, revert, errors, the attention registration and routing.
The kernels need a GPU, so the forwards run here with torch references in place of the ops:
that checks the plumbing (layouts, which op gets which tensors) against transformers exactly."""
import copy
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

from tiletune.suites import hf  # noqa: E402

FAMILY_NAMES = list(hf.FAMILIES)


def config(family, **kw):
    """A tiny config of `family` (GQA: 4 query heads, 2 key/value heads)."""
    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=128)
    if family == "llama":
        return transformers.LlamaConfig(**common, **kw)
    if family == "mistral":
        return transformers.MistralConfig(**common, **kw)
    if family == "qwen2":
        return transformers.Qwen2Config(**common, **kw)
    if family == "qwen3":
        return transformers.Qwen3Config(**common, head_dim=16, **kw)
    # layer 0 sparse (experts), layer 1 dense (MLP)
    return transformers.Qwen3MoeConfig(**common, head_dim=16, moe_intermediate_size=32,
                                       num_experts=4, num_experts_per_tok=2, mlp_only_layers=[1],
                                       **kw)


def build(family, **kw):
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config(family, **kw))
    with torch.no_grad():              # RMSNorm weights start at ones: make them matter
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def module_of(family):
    return hf.FAMILIES[family].module()


def hf_classes(family):
    """HF's classes and functions a class-level patch may replace, by attribute name."""
    mod, prefix = module_of(family), hf.FAMILIES[family].prefix
    names = [prefix + k for k in ("RMSNorm", "MLP", "Attention", "Experts")] + \
        ["apply_rotary_pos_emb"]
    return {n: getattr(mod, n) for n in names if hasattr(mod, n)}


@pytest.fixture(autouse=True)
def unpatched():
    """Every test starts and ends with transformers as shipped."""
    hf.revert()
    originals = {f: hf_classes(f) for f in FAMILY_NAMES}
    yield
    hf.revert()
    for f in FAMILY_NAMES:
        assert hf_classes(f) == originals[f]


# ---------------------------------------------------------------------------------------------
# Torch references standing in for the kernels (each call counted).

def ref_rms_norm(x, w, eps):
    """transformers' values, in x's dtype as the kernel writes them (whatever w's dtype)."""
    x32 = x.float()
    normed = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (w * normed).to(x.dtype)


def rotate_half(x):
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), -1)


def ref_rope(q, k, cos, sin, rotary_dim=None):
    assert q.dim() == 4 and cos.dim() == 3          # (B, H, S, D) and HF's (B, S, D)
    assert rotary_dim is None                        # HF's models rotate the whole head
    cos, sin = cos[:, None], sin[:, None]
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def ref_moe(h, top_k_index, top_k_weights, gate_up_proj, down_proj):
    gate, up = torch.einsum("th,tkih->tki", h, gate_up_proj[top_k_index]).chunk(2, -1)
    y = torch.einsum("tki,tkhi->tkh", F.silu(gate) * up, down_proj[top_k_index])
    return (y * top_k_weights[..., None]).sum(1)


@pytest.fixture
def ops(monkeypatch):
    """Replace the ops the patched forwards call with torch references; route attention as if
    on a GPU in bf16 (the route's mask/dropout rules still apply). Returns the call counts."""
    calls = {k: 0 for k in ("rms_norm", "rope", "rms_norm_rope", "swiglu", "swiglu_linear",
                            "geglu", "moe", "attention")}

    def counted(name, fn):
        def wrapper(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapper

    def norm_rope(q, k, wq, wk, cos, sin, *, eps):
        return ref_rope(ref_rms_norm(q, wq, eps), ref_rms_norm(k, wk, eps), cos, sin)

    def rope(q, k, cos, sin, rotary_dim=None, compute_dtype=None):
        assert compute_dtype == torch.promote_types(q.dtype, cos.dtype)   # as HF's code computes
        return ref_rope(q, k, cos, sin, rotary_dim)

    def sdpa(q, k, v, *, is_causal, scale, enable_gqa):
        assert enable_gqa and k.shape[1] < q.shape[1]        # GQA reaches the kernel as is
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale,
                                              enable_gqa=True)

    route = hf.attention_route
    monkeypatch.setattr(hf, "rms_norm", counted("rms_norm", ref_rms_norm))
    monkeypatch.setattr(hf, "apply_rope", counted("rope", rope))
    monkeypatch.setattr(hf, "rms_norm_rope", counted("rms_norm_rope", norm_rope))
    monkeypatch.setattr(hf, "_swiglu", counted("swiglu", lambda g, u: F.silu(g) * u))
    monkeypatch.setattr(hf, "_swiglu_linear", counted(
        "swiglu_linear", lambda x, wg, wu: F.silu(F.linear(x, wg)) * F.linear(x, wu)))
    monkeypatch.setattr(hf, "_geglu", counted(
        "geglu", lambda g, u, approximate: F.gelu(g, approximate=approximate) * u))
    monkeypatch.setattr(hf, "_moe_experts", counted("moe", ref_moe))
    monkeypatch.setattr(hf, "scaled_dot_product_attention", counted("attention", sdpa))
    monkeypatch.setattr(hf, "experts_supported", lambda hidden, weights: True)
    monkeypatch.setattr(hf, "attention_route", lambda **kw: route(
        **{**kw, "on_cuda": True, "dtype": torch.bfloat16}))
    monkeypatch.setattr(hf, "_logged", set())
    return calls


def loss_and_grads(model, ids, **kw):
    model.zero_grad()
    out = model(ids, labels=ids, **kw)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()
                                 if p.grad is not None}


def assert_same_training_step(model, reference, ids, **kw):
    logits, grads = loss_and_grads(model, ids, **kw)
    ref_logits, ref_grads = loss_and_grads(reference, ids, **kw)
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=1e-5)
    assert grads.keys() == ref_grads.keys()
    for name in grads:
        torch.testing.assert_close(grads[name], ref_grads[name], atol=1e-5, rtol=1e-4,
                                   msg=lambda m: f"{name}: {m}")


# ---------------------------------------------------------------------------------------------
# Instance level.

@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_instance_patch_swaps_classes_in_place(family):
    model = build(family)
    params = [(n, id(p)) for n, p in model.named_parameters()]
    buffers = [(n, id(b)) for n, b in model.named_buffers()]
    keys = list(model.state_dict())
    before = {n: type(m) for n, m in model.named_modules()}

    assert hf.apply_tiletune(model) is model
    fam = hf.FAMILIES[family]
    patched = {n: type(m) for n, m in model.named_modules() if type(m) is not before[n]}
    expected = {"RMSNorm", "MLP", "Attention"} | ({"Experts"} if fam.experts else set())
    assert {t.__name__ for t in patched.values()} == {f"Tiletune{fam.prefix}{k}"
                                                       for k in expected}
    for name, cls in patched.items():
        assert cls._tiletune_original is before[name] and issubclass(cls, before[name])
    n_layers = 2
    assert sum(n.endswith("self_attn") for n in patched) == n_layers
    norms = sum("RMSNorm" in t.__name__ for t in patched.values())
    assert norms == 2 * n_layers + 1 + (2 * n_layers if fam.qk_norm else 0)
    assert [(n, id(p)) for n, p in model.named_parameters()] == params
    assert [(n, id(b)) for n, b in model.named_buffers()] == buffers
    assert list(model.state_dict()) == keys
    assert model.config._attn_implementation == "tiletune"

    hf.apply_tiletune(model)                                     # idempotent
    assert {n: type(m) for n, m in model.named_modules() if type(m) is not before[n]} == patched

    hf.revert(model)
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert model.config._attn_implementation == "sdpa"
    assert list(model.state_dict()) == keys


def test_revert_keeps_an_attention_the_model_was_built_with():
    """A model built with attn_implementation="tiletune" (its own choice, before any patch)
    keeps it through apply_tiletune and revert."""
    hf.register_attention()
    model = build("qwen3")
    model.set_attn_implementation("tiletune")
    hf.apply_tiletune(model)
    hf.revert(model)
    assert model.config._attn_implementation == "tiletune"


def test_instance_patch_leaves_other_models_and_the_module_alone():
    model, other = build("llama"), build("llama")
    originals = hf_classes("llama")
    hf.apply_tiletune(model)
    assert hf_classes("llama") == originals
    assert type(other.model.norm) is originals["LlamaRMSNorm"]
    assert other.config._attn_implementation == "sdpa"


def test_instance_flags_select_what_is_patched():
    model = build("qwen3_moe")
    hf.apply_tiletune(model, rms_norm=False, rope=False, attention=False, mlp=False,
                      experts=False)
    assert not any(type(m).__name__.startswith("Tiletune") for m in model.modules())
    assert model.config._attn_implementation == "sdpa"
    hf.apply_tiletune(model, rms_norm=False, rope=False, attention=False, experts=True)
    names = {type(m).__name__ for m in model.modules()}
    assert "TiletuneQwen3MoeExperts" in names and "Qwen3MoeRMSNorm" in names
    hf.apply_tiletune(model, rope=False, attention=False)         # flags add up
    names = {type(m).__name__ for m in model.modules()}
    assert {"TiletuneQwen3MoeRMSNorm", "Qwen3MoeAttention"} <= names
    assert model.config._attn_implementation == "sdpa"


def test_unsupported_activation_keeps_hf_mlp(caplog, monkeypatch):
    monkeypatch.setattr(hf, "_logged", set())
    model = build("llama", hidden_act="relu")
    with caplog.at_level(logging.WARNING, logger="tiletune"):
        hf.apply_tiletune(model)
    assert type(model.model.layers[0].mlp).__name__ == "LlamaMLP"
    assert type(model.model.norm).__name__ == "TiletuneLlamaRMSNorm"
    assert sum("hidden_act 'relu'" in r.getMessage() for r in caplog.records) == 1


def test_float32_experts_keep_hf_experts(caplog, monkeypatch):
    """The grouped-GEMM experts take bf16/fp16: a float32 Qwen3-MoE (or float32 weights under
    autocast) runs transformers' experts, with one warning, instead of raising."""
    monkeypatch.setattr(hf, "_logged", set())
    monkeypatch.setattr(hf, "_moe_experts", lambda *a: pytest.fail("float32 reached the kernel"))
    assert hf.experts_supported(torch.bfloat16, (torch.bfloat16, torch.bfloat16))
    assert not hf.experts_supported(torch.bfloat16, (torch.float32, torch.float32))
    assert not hf.experts_supported(torch.float32, (torch.float32, torch.float32))
    model = build("qwen3_moe")
    reference = copy.deepcopy(model)
    hf.apply_tiletune(model, rms_norm=False, rope=False, attention=False, mlp=False)
    ids = torch.randint(0, 128, (2, 12))
    with caplog.at_level(logging.WARNING, logger="tiletune"):
        torch.testing.assert_close(model(ids).logits, reference(ids).logits)
    assert sum("tiletune experts: torch.float32" in r.getMessage()
               for r in caplog.records) == 1


def test_experts_past_the_grouped_gemm_limit_keep_hf_experts(caplog, monkeypatch):
    """Expert weights of more than 2^31 - 1 elements (the limit lowered here to the tiny
    model's) run transformers' experts, with one warning, instead of raising mid-model."""
    monkeypatch.setattr(hf, "_logged", set())
    monkeypatch.setattr(hf, "experts_supported", lambda hidden, weights: True)
    monkeypatch.setattr(hf, "_moe_experts", lambda *a: pytest.fail("reached the kernel"))
    model = build("qwen3_moe")
    reference = copy.deepcopy(model)
    hf.apply_tiletune(model, rms_norm=False, rope=False, attention=False, mlp=False)
    experts = next(m for m in model.modules() if type(m).__name__.endswith("Experts"))
    monkeypatch.setattr(hf, "EXPERT_WEIGHT_ELEMS", experts.gate_up_proj.numel() - 1)
    ids = torch.randint(0, 128, (2, 12))
    with caplog.at_level(logging.WARNING, logger="tiletune"):
        torch.testing.assert_close(model(ids).logits, reference(ids).logits)
    assert sum("more than 2^31 - 1 elements" in r.getMessage() for r in caplog.records) == 1


@pytest.mark.parametrize("family", FAMILY_NAMES)
def test_instance_patched_step_matches_hf(family, ops):
    model = build(family)
    reference = copy.deepcopy(model)
    hf.apply_tiletune(model)
    ids = torch.randint(0, 128, (2, 12))
    assert_same_training_step(model, reference, ids)
    layers = 2
    if hf.FAMILIES[family].qk_norm:
        assert ops["rms_norm_rope"] == layers and ops["rope"] == 0
    else:
        assert ops["rope"] == layers and ops["rms_norm_rope"] == 0
    assert ops["rms_norm"] == 2 * layers + 1
    assert ops["attention"] == layers
    if family == "qwen3_moe":
        assert ops["moe"] == 1 and ops["swiglu"] == 1
    else:
        assert ops["swiglu"] == layers and ops["moe"] == 0


@pytest.mark.parametrize("bias", [False, True])
def test_bf16_mlp_runs_gate_and_up_as_one_kernel(ops, bias):
    """A bf16 model's SwiGLU MLP goes through swiglu_linear (gate and up projections and the
    activation in one kernel); projections with a bias keep the separate linears + swiglu."""
    model = build("llama", mlp_bias=bias).to(torch.bfloat16)
    reference = copy.deepcopy(model)
    hf.apply_tiletune(model)
    ids = torch.randint(0, 128, (2, 12))
    torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=0, rtol=0)
    assert (ops["swiglu_linear"], ops["swiglu"]) == ((0, 2) if bias else (2, 0))


def test_mlp_keeps_hooks_and_a_replaced_activation(ops, caplog, monkeypatch):
    """A forward hook on a projection (calibration, steering, offloading) still sees its call:
    that MLP runs the projections as modules, unfused; an act_fn set on the module (not the one
    transformers builds for hidden_act) runs transformers' MLP, with one warning."""
    monkeypatch.setattr(hf, "_logged", set())
    model = build("llama").to(torch.bfloat16)
    hf.apply_tiletune(model)
    reference = build("llama").to(torch.bfloat16)
    reference.load_state_dict(model.state_dict())
    calls = []
    for m in (model, reference):
        mlp0, mlp1 = m.model.layers[0].mlp, m.model.layers[1].mlp
        mlp0.up_proj.register_forward_hook(lambda mod, args, out: calls.append(1) or out * 0.5)
        mlp1.act_fn = torch.nn.GELU()
    ids = torch.randint(0, 128, (2, 12))
    with caplog.at_level(logging.WARNING, logger="tiletune"):
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=0, rtol=0)
    assert len(calls) == 2                                # once in each model
    assert (ops["swiglu_linear"], ops["swiglu"]) == (0, 1)
    assert sum("act_fn is a GELU" in r.getMessage() for r in caplog.records) == 1


class QuantizedWeight(torch.Tensor):
    """A weight held as int8 values and a scale that reports the scale's dtype, as torchao's
    weight-only quantization leaves it in an nn.Linear: its values exist only through its own
    dispatch (its memory is not a bf16 matrix that a kernel could read)."""

    @staticmethod
    def __new__(cls, qdata, scale):
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=scale.dtype,
                                                   device=qdata.device)

    def __init__(self, qdata, scale):
        self.qdata, self.scale = qdata, scale

    @classmethod
    def of(cls, w):
        scale = w.detach().abs().amax(-1, keepdim=True) / 127
        return torch.nn.Parameter(cls(torch.round(w.detach() / scale).to(torch.int8), scale),
                                  requires_grad=False)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.detach.default, torch.ops.aten.clone.default):
            return cls(args[0].qdata.clone(), args[0].scale.clone())
        values = [a.qdata.to(a.scale.dtype) * a.scale if isinstance(a, cls) else a for a in args]
        return func(*values, **(kwargs or {}))


def test_mlp_with_quantized_weights_calls_its_projections(ops, monkeypatch):
    """Projections whose weights are tensor subclasses (torchao's quantized weights keep
    nn.Linear and report bf16) run as modules: swiglu_linear would read the weights' memory,
    not their values. The logits equal transformers' on the same weights."""
    monkeypatch.setattr(hf, "_swiglu_linear", lambda *a: pytest.fail("a quantized weight "
                                                                       "reached the kernel"))
    model = build("llama").to(torch.bfloat16)
    for layer in model.model.layers:
        for proj in (layer.mlp.gate_proj, layer.mlp.up_proj, layer.mlp.down_proj):
            proj.weight = QuantizedWeight.of(proj.weight)
    reference = copy.deepcopy(model)
    hf.apply_tiletune(model)
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=0, rtol=0)
    assert ops["swiglu"] == 2


def test_experts_with_quantized_weights_keep_hf_experts(ops, caplog, monkeypatch):
    """Expert weights that are tensor subclasses (quantized or float8-training weights) run
    transformers' experts, with one warning: the grouped GEMM would read their memory."""
    monkeypatch.setattr(hf, "_moe_experts", lambda *a: pytest.fail("reached the kernel"))
    model = build("qwen3_moe").to(torch.bfloat16)
    experts = next(m for m in model.modules() if type(m).__name__.endswith("Experts"))
    experts.down_proj = QuantizedWeight.of(experts.down_proj)
    reference = copy.deepcopy(model)
    hf.apply_tiletune(model, rms_norm=False, rope=False, attention=False, mlp=False)
    ids = torch.randint(0, 128, (2, 12))
    with caplog.at_level(logging.WARNING, logger="tiletune"), torch.no_grad():
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=0, rtol=0)
    assert sum("tiletune experts: QuantizedWeight expert weights" in r.getMessage()
               for r in caplog.records) == 1


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_partial_rotary_tables_are_refused_as_transformers_fails_on_them(ops, family):
    """A scaled rope type with partial_rotary_factor 0.5 gives head_dim / 2 wide tables, which
    transformers' rotate-half code of these families cannot apply (it raises): the patched
    model raises a ValueError naming the width, instead of rotating half of each head."""
    rope = dict(rope_type="linear", factor=2.0, rope_theta=10000.0, partial_rotary_factor=0.5)
    model = build(family, rope_parameters=rope)
    ids = torch.randint(0, 128, (1, 8))
    with pytest.raises(RuntimeError):
        model(ids)
    hf.apply_tiletune(model)
    with pytest.raises(ValueError, match=r"tiletune attention: cos/sin have 8 columns, not "
                                         r"head_dim 16"):
        model(ids)
    q = torch.randn(1, 4, 8, 16)
    cos = torch.randn(1, 8, 8)
    with pytest.raises(ValueError, match=r"tiletune apply_rotary_pos_emb: cos/sin have 8"):
        hf.hf_apply_rotary_pos_emb(q, q, cos, cos)
    assert ops["rope"] == ops["rms_norm_rope"] == 0


def test_experts_with_a_replaced_activation_keep_hf_experts(ops, caplog, monkeypatch):
    """An experts module whose act_fn is not the one transformers builds for hidden_act runs
    transformers' experts, with one warning (the kernels compute SiLU)."""
    monkeypatch.setattr(hf, "_logged", set())
    model = build("qwen3_moe").to(torch.bfloat16)
    reference = copy.deepcopy(model)
    hf.apply_tiletune(model, rms_norm=False, rope=False, attention=False, mlp=False)
    for m in (model, reference):
        next(e for e in m.modules() if type(e).__name__.endswith("Experts")).act_fn = \
            torch.nn.GELU()
    ids = torch.randint(0, 128, (2, 12))
    with caplog.at_level(logging.WARNING, logger="tiletune"):
        torch.testing.assert_close(model(ids).logits, reference(ids).logits, atol=0, rtol=0)
    assert ops["moe"] == 0
    assert sum("tiletune experts: act_fn is a GELU" in r.getMessage()
               for r in caplog.records) == 1


def test_qwen3_unfused_when_only_rope(ops):
    model = build("qwen3")
    reference = copy.deepcopy(model)
    hf.apply_tiletune(model, rms_norm=False)
    assert_same_training_step(model, reference, torch.randint(0, 128, (2, 12)))
    assert ops["rope"] == 2 and ops["rms_norm_rope"] == 0 and ops["rms_norm"] == 0


def test_qwen3_qk_norm_with_a_hook_runs_unfused(ops):
    """A forward hook on a q_norm sees its call: that layer's norms run as modules (tiletune
    RMSNorm, then RoPE), the others fused; the step equals HF's with the same hook."""
    model = build("qwen3")
    reference = copy.deepcopy(model)
    hf.apply_tiletune(model)
    calls = []
    for m in (model, reference):
        m.model.layers[0].self_attn.q_norm.register_forward_hook(
            lambda mod, args, out: calls.append(1) or out * 0.5)
    assert_same_training_step(model, reference, torch.randint(0, 128, (2, 12)))
    layers = model.config.num_hidden_layers
    assert calls and ops["rms_norm_rope"] == layers - 1 and ops["rope"] == 1


@pytest.mark.parametrize("x_dtype,w_dtype", [
    (torch.bfloat16, torch.float32), (torch.float16, torch.bfloat16),
    (torch.float32, torch.bfloat16), (torch.bfloat16, torch.bfloat16)])
def test_patched_rms_norm_returns_transformers_dtype(ops, x_dtype, w_dtype):
    """transformers' RMSNorm returns `weight * normed.to(x.dtype)`: the promotion of the two
    dtypes (float32 for bf16 x and float32 weights); the patched one and tiletune's RMSNorm
    class return the same dtype and values within the rounding of x's dtype."""
    model = build("qwen3")
    reference = copy.deepcopy(model)
    hf.apply_tiletune(model)
    norm, ref_norm = model.model.norm.to(w_dtype), reference.model.norm.to(w_dtype)
    own = hf.RMSNorm(64, eps=ref_norm.variance_epsilon, dtype=w_dtype)
    own.weight.data.copy_(ref_norm.weight)
    x = torch.randn(3, 5, 64).to(x_dtype)
    expected = ref_norm(x)
    for module in (norm, own):
        y = module(x)
        assert y.dtype == expected.dtype == torch.promote_types(x_dtype, w_dtype)
        rounding = 2.0 ** -7 if torch.bfloat16 in (x_dtype, w_dtype) else 2.0 ** -10
        torch.testing.assert_close(y.float(), expected.float(), atol=4 * rounding,
                                   rtol=2 * rounding)
    assert ops["rms_norm"] == 2


def test_qwen3_under_autocast_keeps_transformers_dtypes(ops, monkeypatch):
    """A float32 Qwen3 under bf16 autocast: its q_norm and k_norm get the projections' bf16
    and float32 weights, so transformers' q and k (and the cached keys) are float32. The
    patched model runs them unfused (the fused kernel writes q's dtype) and caches float32
    keys too; its attention runs in bf16, as SDPA does under autocast (float32 q and k would
    leave the kernel, which takes bf16/fp16); the logits agree within bf16 rounding."""
    model = build("qwen3")
    reference = copy.deepcopy(model)
    hf.apply_tiletune(model)
    ids = torch.randint(0, 128, (2, 12))
    seen, attend = [], hf.scaled_dot_product_attention
    monkeypatch.setattr(hf, "scaled_dot_product_attention", lambda q, k, v, **kw: seen.append(
        (q.dtype, k.dtype, v.dtype)) or attend(q, k, v, **kw))
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out, ref = model(ids, use_cache=True), reference(ids, use_cache=True)
    layers = model.config.num_hidden_layers
    assert ops["rms_norm_rope"] == 0 and ops["rope"] == layers
    assert seen == [(torch.bfloat16,) * 3] * layers
    keys = [layer.keys for layer in out.past_key_values.layers]
    ref_keys = [layer.keys for layer in ref.past_key_values.layers]
    assert [k.dtype for k in keys] == [k.dtype for k in ref_keys] == [torch.float32] * layers
    torch.testing.assert_close(out.logits.float(), ref.logits.float(), atol=0.05, rtol=0.05)


@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "gelu"])
def test_geglu_mlp(ops, act):
    model = build("llama", hidden_act=act)
    reference = copy.deepcopy(model)
    hf.apply_tiletune(model)
    assert_same_training_step(model, reference, torch.randint(0, 128, (2, 12)))
    assert ops["geglu"] == 2 and ops["swiglu"] == 0


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_padded_batch_goes_to_sdpa_once_logged(family, ops, caplog):
    model = build(family)
    reference = copy.deepcopy(model)
    hf.apply_tiletune(model)
    ids = torch.randint(0, 128, (2, 12))
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :5] = 0                                             # left padding
    with caplog.at_level(logging.WARNING, logger="tiletune"):
        assert_same_training_step(model, reference, ids, attention_mask=mask)
    assert ops["attention"] == 0
    assert sum("attention mask" in r.getMessage() for r in caplog.records) == 1
    ops["attention"] = 0                          # an all-ones mask needs none: the kernel
    assert_same_training_step(model, reference, ids, attention_mask=torch.ones_like(mask))
    assert ops["attention"] == 2


def test_generation_with_cache_matches_hf(ops):
    """Prefill (causal) then one-token decode steps (full attention over the cache)."""
    model = build("qwen3").eval()
    reference = copy.deepcopy(model)
    hf.apply_tiletune(model)
    ids = torch.randint(0, 128, (1, 7))
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert torch.equal(out, reference.generate(ids, max_new_tokens=4, do_sample=False))
    assert ops["attention"] == 2 * 4


def test_continuous_batching_generation_matches_hf(ops):
    """transformers' continuous batching (`generate_batch`, what `transformers serve` runs)
    passes its paged cache, whose `update` takes the attention's kwargs: a patched model
    generates what the unpatched one does (and a cache of the older `update` signature is
    called without them)."""
    model = build("llama").eval()
    reference = copy.deepcopy(model)
    hf.apply_tiletune(model, attention=False)
    if not hasattr(model, "generate_batch"):
        pytest.skip("this transformers has no continuous batching")
    from transformers import GenerationConfig
    gc = GenerationConfig(max_new_tokens=3, do_sample=False, eos_token_id=-1, pad_token_id=0)
    prompts = [[1, 2, 3], [4, 5]]
    got = model.generate_batch(prompts, generation_config=gc, warmup=False)
    tokens = [o.generated_tokens for o in got.values()]
    expect = [reference.generate(torch.tensor([p]), max_new_tokens=3, do_sample=False,
                                 eos_token_id=-1, pad_token_id=0)[0, len(p):].tolist()
              for p in prompts]
    assert tokens == expect

    class OldCache:
        def update(self, key, value, layer_idx, cache_kwargs=None):
            return key, value
    assert not hf._update_takes_kwargs(OldCache())


def test_model_generate_steps_at_the_given_cache_lengths(ops, monkeypatch):
    """`tune --generate`'s runner: the prompt with a KV cache, then one-token steps whose
    attention sees exactly the asked cache lengths (the cache filled with random entries in
    between), every layer."""
    seen = []
    attention = hf.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((q.shape[0], q.shape[2], k.shape[2]))
        return attention(q, k, v, **kw)
    monkeypatch.setattr(hf, "scaled_dot_product_attention", spy)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    model = build("qwen3")
    hf.apply_tiletune(model)
    hf.model_generate(model, 2, 5, [6, 9, 17])
    layers = model.config.num_hidden_layers
    assert seen == [s for s in [(2, 5, 5), (2, 1, 6), (2, 1, 9), (2, 1, 17)] for _ in range(layers)]


# ---------------------------------------------------------------------------------------------
# Class level.

def spec_of(family):
    """What a full class-level patch replaces in the family's modeling module."""
    fam = hf.FAMILIES[family]
    kinds = ["RMSNorm", "MLP"] + (["Attention"] if fam.qk_norm else []) + \
        (["Experts"] if fam.experts else [])
    return [fam.prefix + k for k in kinds]


@pytest.mark.parametrize("family", FAMILY_NAMES)
@pytest.mark.parametrize("how", ["name", "config class", "model class"])
def test_class_patch_and_revert(family, how):
    mod, fam = module_of(family), hf.FAMILIES[family]
    originals = hf_classes(family)
    pretrained = getattr(mod, fam.prefix + "PreTrainedModel")
    target = {"name": family, "config class": type(config(family)),
              "model class": getattr(mod, fam.prefix + "ForCausalLM")}[how]

    assert hf.apply_tiletune(target) is None
    replaced = {n: getattr(mod, n) for n in spec_of(family)}
    for name, cls in replaced.items():
        assert cls is not originals[name] and cls._tiletune_original is originals[name]
    assert mod.apply_rotary_pos_emb is hf.hf_apply_rotary_pos_emb
    assert "get_correct_attn_implementation" in vars(pretrained)
    untouched = set(originals) - set(replaced) - {"apply_rotary_pos_emb"}
    assert all(getattr(mod, n) is originals[n] for n in untouched)

    model = transformers.AutoModelForCausalLM.from_config(config(family))
    assert model.config._attn_implementation == "tiletune"
    types = {type(m).__name__ for m in model.modules()}
    assert {f"Tiletune{n}" for n in spec_of(family)} <= types
    explicit = transformers.AutoModelForCausalLM.from_config(
        config(family), attn_implementation="eager")
    assert explicit.config._attn_implementation == "eager"

    hf.apply_tiletune(target)                                    # idempotent
    assert {n: getattr(mod, n) for n in spec_of(family)} == replaced

    hf.revert(family)
    assert hf_classes(family) == originals
    assert "get_correct_attn_implementation" not in vars(pretrained)
    fresh = transformers.AutoModelForCausalLM.from_config(config(family))
    assert fresh.config._attn_implementation == "sdpa"
    assert not any(type(m).__name__.startswith("Tiletune") for m in fresh.modules())
    hf.revert(model)                       # a model built while patched: back to HF classes
    assert not any(type(m).__name__.startswith("Tiletune") for m in model.modules())
    assert model.config._attn_implementation == "sdpa"           # and transformers' default


def test_class_patch_without_target_covers_every_family():
    originals = {f: hf_classes(f) for f in FAMILY_NAMES}
    hf.apply_tiletune()
    for f in FAMILY_NAMES:
        assert module_of(f).apply_rotary_pos_emb is hf.hf_apply_rotary_pos_emb
        assert all(getattr(module_of(f), n) is not originals[f][n] for n in spec_of(f))
    model = build("qwen2")
    hf.apply_tiletune(model)                         # instance patch on top: nothing to do
    hf.revert()
    for f in FAMILY_NAMES:
        assert hf_classes(f) == originals[f]
    assert not any(type(m).__name__.startswith("Tiletune") for m in model.modules())


def test_class_patch_flags():
    originals = hf_classes("qwen3")
    hf.apply_tiletune("qwen3", rms_norm=False, rope=False, attention=False, mlp=True)
    current = hf_classes("qwen3")
    assert current["Qwen3MLP"] is not originals["Qwen3MLP"]
    assert all(current[n] is originals[n] for n in current if n != "Qwen3MLP")
    assert "get_correct_attn_implementation" not in vars(module_of("qwen3").Qwen3PreTrainedModel)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_class_patched_model_matches_hf(family, ops):
    reference = build(family)
    hf.apply_tiletune(family)
    model = transformers.AutoModelForCausalLM.from_config(config(family))
    model.load_state_dict(reference.state_dict())
    assert_same_training_step(model, reference, torch.randint(0, 128, (2, 12)))
    assert ops["attention"] == 2
    # HF's rotary function is looked up at call time: the reference model uses ours too now
    assert ops["rope" if family == "llama" else "rms_norm_rope"] > 0


def test_hf_apply_rotary_pos_emb_layouts(ops):
    q, k = torch.randn(2, 4, 5, 8), torch.randn(2, 2, 5, 8)
    cos, sin = torch.randn(2, 5, 8), torch.randn(2, 5, 8)
    qo, ko = hf.hf_apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin,
                                        unsqueeze_dim=2)
    rq, rk = ref_rope(q, k, cos, sin)
    torch.testing.assert_close(qo, rq.transpose(1, 2))
    torch.testing.assert_close(ko, rk.transpose(1, 2))
    with pytest.raises(ValueError, match="unsqueeze_dim"):
        hf.hf_apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=3)


# ---------------------------------------------------------------------------------------------
# Errors, per-family entry points.

SUPPORTED = "llama, mistral, qwen2, qwen3, qwen3_moe"


def tiny_gpt2():
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32))


@pytest.mark.parametrize("target", ["gpt2", transformers.GPT2Config, "gpt2 model class",
                                    "gpt2 model"])
def test_unsupported_model_lists_families(target):
    if target == "gpt2 model class":
        target = transformers.GPT2LMHeadModel
    elif target == "gpt2 model":
        target = tiny_gpt2()
    with pytest.raises(ValueError, match=f"apply_tiletune: .*supported families: {SUPPORTED}"):
        hf.apply_tiletune(target)
    with pytest.raises(ValueError, match=f"revert: .*supported families: {SUPPORTED}"):
        hf.revert(target)


def test_bad_target_type_and_keywords():
    with pytest.raises(TypeError, match="apply_tiletune: expected a model"):
        hf.apply_tiletune(42)
    with pytest.raises(TypeError):
        hf.apply_tiletune(build("llama"), False)               # flags are keyword-only
    with pytest.raises(TypeError, match="apply_tiletune: attention must be True or False"):
        hf.apply_tiletune(build("llama"), attention="eager")


def test_family_entry_points():
    for family in FAMILY_NAMES:
        entry = getattr(hf, f"apply_tiletune_to_{family}")
        assert entry.__name__ == f"apply_tiletune_to_{family}"
    qwen2 = build("qwen2")
    with pytest.raises(ValueError,
                       match="apply_tiletune_to_llama: model is a qwen2 model, not a llama one"):
        hf.apply_tiletune_to_llama(model=qwen2)
    with pytest.raises(TypeError, match="apply_tiletune_to_llama: model must be"):
        hf.apply_tiletune_to_llama("llama")
    assert hf.apply_tiletune_to_qwen2(qwen2, attention=False) is qwen2
    assert type(qwen2.model.norm).__name__ == "TiletuneQwen2RMSNorm"
    assert qwen2.config._attn_implementation == "sdpa"
    hf.apply_tiletune_to_mistral(mlp=False)
    assert module_of("mistral").apply_rotary_pos_emb is hf.hf_apply_rotary_pos_emb
    assert module_of("mistral").MistralMLP is hf_classes("mistral")["MistralMLP"]
    assert module_of("llama").apply_rotary_pos_emb is not hf.hf_apply_rotary_pos_emb


# ---------------------------------------------------------------------------------------------
# Attention: registration and the routing rule.

def test_attention_registered_by_name():
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    hf.register_attention()
    assert ALL_ATTENTION_FUNCTIONS["tiletune"] is hf.attention_forward
    assert ALL_MASK_ATTENTION_FUNCTIONS["tiletune"] is hf.tiletune_mask
    model = transformers.AutoModelForCausalLM.from_config(
        config("llama"), attn_implementation="tiletune")
    assert model.config._attn_implementation == "tiletune"
    assert type(model.model.norm).__name__ == "LlamaRMSNorm"      # registration patches nothing


def test_attention_forward_on_cpu_is_sdpa(monkeypatch):
    """Unpatched ops, CPU float32: every call takes the SDPA fallback, results unchanged."""
    monkeypatch.setattr(hf, "_logged", set())
    model = build("mistral")
    reference = copy.deepcopy(model)
    hf.apply_tiletune(model, rms_norm=False, rope=False, mlp=False)
    assert model.config._attn_implementation == "tiletune"
    assert_same_training_step(model, reference, torch.randint(0, 128, (2, 12)))


def route(**kw):
    base = dict(q_length=512, kv_length=512, head_dim=128, dtype=torch.bfloat16, on_cuda=True,
                has_mask=False, is_causal=True, dropout=0.0)
    return hf.attention_route(**{**base, **kw})


def test_attention_route():
    assert route() == (True, True, 512, "")
    assert route(dtype=torch.float16, head_dim=256) == (True, True, 512, "")
    assert route(q_length=1, kv_length=600) == (True, False, 600, "")      # decode
    assert route(is_causal=False) == (True, False, 512, "")                # bidirectional
    assert route(q_length=100, kv_length=4096) == (True, True, 100, "")    # empty static cache
    for kw, reason in ((dict(has_mask=True), "attention mask"), (dict(dropout=0.1), "dropout"),
                       (dict(on_cuda=False), "CUDA"), (dict(dtype=torch.float32), "float32"),
                       (dict(head_dim=288), "head_dim"), (dict(has_position_bias=True), "bias"),
                       (dict(v_head_dim=64), "value head_dim"),     # latent attention (MLA)
                       (dict(same_dtype=False), "different dtypes"),
                       (dict(rows=4097 * 16), "grid"),
                       (dict(q_length=1, kv_length=hf.MAX_SEQ + 1), "tokens"),   # long cache
                       (dict(q_length=hf.MAX_SEQ + 1, kv_length=hf.MAX_SEQ + 1), "tokens")):
        r = route(**kw)
        assert not r.use_kernel and reason in r.reason, (kw, r)
    assert not route(has_mask=True, on_cuda=False).use_kernel
    assert route(rows=65535).use_kernel                      # the kernels' grid holds it
    assert route(v_head_dim=128).use_kernel
    assert route(q_length=1, kv_length=hf.MAX_SEQ).use_kernel


def test_sequences_past_the_kernels_grid_go_to_sdpa(monkeypatch):
    """The kernels refuse more than MAX_SEQ query or key tokens (ValueError), which a long
    context's KV cache can reach in decoding: such a call runs transformers' SDPA (the limit
    lowered here to 8 tokens). A packed batch is limited by its longest sequence, not by its
    row: 10 tokens in sequences of 4 and 6 still run fmha_varlen."""
    monkeypatch.setattr(hf, "_logged", set())
    monkeypatch.setattr(hf, "MAX_SEQ", 8)
    monkeypatch.setattr(hf, "scaled_dot_product_attention",
                        lambda *a, **kw: pytest.fail("more tokens than the grid reached FMHA"))
    ran = []
    monkeypatch.setattr(hf, "fmha_varlen", lambda q, *a, **kw: ran.append(1) or torch.zeros_like(q))
    route_on_cpu = hf.attention_route
    monkeypatch.setattr(hf, "attention_route", lambda **kw: route_on_cpu(**{**kw, "on_cuda": True}))
    module = SimpleNamespace(is_causal=True, num_key_value_groups=2, training=False)
    q = torch.randn(1, 4, 1, 16, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2, 10, 16, dtype=torch.bfloat16) for _ in range(2))
    out, _ = hf.attention_forward(module, q, k, v, None, scaling=0.25)       # a decoding step
    expect = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(2, 1),
                                            v.float().repeat_interleave(2, 1), scale=0.25)
    torch.testing.assert_close(out.float(), expect.transpose(1, 2), atol=2e-2, rtol=2e-2)
    q = torch.randn(1, 4, 10, 16, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4, 10])
    hf.attention_forward(module, q, k, v, torch.ones(1, 1, 10, 10, dtype=torch.bool).tril(),
                         scaling=0.25, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6,
                         max_length_k=6)
    assert ran == [1]


def test_packed_batch_runs_fmha_varlen(monkeypatch):
    """One row of concatenated sequences with flash attention's length kwargs: fmha_varlen on
    (tokens, H, D) views with int32 offsets, whatever mask transformers built; anything else
    (no lengths, two rows) is no packed batch."""
    calls = []

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        calls.append((q.shape, k.shape, v.shape, cu_q.dtype, cu_k.dtype, max_q, max_k, causal,
                      scale))
        return torch.zeros_like(q)
    monkeypatch.setattr(hf, "fmha_varlen", varlen)
    route_on_cpu = hf.attention_route
    monkeypatch.setattr(hf, "attention_route", lambda **kw: route_on_cpu(**{**kw, "on_cuda": True}))
    q = torch.randn(1, 8, 10, 64, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 10, 64, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4, 10])
    lengths = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6, max_length_k=6)
    mask = torch.ones(1, 1, 10, 10, dtype=torch.bool)
    out, weights = hf.attention_forward(SimpleNamespace(is_causal=True), q, k, k, mask,
                                        scaling=0.125, **lengths)
    assert out.shape == (1, 10, 8, 64) and weights is None
    assert calls == [((10, 8, 64), (10, 2, 64), (10, 2, 64), torch.int32, torch.int32, 6, 6, True,
                      0.125)]
    assert hf.packed_lengths(lengths, 1) == (cu, cu, 6, 6)
    assert hf.packed_lengths(lengths, 2) is None
    assert hf.packed_lengths({**lengths, "max_length_k": None}, 1) is None


def test_packed_batch_with_a_shorter_sliding_window_takes_the_mask(monkeypatch):
    """A sliding window shorter than the longest packed sequence reaches inside it: plain
    causal varlen attention would be wrong there, so the mask transformers built (packed and
    windowed) goes to SDPA. A window that no sequence reaches past keeps fmha_varlen."""
    monkeypatch.setattr(hf, "_logged", set())
    monkeypatch.setattr(hf, "fmha_varlen", lambda *a, **kw: pytest.fail("varlen ran"))
    route_on_cpu = hf.attention_route
    monkeypatch.setattr(hf, "attention_route", lambda **kw: route_on_cpu(**{**kw, "on_cuda": True}))
    q = torch.randn(1, 4, 10, 16, dtype=torch.bfloat16)
    k, v = torch.randn(1, 2, 10, 16, dtype=torch.bfloat16), torch.randn(1, 2, 10, 16,
                                                                         dtype=torch.bfloat16)
    cu = torch.tensor([0, 4, 10])
    lengths = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6, max_length_k=6)
    pos = torch.tensor([0, 1, 2, 3, 0, 1, 2, 3, 4, 5])
    seq = torch.tensor([0] * 4 + [1] * 6)
    window = 3
    allowed = (seq[:, None] == seq[None]) & (pos[None] <= pos[:, None]) & \
        (pos[:, None] - pos[None] < window)
    module = SimpleNamespace(is_causal=True, num_key_value_groups=2, training=False)
    out, _ = hf.attention_forward(module, q, k, v, allowed[None, None], scaling=0.25,
                                  sliding_window=window, **lengths)
    expect = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(2, 1),
                                            v.float().repeat_interleave(2, 1),
                                            attn_mask=allowed, scale=0.25)
    torch.testing.assert_close(out.float(), expect.transpose(1, 2), atol=2e-2, rtol=2e-2)
    ran = []
    monkeypatch.setattr(hf, "fmha_varlen", lambda q, *a, **kw: ran.append(1) or torch.zeros_like(q))
    hf.attention_forward(module, q, k, v, allowed[None, None], scaling=0.25, sliding_window=6,
                         **lengths)
    assert ran == [1]


@pytest.mark.parametrize("term,value,what", [
    ("s_aux", torch.zeros(4), "attention sinks"),           # GPT-OSS
    ("sinks", torch.zeros(4), "attention sinks"),
    ("softcap", 50.0, "logit softcapping"),                 # Gemma 2
])
def test_score_terms_the_kernels_lack_are_refused(term, value, what):
    """Terms transformers passes that neither the kernel nor SDPA computes raise instead of
    being dropped (Gemma 2's softcap changed its logits by 4e-3 when dropped); None passes."""
    q = torch.randn(1, 4, 8, 16, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 8, 16, dtype=torch.bfloat16)
    module = SimpleNamespace(is_causal=True, num_key_value_groups=2, training=False)
    with pytest.raises(ValueError, match=rf"tiletune attention: {what} \({term}\)"):
        hf.attention_forward(module, q, k, k, None, **{term: value})
    out, _ = hf.attention_forward(module, q, k, k, None, scaling=0.25, **{term: None})
    assert out.shape == (1, 8, 4, 16)


@pytest.mark.parametrize("module,plain", [
    (SimpleNamespace(), True),                                    # Llama: no local attention
    (SimpleNamespace(sliding_window=3), False),                   # Qwen2-MoE's sliding layers
    (SimpleNamespace(sliding_window=None, config=SimpleNamespace(sliding_window=4)), False),
    (SimpleNamespace(config=SimpleNamespace(sliding_window=4, use_sliding_window=False)), True),
    (SimpleNamespace(config=SimpleNamespace(sliding_window=64)), True),    # PhiMoE, long window
    (SimpleNamespace(config=SimpleNamespace(attention_chunk_size=8192)), False),   # Llama 4
])
def test_packed_batch_of_a_family_that_passes_no_window_keeps_its_mask(monkeypatch, module,
                                                                         plain):
    """Families that put their sliding window or chunked attention in the mask alone (no
    `sliding_window` kwarg: Qwen2-MoE, PhiMoE, Llama 4): a packed batch runs fmha_varlen only
    where no window reaches inside its longest sequence (6 tokens), else the mask goes to SDPA
    (plain causal varlen attention gave logits 0.19-0.57 off)."""
    monkeypatch.setattr(hf, "_logged", set())
    ran = []
    monkeypatch.setattr(hf, "fmha_varlen", lambda q, *a, **kw: ran.append(1) or torch.zeros_like(q))
    route_on_cpu = hf.attention_route
    monkeypatch.setattr(hf, "attention_route", lambda **kw: route_on_cpu(**{**kw, "on_cuda": True}))
    for name, v in dict(is_causal=True, num_key_value_groups=2, training=False).items():
        setattr(module, name, v)
    q = torch.randn(1, 4, 10, 16, dtype=torch.bfloat16)
    k = torch.randn(1, 2, 10, 16, dtype=torch.bfloat16)
    cu = torch.tensor([0, 4, 10])
    lengths = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=6, max_length_k=6)
    mask = torch.ones(1, 1, 10, 10, dtype=torch.bool).tril()
    hf.attention_forward(module, q, k, k, mask, scaling=0.25, **lengths)
    assert ran == ([1] if plain else [])


def test_tiletune_mask():
    from transformers.masking_utils import (causal_mask_function, sdpa_mask,
                                            sliding_window_causal_mask_function)

    def both(**kw):
        kw = {"batch_size": 2, "mask_function": causal_mask_function, **kw}
        return hf.tiletune_mask(**kw), sdpa_mask(**kw)

    for kw in (dict(q_length=8, kv_length=8), dict(q_length=1, kv_length=9, q_offset=8),
               dict(q_length=8, kv_length=32),                           # empty static cache
               dict(q_length=8, kv_length=8, local_size=16,
                    mask_function=sliding_window_causal_mask_function(16)),
               dict(q_length=8, kv_length=8, attention_mask=torch.ones(2, 8, dtype=torch.bool))):
        ours, sdpa = both(**kw)
        assert ours is None and sdpa is None, kw
    padding = torch.ones(2, 8, dtype=torch.bool)
    padding[0, :3] = False
    for kw in (dict(q_length=8, kv_length=8, attention_mask=padding),
               dict(q_length=4, kv_length=12, q_offset=8),                # chunked prefill
               dict(q_length=8, kv_length=8, allow_is_causal_skip=False),
               dict(q_length=8, kv_length=8, local_size=4,
                    mask_function=sliding_window_causal_mask_function(4))):
        ours, sdpa = both(**kw)
        assert torch.equal(ours, sdpa), kw


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_compile_traces_kernels_without_graph_breaks(family, ops):
    """torch.compile (dynamo) traces the patched forwards with no graph break and no warning
    about our code, and the kernel attention serves a forward with a cache (transformers'
    default); without one (use_cache=False) transformers' packed-sequence check needs the data,
    so a mask is built: SDPA."""
    import warnings
    model = build(family)
    hf.apply_tiletune(model)
    ids = torch.randint(0, 128, (2, 12))
    torch._dynamo.reset()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            explained = torch._dynamo.explain(model)(input_ids=ids, labels=ids)
        assert explained.graph_break_count == 0, [r.reason for r in explained.break_reasons]
        ours = [str(w.message) for w in caught if "suites" in str(w.message)
                or "tiletune" in str(w.message) or "/ops/" in str(w.message)]
        assert not ours, ours
        assert ops["attention"] == 2
        ops["attention"] = 0
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(input_ids=ids, labels=ids, use_cache=False)
        assert explained.graph_break_count == 0 and ops["attention"] == 0
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("family", ["llama", "qwen3_moe"])
def test_a_patched_model_pickles_whole(family, tmp_path):
    """torch.save of the whole patched model (and any pickling: spawned processes) finds the
    tiletune subclasses by name, in this process and in a fresh one that has patched nothing:
    there the modules come back patched, the "tiletune" attention registered, and revert gives
    back transformers' model with the same weights."""
    import subprocess
    import sys
    model = build(family)
    ids = torch.randint(0, 128, (2, 12))
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    hf.apply_tiletune(model)
    path = tmp_path / "model.pt"
    torch.save(model, path)
    again = torch.load(path, weights_only=False)
    assert [type(m) for m in again.modules()] == [type(m) for m in model.modules()]
    torch.save(ids, tmp_path / "ids.pt")
    torch.save(expected, tmp_path / "expected.pt")
    child = f"""
import torch
model = torch.load({str(path)!r}, weights_only=False)
patched = sorted({{type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Tiletune")}})
from transformers import AttentionInterface
from tiletune.suites import hf
assert "tiletune" in AttentionInterface._global_mapping and model.config._attn_implementation == "tiletune"
hf.revert(model)
with torch.no_grad():
    logits = model(input_ids=torch.load({str(tmp_path / 'ids.pt')!r})).logits
print("PATCHED", patched, "EQUAL", torch.equal(logits, torch.load({str(tmp_path / 'expected.pt')!r})))
"""
    out = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "EQUAL True" in out.stdout and "Tiletune" in out.stdout, out.stdout
