"""Wall time of one matmul search in a fresh process, compile included when CUDA_TILE_CACHE_DIR
points at an empty folder.  Usage: search_time.py [M N K]  (default 4096 4096 4096, bf16)."""
import os
import sys
import time

import torch

import tiletune
from tiletune.ops.matmul import matmul

os.environ["TILETUNE_CACHE_DIR"] = "off"
M, N, K = (int(v) for v in sys.argv[1:4]) if len(sys.argv) > 3 else (4096, 4096, 4096)
a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
t0 = time.perf_counter()
matmul(a, b)
torch.cuda.synchronize()
first_call = time.perf_counter() - t0
[rec] = tiletune.records()["matmul"].values()
print(f"{M}x{N}x{K} jobs={os.environ.get('TILETUNE_COMPILE_JOBS', 'default')} configs={len(rec.timings)} "
      f"failed={len(rec.failures)} search_s={rec.search_s:.1f} first_call_s={first_call:.1f} "
      f"best={rec.config} {rec.best_us:.1f}us {rec.rates}")
