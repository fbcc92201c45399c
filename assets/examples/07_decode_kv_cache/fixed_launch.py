"""Before: one decode step (a new token per sequence) over a KV cache, the decode kernel launched
with one hand-picked config: no split of the key range, so each of the B x Hkv CTAs walks its
sequence's whole cache alone (batch 1, 32 query and 8 KV heads, 30000 filled of a 32768-token
cache, D 128, bf16: 8 CTAs on a GPU of 132 SMs), 64-key tiles, occupancy 2. The cache's filled
length lives on the device (`used`), so the step is replayed from a CUDA graph, as a serving
loop runs decode."""
import math

import cuda.tile as ct
import torch

from tiletune.bench import graphed
from tiletune.ops.fmha import LOG2E, decode_rows, fmha_decode_kernel
from tiletune.timing import time_us

B, HQ, HKV, CAPACITY, FILLED, D = 1, 32, 8, 32768, 30000, 128
torch.manual_seed(0)
q = torch.randn(B, HQ, 1, D, device="cuda", dtype=torch.bfloat16)
k = torch.randn(B, HKV, CAPACITY, D, device="cuda", dtype=torch.bfloat16)
v = torch.randn(B, HKV, CAPACITY, D, device="cuda", dtype=torch.bfloat16)
used = torch.full((B,), FILLED, device="cuda", dtype=torch.int32)
o = torch.empty_like(q)
lse = torch.empty(B * HQ, 4, device="cuda", dtype=torch.float32)[:, :1]   # rows of 16 bytes

GROUP = HQ // HKV
TG, TQ = decode_rows(GROUP, 1)            # the q heads of a KV head (and query rows) per CTA
TN = 64
kernel = fmha_decode_kernel.replace_hints(occupancy=2, num_worker_warps=4)
args = (q, k, v, used, o, lse, k, k,      # (no partials without a split: k stands in for them)
        LOG2E / math.sqrt(D), 0, GROUP, TG, TQ, 1, TN, D, False, True, False, False)


def step():
    ct.launch(torch.cuda.current_stream(), (1, B * HKV), kernel, args)


step()                                   # compiles once
replay = graphed(step)
replay()
res = o.double()
r = torch.randn(res.shape, device="cuda", dtype=torch.float64,
                generator=torch.Generator("cuda").manual_seed(1))
print(f"checksum={res.square().sum().item():.9e}")   # the squared norm
print(f"projection={(res * r).sum().item():.9e}")    # on a random vector: any wrong value moves it
print(f"us={time_us(replay):.2f}")
del replay    # free the graph before interpreter exit (see assets/README.md)
