"""After: the same in-place kernel through tune-once/cache/launch. A search must not touch q and
k, so the tuner declares a twin for it: `search_kernel` is the out-of-place `rope_kernel` (same
body and traffic, separate output arrays) and `search_inputs` gives it scratch outputs, made once
per miss (split buffers, no clones per sample). The winning config is then applied to the
in-place kernel, which runs once on the real data. (`apply_rope(..., inplace=True)` searches
differently: the in-place kernel on copies of q and k, since the twin's out-of-place traffic
ranks some configs differently; references/kernel-type-templates.md.)"""
import torch

from tiletune import Autotuner, bucket, cdiv
from tiletune.device import persistent_ctas
from tiletune.ops.rope import rope_inplace_kernel, rope_kernel, rope_tile_configs
from tiletune.timing import time_us

B, HQ, HK, S, D = 4, 32, 8, 4096, 128
torch.manual_seed(0)
q = torch.randn(B, HQ, S, D, device="cuda", dtype=torch.bfloat16)
k = torch.randn(B, HK, S, D, device="cuda", dtype=torch.bfloat16)
ang = torch.rand(S, D // 2, device="cuda") * 6.28
cos = torch.cat((ang.cos(), ang.cos()), -1).to(torch.bfloat16)[None].expand(B, S, D)
sin = torch.cat((ang.sin(), ang.sin()), -1).to(torch.bfloat16)[None].expand(B, S, D)


def grid(cfg, dev, q, *rest):
    """A persistent grid (SMs x occupancy CTAs striding over position tiles) or one CTA each."""
    tiles = q.shape[0] * cdiv(q.shape[2], cfg.tile_s)
    return (persistent_ctas(tiles, dev, cfg.occupancy) if cfg.persistent else tiles,)


def args(cfg, q, k, cos, sin, q_out, k_out):
    """The in-place kernel's arguments; with scratch outputs (the search), its twin's. The whole
    head rotates (half = D/2, a power of two: the halves-as-tiles entry applies), no
    position_ids (cos stands in for them), forward, float32 arithmetic. The head counts and the
    half are powers of two, so the tiles are whole (no bounds checks) where S is a multiple of
    the position tile."""
    as_tiles = getattr(cfg, "halves_as_tiles", False)
    whole = S % cfg.tile_s == 0
    if q_out is None:
        return (q, k, cos, sin, cos, D // 2, HQ, HK, cfg.tile_s, D // 2, False, False,
                cfg.latency, True, as_tiles, whole)
    return (q, k, cos, sin, cos, q_out, k_out, D // 2, HQ, HK, cfg.tile_s, D // 2, 1, False,
            False, False, cfg.latency, True, as_tiles, whole)


tuner = Autotuner(
    "example_rope_inplace", rope_inplace_kernel, rope_tile_configs, default=None,
    space=lambda q, k, *rest: dict(heads=q.shape[1], rot=q.shape[3]), grid=grid, args=args,
    search_kernel=rope_kernel,
    search_inputs=lambda q, k, cos, sin, q_out, k_out: (q, k, cos, sin, torch.empty_like(q),
                                                        torch.empty_like(k)))


def run():
    dev = q.get_device()
    tuner.launch((HQ, HK, D, bucket(B * S), q.dtype, dev), dev, q, k, cos, sin, None, None)


run()                                    # tunes (search on scratch), then rotates q and k once
rec = next(iter(tuner.records.values()))
print(f"best={rec.config} source={rec.source}")
res = torch.cat((q.flatten(), k.flatten())).double()
r = torch.randn(res.shape, device="cuda", dtype=torch.float64,
                generator=torch.Generator("cuda").manual_seed(1))
print(f"checksum={res.square().sum().item():.9e}")   # the squared norm
print(f"projection={(res * r).sum().item():.9e}")    # on a random vector: any wrong value moves it
print(f"us={time_us(run):.2f}")
