"""A/B benchmarks on the current GPU: tuned vs fixed default vs the best baselines in this process.

Each op contributes `bench_cases()` -> list of BenchCase. Times are medians of CUDA-event timings
with L2 flushed before every run (as exhaustive_search does), after warm-up; every number in a row
comes from the same process and card, and the row's candidates (tuned, fixed, baselines, ceiling)
are timed in turns, so that clock drift during the row does not favour one of them.
"""
import contextlib
import json
import os
import time
from dataclasses import dataclass, field

import torch

from tiletune import autotune
from tiletune.timing import time_interleaved


@dataclass
class BenchCase:
    op: str
    name: str            # shape/dtype label
    mode: str            # "fwd" or "fwd+bwd"
    ours: object         # () -> None, runs our op (tuning happens on its first call)
    baselines: dict      # label -> () -> None
    bytes: float = 0.0   # ideal bytes moved (for GB/s)
    flops: float = 0.0
    ceiling: tuple = None  # (label, () -> None): the ceiling, e.g. a copy of the same tensor
    ceiling_scale: float = 1.0   # ceiling time = scale x time of that callable
    extra: dict = field(default_factory=dict)


def host_us(fn, n=2000, reps=5):
    """Host time per call (min over reps of the mean over n calls)."""
    for _ in range(200):
        fn()
    torch.cuda.synchronize()
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n * 1e6)
        torch.cuda.synchronize()
    return best


def _caches():
    return {name: (dict(t.cache), dict(t.records)) for name, t in autotune.tuners().items()}


def _install(caches):
    for name, t in autotune.tuners().items():
        cache, recs = caches.get(name, ({}, {}))
        t.cache.clear()
        t.cache.update(cache)
        t.records.clear()
        t.records.update(recs)


@contextlib.contextmanager
def fixed_configs(caches=None):
    """Run the block with every op on its default config (as DISABLE_AUTOTUNE=1 would), then put
    the tuned cache back. `caches` (from `_caches()` inside an earlier block) reinstalls the
    default kernels already built there instead of starting from empty caches."""
    saved = _caches()
    old = os.environ.get("DISABLE_AUTOTUNE")
    os.environ["DISABLE_AUTOTUNE"] = "1"
    try:
        _install(caches or {})
        yield
    finally:
        if old is None:
            os.environ.pop("DISABLE_AUTOTUNE", None)
        else:
            os.environ["DISABLE_AUTOTUNE"] = old
        _install(saved)


def _error(e):
    return f"{type(e).__name__}: {str(e)[:120]}"


def run_case(case):
    row = {"op": case.op, "case": case.name, "mode": case.mode}
    t0 = time.perf_counter()
    case.ours()                       # first call tunes (or loads the store)
    torch.cuda.synchronize()
    row["first_call_s"] = round(time.perf_counter() - t0, 3)
    with fixed_configs():
        case.ours()                   # builds the default kernels once
        fixed = _caches()
    candidates = [("tuned", case.ours, None),
                  ("fixed", case.ours, lambda: fixed_configs(fixed))]
    candidates += [(label, fn, None) for label, fn in case.baselines.items()]
    if case.ceiling:
        candidates.append((case.ceiling[0], case.ceiling[1], None))
    us = time_interleaved(candidates)
    if isinstance(us["tuned"], Exception):
        raise us["tuned"]
    row["tuned_us"] = us["tuned"]
    row["fixed_us"] = us["fixed"]
    row["speedup_over_fixed"] = row["fixed_us"] / row["tuned_us"]
    for label in case.baselines:
        if isinstance(us[label], Exception):   # a baseline that cannot run is reported, not fatal
            row[f"{label}_error"] = _error(us[label])
            continue
        row[f"{label}_us"] = us[label]
        row[f"vs_{label}"] = us[label] / row["tuned_us"]      # > 1: we are faster
    if case.ceiling:
        label = case.ceiling[0]
        if isinstance(us[label], Exception):
            row[f"{label}_error"] = _error(us[label])
        else:
            row[f"{label}_us"] = us[label] * case.ceiling_scale
            row[f"frac_{label}"] = row[f"{label}_us"] / row["tuned_us"]
    if case.bytes:
        row["tuned_GBps"] = case.bytes / row["tuned_us"] / 1e3
    if case.flops:
        row["tuned_TFLOPs"] = case.flops / row["tuned_us"] / 1e6
    row.update(case.extra)
    return row


def _fmt(v):
    return f"{v:.3f}" if isinstance(v, float) else str(v)


def print_table(rows):
    cols = ["case", "mode", "tuned_us", "fixed_us", "speedup_over_fixed"]
    extra = sorted({k for r in rows for k in r if k.startswith(("vs_", "frac_"))})
    cols += extra + ["tuned_GBps", "tuned_TFLOPs"]
    widths = [max(len(c), *(len(_fmt(r.get(c, "-"))) for r in rows)) for c in cols]
    print("  ".join(c.ljust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(_fmt(r.get(c, "-")).ljust(w) for c, w in zip(cols, widths)))


def plot(rows, path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    labels = [f"{r['case']} {r['mode']}" for r in rows]
    keys = sorted({k for r in rows for k in r if k.startswith(("vs_", "frac_"))})
    fig, ax = plt.subplots(figsize=(max(6, len(rows) * 1.2), 4))
    width = 0.8 / max(len(keys), 1)
    for i, k in enumerate(keys):
        ax.bar([j + i * width for j in range(len(rows))], [r.get(k, 0) for r in rows], width, label=k)
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xticks([j + 0.4 for j in range(len(rows))], labels, rotation=30, ha="right", fontsize=7)
    ax.set_ylabel("ratio (>1: tiletune faster / share of ceiling)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def _write(path, dev, rows, host):
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({"device": dev, "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                   "rows": rows, "host_us": host,
                   "tuning": {op: {str(k): r.to_json() for k, r in recs.items()}
                              for op, recs in autotune.records().items()}}, f, indent=1)


def _matches(label, pattern):
    """pattern in label; a trailing "$" anchors it at the end ("d128 bf16 fwd$": not fwd+bwd)."""
    return label.endswith(pattern[:-1]) if pattern.endswith("$") else pattern in label


def main(ops, json_path=None, plot_path=None, match=(), skip_peers=()):
    """match: keep only cases whose "name mode" contains one of these (case-insensitive; a
    trailing "$" anchors at the end);
    skip_peers: baseline labels not to time (e.g. "tilegym", whose own first-call tuning is
    slow)."""
    import importlib
    dev = torch.cuda.get_device_name(0)
    print(f"device: {dev}, torch {torch.__version__}", flush=True)
    rows, host = [], {}
    for op in ops:
        mod = importlib.import_module(f"tiletune.ops.{op}")
        try:
            cases = mod.bench_cases()
        except Exception as e:       # one op that cannot set up must not stop the others
            print(f"{op}: bench setup failed: {type(e).__name__}: {e}", flush=True)
            continue
        for case in cases:
            label = f"{case.name} {case.mode}".lower()
            if match and not any(_matches(label, m.lower()) for m in match):
                continue
            for peer in skip_peers:
                case.baselines.pop(peer, None)
            try:
                row = run_case(case)
            except Exception as e:
                print(f"{op} {case.name} {case.mode}: FAILED {type(e).__name__}: {e}", flush=True)
                continue
            rows.append(row)
            print(json.dumps(row), flush=True)
            if json_path:
                _write(json_path, dev, rows, host)
        if hasattr(mod, "bench_host"):
            host[op] = mod.bench_host()
            print(f"host overhead {op}: {json.dumps(host[op])}", flush=True)
    print()
    if rows:
        print_table(rows)
    for op, h in host.items():
        print(f"{op} host us: " + ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in h.items()))
    for op, recs in autotune.records().items():
        for k, r in recs.items():
            if r.source == "search":
                print(f"tuned {op} {[str(p) for p in k]}: {r.config} {r.best_us:.1f} us, "
                      f"{len(r.timings)} configs in {r.search_s:.1f}s, slowest "
                      f"{r.timings[-1]['mean_us']:.1f} us; final round: "
                      + (", ".join(f"{f['config']} {f['median_us']:.1f}" for f in r.final)
                         or "none"))
    if json_path:
        _write(json_path, dev, rows, host)
        print(f"wrote {json_path}")
    if plot_path:
        plot(rows, plot_path)
    return 0
