"""FMHA pieces that need no GPU: config spaces per arch and head-dim tile, the FLOP count of the
causal mask, the cache key, and input checks that fail before any launch."""
import itertools
from types import SimpleNamespace

import pytest
import torch

from tiletune.autotune import MAX_CONFIGS, default_hints
from tiletune.ops import fmha as FM

GENS = {"fwd": FM.fwd_configs, "dq": FM.dq_configs, "dkdv": FM.dkdv_configs}


def spaces():
    for arch, td, (sq, sk), (kind, gen), causal in itertools.product(
            ("sm_90", "sm_100", "sm_120", "sm_80"), (16, 32, 64, 128, 256),
            ((4096, 4096), (1, 4096), (4096, 1), (64, 64), (128, 16384)), GENS.items(),
            (False, True)):
        yield (f"{kind} {arch} TD{td} Sq{sq} Sk{sk}{' causal' if causal else ''}", arch, sq, sk,
               list(gen(arch, td, sq, sk, causal=causal)))


@pytest.mark.parametrize("label,arch,sq,sk,cfgs", list(spaces()),
                         ids=lambda v: v if isinstance(v, str) and " " in v else "")
def test_space(label, arch, sq, sk, cfgs):
    assert 1 <= len(cfgs) <= MAX_CONFIGS
    assert len({tuple(sorted(vars(c).items())) for c in cfgs}) == len(cfgs), "repeated config"
    for c in cfgs:
        h = default_hints(c)
        assert 1 <= h["occupancy"] <= 32 and h.get("num_worker_warps", 4) in (4, 8)
        assert h["num_ctas"] in (1, 2, 4, 8)
        assert c.tm * c.tn <= 128 * 256
        for v in (c.tm, c.tn):
            assert v >= 16 and v & (v - 1) == 0
        assert c.tm <= max(64, FM.next_pow2(sq)) and c.tn <= max(64, FM.next_pow2(sk))
    if arch not in ("sm_90", "sm_100"):
        assert len(cfgs) <= 2 and all(c.num_ctas == 1 for c in cfgs)


def test_sm90_defaults():
    assert next(FM.fwd_configs("sm_90", 128)) == SimpleNamespace(
        tm=128, tn=128, occupancy=1, num_ctas=1, num_worker_warps=8)
    assert next(FM.dq_configs("sm_90", 128)).tm == 128
    assert next(FM.dkdv_configs("sm_90", 128)).tn == 128
    assert next(FM.fwd_configs("sm_90", 128, 1, 4096)).tm == 64     # decode: no 128-row tiles


def test_aot_covers_every_sm90_and_sm100_config_at_d128():
    labels = [c.label for c in FM.aot_cases()]
    for kind, gen in GENS.items():
        for arch in ("sm_90", "sm_100"):
            for cfg in gen(arch, 128, causal=True):
                assert any(f"fmha {kind} " in lb and str(vars(cfg)) in lb for lb in labels), \
                    (kind, arch, vars(cfg))
    assert len(labels) <= 64, "keep the CI's FMHA compiles near 125 (two archs)"


def test_heavy_first_only_for_causal_forward_on_sm90():
    """The query-tile order is a forward, causal-only trial: non-causal tiles all cost the same."""
    plain = list(FM.fwd_configs("sm_90", 128))
    causal = list(FM.fwd_configs("sm_90", 128, causal=True))
    assert causal[:len(plain)] == plain
    heavy = causal[len(plain):]
    assert [(c.tm, c.tn, c.occupancy) for c in heavy] == [(128, 128, 1), (64, 128, 2)]
    assert all(c.heavy_first for c in heavy)
    assert not any(hasattr(c, "heavy_first") for c in FM.fwd_configs("sm_100", 128, causal=True))
    assert not any(hasattr(c, "heavy_first") for c in FM.dq_configs("sm_90", 128, causal=True))


def brute_pairs(sq, sk, causal, offset):
    return sum(1 for i in range(sq) for j in range(sk) if not causal or j <= i + offset)


@pytest.mark.parametrize("sq,sk", list(itertools.product((0, 1, 2, 7, 33), (0, 1, 5, 33))))
def test_visible_pairs(sq, sk):
    for causal, offset in ((False, 0), (True, sk - sq), (True, 0), (True, -3), (True, 4)):
        assert FM.visible_pairs(sq, sk, causal, offset) == brute_pairs(sq, sk, causal, offset)


def test_head_tile():
    assert [FM.head_tile(d) for d in (1, 16, 17, 64, 80, 96, 128, 129, 256)] == \
        [16, 16, 32, 64, 128, 128, 128, 256, 256]


def test_rejects_cpu_and_bad_types_without_a_gpu():
    q = torch.randn(1, 2, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        FM.fmha(q, q, q)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        FM.fmha([1.0], q, q)
    with pytest.raises(ValueError, match="dropout_p"):
        FM.scaled_dot_product_attention(q, q, q, dropout_p=0.5)
