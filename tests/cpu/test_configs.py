"""Every op's config spaces: at most 30, default first, no repeats, hints the compiler accepts,
power-of-two tiles; and the input checks that need no GPU."""
import itertools
from types import SimpleNamespace

import pytest
import torch

from tiletune.autotune import MAX_CONFIGS, default_hints
from tiletune.ops import matmul as MM
from tiletune.ops import partials
from tiletune.ops import rms_norm as RN
from tiletune.ops import rms_norm_rope as RNR
from tiletune.ops import rope as RP

ARCHS = ("sm_90", "sm_100", "sm_120", "sm_80")


def spaces():
    for arch in ARCHS:
        for n in (1, 2, 7, 64, 100, 128, 1000, 1001, 4096, 5120, 8192, 12000, 16384, 16385, 65536):
            yield f"rms_norm_fwd {arch} N={n}", list(RN.fwd_configs(arch, n))
            if RN.next_pow2(n) <= RN.MAX_ROW_TILE:
                yield f"rms_norm_bwd {arch} N={n}", list(RN.bwd_configs(arch, n))
        yield f"rms_norm_bwd_coef {arch}", list(RN.bwd_coef_configs(arch, 65536))
        yield f"rms_norm_bwd_cols {arch}", list(RN.bwd_cols_configs(arch, 65536))
        yield f"column_sum {arch}", list(partials.column_sum_configs(arch, 4096))
        for m, n, k in ((1, 4096, 4096), (256, 4096, 4096), (4096, 14336, 4096), (1000, 1999, 777)):
            yield f"matmul {arch} {m}x{n}x{k}", list(MM.matmul_configs(arch, m, n, k))
        for heads, rot in itertools.product((2, 40, 160), (32, 64, 128)):
            yield f"rms_norm_rope {arch} H={heads} R={rot}", list(RNR.fused_configs(arch, heads, rot))
            yield (f"rms_norm_rope_bwd {arch} H={heads} R={rot}",
                   list(RNR.fused_configs(arch, heads, rot, backward=True)))
        for heads, rot, pos in itertools.product((1, 8, 32, 64), (32, 128, 256), (False, True)):
            yield (f"rope_tiles {arch} H={heads} R={rot} pos={pos}",
                   list(RP.rope_tile_configs(arch, heads, rot, pos)))


@pytest.mark.parametrize("label,cfgs", list(spaces()), ids=lambda v: v if isinstance(v, str) else "")
def test_space(label, cfgs):
    arch = label.split()[1] if label.split()[1].startswith("sm_") else ""
    assert 1 <= len(cfgs) <= MAX_CONFIGS
    assert all(isinstance(c, SimpleNamespace) for c in cfgs)
    assert len({tuple(sorted(vars(c).items())) for c in cfgs}) == len(cfgs), "repeated config"
    for c in cfgs:
        h = default_hints(c)
        assert 1 <= h.get("occupancy", 1) <= 32
        assert h.get("num_worker_warps", 4) in (4, 8)       # tileiras 13.4 takes only these
        if arch in ("sm_90", "sm_100"):
            assert h.get("num_ctas", 1) in (1, 2, 4, 8)     # portable cluster sizes
        if hasattr(c, "tm"):
            per_cta = c.tm * c.tn // h.get("num_ctas", 1)
            assert per_cta <= 128 * 256, "fp32 accumulator would not fit the registers"
        for name in ("tile_m", "tile_n", "tile_g", "tm", "tn", "tk"):
            v = getattr(c, name, 1)
            assert v >= 1 and v & (v - 1) == 0, f"{name}={v} is not a power of two"


def test_rms_norm_defaults_are_what_disable_autotune_runs():
    assert next(RN.fwd_configs("sm_90", 4096)) == SimpleNamespace(
        kind="rows", tile_m=2, tile_n=4096, occupancy=2, num_worker_warps=4, persistent=True)
    assert next(RN.fwd_configs("sm_90", 65536)).kind == "chunked"


def test_rms_norm_rejects_bad_input_without_a_gpu():
    x, w = torch.randn(4, 8), torch.randn(8)
    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        RN.rms_norm(x, w)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        RN.rms_norm([1.0], w)


def test_rope_rejects_cpu_tensors():
    q = torch.randn(1, 2, 4, 8)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        RP.apply_rope(q, q, torch.randn(4, 8), torch.randn(4, 8))


def test_rms_norm_wide_forward_is_offered_for_16_bit_rows_of_16k_to_32k_only():
    """The one-read wide forward holds a row in its own 16-bit dtype at 8 warps, occupancy 1,
    with a 16-bit weight (other builds spill on sm_90): one persistent entry, the default,
    before the chunked ones, nowhere else."""
    def wide(n, x_bytes, w_bytes=2):
        return [c for c in RN.fwd_configs("sm_90", n, x_bytes, w_bytes) if c.kind == "wide"]
    assert wide(20000, 2) == wide(32768, 2) == [SimpleNamespace(
        kind="wide", tile_m=1, tile_n=32768, occupancy=1, num_worker_warps=8, persistent=True)]
    assert not wide(20000, 4) and not wide(20000, 2, 4) and not wide(16384, 2)
    assert not wide(32769, 2)
    assert next(RN.fwd_configs("sm_90", 20000, 2, 2)).kind == "wide"
    assert next(RN.fwd_configs("sm_90", 20000, 2, 4)).kind == "chunked"
