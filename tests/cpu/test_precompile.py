"""Parallel precompile (tiletune/precompile.py) with the real compiler in real worker processes:
a compile lands in cuTile's disk cache, a kernel the compiler rejects comes back as a verdict."""
import torch
from cutile_cache._cache import cache_entries

from tiletune import precompile
from tiletune.aot import F32, jit_array
from tiletune.ops import rms_norm as R


def fwd_params(tile_n):
    bf = torch.bfloat16
    return [jit_array(bf, (64, 4096)), jit_array(bf, (4096,)), jit_array(bf, (64, 4096)),
            jit_array(torch.float32, (64,)), F32, F32, 1, tile_n]


def test_kernel_location_finds_module_kernels_only():
    assert precompile.kernel_location(R.rms_norm_fwd_rows) == ("tiletune.ops.rms_norm",
                                                               "rms_norm_fwd_rows")
    assert precompile.kernel_location(R.rms_norm_fwd_rows.replace_hints(occupancy=2)) is None


def test_enabled_follows_jobs_and_disk_cache(monkeypatch):
    monkeypatch.setenv("TILETUNE_COMPILE_JOBS", "1")
    assert not precompile.enabled()
    monkeypatch.setenv("TILETUNE_COMPILE_JOBS", "4")
    monkeypatch.setenv("CUDA_TILE_CACHE_DIR", "off")
    assert not precompile.enabled()


def test_workers_fill_the_disk_cache_and_report_rejections(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_TILE_CACHE_DIR", str(tmp_path))
    job = lambda i, tile_n: (i, "tiletune.ops.rms_norm", "rms_norm_fwd_rows", {"occupancy": 2},
                             fwd_params(tile_n), "t2")
    res = precompile.run_jobs([job(0, 4096), job(1, 4095), job(2, 2048)], "sm_90", 120, 2)
    assert res[0] is None and res[2] is None
    assert len(list(cache_entries(str(tmp_path)))) == 2       # the two cubins, in cuTile's cache
    etype, msg, verdict = res[1]          # not a power of two: the compiler's verdict
    assert verdict and "power of two" in msg, (etype, msg)
