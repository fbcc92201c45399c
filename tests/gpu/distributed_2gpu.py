"""Multi-GPU tuning on two GPUs (tiletune.distributed): run under torchrun, one process per GPU.

    torchrun --standalone --nproc_per_node 2 tests/gpu/distributed_2gpu.py --dir DIR

trains a small Llama-shaped model built from tiletune's ops (rms_norm, matmul, apply_rope, fmha,
swiglu) with DDP for a few steps, each rank drawing its own random sequence lengths (so some keys
are met by one rank first, some by both at once), then rank 1 alone meets a key rank 0 never
meets while rank 0 waits in a collective. Then it checks, and prints one line per check and a
final `RESULT: PASS` or `RESULT: FAIL` (exit status 0 or 1 on every rank):

  configs      every key met by several ranks has one config on all of them (compared records)
  records      their records agree (config, timings of every config, final round)
  one search   no config of a key was timed twice in the job
  shared       some key was timed by both ranks (the shares of a search)
  stored once  each decision was written to the store once, by one rank
  replicas     the DDP replicas' parameters are identical after the steps
  extra key    the key only rank 1 met was tuned by it alone, without waiting for rank 0

--warm (same --dir as a finished run, optionally --swap-devices: rank r on cuda:1-r): the same
steps must time nothing (every key comes from the store or another rank's decision).
--measure: tune one fixed-shape training step (the same on every rank) and print `MEASURE {json}`
with the tuning wall time (first step minus second), to compare nproc 1 (no process group), 2
(mode share) and 2 with --mode replicate; each run with its own fresh --dir (its own store and
cuTile compile cache).
--dry-run: CPU and gloo, torch math instead of the kernels, the engine's real agreement path
with a stand-in search (checks this script without GPUs).

DIR holds the tiletune store (DIR/store) and the cuTile compile cache (DIR/cutile) of the run.
"""
import argparse
import datetime
import faulthandler
import json
import os
import random
import sys
import time


def parse():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", default=None, help="store and compile cache folder (fresh for a "
                   "cold run; default: a folder in the temp dir named after the torchrun job)")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--seqs", type=int, nargs="+", default=[96, 160, 224],
                   help="sequence lengths each rank draws from, per step")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--inter", type=int, default=1024)
    p.add_argument("--layers", type=int, default=1)
    p.add_argument("--vocab", type=int, default=2048)
    p.add_argument("--mode", choices=("share", "replicate"), default="share")
    p.add_argument("--timeout", type=float, default=300.0, help="set_process_group's timeout")
    p.add_argument("--warm", action="store_true", help="expect no tuning at all")
    p.add_argument("--swap-devices", action="store_true", help="rank r drives cuda:(W-1-r)")
    p.add_argument("--measure", action="store_true")
    p.add_argument("--measure-seq", type=int, default=1024)
    p.add_argument("--no-group", action="store_true", help="tune each rank alone (baseline)")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--watchdog", type=float, default=1500.0,
                   help="seconds after which the stacks are dumped and the process exits")
    return p.parse_args()


ARGS = parse()
RANK, WORLD = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
LOCAL = int(os.environ.get("LOCAL_RANK", RANK))
if ARGS.dir is None:
    import tempfile
    ARGS.dir = os.path.join(tempfile.gettempdir(),
                            f"tiletune-2gpu-{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}")
os.makedirs(ARGS.dir, exist_ok=True)
# before cuda.tile is imported (it reads its cache folder once)
os.environ["TILETUNE_CACHE_DIR"] = os.path.join(ARGS.dir, "store")
os.environ["CUDA_TILE_CACHE_DIR"] = os.path.join(ARGS.dir, "cutile")
os.environ.pop("DISABLE_AUTOTUNE", None)
faulthandler.dump_traceback_later(ARGS.watchdog, exit=True)

import torch                                                     # noqa: E402
import torch.distributed as dist                                 # noqa: E402
import torch.nn.functional as F                                  # noqa: E402

import tiletune                                                  # noqa: E402
from tiletune import distributed as tdist                       # noqa: E402
from tiletune import store                                      # noqa: E402
from tiletune.autotune import job_key                           # noqa: E402

saves = []
_real_save = store.save


def _counted_save(op, key, entry):
    saves.append([op, key])
    _real_save(op, key, entry)


store.save = _counted_save


def say(*parts):
    if RANK == 0:
        print(*parts, flush=True)


# -- the ops: tiletune's kernels, or (dry run) torch math behind stand-in tuners -------------------

def real_ops():
    from tiletune.ops.fmha import fmha
    from tiletune.ops.matmul import matmul
    from tiletune.ops.rms_norm import rms_norm
    from tiletune.ops.rope import apply_rope
    from tiletune.ops.swiglu import swiglu
    return dict(matmul=matmul, rms_norm=rms_norm, apply_rope=apply_rope,
                fmha=lambda q, k, v: fmha(q, k, v, causal=True), swiglu=swiglu)


def dry_run_ops():
    """Torch math; each call first resolves a key with a stand-in search whose times depend on
    the rank (ranks tuning alone would disagree), through the engine's real miss path."""
    import contextlib
    from types import SimpleNamespace
    import cuda.tile as ct
    import cuda.tile.tune
    from tiletune import device, precompile, timing
    from tiletune.autotune import Autotuner, Search, bucket
    device.arch = lambda d=None: "sm_90"
    device.gpu_name = lambda d: "Dry-run GPU"
    torch.cuda.current_stream = lambda *a, **k: None
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.cuda.device = lambda d: contextlib.nullcontext()
    ct.launch = lambda *a, **k: None
    precompile.enabled = lambda: False

    def search(space, stream, grid_fn, kernel, args_fn):
        time.sleep(0.02 * len(space))   # long enough for ranks that meet a key together
        ok = [cuda.tile.tune.Measurement(config=c, mean_us=10.0 + ((i + RANK) % len(space)),
                                         num_samples=5, error_margin_us=0.1)
              for i, c in enumerate(space)]
        return cuda.tile.tune.TuningResult(best=ok[0], successes=ok, failures=[])
    timing.search_kernels = search
    timing.time_interleaved = lambda c, **kw: {i: 10.0 + i for i, _, _ in c}   # search's pick

    @ct.kernel
    def kernel(x, T: ct.Constant[int]):
        ct.store(x, (ct.bid(0),), ct.load(x, (ct.bid(0),), (T,)))
    tuners = {}

    def tuned(name, key):
        t = tuners.get(name)
        if t is None:
            t = tuners[name] = Autotuner(
                f"dry_{name}", kernel,
                lambda arch, n: (SimpleNamespace(tile=16, occupancy=o) for o in (1, 2, 4, 8)),
                default=SimpleNamespace(tile=16, occupancy=1))
        dev = INDEX                     # the device index an op puts last in its key
        key = (*key, dev)
        if key not in t.cache:
            t.tune(key, dev, Search(shape=dict(n=16), grid_fn=lambda c: (1,),
                                    args_fn=lambda c: ()))

    def mm(a, b):
        tuned("matmul", (bucket(a.shape[0]), b.shape[1], a.shape[1]))
        return MatMul.apply(a, b)

    class MatMul(torch.autograd.Function):       # its backward meets keys too, as ours does
        @staticmethod
        def forward(ctx, a, b):
            ctx.save_for_backward(a, b)
            return a @ b

        @staticmethod
        def backward(ctx, dc):
            a, b = ctx.saved_tensors
            tuned("matmul", (bucket(dc.shape[0]), b.shape[0], dc.shape[1]))
            tuned("matmul", (bucket(a.shape[1]), dc.shape[1], a.shape[0]))
            return dc @ b.t(), a.t() @ dc

    def rms_norm(x, w):
        tuned("rms_norm", (x.shape[-1], bucket(x.numel() // x.shape[-1])))
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w

    def apply_rope(q, k, cos, sin):
        tuned("rope", (q.shape[1], k.shape[1], bucket(q.shape[2])))

        def rot(x):
            x1, x2 = x.chunk(2, dim=-1)
            return x * cos + torch.cat((-x2, x1), dim=-1) * sin
        return rot(q), rot(k)

    def fmha(q, k, v):
        tuned("fmha", (q.shape[1], k.shape[1], bucket(q.shape[2])))
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    def swiglu(g, u):
        tuned("swiglu", (g.shape[-1], bucket(g.numel() // g.shape[-1])))
        return F.silu(g) * u
    return dict(matmul=mm, rms_norm=rms_norm, apply_rope=apply_rope, fmha=fmha, swiglu=swiglu)


# -- a small Llama-shaped model from the ops ---------------------------------------------------------

class Block(torch.nn.Module):
    def __init__(self, hidden, heads, kv_heads, inter, dtype):
        super().__init__()
        self.heads, self.kv_heads, self.hd = heads, kv_heads, hidden // heads

        def w(*shape):
            return torch.nn.Parameter(torch.randn(*shape, dtype=dtype) * shape[0] ** -0.5)
        self.norm1 = torch.nn.Parameter(torch.ones(hidden, dtype=dtype))
        self.wqkv = w(hidden, (heads + 2 * kv_heads) * self.hd)
        self.wo = w(heads * self.hd, hidden)
        self.norm2 = torch.nn.Parameter(torch.ones(hidden, dtype=dtype))
        self.wgu = w(hidden, 2 * inter)
        self.wd = w(inter, hidden)

    def forward(self, x, cos, sin):
        B, S, H = x.shape
        h = OPS["rms_norm"](x, self.norm1).reshape(B * S, H)
        qkv = OPS["matmul"](h, self.wqkv).view(B, S, -1, self.hd).transpose(1, 2)
        q, k = qkv[:, :self.heads], qkv[:, self.heads:self.heads + self.kv_heads]
        v = qkv[:, self.heads + self.kv_heads:]
        q, k = OPS["apply_rope"](q, k, cos, sin)
        a = OPS["fmha"](q, k, v).transpose(1, 2).reshape(B * S, -1)
        x = x + OPS["matmul"](a, self.wo).view(B, S, H)
        h = OPS["rms_norm"](x, self.norm2).reshape(B * S, H)
        g, u = OPS["matmul"](h, self.wgu).chunk(2, dim=-1)
        return x + OPS["matmul"](OPS["swiglu"](g, u), self.wd).view(B, S, H)


class Tiny(torch.nn.Module):
    def __init__(self, a, dtype):
        super().__init__()
        self.emb = torch.nn.Embedding(a.vocab, a.hidden, dtype=dtype)
        self.blocks = torch.nn.ModuleList(Block(a.hidden, a.heads, a.kv_heads, a.inter, dtype)
                                          for _ in range(a.layers))
        self.norm = torch.nn.Parameter(torch.ones(a.hidden, dtype=dtype))
        self.head = torch.nn.Parameter(torch.randn(a.hidden, a.vocab, dtype=dtype)
                                       * a.hidden ** -0.5)
        self.hd = a.hidden // a.heads

    def forward(self, ids):
        B, S = ids.shape
        pos = torch.arange(S, device=ids.device, dtype=torch.float32)
        inv = 10000.0 ** (-torch.arange(0, self.hd, 2, device=ids.device) / self.hd)
        ang = torch.outer(pos, inv)
        ang = torch.cat((ang, ang), dim=-1)
        cos, sin = ang.cos(), ang.sin()
        x = self.emb(ids)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        h = OPS["rms_norm"](x, self.norm).reshape(B * S, -1)
        logits = OPS["matmul"](h, self.head).float()
        return F.cross_entropy(logits[:-1], ids.reshape(-1)[1:])


def step(model, opt, seq, seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, ARGS.vocab, (ARGS.batch, seq), generator=g).to(DEVICE)
    loss = model(ids)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item()


def sync():
    if not ARGS.dry_run:
        torch.cuda.synchronize()
    dist.barrier()


# -- what the ranks resolved -------------------------------------------------------------------------

def resolved():
    """{op | job key: {config, timings, final, failures, source, agreement}} of this rank."""
    out = {}
    for op, recs in tiletune.records().items():
        for key, r in recs.items():
            dev = key[-1] if key and isinstance(key[-1], int) else None
            jk = job_key(key, dev) if dev is not None else key
            out[f"{op} | {' | '.join(map(str, jk))}"] = {
                "config": r.config, "timings": r.timings, "final": r.final,
                "failures": r.failures, "source": r.source, "agreement": r.agreement,
                "search_s": r.search_s}
    return out


def gather(obj):
    objs = [None] * WORLD
    dist.all_gather_object(objs, obj)
    return objs


def checks_of(per_rank, extra):
    """[(name, passed, detail)] on rank 0 from every rank's resolved keys."""
    out = []
    keys = sorted({k for r in per_rank for k in r})
    shared_keys = [k for k in keys if sum(k in r for r in per_rank) > 1]
    divergent = [k for k in shared_keys
                 if len({json.dumps(r[k]["config"], sort_keys=True)
                         for r in per_rank if k in r}) > 1]
    out.append(("configs", not divergent, f"{len(shared_keys)} keys met by several ranks, "
                f"{len(divergent)} with differing configs {divergent[:3]}"))
    differ = [k for k in shared_keys
              if len({json.dumps([r[k][f] for f in ("config", "timings", "final", "failures")],
                                 sort_keys=True) for r in per_rank if k in r}) > 1]
    out.append(("records", not differ, f"{len(differ)} keys whose records differ {differ[:3]}"))
    twice, took_over, timed_by_two = [], 0, 0
    for k in keys:
        timed = [i for r in per_rank if k in r for i in r[k]["agreement"].get("timed", [])]
        if len(timed) != len(set(timed)) and ARGS.mode == "share":
            twice.append(k)
        took_over += any(r[k]["agreement"].get("took_over") for r in per_rank if k in r)
        timed_by_two += sum(bool(r[k]["agreement"].get("timed")) for r in per_rank if k in r) > 1
    if not ARGS.warm:
        out.append(("one search", not twice, f"{len(keys)} keys; {len(twice)} with a config "
                    f"timed twice; {took_over} taken over after a timeout"))
        out.append(("shared", timed_by_two > 0 or ARGS.mode == "replicate",
                    f"{timed_by_two} keys timed by more than one rank"))
    searched = {k for k in keys if any(r[k]["agreement"].get("by") == i and
                                       r[k]["agreement"].get("how") != "store"
                                       for i, r in enumerate(per_rank) if k in r)}
    written = [s for r in extra for s in r["saves"]]
    distinct = {tuple(s) for s in written}
    out.append(("stored once", len(written) == len(distinct) and
                (ARGS.warm or len(distinct) == len(searched)),
                f"{len(written)} store writes for {len(distinct)} rows; {len(searched)} keys "
                "decided by a search"))
    if ARGS.warm:
        timed = sum(len(r[k]["agreement"].get("timed", [])) for r in per_rank for k in r)
        sources = sorted({r[k]["source"] for r in per_rank for k in r})
        searches = sum(r["searches"] for r in extra)
        out.append(("warm", timed == 0 and searches == 0 and set(sources) <= {"store", "agreed"},
                    f"{timed} configs timed, {searches} searches, sources {sources}"))
    return out


def main():
    global DEVICE, INDEX, OPS
    backend = "gloo" if ARGS.dry_run else "nccl"
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=900))
    INDEX = (WORLD - 1 - LOCAL) if ARGS.swap_devices else LOCAL
    if ARGS.dry_run:
        DEVICE = torch.device("cpu")
        OPS = dry_run_ops()
    else:
        DEVICE = torch.device("cuda", INDEX)
        torch.cuda.set_device(DEVICE)
        OPS = real_ops()
    if not ARGS.no_group:
        tdist.set_process_group(timeout=ARGS.timeout, mode=ARGS.mode)
    say(f"tiletune multi-GPU test: {WORLD} ranks, backend {backend}, dir {ARGS.dir}, "
        f"mode {'none' if ARGS.no_group else ARGS.mode}{', warm' if ARGS.warm else ''}"
        f"{', measure' if ARGS.measure else ''}")
    torch.manual_seed(0)
    dtype = torch.float32 if ARGS.dry_run else torch.bfloat16
    net = Tiny(ARGS, dtype).to(DEVICE)
    model = torch.nn.parallel.DistributedDataParallel(
        net, device_ids=None if ARGS.dry_run else [DEVICE.index])
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    return measure(model, opt) if ARGS.measure else train(model, opt, net)


def train(model, opt, net):
    rng = random.Random(1234 + 7919 * RANK)
    t0 = time.perf_counter()
    sync()
    step(model, opt, ARGS.seqs[0], seed=RANK)         # one step both ranks meet at once
    losses = []
    for s in range(ARGS.steps):
        seq = rng.choice(ARGS.seqs)
        losses.append(step(model, opt, seq, seed=1000 * s + RANK))
    sync()
    train_s = time.perf_counter() - t0

    # a key only rank 1 meets, while rank 0 waits in a collective
    extra_s, extra_key = None, None
    if RANK == 1:
        before = set(resolved())
        t1 = time.perf_counter()
        a = torch.randn(777, 320, device=DEVICE, dtype=net.head.dtype)
        OPS["matmul"](a, torch.randn(320, 448, device=DEVICE, dtype=net.head.dtype))
        if not ARGS.dry_run:
            torch.cuda.synchronize()
        extra_s = time.perf_counter() - t1
        extra_key = sorted(set(resolved()) - before)
    dist.barrier()

    # replicas
    same = True
    for p in net.parameters():
        ref = p.detach().clone()
        dist.broadcast(ref, 0)
        same &= bool(torch.equal(ref, p.detach()))
    mine = resolved()
    extra = {"saves": saves, "searches": sum(t.searches for t in tiletune.tuners().values()),
             "same_params": same, "extra_s": extra_s, "extra_key": extra_key,
             "losses": losses, "train_s": train_s}
    per_rank, extras = gather(mine), gather(extra)
    ok = True
    if RANK == 0:
        checks = checks_of(per_rank, extras)
        checks.append(("replicas", all(e["same_params"] for e in extras),
                       "parameters " + ("identical" if all(e["same_params"] for e in extras)
                                        else "differ") + " across ranks"))
        e1 = extras[1] if WORLD > 1 else None
        if e1 is not None and not ARGS.warm:
            recs = [per_rank[1][k] for k in e1["extra_key"] or []]
            alone = all(r["agreement"].get("how") == "alone" for r in recs) and recs
            waited = max((r["agreement"].get("wait_s", 0.0) for r in recs), default=0.0)
            checks.append(("extra key", bool(alone) and waited < 1.0,
                           f"{len(recs)} keys met by rank 1 only, tuned alone in "
                           f"{e1['extra_s']:.2f} s, {waited:.3f} s waiting"))
        for name, passed, detail in checks:
            print(f"CHECK {name:12s} {'PASS' if passed else 'FAIL'}  {detail}", flush=True)
        ok = all(p for _, p, _ in checks)
        hows = {}
        for r in per_rank:
            for k, v in r.items():
                hows[v["agreement"].get("how", "-")] = hows.get(v["agreement"].get("how", "-"),
                                                                0) + 1
        wait = [sum(v["agreement"].get("wait_s", 0.0) for v in r.values()) for r in per_rank]
        print(f"keys per rank {[len(r) for r in per_rank]}; decisions by origin {hows}; "
              f"waiting per rank {[round(w, 2) for w in wait]} s; training (tuning included) "
              f"per rank {[round(e['train_s'], 1) for e in extras]} s; searches per rank "
              f"{[e['searches'] for e in extras]}", flush=True)
        print(f"RESULT: {'PASS' if ok else 'FAIL'}", flush=True)
    verdict = [ok]
    dist.broadcast_object_list(verdict, 0)
    return 0 if verdict[0] else 1


def measure(model, opt):
    """Tuning wall time of one fixed-shape step (the same keys on every rank)."""
    seq = ARGS.measure_seq
    sync()
    t0 = time.perf_counter()
    step(model, opt, seq, seed=RANK)
    sync()
    first = time.perf_counter() - t0
    t0 = time.perf_counter()
    step(model, opt, seq, seed=RANK + 1)
    sync()
    second = time.perf_counter() - t0
    mine = resolved()
    row = {"rank": RANK, "first_s": first, "second_s": second, "tuning_s": first - second,
           "keys": len(mine),
           "searches": sum(t.searches for t in tiletune.tuners().values()),
           "configs_timed": sum(len(v["agreement"].get("timed", []))
                                if v["agreement"] else
                                (len(v["timings"]) + len(v["failures"])
                                 if v["source"] == "search" else 0) for v in mine.values()),
           "wait_s": sum(v["agreement"].get("wait_s", 0.0) for v in mine.values()),
           "search_s": sum(v["search_s"] for v in mine.values() if v["source"] == "search")}
    rows = gather(row)
    if RANK == 0:
        report = {"world": WORLD, "mode": "none" if ARGS.no_group else ARGS.mode,
                  "warm": ARGS.warm, "tuning_s": max(r["tuning_s"] for r in rows),
                  "ranks": rows}
        print("MEASURE " + json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    status = 1
    try:
        status = main()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
    sys.exit(status)
