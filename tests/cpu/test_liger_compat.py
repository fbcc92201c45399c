"""tiletune.suites.liger on CPU: Liger-Kernel 0.8.5's signatures, the options that raise, and what
each name computes (torch references stand in for the GPU kernels)."""
import inspect

import pytest
import torch
import torch.nn.functional as F

from tiletune.suites import hf, liger


def params(fn):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values()]


E = inspect.Parameter.empty

# Liger-Kernel 0.8.5's parameter names, order and defaults (cross-entropy defaults differ: see
# the module docstring).
SIGNATURES = {
    liger.liger_rms_norm: [("X", E), ("W", E), ("eps", E), ("offset", 0.0),
                           ("casting_mode", "llama"), ("in_place", True)],
    liger.LigerRMSNormFunction.apply: [("X", E), ("W", E), ("eps", E), ("offset", 0.0),
                                       ("casting_mode", "llama"), ("in_place", True),
                                       ("row_mode", None)],
    liger.LigerRMSNorm.__init__: [("self", E), ("hidden_size", E), ("eps", 1e-6),
                                  ("offset", 0.0), ("casting_mode", "llama"),
                                  ("init_fn", "ones"), ("in_place", True), ("row_mode", None),
                                  ("elementwise_affine", True)],
    liger.liger_rotary_pos_emb: [("q", E), ("k", E), ("cos", E), ("sin", E),
                                 ("position_ids", None), ("unsqueeze_dim", 1),
                                 ("rotary_dim", None)],
    liger.LigerRopeFunction.apply: [("q", E), ("k", E), ("cos", E), ("sin", E),
                                    ("position_ids", None), ("unsqueeze_dim", 1),
                                    ("rotary_dim", None)],
    liger.liger_swiglu: [("a", E), ("b", E)],
    liger.LigerSiLUMulFunction.apply: [("a", E), ("b", E), ("gate_multiplier", 1.0),
                                       ("down_multiplier", 1.0)],
    liger.liger_geglu: [("a", E), ("b", E)],
    liger.LigerGELUMulFunction.apply: [("a", E), ("b", E)],
    liger.LigerSwiGLUMLP.__init__: [("self", E), ("config", E), ("intermediate_size", None)],
    liger.LigerGEGLUMLP.__init__: [("self", E), ("config", E)],
}
PATCH_SIGNATURE = [("rope", True), ("cross_entropy", False),
                   ("fused_linear_cross_entropy", False), ("rms_norm", True), ("swiglu", True),
                   ("model", None)]


def test_signatures():
    for fn, expected in SIGNATURES.items():
        assert params(fn) == expected, fn
    assert liger.liger_rope is liger.liger_rotary_pos_emb
    for family, fn in liger.MODEL_TYPE_TO_APPLY_LIGER_FN.items():
        assert fn is getattr(liger, f"apply_liger_kernel_to_{family}")
        assert params(fn) == PATCH_SIGNATURE


@pytest.fixture
def refs(monkeypatch):
    """Torch references for the ops liger.py calls (its RoPE through hf.py's); returns the
    kwargs apply_rope got."""
    seen = {}

    def rms(x, w, eps):
        x32 = x.float()
        return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps) * w).to(x.dtype)

    def rope(q, k, cos, sin, *, rotary_dim, compute_dtype):
        assert compute_dtype == torch.promote_types(q.dtype, cos.dtype)   # as HF computes
        seen.update(cos=cos, rotary_dim=rotary_dim)
        return rope_reference(q, cos, sin, rotary_dim), rope_reference(k, cos, sin, rotary_dim)

    monkeypatch.setattr(liger, "rms_norm", rms)
    monkeypatch.setattr(hf, "apply_rope", rope)      # liger's RoPE runs through hf's
    monkeypatch.setattr(liger, "_swiglu", lambda g, u: F.silu(g) * u)
    monkeypatch.setattr(liger, "_geglu_tanh", lambda g, u: F.gelu(g, approximate="tanh") * u)
    return seen


def rope_reference(x, cos, sin, rot):
    """Rotate-half RoPE of the first rot dims of x (B, H, S, D); cos/sin (S, R) or (B|1, S, R)."""
    cos, sin = cos[..., :rot], sin[..., :rot]
    cos, sin = (cos[None, None], sin[None, None]) if cos.dim() == 2 else (cos[:, None],
                                                                            sin[:, None])
    xr, rest = x[..., :rot], x[..., rot:]
    half = rot // 2
    rotated = torch.cat((-xr[..., half:], xr[..., :half]), -1)
    return torch.cat((xr * cos + rotated * sin, rest), -1)


def test_rms_norm_options():
    x, w = torch.randn(3, 8), torch.ones(8)
    for kw, name in ((dict(offset=float("nan")), "offset"), (dict(offset="1"), "offset"),
                     (dict(casting_mode="none"), "casting_mode"), (dict(casting_mode=-1),
                                                                    "casting_mode")):
        with pytest.raises(ValueError, match=f"liger_rms_norm: {name}="):
            liger.liger_rms_norm(x, w, 1e-6, **kw)
        with pytest.raises(ValueError, match=f"LigerRMSNorm: {name}="):
            liger.LigerRMSNorm(8, **kw)
        with pytest.raises(ValueError, match=f"LigerRMSNormFunction: {name}="):
            liger.LigerRMSNormFunction.apply(x, w, 1e-6, **kw)
    with pytest.raises(ValueError, match="init_fn"):
        liger.LigerRMSNorm(8, init_fn="normal")


def test_rms_norm_values(refs):
    x, w = torch.randn(2, 3, 8), torch.randn(8)
    expected = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * w
    for in_place in (True, False):
        torch.testing.assert_close(liger.liger_rms_norm(X=x, W=w, eps=1e-5, offset=0.0,
                                                        casting_mode="llama",
                                                        in_place=in_place), expected)
    torch.testing.assert_close(liger.LigerRMSNormFunction.apply(x, w, 1e-5, 0.0, 0), expected)
    plain = liger.LigerRMSNorm(8, eps=1e-5, elementwise_affine=False)
    assert plain.weight is None and plain.variance_epsilon == 1e-5
    torch.testing.assert_close(plain(x), expected / w)
    zeros = liger.LigerRMSNorm(8, init_fn="zeros")
    assert list(zeros.state_dict()) == ["weight"] and not zeros.weight.any()
    assert zeros.to(torch.float64).weight.dtype == torch.float64


def test_rms_norm_gemma_offset_and_casting(refs):
    """Gemma's (offset + weight) in float32 and casting_mode "gemma", by argument and, on the
    module, set after construction (as Liger's model patches set them): read on every call."""
    x, w = torch.randn(2, 3, 8, dtype=torch.bfloat16), torch.randn(8, dtype=torch.bfloat16)
    x32 = x.float()
    gemma = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + w.float())
             ).to(torch.bfloat16)
    for mode in ("gemma", 1):
        assert torch.equal(liger.liger_rms_norm(x, w, 1e-6, offset=1.0, casting_mode=mode),
                           gemma)
        assert torch.equal(liger.LigerRMSNormFunction.apply(x, w, 1e-6, 1.0, mode), gemma)
    norm = liger.LigerRMSNorm(8, eps=1e-6).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(w)
    norm.offset, norm.casting_mode = 1.0, "gemma"
    assert torch.equal(norm(x), gemma) and "offset=1.0" in repr(norm)
    norm.casting_mode = "none"
    with pytest.raises(ValueError, match="LigerRMSNorm: casting_mode='none'"):
        norm(x)
    wg = w.clone().requires_grad_()
    (gw,) = torch.autograd.grad(liger.liger_rms_norm(x, wg, 1e-6, offset=1.0).float().sum(), wg)
    assert gw.dtype == torch.bfloat16
    # no weight: Liger multiplies by nothing, offset or not
    plain = (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert torch.equal(liger.liger_rms_norm(x, None, 1e-6, offset=1.0), plain)
    unweighted = liger.LigerRMSNorm(8, eps=1e-6, offset=1.0, elementwise_affine=False)
    assert torch.equal(unweighted(x), plain)


def test_rms_norm_input_errors_name_the_entry_point():
    """Without a weight, and with an offset added to it, the input is checked before it is
    used: a TypeError or ValueError naming the Liger entry point and its argument."""
    with pytest.raises(ValueError, match="liger_rms_norm: X must have a last dimension"):
        liger.liger_rms_norm(torch.tensor(1.0), None, 1e-6)
    with pytest.raises(ValueError, match="LigerRMSNormFunction: X must have a last dimension"):
        liger.LigerRMSNormFunction.apply(torch.tensor(1.0), None, 1e-6)
    with pytest.raises(ValueError, match="LigerRMSNorm: hidden_states must have a last dim"):
        liger.LigerRMSNorm(8, elementwise_affine=False)(torch.tensor(1.0))
    with pytest.raises(TypeError, match="liger_rms_norm: X must be a torch.Tensor, got list"):
        liger.liger_rms_norm([1.0, 2.0], None, 1e-6)
    with pytest.raises(TypeError, match="LigerRMSNormFunction: W must be a torch.Tensor, got "
                                        "list"):
        liger.LigerRMSNormFunction.apply(torch.randn(2, 2), [1.0, 1.0], 1e-6, 1.0, "gemma")


@pytest.mark.parametrize("cos_shape", ["(S, D)", "(1, S, D)", "(B, S, D)", "(B, 1, S, D)"])
def test_rope_cos_layouts(refs, cos_shape):
    B, S, D = 2, 5, 8
    q, k = torch.randn(B, 4, S, D), torch.randn(B, 2, S, D)
    cos3, sin3 = torch.randn(B, S, D), torch.randn(B, S, D)
    cos, sin = {"(S, D)": (cos3[0], sin3[0]), "(1, S, D)": (cos3[:1], sin3[:1]),
                "(B, S, D)": (cos3, sin3), "(B, 1, S, D)": (cos3[:, None], sin3[:, None])}[
        cos_shape]
    ref_cos, ref_sin = (cos3[:1], sin3[:1]) if cos_shape in ("(S, D)", "(1, S, D)") else (cos3,
                                                                                          sin3)
    qo, ko = liger.liger_rotary_pos_emb(q=q, k=k, cos=cos, sin=sin,
                                        position_ids=torch.arange(S)[None])
    torch.testing.assert_close(qo, rope_reference(q, ref_cos, ref_sin, D))
    torch.testing.assert_close(ko, rope_reference(k, ref_cos, ref_sin, D))
    assert refs["rotary_dim"] == D


def test_rope_rotary_dim_and_half_width_cos(refs):
    """Liger-Kernel 0.8.5's reading: R = rotary_dim, else min(cos width, D); the first R / 2
    columns of cos/sin are both halves' angles (a table R wide is used as it is)."""
    B, S, D, R = 1, 4, 16, 8
    q, k = torch.randn(B, 2, S, D), torch.randn(B, 1, S, D)
    freqs = torch.randn(S, R // 2)
    cos_half, sin_half = freqs.cos()[None], freqs.sin()[None]             # (1, S, R/2)
    cos_full, sin_full = torch.cat((cos_half,) * 2, -1), torch.cat((sin_half,) * 2, -1)
    qo, ko = liger.LigerRopeFunction.apply(q, k, cos_half, sin_half, None, 1, R)
    torch.testing.assert_close(qo, rope_reference(q, cos_full, sin_full, R))
    torch.testing.assert_close(refs["cos"], cos_full)
    qo, _ = liger.liger_rope(q, k, cos_full, sin_full, rotary_dim=R)
    torch.testing.assert_close(qo, rope_reference(q, cos_full, sin_full, R))
    # wider than R (here 6 columns for R 8, and a whole-head table): the first R / 2 columns
    for wide in (torch.cat((cos_half, torch.randn(1, S, 2)), -1),
                 torch.cat((cos_half, torch.randn(1, S, D - R // 2)), -1)):
        qo, _ = liger.liger_rotary_pos_emb(q, k, wide, wide.clone(), rotary_dim=R)
        torch.testing.assert_close(qo, rope_reference(q, cos_full, cos_full, R))
    with pytest.raises(ValueError, match="at least rotary_dim / 2 = 4 columns, got 2"):
        liger.liger_rotary_pos_emb(q, k, cos_half[..., :2], sin_half[..., :2], rotary_dim=R)
    for bad, error in ((7, ValueError), (18, ValueError), (8.0, TypeError)):
        with pytest.raises(error, match="liger_rotary_pos_emb: rotary_dim must be"):
            liger.liger_rotary_pos_emb(q, k, cos_full, sin_full, rotary_dim=bad)
    # without rotary_dim, a table D / 2 wide (partial_rotary_factor 0.5) rotates D / 2 dims
    # from its duplicated halves, as transformers and Liger do
    qo, _ = liger.liger_rotary_pos_emb(q, k, cos_full, sin_full)
    torch.testing.assert_close(qo, rope_reference(q, cos_full, sin_full, R))
    assert refs["rotary_dim"] == R
    with pytest.raises(ValueError, match="unsqueeze_dim=2"):
        liger.liger_rotary_pos_emb(q, k, torch.randn(1, 2, 4, 16), torch.randn(1, 2, 4, 16),
                                   unsqueeze_dim=2)


def test_rope_rotary_dim_of_numpy(refs):
    """rotary_dim as numpy's integer (a config read through numpy), as Liger takes it."""
    np = pytest.importorskip("numpy")
    q, k = torch.randn(1, 2, 4, 16), torch.randn(1, 1, 4, 16)
    cos, sin = torch.randn(1, 4, 8), torch.randn(1, 4, 8)
    qo, ko = liger.liger_rotary_pos_emb(q, k, cos, sin, rotary_dim=np.int64(8))
    assert type(refs["rotary_dim"]) is int and refs["rotary_dim"] == 8
    torch.testing.assert_close(qo, rope_reference(q, cos, sin, 8))
    torch.testing.assert_close(ko, rope_reference(k, cos, sin, 8))
    with pytest.raises(ValueError, match="liger_rotary_pos_emb: rotary_dim must be even"):
        liger.liger_rotary_pos_emb(q, k, cos, sin, rotary_dim=np.int64(7))


def test_rope_unsqueeze_dim(refs):
    """unsqueeze_dim=2: q and k (B, S, H, D), as transformers means it (Hq == Hkv, where the
    shapes alone cannot tell); cos (B, S, D) or (B, S, 1, D). Other values are refused."""
    B, S, H, D = 2, 5, 3, 8
    q, k = torch.randn(B, S, H, D), torch.randn(B, S, H, D)
    cos, sin = torch.randn(B, S, D), torch.randn(B, S, D)
    for c, s_ in ((cos, sin), (cos[:, :, None], sin[:, :, None])):
        qo, ko = liger.liger_rotary_pos_emb(q, k, c, s_, unsqueeze_dim=2)
        assert qo.shape == q.shape and ko.shape == k.shape
        torch.testing.assert_close(qo.transpose(1, 2), rope_reference(q.transpose(1, 2), cos,
                                                                      sin, D))
        torch.testing.assert_close(ko.transpose(1, 2), rope_reference(k.transpose(1, 2), cos,
                                                                      sin, D))
    for bad in (0, 3, 7, True):
        with pytest.raises(ValueError, match="liger_rotary_pos_emb: unsqueeze_dim must be"):
            liger.liger_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=bad)


def test_glu_functions(refs):
    a, b = torch.randn(3, 8), torch.randn(3, 8)
    torch.testing.assert_close(liger.liger_swiglu(a=a, b=b), F.silu(a) * b)
    torch.testing.assert_close(liger.LigerSiLUMulFunction.apply(a, b, 0.5, 3.0),
                               F.silu(0.5 * a) * b * 3.0)
    gelu = F.gelu(a, approximate="tanh") * b
    torch.testing.assert_close(liger.liger_geglu(a, b), gelu)
    torch.testing.assert_close(liger.LigerGELUMulFunction.apply(a, b), gelu)


def test_mlp_modules(refs):
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaMLP
    config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32,
                                       num_attention_heads=4)
    x = torch.randn(2, 3, 16)
    hf_mlp, ours = LlamaMLP(config), liger.LigerSwiGLUMLP(config)
    assert ours.load_state_dict(hf_mlp.state_dict()) is not None
    torch.testing.assert_close(ours(x), hf_mlp(x))
    assert liger.LigerSwiGLUMLP(config, intermediate_size=8).up_proj.out_features == 8
    with pytest.raises(ValueError, match="LigerSwiGLUMLP: config.hidden_act='relu'"):
        liger.LigerSwiGLUMLP(transformers.LlamaConfig(hidden_act="relu"))

    gelu_config = transformers.LlamaConfig(hidden_size=16, intermediate_size=32,
                                           num_attention_heads=4, hidden_act="gelu_pytorch_tanh")
    hf_mlp, ours = LlamaMLP(gelu_config), liger.LigerGEGLUMLP(gelu_config)
    ours.load_state_dict(hf_mlp.state_dict())
    torch.testing.assert_close(ours(x), hf_mlp(x))
    with pytest.raises(ValueError, match="LigerGEGLUMLP: activation 'gelu'"):
        liger.LigerGEGLUMLP(transformers.LlamaConfig(hidden_act="gelu"))


def test_model_patching():
    transformers = pytest.importorskip("transformers")
    from tiletune.suites import hf
    config = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2,
                                      vocab_size=128)
    hf.revert()
    try:
        model = transformers.AutoModelForCausalLM.from_config(config)
        assert liger.apply_liger_kernel_to_qwen2(model=model) is None
        names = {type(m).__name__ for m in model.modules()}
        assert {"TiletuneQwen2RMSNorm", "TiletuneQwen2MLP", "TiletuneQwen2Attention"} <= names
        assert model.config._attn_implementation == "sdpa"          # attention untouched
        assert hf.FAMILIES["qwen2"].module().Qwen2RMSNorm.__name__ == "Qwen2RMSNorm"  # (model only)
        hf.revert(model)
        liger._apply_liger_kernel_to_instance(model, rope=False, swiglu=False,
                                              layer_norm=True)          # unknown: dropped
        names = {type(m).__name__ for m in model.modules()}
        assert "TiletuneQwen2RMSNorm" in names and "Qwen2MLP" in names
        assert "Qwen2Attention" in names
        with pytest.raises(ValueError, match="apply_liger_kernel_to_llama: model is a qwen2 model"):
            liger.apply_liger_kernel_to_llama(model=model)
        for flag in ("cross_entropy", "fused_linear_cross_entropy"):
            with pytest.raises(ValueError, match=f"apply_liger_kernel_to_qwen2: {flag}=True"):
                liger.apply_liger_kernel_to_qwen2(**{flag: True})
        gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32))
        with pytest.warns(UserWarning, match="model type 'gpt2' has no tiletune kernels .* "
                                             "left unpatched"):
            assert liger._apply_liger_kernel_to_instance(gpt2) is None
        assert not any(type(m).__name__.startswith("Tiletune") for m in gpt2.modules())

        liger.apply_liger_kernel_to_mistral(rms_norm=False)
        modeling = hf.FAMILIES["mistral"].module()
        assert modeling.apply_rotary_pos_emb is hf.hf_apply_rotary_pos_emb
        assert modeling.MistralMLP.__name__ == "TiletuneMistralMLP"
        assert modeling.MistralRMSNorm.__name__ == "MistralRMSNorm"
        assert "get_correct_attn_implementation" not in vars(modeling.MistralPreTrainedModel)
    finally:
        hf.revert()
