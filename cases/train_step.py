"""Whole training steps of transformers models (forward, backward, AdamW step) patched with
`tiletune.suites.hf.apply_tiletune`, against the same model unpatched (SDPA attention; for
Qwen3-MoE transformers' default torch._grouped_mm experts and its per-expert loop), Liger-patched
and TileGym-patched. `--full` only: each row builds several models of about a billion
parameters and takes minutes. No compile cases (the ops' own modules have them).

Rows and what each peer patches (tiletune_sdpa: our patch with transformers' SDPA attention, the
same model as `tuned`, to show the attention's share):
- dense: a Llama (hidden 2048, 16 layers, 16 / 8 heads of 128, MLP 8192, vocab 32000), batch 2
  x 4096 tokens, bf16. liger: RMSNorm, RoPE and SwiGLU, as ours (no fused cross-entropy, which
  tiletune does not have); liger_flce: Liger's defaults (its fused linear cross-entropy too).
  tilegym: its cuTile RMSNorm, RoPE and SwiGLU; its attention has no backward, so SDPA stays.
- moe: a Qwen3-MoE (hidden 2048, 4 layers, 32 / 4 heads of 128, 128 experts of 768, top-8),
  same batch. unpatched: transformers' default experts (torch._grouped_mm); hf_loop: its
  per-expert loop (experts_implementation="eager"); liger: RMSNorm, RoPE and its experts.

Peers patch module-level names (apply_rotary_pos_emb, classes, the attention registry): each
model is built under its own patch, and every step first puts back the module state its model
was built with, so the models can take turns in one process. Extra columns in the JSON: tokens
per step and each model's peak memory of a step above its resident weights and optimizer state
(GiB). TFLOP/s counts model FLOPs (`_flops`)."""
import copy
import time
import warnings

import torch

from tiletune.bench import BenchCase
from tiletune.pretune import ModelSpec
from tiletune.suites import hf

BATCH, SEQ = 2, 4096
# `python -m tiletune tune` builds and steps its one-layer models through these
# (tiletune.registry.models)
build_model, model_step, model_generate = hf.build_model, hf.model_step, hf.model_generate


DENSE = ModelSpec("llama", hidden=2048, intermediate=8192, heads=16, kv_heads=8, head_dim=128)
MOE = ModelSpec("qwen3_moe", hidden=2048, intermediate=6144, heads=32, kv_heads=4, head_dim=128,
                experts=128, top_k=8, moe_intermediate=768)


def _dense_config():
    return hf.model_config(DENSE, SEQ, layers=16, vocab=32000)


def _moe_config():
    return hf.model_config(MOE, SEQ, layers=4, vocab=32000)


# ---------------------------------------------------------------------------------------------
# Module state: what a peer's patch may change (the family's modeling module, transformers'
# attention and experts registries), captured after its model is built and put back before each
# of its steps.

def _mutables(module):
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    return [vars(module), ALL_ATTENTION_FUNCTIONS._local_mapping,
            ALL_ATTENTION_FUNCTIONS._global_mapping, ALL_EXPERTS_FUNCTIONS._local_mapping,
            ALL_EXPERTS_FUNCTIONS._global_mapping]


def _capture(module):
    return [dict(d) for d in _mutables(module)]


def _restore(module, state):
    for d, saved in zip(_mutables(module), state):
        for k in [k for k in d if k not in saved]:
            del d[k]
        for k, v in saved.items():
            if d.get(k) is not v:
                d[k] = v


class _Model:
    """One model and its AdamW, built under `patch(model_or_none)` on a fresh module state.
    `settings`: config attributes (the attention or experts implementation) set before each
    step, so that variants of one model (`variant`) share its weights and optimizer."""

    def __init__(self, module, clean, build, patch, before_build=False):
        _restore(module, clean)
        if before_build:                  # class-level patchers: the classes they swap in
            patch(None)
        torch.manual_seed(0)
        with torch.device("cuda"):
            self.model = build().to(torch.bfloat16)
        if not before_build:
            patch(self.model)
        self.state = _capture(module)
        self.module = module
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-5, fused=True)
        self.settings = {"_attn_implementation": self.model.config._attn_implementation,
                         "_experts_implementation": getattr(
                             self.model.config, "_experts_implementation", None)}
        _restore(module, clean)

    def variant(self, **settings):
        other = copy.copy(self)
        other.settings = {**self.settings, **settings}
        return other

    def step(self, ids):
        _restore(self.module, self.state)
        for k, v in self.settings.items():
            if v is not None and getattr(self.model.config, k) != v:
                setattr(self.model.config, k, v)
        # no KV cache: a training forward has no use for one, and transformers' default
        # (use_cache=True) copies every layer's K and V into it, and their gradients back
        loss = self.model(input_ids=ids, labels=ids, use_cache=False).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def peak_gib(self, ids):
        """(peak memory of one step above what is allocated before it in GiB, the seconds of
        the step before it: a model's first, which tunes)."""
        t0 = time.perf_counter()
        self.step(ids)
        torch.cuda.synchronize()
        first_s = time.perf_counter() - t0
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        self.step(ids)
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() - base) / 2**30, first_s


def _ours(model):
    from tiletune.suites.hf import apply_tiletune
    apply_tiletune(model)


def _liger(family, **flags):
    def patch(model):
        from liger_kernel.transformers import monkey_patch
        getattr(monkey_patch, f"apply_liger_kernel_to_{family}")(model=model, **flags)
    return patch


def _tilegym_llama(model):
    from tilegym.transformers.monkey_patch import apply_tilegym_kernel_to_llama
    apply_tilegym_kernel_to_llama(attn=False, use_cutile=True)


def _peer(label, make):
    """(label, _Model), or None when the peer is not installed or fails to patch or build."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return label, make()
    except Exception as e:
        print(f"train_step: {label} left out: {type(e).__name__}: {str(e)[:160]}", flush=True)
        return None


def _flops(model, config, tokens):
    """Model FLOPs of one training step: 6 per token per matmul weight a token meets (an expert
    weight counts k / E of its size), plus causal attention's 6 * layers * seq * q-width per
    token (half of the full 12)."""
    n = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name or p.dim() < 2:
            continue
        share = (config.num_experts_per_tok / config.num_experts
                 if "experts" in name and p.dim() == 3 else 1.0)
        n += p.numel() * share
    q_width = config.num_attention_heads * config.head_dim
    return 6.0 * n * tokens + 6.0 * config.num_hidden_layers * SEQ * q_width * tokens


_live = []       # the models of the row being timed; emptied before the next row's are built


def _setup(module_fn, config_fn, class_name, peers, experts_loop):
    """The row's setup: builds its models (ours, unpatched, the peers), measures each one's
    step memory, and points the row's callables at them."""
    def setup(case):
        _live.clear()
        torch.cuda.empty_cache()
        module = module_fn()
        model_class = getattr(module, class_name)
        clean = _capture(module)

        def build():
            return lambda: model_class._from_config(config_fn())

        def plain(m):
            pass

        ours = _Model(module, clean, build(), _ours)
        unpatched = _Model(module, clean, build(), plain)
        # ours with transformers' SDPA attention: the attention's share of our step
        models = [("tiletune_sdpa", ours.variant(_attn_implementation="sdpa")),
                  ("unpatched", unpatched)]
        if experts_loop:     # transformers' per-expert loop instead of torch._grouped_mm
            models.append(("hf_loop", unpatched.variant(_experts_implementation="eager")))
        models += [p for p in (_peer(label, lambda f=f: f(module, clean, build))
                               for label, f in peers) if p]
        _live.extend([ours, *(m for _, m in models)])
        ids = torch.randint(0, ours.model.config.vocab_size, (BATCH, SEQ), device="cuda")
        case.extra["tokens"] = BATCH * SEQ
        for label, m in [("tuned", ours), *models]:
            peak, first_s = m.peak_gib(ids)
            case.extra[f"peak_GiB_{label}"] = round(peak, 2)
            if label == "tuned":     # its first step tuned every key: the row's tuning time
                case.extra["first_call_s"] = round(first_s, 3)

        def step(i):            # through _live: the next row's setup frees these models
            return lambda: _live[i].step(ids)
        case.ours = step(0)
        case.baselines = {label: step(i + 1) for i, (label, _) in enumerate(models)}
        case.flops = _flops(ours.model, ours.model.config, BATCH * SEQ)
    return setup


def _row(name, module_fn, config_fn, class_name, peers, experts_loop=False):
    return BenchCase("train_step", name, "step", None, {},
                     setup=_setup(module_fn, config_fn, class_name, peers, experts_loop),
                     timing=dict(rounds=3, reps=4, warmup=2))


def _llama_module():
    from transformers.models.llama import modeling_llama
    return modeling_llama


def _qwen3_moe_module():
    from transformers.models.qwen3_moe import modeling_qwen3_moe
    return modeling_qwen3_moe


DENSE_PEERS = [
    ("liger", lambda mod, clean, build: _Model(
        mod, clean, build(), _liger("llama", fused_linear_cross_entropy=False))),
    ("liger_flce", lambda mod, clean, build: _Model(mod, clean, build(), _liger("llama"))),
    ("tilegym", lambda mod, clean, build: _Model(mod, clean, build(), _tilegym_llama,
                                                 before_build=True))]
MOE_PEERS = [
    ("liger", lambda mod, clean, build: _Model(
        mod, clean, build(), _liger("qwen3_moe", fused_linear_cross_entropy=False)))]


def bench_cases(full=False):
    if not full:
        return []
    return [_row(f"llama 2048x16L b{BATCH}x{SEQ} bf16", _llama_module, _dense_config,
                 "LlamaForCausalLM", DENSE_PEERS),
            _row(f"qwen3_moe 2048x4L 128e top8 b{BATCH}x{SEQ} bf16", _qwen3_moe_module,
                 _moe_config, "Qwen3MoeForCausalLM", MOE_PEERS, experts_loop=True)]


def compile_cases():
    return iter(())
