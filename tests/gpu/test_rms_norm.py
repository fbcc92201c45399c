"""RMSNorm on the GPU against a float32 reference on random data."""
import math
import os
import subprocess
import sys
import threading

import cuda.tile as ct
import pytest
import torch

import tiletune
from tiletune import timing
from tiletune.ops import partials, rms_norm as R
from tiletune.ops.rms_norm import rms_norm
from tiletune.space import cdiv, row_chunks

from .conftest import (assert_each_cta_loops, assert_pair_agrees, assert_rows_close, each_config,
                       poison_allocator, run_example_pair)

TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}   # relative norm error


def reference(x, w, eps):
    x64, w64 = x.double(), w.double()
    return x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w64


def rel(a, b):
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all(), "non-finite values (unwritten output?)"
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_dx_rows_close(dx, ref_dx, x, dy, w, eps, tol):
    """Each row of dx within `tol` of ref_dx's, relative to that row's |r*g| (g = dy*w, r the
    row's rstd): dx = r*g - x*r^3*mean(g*x) subtracts two terms of that size, so its errors
    scale with it (for N=1 they cancel almost exactly and dx itself is ~eps-sized)."""
    N = x.shape[-1]
    x64 = x.detach().double().reshape(-1, N)
    scale = (dy.detach().double().reshape(-1, N) * w.detach().double()
             * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + eps)).norm(dim=1)
    assert_rows_close(dx, ref_dx, tol, "x.grad", row_scale=scale)


def check(shape, dt, wdt, eps=1e-6, grad=True):
    N = shape[-1]
    x = torch.randn(shape, device="cuda", dtype=dt) * 3
    w = (torch.rand(N, device="cuda", dtype=wdt) + 0.5)
    xr, wr = x.clone().requires_grad_(grad), w.clone().requires_grad_(grad)
    poison_allocator(torch)
    y = rms_norm(xr, wr, eps)
    assert y.shape == x.shape and y.dtype == dt
    ref_x, ref_w = x.double().requires_grad_(), w.double().requires_grad_()
    ref = reference(ref_x, ref_w, eps)
    tol = max(TOL[dt], TOL[wdt])
    assert_rows_close(y, ref, tol, "y")
    if grad:
        dy = torch.randn_like(y)
        y.backward(dy)
        ref.backward(dy.double())
        assert xr.grad.dtype == dt and wr.grad.dtype == wdt
        assert_dx_rows_close(xr.grad, ref_x.grad, x, dy, w, eps, tol * 2)
        assert rel(wr.grad, ref_w.grad) < tol * 2        # dweight is one row
    assert torch.equal(xr.detach(), x)    # input untouched


# (..., N) inputs whose leading dims merge into rows reach every kernel as they are (viewed as
# rows in the kernel): (B, S, N), decode's (B, 1, N), (B, S, H, D) heads, and wide rows.
SHAPES = [(1, 1), (3, 7), (5, 1000), (37, 4096), (2, 3, 8192), (17, 16384), (9, 20000),
          (4, 65536), (1025, 1001), (300, 128), (4, 1, 1000), (1, 1, 4096), (3, 64, 1024),
          (2, 5, 4096), (2, 3, 5, 128), (2, 3, 20000)]


# Tuned (a full search per key, ~10 s of compiles each): every dtype, aligned, odd and wide rows.
@pytest.mark.parametrize("shape,dt", [((5, 1000), torch.float16), ((37, 4096), torch.bfloat16),
                                      ((9, 20000), torch.float32), ((1025, 1001), torch.bfloat16),
                                      ((3, 7), torch.float32), ((3, 64, 1024), torch.bfloat16)],
                         ids=str)
def test_tuned(fresh, shape, dt):
    check(shape, dt, dt)
    assert R._fwd.searches == 1


def test_rows_and_batched_rows_share_a_key(fresh, monkeypatch):
    """(192, 1024), (3, 64, 1024) and (192, 1, 1024) are one launch key: one search each way,
    whichever layout comes first, every layout correct."""
    for i, shapes in enumerate((((192, 1024), (3, 64, 1024), (192, 1, 1024)),
                                ((192, 1, 1024), (3, 64, 1024), (192, 1024)))):
        monkeypatch.setenv("TILETUNE_CACHE_DIR", str(fresh / str(i)))     # an empty store
        tiletune.clear_cache()
        for shape in shapes:
            check(shape, torch.bfloat16, torch.bfloat16)
        assert R._fwd.searches == 1 and R._bwd.searches == 1


# Every config of each kernel (the others on their defaults), not only the searches' winners, on
# grids where a persistent CTA makes many trips of its tile loop: tileiras 13.4 built TMA loops
# of other kernels that went wrong only there (references/hardware-constraints.md).
EVERY = [("fwd", (20011, 4096)), ("fwd", (8001, 20000)), ("bwd", (20011, 4096)),
         ("bwd_coef", (8001, 20000)), ("bwd_cols", (8001, 20000)), ("column_sum", (20011, 4096)),
         # (..., N) tensors the kernels view as rows
         ("fwd", (8, 2501, 4096)), ("fwd", (20011, 1, 4096)), ("bwd", (7, 2861, 4096)),
         ("fwd", (3, 2667, 20000))]
TUNERS = {"fwd": R._fwd, "bwd": R._bwd, "bwd_coef": R._bwd_coef, "bwd_cols": R._bwd_cols,
          "column_sum": partials._column_sum}


@pytest.mark.parametrize("kernel,shape", EVERY, ids=str)
def test_every_config_is_correct(fresh, monkeypatch, kernel, shape):
    tuner = TUNERS[kernel]
    space = list(tuner.configs("sm_90", n_cols=shape[-1]))
    for cfg in each_config(monkeypatch, tuner, space):
        check(shape, torch.bfloat16, torch.bfloat16, grad=kernel != "fwd")
        assert [c for c, _ in tuner.cache.values()] == [cfg], vars(cfg)
        if kernel in ("fwd", "bwd", "bwd_coef") and getattr(cfg, "persistent", True):
            assert_each_cta_loops(cdiv(math.prod(shape[:-1]), getattr(cfg, "tile_m", 1)), cfg)


# Default configs (DISABLE_AUTOTUNE=1): every shape x every dtype.
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("dt", [torch.float32, torch.float16, torch.bfloat16], ids=str)
def test_disable_autotune_never_searches(fresh, monkeypatch, shape, dt):
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    monkeypatch.setattr(timing, "search_kernels",
                        lambda *a, **k: pytest.fail("a search under DISABLE_AUTOTUNE=1"))
    check(shape, dt, dt)
    assert all(t.searches == 0 for t in tiletune.tuners().values())


@pytest.mark.parametrize("eps", [0.5, 1e-2], ids=str)
def test_eps_moves_the_result(fresh, monkeypatch, eps):
    """Inputs of mean square 9 leave eps=1e-6 invisible: here eps is a few percent of the mean
    square (float32: a kernel that ignores or misplaces eps misses the 2e-5 tolerance)."""
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    check((65, 4096), torch.float32, torch.float32, eps=eps * 9)
    check((3, 20000), torch.float32, torch.float32, eps=eps * 9)      # the chunked kernel


@pytest.mark.parametrize("dt,wdt", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                    (torch.float32, torch.bfloat16)], ids=str)
def test_weight_dtype_differs(fresh, dt, wdt):
    check((33, 4096), dt, wdt)
    keys = list(R._fwd.cache)
    assert any(wdt in k for k in keys)


def test_second_call_no_search_no_replace_hints(fresh, monkeypatch):
    x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    rms_norm(x, w)
    assert R._fwd.searches == 1
    monkeypatch.setattr(ct.kernel, "replace_hints", lambda *a, **k: pytest.fail("replace_hints"))
    monkeypatch.setattr(timing, "search_kernels", lambda *a, **k: pytest.fail("search"))
    rms_norm(x, w)
    rms_norm(torch.randn(60, 2048, device="cuda", dtype=torch.bfloat16), w)   # same M bucket
    assert R._fwd.searches == 1


def test_tuned_kernel_is_compiled_once(fresh):
    x = torch.randn(64, 2048, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2048, device="cuda", dtype=torch.bfloat16)
    rms_norm(x, w)
    (cfg, kernel), = R._fwd.cache.values()
    rms_norm(x, w)
    assert R._fwd.cache[next(iter(R._fwd.cache))][1] is kernel
    rec = next(iter(R._fwd.records.values()))
    assert rec.source == "search" and rec.timings and rec.rates.get("gb_per_s", 0) > 0


_CHILD = """
import torch
from tiletune.ops import rms_norm as R
x = torch.randn(128, 3000, device="cuda", dtype=torch.float16)
w = torch.randn(3000, device="cuda", dtype=torch.float16)
R.rms_norm(x.requires_grad_(), w.requires_grad_()).sum().backward()
from tiletune.ops import partials
print("SEARCHES", sum(t.searches for t in R.TUNERS + partials.TUNERS))
"""


def test_second_process_reuses_store(tmp_path):
    env = dict(os.environ, TILETUNE_CACHE_DIR=str(tmp_path / "store"))
    env.pop("DISABLE_AUTOTUNE", None)
    out = [subprocess.run([sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True,
                          timeout=600) for _ in range(2)]
    for o in out:
        assert o.returncode == 0, o.stderr[-2000:]
    first, second = (int(o.stdout.split("SEARCHES")[1]) for o in out)
    assert first == 3 and second == 0   # fwd, bwd, dweight sum (not the wide-row pair)


def test_eight_threads_cold_key_one_search(fresh):
    x = torch.randn(96, 1536, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(1536, device="cuda", dtype=torch.bfloat16)
    outs, errors = [None] * 8, []

    def work(i):
        try:
            outs[i] = rms_norm(x, w)
        except Exception as e:
            errors.append(e)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    torch.cuda.synchronize()
    assert not errors and R._fwd.searches == 1
    assert all(torch.equal(o, outs[0]) for o in outs)


_CONTEXT_CHILD = """
import ctypes, torch
from tiletune.ops.rms_norm import rms_norm
libcuda = ctypes.CDLL("libcuda.so.1")
seen = []
class Probe(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a.clone()
    @staticmethod
    def backward(ctx, g):
        c = ctypes.c_void_p()
        libcuda.cuCtxGetCurrent(ctypes.byref(c))
        seen.append(c.value or 0)
        return g
x = torch.randn(8, 64, device="cuda", requires_grad=True)
w = torch.ones(64, device="cuda", requires_grad=True)
Probe.apply(x).sum().backward()                 # the probe alone
rms_norm(Probe.apply(x), w).sum().backward()    # rms_norm's backward runs before the probe's
print("CONTEXTS", *seen)
"""


def test_backward_makes_a_context_current_on_autograd_thread(tmp_path):
    """A fresh process: torch's autograd thread for device 0 starts with no current CUDA
    context (where allocations and launches cost more); a backward of ours makes one current."""
    env = dict(os.environ, TILETUNE_CACHE_DIR=str(tmp_path / "store"), DISABLE_AUTOTUNE="1")
    o = subprocess.run([sys.executable, "-c", _CONTEXT_CHILD], env=env, capture_output=True,
                       text=True, timeout=600)
    assert o.returncode == 0, o.stderr[-2000:]
    alone, after = (int(v) for v in o.stdout.split("CONTEXTS")[1].split())
    print("context before / after a backward of ours:", alone, after)
    assert after != 0


def test_torch_compile_fullgraph(fresh):
    x = torch.randn(4, 50, 2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(2048, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def f(x, w):
        return rms_norm(x * 2, w)
    # The loss is summed outside the compiled graph: Inductor would sum 400k float32 values in
    # another order than eager (5e-5 apart), which is not what this test is about.
    eager = f(x, w)
    gx, gw = torch.autograd.grad(eager.float().sum(), (x, w))
    compiled = torch.compile(f, fullgraph=True)
    out = compiled(x, w)
    cx, cw = torch.autograd.grad(out.float().sum(), (x, w))
    torch.testing.assert_close(out, eager)
    torch.testing.assert_close(cx, gx)
    torch.testing.assert_close(cw, gw)


def test_cuda_graph_replay(fresh):
    x = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(4096, device="cuda", dtype=torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        rms_norm(x, w)             # warm-up tunes outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = rms_norm(x, w)
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    assert_rows_close(y, reference(x, w, 1e-6), TOL[torch.bfloat16])


_GRAPH_AFTER_CLEAR = """
import gc, torch, tiletune
from tiletune.ops.rms_norm import rms_norm
x = torch.randn(256, 1000, device="cuda", dtype=torch.bfloat16)
w = torch.rand(1000, device="cuda", dtype=torch.bfloat16)
s = torch.cuda.Stream()
s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s):
    rms_norm(x, w)                      # resolves the key outside the capture
torch.cuda.current_stream().wait_stream(s)
g = torch.cuda.CUDAGraph()
with torch.cuda.graph(g):
    y = rms_norm(x, w)
tiletune.clear_cache()
gc.collect()
x.copy_(torch.randn_like(x))
y.fill_(float("nan"))
g.replay()
torch.cuda.synchronize()
print("EQUAL", torch.equal(y, rms_norm(x, w)))
del g
"""


def test_graph_replays_after_clear_cache(tmp_path):
    """clear_cache() forgets results but keeps the compiled kernels a captured graph holds
    (a freed kernel object unloads its code). A fresh process: a crash must not take pytest."""
    env = dict(os.environ, TILETUNE_CACHE_DIR=str(tmp_path / "store"), DISABLE_AUTOTUNE="1")
    r = subprocess.run([sys.executable, "-c", _GRAPH_AFTER_CLEAR], env=env, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and "EQUAL True" in r.stdout, (r.returncode, r.stderr[-2000:])


def test_capture_of_cold_key_does_not_search(fresh):
    x = torch.randn(100, 640, device="cuda", dtype=torch.float16)
    w = torch.rand(640, device="cuda", dtype=torch.float16)
    ref = reference(x, w, 1e-6)
    g = torch.cuda.CUDAGraph()
    with pytest.warns(UserWarning, match="capture"):
        with torch.cuda.graph(g):
            y = rms_norm(x, w)
    g.replay()
    torch.cuda.synchronize()
    assert R._fwd.searches == 0
    assert_rows_close(y, ref, TOL[torch.float16])


def test_non_contiguous_input(fresh):
    base = torch.randn(64, 2, 4096, device="cuda", dtype=torch.bfloat16)
    x = base[:, 1, :]                    # row stride 8192: a strided view
    w = torch.rand(4096, device="cuda", dtype=torch.bfloat16)
    assert_rows_close(rms_norm(x, w), reference(x, w, 1e-6), TOL[torch.bfloat16])
    xt = torch.randn(4096, 64, device="cuda", dtype=torch.float32).t()   # last dim not unit stride
    wt = torch.rand(4096, device="cuda", dtype=torch.float32)
    assert_rows_close(rms_norm(xt, wt), reference(xt, wt, 1e-6), TOL[torch.float32])


def test_batched_rows_in_other_layouts(fresh):
    """(B, S, N) views, forward and backward against float64: rows of a wider tensor (the
    kernels view it as rows), the batch and sequence dims swapped (copied as rows), one position
    of a longer sequence (an (M, N) view), a (B, 1, S, N) slice of a longer cache."""
    w = torch.rand(4096, device="cuda", dtype=torch.bfloat16) + 0.5
    wide = torch.randn(2, 48, 4160, device="cuda", dtype=torch.bfloat16)[..., :4096]
    swapped = torch.randn(48, 2, 4096, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
    last = torch.randn(6, 33, 4096, device="cuda", dtype=torch.bfloat16)[:, -1:]
    # (B, 1, S, N) of a longer buffer: rows that do not merge across the size-1 dim
    cache = torch.randn(3, 1, 40, 4096, device="cuda", dtype=torch.bfloat16)[:, :, :17]
    for x in (wide, swapped, last, cache):
        poison_allocator(torch)
        xr, wr = x.detach().requires_grad_(), w.detach().clone().requires_grad_()
        y = rms_norm(xr, wr)
        ref_x, ref_w = x.double().requires_grad_(), w.double().requires_grad_()
        ref = reference(ref_x, ref_w, 1e-6)
        assert y.shape == x.shape
        assert_rows_close(y, ref, TOL[torch.bfloat16], "y")
        dy = torch.randn_like(y)
        y.backward(dy)
        ref.backward(dy.double())
        assert_dx_rows_close(xr.grad, ref_x.grad, x, dy, w, 1e-6, 2 * TOL[torch.bfloat16])
        assert rel(wr.grad, ref_w.grad) < 2 * TOL[torch.bfloat16]


def test_frozen_weight_gets_no_gradient_and_x_the_right_one(fresh):
    """LoRA-style: the weight needs no gradient (no column-sum launch); dx against float64, in
    one tile and in wide rows."""
    for shape in ((37, 4096), (5, 20000)):
        x = torch.randn(shape, device="cuda", dtype=torch.bfloat16).requires_grad_()
        w = torch.rand(shape[-1], device="cuda", dtype=torch.bfloat16) + 0.5
        poison_allocator(torch)
        y = rms_norm(x, w)
        dy = torch.randn_like(y)
        (dx,) = torch.autograd.grad(y, x, dy)
        x64 = x.detach().double().requires_grad_()
        (ex,) = torch.autograd.grad(reference(x64, w.double(), 1e-6), x64, dy.double())
        assert_dx_rows_close(dx, ex, x, dy, w, 1e-6, 2 * TOL[torch.bfloat16])
    assert not partials._column_sum.records


def test_merged_rows_reach_the_kernels_without_a_view(fresh, monkeypatch):
    """Contiguous (B, S, N) and (B, S, H, D) tensors are the very tensors the kernels get,
    forward and backward; dx comes back in x's shape."""
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    seen = []
    for name in ("launch_fwd", "launch_bwd"):
        real = getattr(R, name)

        def spy(*args, real=real):
            seen.append(args)
            real(*args)
        monkeypatch.setattr(R, name, spy)
    for shape in ((2, 33, 1024), (2, 5, 4, 128), (2, 3, 20000)):
        seen.clear()
        check(shape, torch.bfloat16, torch.bfloat16)
        (fx, _, fy, *_), (bdy, bx, _, _, bdx, *_) = seen
        assert all(t.shape == shape for t in (fx, fy, bdy, bx, bdx)), shape


def test_empty_batch(fresh):
    """No rows: an empty output and x gradient, a zero weight gradient."""
    w = torch.rand(4096, device="cuda", requires_grad=True)
    for shape in [(0, 4096), (2, 0, 4096)]:
        x = torch.randn(shape, device="cuda", requires_grad=True)
        w.grad = None
        y = rms_norm(x, w)
        assert y.shape == x.shape
        poison_allocator(torch)                 # an unwritten weight gradient shows as NaN
        y.sum().backward()
        assert x.grad.shape == x.shape
        assert w.grad.shape == w.shape and w.grad.dtype == w.dtype
        assert not w.grad.count_nonzero(), shape


def test_bad_input():
    x = torch.randn(4, 64, device="cuda")
    w = torch.rand(64, device="cuda")
    with pytest.raises(ValueError, match="x must be a CUDA tensor"):
        rms_norm(x.cpu(), w)
    with pytest.raises(ValueError, match="weight must be a CUDA tensor"):
        rms_norm(x, w.cpu())
    with pytest.raises(ValueError, match="weight must have shape"):
        rms_norm(x, torch.rand(63, device="cuda"))
    with pytest.raises(TypeError, match="x dtype"):
        rms_norm(x.to(torch.int32), w)
    with pytest.raises(TypeError, match="weight dtype"):
        rms_norm(x, w.double())
    with pytest.raises(ValueError, match="eps"):
        rms_norm(x, w, eps=-1e-6)
    with pytest.raises(TypeError, match="x must be a torch.Tensor"):
        rms_norm([1.0], w)


def test_module_hf_attributes(fresh):
    from tiletune.suites.hf import RMSNorm
    m = RMSNorm(1024, eps=1e-5).cuda().to(torch.bfloat16)
    assert m.weight.shape == (1024,) and m.variance_epsilon == 1e-5
    x = torch.randn(2, 9, 1024, device="cuda", dtype=torch.bfloat16)
    assert_rows_close(m(x), reference(x, m.weight, 1e-5), TOL[torch.bfloat16])


def test_int32_overflow_rows_are_chunked():
    assert row_chunks(10, 100) == ((0, 10),)
    chunks = row_chunks(70000, 65536)
    assert chunks[0][0] == 0 and chunks[-1][1] == 70000
    assert all((e - s) * 65536 < 2**31 for s, e in chunks)


def test_examples_run_and_agree():
    fixed, tuned = run_example_pair("01_rmsnorm_occupancy_only")
    assert_pair_agrees(fixed, tuned)
    assert float(tuned["us"]) <= float(fixed["us"]) * 1.05, (fixed, tuned)


def test_more_than_2_31_elements(fresh, monkeypatch):
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")     # one launch per chunk, no search: keep it quick
    M, N = 65600, 32768                            # 2.15e9 elements > 2**31
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    w = torch.rand(N, device="cuda", dtype=torch.bfloat16)
    y = rms_norm(x, w)
    for rows in (slice(0, 8), slice(M // 2 - 4, M // 2 + 4), slice(M - 8, M)):
        assert_rows_close(y[rows], reference(x[rows], w, 1e-6), TOL[torch.bfloat16])
    del x, y


def test_aot_signature_matches_jit():
    """The CI compile's signatures (tiletune.aot.jit_array) equal what the JIT infers on the GPU,
    for (M, N) rows and the (..., N) tensors the kernels view as rows."""
    from cuda.tile.compilation import CallingConvention, KernelSignature
    from tiletune.aot import F32, jit_array, signature
    for shape, dt in [((4096, 4096), torch.bfloat16), ((1000, 1001), torch.float16),
                      ((1, 4097), torch.float32), ((4, 1024, 4096), torch.bfloat16),
                      ((4096, 1, 4096), torch.bfloat16), ((2, 2048, 32, 128), torch.bfloat16)]:
        M, N = math.prod(shape[:-1]), shape[-1]
        x = torch.randn(shape, device="cuda", dtype=dt)
        w = torch.rand(N, device="cuda", dtype=torch.float32)
        y, r = torch.empty_like(x), torch.empty(M, device="cuda")
        tn = R.next_pow2(N)
        jit = KernelSignature.from_kernel_args(R.rms_norm_fwd_rows, (x, w, y, r, 1.0 / N, 1e-6, 1, tn),
                                               CallingConvention.cutile_python_v2())
        mine = signature([jit_array(x.dtype, x.shape), jit_array(w.dtype, w.shape),
                          jit_array(y.dtype, y.shape), jit_array(r.dtype, r.shape), F32, F32, 1, tn])
        assert jit.parameters == mine.parameters, shape


def test_no_grad_stand_in_has_the_real_rstd_signature():
    """A call no gradient reaches hands the kernel a stand-in rstd; the JIT must see the same
    signature as with the real (M,) rstd, or the first such call compiles a second kernel."""
    from cuda.tile.compilation import CallingConvention, KernelSignature
    conv = CallingConvention.cutile_python_v2()
    for M in (1, 5, 16, 17, 64, 1000, 4096):
        x = torch.randn(M, 256, device="cuda", dtype=torch.bfloat16)
        w = torch.rand(256, device="cuda", dtype=torch.bfloat16)
        y = torch.empty_like(x)
        sigs = [KernelSignature.from_kernel_args(R.rms_norm_fwd_rows,
                                                 (x, w, y, r, 1 / 256, 1e-6, 1, 256), conv)
                for r in (torch.empty(M, device="cuda"), R._NO_RSTD.get(x, 0, M))]
        assert sigs[0].parameters == sigs[1].parameters, M
