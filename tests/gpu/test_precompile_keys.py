"""The parallel precompile must leave exactly the cubins that the launch looks up: a cubin
compiled under another signature or calling convention lands under another disk-cache key, and
the search then compiles every config a second time, serially."""
import cuda.tile as ct
import cuda.tile._compile as ct_compile
import pytest
import torch
from cuda.tile.compilation import CallingConvention, KernelSignature

import tiletune
from tiletune import device, precompile
from tiletune.ops import grouped_gemm as G
from tiletune.ops import rms_norm as R
from tiletune.ops.rms_norm import rms_norm

from .test_rms_norm import TOL, reference, rel


def _rms_case(M, N):
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(N, device="cuda", dtype=torch.bfloat16)
    y, r = torch.empty_like(x), torch.empty(M, device="cuda")
    tn = R.next_pow2(N)
    return R.rms_norm_fwd_rows, {"occupancy": 2}, (M,), (x, w, y, r, 1.0 / N, 1e-6, 1, tn)


def _grouped_case():
    x = torch.randn(1000, 512, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(4, 768, 512, device="cuda", dtype=torch.bfloat16).transpose(-2, -1)
    offs = torch.tensor([100, 100, 700, 1000], device="cuda", dtype=torch.int32)
    out = torch.empty(1000, 768, device="cuda", dtype=torch.bfloat16)
    cfg = next(G.grouped_configs(device.arch(), 1000, 4, 512, 768))
    return G.grouped_mm_kernel, G._grouped.hints(cfg), (8,), G._args(cfg, x, w, offs, out)


@pytest.mark.parametrize("case", ["rows", "one row (a constant dim)", "grouped"])
def test_precompiled_key_is_the_launch_key(monkeypatch, case):
    kernel, hints, grid, args = {"rows": lambda: _rms_case(1000, 3000),
                                 "one row (a constant dim)": lambda: _rms_case(1, 3000),
                                 "grouped": _grouped_case}[case]()
    keys = []
    real_key = ct_compile.cache_key
    monkeypatch.setattr(ct_compile, "cache_key",
                        lambda *a, **k: keys.append(real_key(*a, **k)) or keys[-1])
    v2 = CallingConvention.cutile_python_v2()
    sig = precompile.launch_signature(KernelSignature.from_kernel_args(kernel, args, v2).parameters)
    module, name = precompile.kernel_location(kernel)
    assert isinstance(precompile.compile_job(module, name, hints, sig.parameters,
                                             sig.calling_convention.code,
                                             precompile.code_digest(kernel), device.arch(), 120),
                      precompile.Cubin)
    ct.launch(torch.cuda.current_stream(), grid, kernel.replace_hints(**hints), args)
    torch.cuda.synchronize()
    assert len(keys) == 2 and keys[0] == keys[1]


def test_search_compiles_nothing_itself(monkeypatch, fresh):
    """With the precompile on, a search's own launches load the cubins of its parallel compile
    (the workers', or this process's compile threads' while they start): no compile on the
    searching thread, fewer traces there than configs (each handed cubin spares one), right
    results."""
    import threading
    if not precompile.enabled():
        pytest.skip("parallel precompile is off here (one CPU or no cuTile disk cache)")
    compiles, traces = [], []
    real, real_trace = ct_compile.compile_cubin, ct_compile.compile_tile

    def on_this_thread(calls, fn):
        def counted(*a, **k):
            if threading.current_thread() is threading.main_thread():
                calls.append(a[0])
            return fn(*a, **k)
        return counted
    monkeypatch.setattr(ct_compile, "compile_cubin", on_this_thread(compiles, real))
    monkeypatch.setattr(ct_compile, "compile_tile", on_this_thread(traces, real_trace))
    x = torch.randn(777, 2999, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(2999, device="cuda", dtype=torch.bfloat16)
    rms_norm(x, w)
    torch.cuda.synchronize()
    searched = [r for r in tiletune.records()["rms_norm_fwd"].values() if r.source == "search"]
    assert searched and compiles == []
    assert len(traces) < sum(len(r.timings) for r in searched)
    assert rel(rms_norm(x, w), reference(x, w, 1e-6)) < TOL[torch.bfloat16]
