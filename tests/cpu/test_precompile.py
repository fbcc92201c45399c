"""Parallel precompile (tiletune/precompile.py) with the real compiler in real spawned workers:
a compile lands in cuTile's disk cache, a kernel the compiler rejects comes back as a verdict."""
import os

import pytest
import torch

from tiletune import precompile
from tiletune.aot import F32, jit_array
from tiletune.ops import rms_norm as R


@pytest.fixture
def pool(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_TILE_CACHE_DIR", str(tmp_path / "cubins"))
    monkeypatch.setenv("TILETUNE_COMPILE_JOBS", "2")
    monkeypatch.setattr(precompile, "_pool", None)
    yield tmp_path / "cubins"
    if precompile._pool is not None:
        precompile._pool.shutdown()


def fwd_params(tile_m, tile_n):
    bf = torch.bfloat16
    return [jit_array(bf, (64, 4096)), jit_array(bf, (4096,)), jit_array(bf, (64, 4096)),
            jit_array(torch.float32, (64,)), F32, F32, tile_m, tile_n]


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


def test_worker_fills_the_disk_cache_and_reports_rejections(pool):
    run = lambda tile_n: precompile._executor().submit(
        precompile.compile_worker, "tiletune.ops.rms_norm", "rms_norm_fwd_rows",
        {"occupancy": 2}, fwd_params(1, tile_n), "t2", "sm_90", 120).result(timeout=300)
    assert run(4096) is None
    assert any(files for _, _, files in os.walk(pool))
    etype, msg, verdict = run(4095)           # not a power of two: the compiler's verdict
    assert verdict and "power of two" in msg, (etype, msg)
