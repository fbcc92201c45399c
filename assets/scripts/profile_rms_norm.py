"""Where the time of one RMSNorm training step goes (torch.profiler kernel table)."""
import torch
from torch.profiler import ProfilerActivity, profile

from tiletune.ops.rms_norm import rms_norm

for M, N in [(4096, 8192), (16384, 4096)]:
    x = torch.randn(M, N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.rand(N, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)
    for _ in range(3):
        torch.autograd.grad(rms_norm(x, w), (x, w), dy)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            torch.autograd.grad(rms_norm(x, w), (x, w), dy)
        torch.cuda.synchronize()
    print(f"== {M}x{N}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))
