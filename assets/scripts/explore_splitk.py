"""Where split-K wins: skinny products with few output tiles (decode-sized M, large K). For each
shape: the tuned matmul (its search and final round, which times the fastest whole config beside
any split-K finalist) and cuBLAS timed in turns, L2 flushed.  Usage: explore_splitk.py"""
import os

import torch

import tiletune
from tiletune.ops.matmul import matmul
from tiletune.timing import time_interleaved

os.environ["TILETUNE_CACHE_DIR"] = "off"
SHAPES = [(16, 1024, 4096), (16, 4096, 14336), (32, 2048, 8192), (64, 1024, 14336),
          (128, 1024, 8192), (16, 4096, 4096)]
print(torch.cuda.get_device_name(0))
for M, N, K in SHAPES:
    a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
    err = ((matmul(a, b).float() - a.float() @ b.float()).norm() / (a.float() @ b.float()).norm()).item()
    rec = next(r for k, r in tiletune.records()["matmul"].items() if k[:3] == (M, N, K))
    us = time_interleaved([("ours", lambda: matmul(a, b), None), ("cublas", lambda: a @ b, None)],
                          rounds=5, reps=20)
    whole = [f for f in rec.final if "split" not in f["config"]]
    split = [f for f in rec.final if "split" in f["config"]]
    print(f"{M}x{N}x{K}: ours {us['ours']:.2f} us, cuBLAS {us['cublas']:.2f} us, "
          f"vs cuBLAS {us['cublas'] / us['ours']:.3f}, rel err {err:.1e}; winner {rec.config}; "
          f"final: best whole {whole[0]['median_us'] if whole else '-'} "
          f"best split {split[0]['median_us'] if split else '-'} "
          f"({split[0]['config'].get('split') if split else '-'})", flush=True)
