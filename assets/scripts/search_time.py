"""Wall time of one matmul search (4096^3 bf16) in a fresh process, compile included when
CUDA_TILE_CACHE_DIR points at an empty folder."""
import os
import time

import torch

import tiletune
from tiletune.ops.matmul import matmul

os.environ["TILETUNE_CACHE_DIR"] = "off"
a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
t0 = time.perf_counter()
matmul(a, b)
torch.cuda.synchronize()
first_call = time.perf_counter() - t0
[rec] = tiletune.records()["matmul"].values()
print(f"configs={len(rec.timings)} "
      f"failed={len(rec.failures)} search_s={rec.search_s:.1f} first_call_s={first_call:.1f} "
      f"best={rec.config} {rec.best_us:.1f}us {rec.rates}")
