"""One GPU call's worth of exploration for RMSNorm search-space design (not part of the suite).

Runs exhaustive_search over a deliberately wide space at the headline shapes and prints every
timing, next to torch / torch.compile / Liger / TileGym and the copy-bandwidth ceiling. Also
checks host-side launch costs and the AOT signature helper against the JIT's own signature.
"""
import json
import os
import time

import cuda.tile as ct
import torch
import triton.testing
from cuda.tile.tune import exhaustive_search

from tiletune.aot import F32, jit_array, signature
from tiletune.ops import rms_norm as R

out_dir = os.environ.get("OUT", "/tmp")
dev = torch.device("cuda")
sms = torch.cuda.get_device_properties(0).multi_processor_count
print("device:", torch.cuda.get_device_name(0), "SMs", sms, "torch", torch.__version__)
results = {}


def bench(fn):
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3  # us


def peers():
    out = {}
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        out["liger"] = lambda x, w: LigerRMSNormFunction.apply(x, w, 1e-6)
    except Exception as e:
        print("liger unavailable:", e)
    try:
        from tilegym.ops.cutile.rms_norm import rms_norm as tg
        out["tilegym"] = lambda x, w: tg(x, None, w, 1e-6)
    except Exception as e:
        print("tilegym unavailable:", e)
    return out


P = peers()
for (M, N) in [(16384, 4096), (4096, 8192)]:
    x = torch.randn(M, N, device=dev, dtype=torch.bfloat16)
    w = torch.randn(N, device=dev, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    rstd = torch.empty(M, device=dev, dtype=torch.float32)
    nbytes = 2 * x.numel() * 2
    row = {"shape": [M, N]}
    row["copy_us"] = bench(lambda: y.copy_(x))
    row["torch_us"] = bench(lambda: torch.nn.functional.rms_norm(x, (N,), w, 1e-6))
    comp = torch.compile(lambda x, w: torch.nn.functional.rms_norm(x, (N,), w, 1e-6))
    row["compile_us"] = bench(lambda: comp(x, w))
    for name, fn in P.items():
        try:
            row[name + "_us"] = bench(lambda: fn(x, w))
        except Exception as e:
            print(name, "failed:", e)
    # forward: wide space
    cfgs = list(R.fwd_configs("sm_90", N, tile_elems=(4096, 8192, 16384, 32768), occupancies=(1, 2, 4, 8, 16, 32)))
    cfgs += [c for c in R.fwd_configs("sm_90", 40000)]  # chunked variants on this N too
    kern = lambda c: R.rms_norm_fwd_rows if c.kind == "rows" else R.rms_norm_fwd_chunked
    t0 = time.time()
    res = exhaustive_search(cfgs, torch.cuda.current_stream(), lambda c: R._fwd_grid(c, M, 0), kern,
                            lambda c: (x, w, y, rstd, 1.0 / N, 1e-6, c.tile_m, c.tile_n), R._fwd.hints, quiet=True)
    row["fwd_search_s"] = time.time() - t0
    print(res.summary(top_k=12, bottom_k=3))
    row["fwd"] = sorted([(str(vars(m.config)), m.mean_us) for m in res.successes], key=lambda t: t[1])
    best = res.best.config
    bk = kern(best).replace_hints(occupancy=best.occupancy)
    st = torch.cuda.current_stream()
    row["ours_fwd_us"] = bench(lambda: ct.launch(st, R._fwd_grid(best, M, 0), bk, (x, w, y, rstd, 1.0 / N, 1e-6, best.tile_m, best.tile_n)))
    ref = torch.nn.functional.rms_norm(x.float(), (N,), w.float(), 1e-6)
    row["fwd_err"] = ((y.float() - ref).norm() / ref.norm()).item()
    # backward: wide space
    dy = torch.randn_like(x)
    dx = torch.empty_like(x)
    bcfgs = list(R.bwd_configs("sm_90", N, tile_elems=(4096, 8192, 16384, 32768), occupancies=(1, 2, 4, 8, 16)))
    scratch = torch.empty((sms * 32, N), device=dev, dtype=torch.float32)
    grid = lambda c: (R._ctas(-(-M // c.tile_m), 0, c.occupancy),)
    t0 = time.time()
    res = exhaustive_search(bcfgs, st, grid, R.rms_norm_bwd_rows,
                            lambda c: (dy, x, w, rstd, dx, scratch[:grid(c)[0]], 1.0 / N, c.tile_m, c.tile_n),
                            R._bwd.hints, quiet=True)
    row["bwd_search_s"] = time.time() - t0
    print(res.summary(top_k=12, bottom_k=3))
    row["bwd"] = sorted([(str(vars(m.config)), m.mean_us) for m in res.successes], key=lambda t: t[1])
    xr = x.detach().clone().requires_grad_()
    wr = w.detach().clone().requires_grad_()
    try:
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction
        yl = LigerRMSNormFunction.apply(xr, wr, 1e-6, 0.0, "llama", False)
        row["liger_bwd_us"] = bench(lambda: torch.autograd.grad(yl, (xr, wr), dy, retain_graph=True))
    except Exception as e:
        print("liger bwd failed", e)
    yt = torch.nn.functional.rms_norm(xr, (N,), wr, 1e-6)
    row["torch_bwd_us"] = bench(lambda: torch.autograd.grad(yt, (xr, wr), dy, retain_graph=True))
    row["copy_GBps"] = nbytes / row["copy_us"] / 1e3
    for k in list(row):
        if k.endswith("_us") and "bwd" not in k:
            row[k.replace("_us", "_frac_copy")] = row["copy_us"] / row[k]
    results[f"{M}x{N}"] = row
    print(json.dumps({k: v for k, v in row.items() if k not in ("fwd", "bwd")}, indent=0))

# Host cost: bare ct.launch vs stream lookups, tiny shape.
x = torch.randn(64, 1024, device=dev, dtype=torch.bfloat16); w = torch.randn(1024, device=dev, dtype=torch.bfloat16)
y = torch.empty_like(x); rstd = torch.empty(64, device=dev)
k = R.rms_norm_fwd_rows.replace_hints(occupancy=4)
args = (x, w, y, rstd, 1 / 1024, 1e-6, 1, 1024)
st = torch.cuda.current_stream()
host = {}
for name, fn in [("bare_launch_stream_obj", lambda: ct.launch(st, (64,), k, args)),
                 ("launch_current_stream", lambda: ct.launch(torch.cuda.current_stream(0), (64,), k, args)),
                 ("launch_raw_int", lambda: ct.launch(torch.cuda.current_stream(0).cuda_stream, (64,), k, args)),
                 ("current_stream_only", lambda: torch.cuda.current_stream(0)),
                 ("raw_stream_only", lambda: torch._C._cuda_getCurrentRawStream(0)),
                 ("torch_empty_like", lambda: torch.empty_like(x))]:
    try:
        for _ in range(200): fn()
        torch.cuda.synchronize()
        ts = []
        for rep in range(5):
            t0 = time.perf_counter()
            for _ in range(2000): fn()
            ts.append((time.perf_counter() - t0) / 2000 * 1e6)
            torch.cuda.synchronize()
        host[name] = min(ts)
    except Exception as e:
        host[name] = f"fail {type(e).__name__}: {e}"
try:
    for _ in range(100): ct.launch(torch._C._cuda_getCurrentRawStream(0), (64,), k, args)
    torch.cuda.synchronize(); host["raw_stream_launch_ok"] = True
except Exception as e:
    host["raw_stream_launch_ok"] = f"{type(e).__name__}: {e}"
print("host us:", json.dumps(host, indent=0))
results["host_us"] = host

# AOT signature vs the JIT's.
from cuda.tile.compilation import CallingConvention, KernelSignature
sigcheck = {}
for (M, N) in [(4096, 4096), (1000, 1000), (1, 4097), (7, 1)]:
    x = torch.randn(M, N, device=dev, dtype=torch.bfloat16); w = torch.randn(N, device=dev, dtype=torch.float32)
    y = torch.empty_like(x); rstd = torch.empty(M, device=dev)
    args = (x, w, y, rstd, 1.0 / N, 1e-6, 1, R.next_pow2(N))
    jit = KernelSignature.from_kernel_args(R.rms_norm_fwd_rows, args, CallingConvention.cutile_python_v2())
    mine = signature([jit_array(x.dtype, x.shape, x.stride()), jit_array(w.dtype, w.shape, w.stride()),
                      jit_array(y.dtype, y.shape, y.stride()), jit_array(rstd.dtype, rstd.shape, rstd.stride()),
                      F32, F32, 1, R.next_pow2(N)])
    same = jit.parameters == mine.parameters
    sigcheck[f"{M}x{N}"] = same
    if not same:
        for a, b in zip(jit.parameters, mine.parameters):
            if a != b:
                print("JIT :", a); print("MINE:", b)
print("signature check:", sigcheck)
results["sigcheck"] = sigcheck
json.dump(results, open(os.path.join(out_dir, "explore_rms_norm.json"), "w"), indent=1)
