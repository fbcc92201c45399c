"""Train a transformers Llama (random init from a config, synthetic tokens) with and without
tiletune's kernels: one call patches the built model in place.

    python assets/examples/06_hf_llama_patch/train_llama.py              # patched
    python assets/examples/06_hf_llama_patch/train_llama.py --unpatched  # transformers' own

`apply_tiletune_to_llama(model)` swaps the model's RMSNorm, MLP (SwiGLU) and attention modules
for tiletune subclasses (same parameters and state_dict keys) and sets its attention
implementation to "tiletune" (tiletune's FMHA; RoPE in the attention). The first steps tune each
new shape once (or read the store); later steps launch the cached kernels.

Prints `step=<i> loss=<value>` per step, then `ms_per_step=`, `tokens_per_s=` and
`peak_GiB=` (the step's peak memory above the resident weights and optimizer state) over the
timed steps."""
import argparse
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import tiletune
from tiletune.suites.hf import apply_tiletune_to_llama

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
p.add_argument("--unpatched", action="store_true", help="transformers' own kernels (SDPA)")
p.add_argument("--hidden", type=int, default=2048)
p.add_argument("--layers", type=int, default=16)
p.add_argument("--seq", type=int, default=4096)
p.add_argument("--batch", type=int, default=2)
p.add_argument("--steps", type=int, default=12, help="steps in all; the first 2 are warm-up")
args = p.parse_args()

if not args.unpatched:
    tiletune.start_compile_workers()    # they start while the model builds
config = LlamaConfig(hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                     num_hidden_layers=args.layers, num_attention_heads=args.hidden // 128,
                     num_key_value_heads=max(args.hidden // 256, 1), head_dim=128,
                     vocab_size=32000, max_position_embeddings=args.seq)
torch.manual_seed(0)
with torch.device("cuda"):
    model = LlamaForCausalLM(config).to(torch.bfloat16)
if not args.unpatched:
    apply_tiletune_to_llama(model)
opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=True)
data = torch.randint(0, config.vocab_size, (args.steps, args.batch, args.seq), device="cuda")

warmup = min(2, args.steps - 1)
for i in range(args.steps):
    if i == warmup:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        resident = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
    # use_cache=False: training has no use for a KV cache, and filling one copies K and V
    loss = model(input_ids=data[i], labels=data[i], use_cache=False).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    print(f"step={i} loss={loss.item():.5f}", flush=True)
torch.cuda.synchronize()
timed = args.steps - warmup
seconds = time.perf_counter() - t0
print(f"ms_per_step={seconds / timed * 1e3:.1f}")
print(f"tokens_per_s={timed * args.batch * args.seq / seconds:.0f}")
print(f"peak_GiB={(torch.cuda.max_memory_allocated() - resident) / 2**30:.2f}")
