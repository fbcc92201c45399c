"""After: the same decode step through `fmha(q, k, v, seqused_k=used)`: its first call searches
how many CTAs share each sequence's key range (1 to 64 splits, the key tile and the occupancy;
with a split, a second small kernel merges the partial softmaxes), tuned per (B x Hkv and the
cache's capacity, both bucketed to powers of two, Sq, D, the mask, the GQA group, lengths given or
not, dtype), so a longer cache next step reuses the winner. The
step is captured once into a CUDA graph and replayed: the call reads the filled lengths on the
device, so the next token is the same graph with `used` raised in place."""
import torch

from tiletune import autotune
from tiletune.bench import graphed
from tiletune.ops.fmha import fmha
from tiletune.timing import time_us

B, HQ, HKV, CAPACITY, FILLED, D = 1, 32, 8, 32768, 30000, 128
torch.manual_seed(0)
q = torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
k = torch.randn(B, HKV, CAPACITY, D, device="cuda", dtype=torch.bfloat16)
v = torch.randn(B, HKV, CAPACITY, D, device="cuda", dtype=torch.bfloat16)
used = torch.full((B,), FILLED, device="cuda", dtype=torch.int32)
out = {}


def step():
    out["o"] = fmha(q, k, v, seqused_k=used)


step()                                   # tunes once
replay = graphed(step)                   # out["o"] is now the graph's output
replay()
print(f"best={next(iter(autotune.records()['fmha_decode'].values())).config}")
res = out['o'].double()
r = torch.randn(res.shape, device="cuda", dtype=torch.float64,
                generator=torch.Generator("cuda").manual_seed(1))
print(f"checksum={res.square().sum().item():.9e}")   # the squared norm
print(f"projection={(res * r).sum().item():.9e}")    # on a random vector: any wrong value moves it
print(f"us={time_us(replay):.2f}")

used.add_(1)                             # the next token: one more key in the cache, same graph
replay()
want = torch.nn.functional.scaled_dot_product_attention(
    q.float(), k[:, :, :FILLED + 1].float(), v[:, :, :FILLED + 1].float(), enable_gqa=True)
print(f"next_token_max_err={(out['o'].float() - want).abs().max().item():.3e}")
del replay    # free the graph before interpreter exit (see assets/README.md)
