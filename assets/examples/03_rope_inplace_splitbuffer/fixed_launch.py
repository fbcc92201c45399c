"""Before: the in-place RoPE kernel launched with hard-coded choices (no tuning): one CTA per
position, occupancy 4, no latency hint to speak of (1)."""
import cuda.tile as ct
import torch

from tiletune.timing import time_us
from tiletune.ops.rope import rope_inplace_kernel

B, HQ, HK, S, D = 4, 32, 8, 4096, 128
torch.manual_seed(0)
q = torch.randn(B, HQ, S, D, device="cuda", dtype=torch.bfloat16)
k = torch.randn(B, HK, S, D, device="cuda", dtype=torch.bfloat16)
ang = torch.rand(S, D // 2, device="cuda") * 6.28
cos = torch.cat((ang.cos(), ang.cos()), -1).to(torch.bfloat16)[None].expand(B, S, D)
sin = torch.cat((ang.sin(), ang.sin()), -1).to(torch.bfloat16)[None].expand(B, S, D)

kernel = rope_inplace_kernel.replace_hints(occupancy=4)      # fixed choice
# q, k, cos, sin, (unused) position ids, half, TILE_HQ, TILE_HK, TILE_S, TILE_R, HAS_POS, BACKWARD,
# LATENCY, MATH_F32, HALVES_AS_TILES, WHOLE (heads and half powers of two: no bounds checks)
args = (q, k, cos, sin, cos, D // 2, HQ, HK, 1, D // 2, False, False, 1, True, False, True)


def run():
    ct.launch(torch.cuda.current_stream(), (B * S,), kernel, args)


run()                                    # rotates q and k once
res = torch.cat((q.flatten(), k.flatten())).double()
r = torch.randn(res.shape, device="cuda", dtype=torch.float64,
                generator=torch.Generator("cuda").manual_seed(1))
print(f"checksum={res.square().sum().item():.9e}")   # the squared norm
print(f"projection={(res * r).sum().item():.9e}")    # on a random vector: any wrong value moves it
print(f"us={time_us(run):.2f}")          # timing keeps rotating in place: fine for timing
