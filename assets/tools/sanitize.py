"""Run every op, forward and backward, at odd shapes under NVIDIA compute-sanitizer.

    python assets/tools/sanitize.py [--tools memcheck,racecheck,initcheck] [--ops rms_norm,...]

For each tool, two runs: DISABLE_AUTOTUNE=1 (each op's default configs) and tuned (a first run
without the sanitizer searches and stores the winners in a temporary store; the sanitized run
then launches those winners from the store, so no search runs under the sanitizer). torch's
caching allocator is off in the sanitized runs, so an out-of-bounds access into a neighbouring
tensor is reported instead of landing in the same pool block. Exit status 0 only if every run
reports no error; each run's log ends in compute-sanitizer's summary line.
"""
import argparse
import itertools
import os
import subprocess
import sys
import tempfile

import torch

TOOLS = ("memcheck", "racecheck", "initcheck")


# ---------------------------------------------------------------------------------------------
# The workload: each op at shapes that are not tile multiples, forward and backward.

def _grad_step(out, *inputs):
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.grad(outs, inputs, [torch.randn_like(o) for o in outs])


def run_rms_norm():
    from tiletune.ops.rms_norm import rms_norm
    for shape in ((37, 1000), (5, 20001)):              # one tile per row; chunked rows
        x = torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        w = torch.rand(shape[1], device="cuda", dtype=torch.bfloat16, requires_grad=True)
        _grad_step(rms_norm(x, w), x, w)


def _qk_cos_sin(B=2, Hq=6, Hk=2, S=37, D=80):
    q = torch.randn(B, S, Hq, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    k = torch.randn(B, S, Hk, D, device="cuda", dtype=torch.bfloat16).transpose(1, 2)
    ang = torch.rand(B, S, D, device="cuda")
    return q, k, ang.cos(), ang.sin()


def run_rope():
    from tiletune.ops.rope import apply_rope
    q, k, cos, sin = _qk_cos_sin()
    q.requires_grad_()
    k.requires_grad_()
    _grad_step(apply_rope(q, k, cos, sin, rotary_dim=64), q, k)
    q, k, cos, sin = _qk_cos_sin()
    apply_rope(q, k, cos, sin, inplace=True)
    pos = torch.randint(0, 37, (2, 37), device="cuda")
    apply_rope(q, k, cos, sin, position_ids=pos)


def run_rms_norm_rope():
    from tiletune.ops.rms_norm_rope import rms_norm_rope
    q, k, cos, sin = _qk_cos_sin()
    q.requires_grad_()
    k.requires_grad_()
    wq = torch.rand(80, device="cuda", requires_grad=True)
    wk = torch.rand(80, device="cuda", requires_grad=True)
    _grad_step(rms_norm_rope(q, k, wq, wk, cos, sin), q, k, wq, wk)


def run_matmul():
    from tiletune.ops.matmul import matmul
    for a_shape, b_shape in (((77, 130), (130, 95)),            # ragged
                             ((16, 2048), (2048, 200)),         # skinny: split-K configs
                             ((3, 50, 70), (3, 70, 33))):       # batched
        a = torch.randn(*a_shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        b = torch.randn(*b_shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        _grad_step(matmul(a, b), a, b)


def run_fmha():
    """Dense forward and backward; decode (Sq <= 16: split-KV and its combine) with and without
    cache lengths, for a power-of-two group, MHA and a group of 7; a packed variable-length
    batch with an empty sequence, forward and backward."""
    from tiletune.ops.fmha import fmha, fmha_varlen

    def qkv(B, Hq, Hk, Sq, Sk, D, grad=True):
        return (torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=grad)
                for H, S in ((Hq, Sq), (Hk, Sk), (Hk, Sk)))
    for shape, causal in (((1, 4, 2, 77, 77, 64), True), ((2, 2, 1, 33, 100, 80), False),
                          ((2, 8, 2, 4, 300, 64), True)):
        q, k, v = qkv(*shape)
        _grad_step(fmha(q, k, v, causal=causal), q, k, v)
    for shape in ((3, 32, 8, 1, 1000, 128), (2, 8, 8, 5, 77, 64), (2, 28, 4, 1, 300, 128)):
        q, k, v = qkv(*shape, grad=False)
        lengths = torch.tensor([shape[4], 0, 7][:shape[0]], dtype=torch.int32, device="cuda")
        for used in (None, lengths):
            fmha(q, k, v, causal=True, seqused_k=used)
    lens = [100, 0, 1, 513, 64]
    cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=torch.int32, device="cuda")
    q, k, v = (torch.randn(sum(lens), h, 64, device="cuda", dtype=torch.bfloat16,
                           requires_grad=True) for h in (8, 2, 2))
    _grad_step(fmha_varlen(q, k, v, cu, cu, max(lens), max(lens), causal=True), q, k, v)


def run_grouped_gemm():
    from tiletune.ops.grouped_gemm import grouped_mm
    E, K, N = 5, 130, 95
    counts = torch.tensor([0, 17, 40, 0, 20], device="cuda")   # empty groups, ragged sizes
    offs = counts.cumsum(0).to(torch.int32)
    x = torch.randn(int(counts.sum()), K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(E, N, K, device="cuda", dtype=torch.bfloat16).transpose(-2, -1)
    w.requires_grad_()
    _grad_step(grouped_mm(x, w, offs), x, w)


def run_fp8_gemm():
    """Each quantizer at a ragged shape, then the GEMM in each scaling mode on its results
    (K = 272: a partial 128-block; M, N not tile multiples)."""
    from tiletune.ops.fp8_gemm import fp8_mm, quantize_fp8
    M, N, K = 77, 95, 272
    x = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(N, K, device="cuda", dtype=torch.bfloat16)
    for a_g, b_g in (("tensor", "tensor"), ("row", "row"), ("block1x128", "block128x128"),
                     ("block1x128", "block1x128")):
        a, sa = quantize_fp8(x, a_g)
        b, sb = quantize_fp8(w, b_g)
        for fast in (False, True):
            fp8_mm(a, b.t(), sa, sb.t(), fast_accum=fast)


WORKLOADS = {"rms_norm": run_rms_norm, "rope": run_rope, "rms_norm_rope": run_rms_norm_rope,
             "matmul": run_matmul, "fmha": run_fmha, "grouped_gemm": run_grouped_gemm,
             "fp8_gemm": run_fp8_gemm}


def workload(names):
    for name in names:
        WORKLOADS[name]()
        torch.cuda.synchronize()
        print(f"{name}: ran", flush=True)


# ---------------------------------------------------------------------------------------------
# The driver.

def _run(cmd, env, log_path):
    with open(log_path, "w") as log:
        proc = subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
    with open(log_path) as log:
        lines = log.read().splitlines()
    # memcheck/initcheck end in "ERROR SUMMARY", racecheck in "RACECHECK SUMMARY" (hazards,
    # then errors and warnings)
    summary = next((l for l in reversed(lines) if "SUMMARY" in l), lines[-1] if lines else "")
    return proc.returncode, summary


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tools", default=",".join(TOOLS))
    parser.add_argument("--ops", default=",".join(WORKLOADS))
    parser.add_argument("--modes", default="default,tuned",
                        help="default (DISABLE_AUTOTUNE=1) and/or tuned (searched first)")
    parser.add_argument("--logs", default=".", help="folder for one log per run")
    parser.add_argument("--workload", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    ops = args.ops.split(",")
    if args.workload:
        workload(ops)
        return 0
    me = [sys.executable, os.path.abspath(__file__), "--workload", "--ops", args.ops]
    os.makedirs(args.logs, exist_ok=True)
    failed = 0
    modes = args.modes.split(",")
    with tempfile.TemporaryDirectory() as store:
        tuned = dict(os.environ, TILETUNE_CACHE_DIR=store)
        tuned.pop("DISABLE_AUTOTUNE", None)
        if "tuned" in modes:
            rc, summary = _run(me, tuned, os.path.join(args.logs, "tune.log"))
            print(f"tuning run (no sanitizer): exit {rc}", flush=True)
            failed += rc != 0
        envs = {"default": dict(os.environ, DISABLE_AUTOTUNE="1"), "tuned": tuned}
        for tool in args.tools.split(","):
            for mode in modes:
                env = dict(envs[mode], PYTORCH_NO_CUDA_MEMORY_CACHING="1")
                cmd = ["compute-sanitizer", "--tool", tool, "--error-exitcode", "99",
                       "--print-limit", "20"] + me
                rc, summary = _run(cmd, env, os.path.join(args.logs, f"{tool}-{mode}.log"))
                print(f"{tool} {mode}: exit {rc}; {summary}", flush=True)
                failed += rc != 0
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
