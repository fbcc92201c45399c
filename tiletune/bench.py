"""A/B benchmarks on the current GPU: tuned vs fixed default vs the best baselines in this process.

The ops come from tiletune.registry: each case module's `bench_cases(full=False)` -> list of
BenchCase (its headline rows; `full=True`: every row it has) and optionally `bench_host()`.
Times are medians of CUDA-event timings with L2 flushed before every run (as the search
does), after warm-up; every number in a row comes from the same process and card, and the row's
candidates (tuned, fixed, baselines, ceiling) are timed in turns, so that clock drift during the
row does not favour one of them.

A row may also time each candidate replayed from a CUDA graph (`BenchCase.graph`, or `--graph`
for every row). A replay costs the kernels' time alone, which is what a caller that replays
graphs sees (a serving loop's decode). The eager time includes the host's only where a call's
host work outlasts the L2 flush queued before it (a 256 MiB write) plus its kernels: the host
prepares the call while the flush runs. Every row also gives the tuned call's host time
(`host_us`: calls back to back with their kernels left queued) and the flush's (`flush_us`); a
row whose host time past the flush reaches HOST_BOUND of its eager time is marked `host_bound`:
its eager times, the fixed default's included, read the host more than the kernels. Each
baseline's host time is given and marked the same way (`<peer>_host_us`, `<peer>_host_bound`):
a ratio against a host-bound peer compares host costs. A call's host cost at a tiny shape is
`--host`'s table.

With `sustained` (`--sustained`) each candidate's turn is a 100 ms block, the first half untimed,
so that every kernel is timed at the clock its own load settles at (the power limit, for heavy
GEMMs) instead of after the idle gaps a slower or host-bound neighbour leaves: the two regimes
can order a pair differently (references/search-strategies.md, A/B method).

`main` prints one line per row as it finishes, then a table per op, the store and the number of
searches this process ran, and the host overheads; it writes the rows to JSON after every row.
"""
import contextlib
import json
import os
import time
from dataclasses import dataclass, field

import torch

from tiletune import autotune, env, precompile, registry, store
from tiletune.timing import SUSTAINED_BLOCK_MS, flush_us, time_interleaved


# A row whose tuned call costs the host, past the flush, at least this fraction of its eager
# time is host-bound
HOST_BOUND = 0.8
HOST_TIMING_US = 20000.0    # host_us_behind's calls: about this much device time, 3 to 20 calls


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
    timing: dict = field(default_factory=dict)   # time_interleaved's rounds/reps/warmup
    setup: object = None  # (case) -> None: fills in ours, baselines, ... when the row runs
                          # (rows that allocate gigabytes, so --match can skip them cheaply)
    graph: bool = False   # also time each candidate replayed from a CUDA graph (<label>_graph)


def host_in_turns(fns, n=300, rounds=7):
    """Host microseconds per call of each callable of `fns` ({label: fn}): every round times n
    calls of each in turn, and each keeps its best round. Timing one after another instead
    put the first callables after a search 1.5-2.5x behind their later rounds."""
    for fn in fns.values():
        for _ in range(20):
            fn()
    torch.cuda.synchronize()
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for label, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
            best[label] = min(best[label], (time.perf_counter() - t0) / n * 1e6)
    return best


def host_us_behind(fn):
    """Host microseconds per call of fn with its kernels left queued behind the host: calls back
    to back with no synchronization between them, as a training or serving loop makes them
    (about HOST_TIMING_US of queued work by one synchronized call's time, 3 to 20 calls). Where
    this reaches a row's eager time, that time is the host's."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    one_us = (time.perf_counter() - t0) * 1e6
    n = max(3, min(20, int(HOST_TIMING_US / max(one_us, 1.0))))
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    us = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return us


def leaves(*tensors):
    """Detached copies that require grad (same strides): a step's inputs."""
    return tuple(t.detach().clone().requires_grad_() for t in tensors)


def grad_step(f, inputs, grads=None):
    """() -> one training step: f(*inputs) (a tensor or a tuple of them), then
    torch.autograd.grad into `inputs` with the output gradients `grads` (default: random ones
    shaped by the first step's outputs, then kept); nothing accumulates into .grad. Nothing
    runs before the first step: a forward made here would search the op's keys while the bench
    sets up, and the row that times that key's first call would read no tuning time."""
    def step():
        nonlocal grads
        outs = f(*inputs)
        if grads is None:
            grads = tuple(torch.randn_like(o) for o in
                          ((outs,) if isinstance(outs, torch.Tensor) else outs))
        return torch.autograd.grad(outs, inputs, grads)
    return step


def host_against_torch(call, torch_call, step=None, torch_step=None, others=None):
    """An op's host table at a tiny shape, where the GPU is never the limit: the whole call
    against torch's equivalent call and, for ops that train, one forward+backward step
    (`torch.autograd.grad`) against torch's; ratios are ours / torch's (lower is better).
    `others` ({label: fn}, e.g. peers' steps) are timed in the same turns."""
    fns = {"call": call, "torch_call": torch_call}
    if step is not None:
        fns.update(step=step, torch_step=torch_step)
    fns.update(others or {})
    us = host_in_turns(fns)
    us["call_over_torch"] = us["call"] / us["torch_call"]
    if step is not None:
        us["step_over_torch"] = us["step"] / us["torch_step"]
    return us


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


def graphed(fn, context=None):
    """fn captured once into a CUDA graph, warmed up first on a side stream (as capture needs),
    both under `context` (a context-manager factory or None) as fn's timed runs are; returns the
    graph's replay."""
    ctx = context or contextlib.nullcontext
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side), ctx():
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with ctx(), torch.cuda.graph(graph):
        fn()
    return graph.replay


def _time_graphs(row, candidates, timing):
    """The row's `<label>_graph` entries: each candidate replayed from its CUDA graph, timed in
    turns; ratios as the eager ones (`vs_fixed_graph`: the fixed default's). A candidate that
    cannot be captured is reported (`<label>_graph_error`), not fatal."""
    replays, us = [], {}
    for label, fn, ctx in candidates:
        try:
            replays.append((label, graphed(fn, ctx), None))
        except Exception as e:
            us[label] = e
    us.update(time_interleaved(replays, **timing) if replays else {})
    tuned = us["tuned"]
    if isinstance(tuned, Exception):
        row["tuned_graph_error"] = _error(tuned)
        return
    row["tuned_graph_us"] = tuned
    for label, _, _ in candidates[1:]:
        if isinstance(us[label], Exception):
            row[f"{label}_graph_error"] = _error(us[label])
            continue
        row[f"{label}_graph_us"] = us[label]
        row[f"vs_{label}_graph"] = us[label] / tuned


def run_case(case, skip_peers=(), seen_peers=None, sustained=False):
    """Time one row. skip_peers: baseline labels not to time; seen_peers (a set): gets the
    row's baseline labels, skipped ones included; sustained: every candidate in blocks of
    SUSTAINED_BLOCK_MS (time_interleaved's block_ms), the row marked "timing": "sustained"."""
    if case.setup is not None:
        case.setup(case)
    if seen_peers is not None:
        seen_peers.update(case.baselines)
    for peer in skip_peers:
        case.baselines.pop(peer, None)
    row = {"op": case.op, "case": case.name, "mode": case.mode}
    timing = dict(case.timing)
    if sustained:
        timing["block_ms"] = SUSTAINED_BLOCK_MS
        row["timing"] = "sustained"
    # torch.compile peers compile for this row's shapes alone: rows that wrap one function
    # would otherwise share dynamo's cache (a dynamic-shape graph from the second row on)
    torch._dynamo.reset()
    t0 = time.perf_counter()
    case.ours()                       # first call tunes (or loads the store)
    torch.cuda.synchronize()
    first_s = round(time.perf_counter() - t0, 3)
    # a row whose setup ran ours first (a training step measuring its memory) reports that call
    row["first_call_s"] = case.extra.pop("first_call_s", first_s)
    candidates = [("tuned", case.ours, None)]
    try:
        with fixed_configs():
            case.ours()               # builds the default kernels once
            fixed = _caches()
        candidates.append(("fixed", case.ours, lambda: fixed_configs(fixed)))
    except Exception as e:            # reported in the row; the tuned and peer numbers stand
        row["fixed_error"] = _error(e)
    candidates += [(label, fn, None) for label, fn in case.baselines.items()]
    host_us = host_us_behind(case.ours)
    ceiling = [(case.ceiling[0], case.ceiling[1], None)] if case.ceiling else []
    us = time_interleaved(candidates + ceiling, **timing)
    if isinstance(us["tuned"], Exception):
        raise us["tuned"]
    row["tuned_us"] = us["tuned"]
    row["host_us"] = host_us
    row["flush_us"] = flush = flush_us()
    if host_us - flush >= HOST_BOUND * row["tuned_us"]:
        row["host_bound"] = True
    if isinstance(us.get("fixed"), Exception):
        row["fixed_error"] = _error(us["fixed"])
    elif "fixed" in us:
        row["fixed_us"] = us["fixed"]
        row["speedup_over_fixed"] = row["fixed_us"] / row["tuned_us"]
    for label in case.baselines:
        if isinstance(us[label], Exception):   # a baseline that cannot run is reported, not fatal
            row[f"{label}_error"] = _error(us[label])
            continue
        row[f"{label}_us"] = us[label]
        row[f"vs_{label}"] = us[label] / row["tuned_us"]      # > 1: we are faster
        # the peer's host time too: where it passes the flush, the ratio compares host costs
        try:
            peer_host = row[f"{label}_host_us"] = host_us_behind(case.baselines[label])
        except Exception:
            continue
        if peer_host - flush >= HOST_BOUND * us[label]:
            row[f"{label}_host_bound"] = True
    if case.ceiling:
        label = case.ceiling[0]
        if isinstance(us[label], Exception):
            row[f"{label}_error"] = _error(us[label])
        else:
            # the ceiling's time for our work: its callable's time x the scale (both kept)
            row[f"{label}_us"] = us[label] * case.ceiling_scale
            if case.ceiling_scale != 1.0:
                row[f"{label}_scale"] = case.ceiling_scale
            row[f"frac_{label}"] = row[f"{label}_us"] / row["tuned_us"]
    if case.graph:                    # tuned, fixed and the baselines (not the ceiling)
        _time_graphs(row, candidates, timing)
    for when in ("", "_graph"):       # rates of the eager time, and of the graph's where timed
        tuned_us = row.get(f"tuned{when}_us")
        if case.bytes and tuned_us:
            row[f"tuned{when}_GBps"] = case.bytes / tuned_us / 1e3
        if case.flops and tuned_us:
            row[f"tuned{when}_TFLOPs"] = case.flops / tuned_us / 1e6
    row.update(case.extra)
    return row


# ---------------------------------------------------------------------------------------------
# Presentation: a line per row as it finishes, a table per op, the summary, the plot, the JSON.

DEFAULT_JSON = "bench-results/bench.json"


class OutputNotWritable(ValueError):
    """--json or --plot names a path that cannot be written (checked before any row runs)."""


def _peers(row):
    """The row's baseline labels in timing order: timed ones (vs_<label>) and those that could
    not run (<label>_error)."""
    return [k[3:] if k.startswith("vs_") else k[:-6] for k in row
            if k.startswith("vs_") or (k.endswith("_error") and k != "fixed_error")]


def progress_line(row):
    """One row in words: `op case mode: tuned us, Nx fixed, Nx <peer>..., N% of <ceiling>;
    tuning N s` (the first call's time: search or store lookup, compiles). A ratio > 1 means
    the tuned op is faster; a baseline that could not run reads `<peer> failed`."""
    parts = [f"{row['tuned_us']:.2f} us",
             f"{row['speedup_over_fixed']:.2f}x fixed" if "speedup_over_fixed" in row
             else "fixed failed"]
    if "tuned_graph_us" in row:
        parts.append(f"{row['tuned_graph_us']:.2f} us from a CUDA graph")
    if row.get("host_bound"):
        parts.append(f"host-bound ({row['host_us']:.2f} us of host time a call)")
    for label in _peers(row):
        v = row.get(f"vs_{label}")
        bound = " (its host-bound)" if row.get(f"{label}_host_bound") else ""
        parts.append(f"{v:.2f}x {label}{bound}" if v is not None else f"{label} failed")
    parts += [f"{row[k]:.0%} of {k[5:]}" for k in row if k.startswith("frac_")]
    return (f"{row['op']} {row['case']} {row['mode']}: " + ", ".join(parts)
            + f"; tuning {row['first_call_s']:.2f} s")


def _columns(rows):
    """(header, row -> text) per column of one op's table."""
    def num(key, fmt):
        return lambda r: fmt.format(r[key]) if isinstance(r.get(key), (int, float)) else "-"

    def ratio(label):
        key = f"vs_{label}"
        return lambda r: (f"{r[key]:.2f}x" if key in r
                          else "failed" if f"{label}_error" in r else "-")

    cols = [("case", lambda r: str(r["case"])), ("mode", lambda r: str(r["mode"])),
            ("tuned us", num("tuned_us", "{:.2f}")), ("fixed us", num("fixed_us", "{:.2f}")),
            ("vs fixed", num("speedup_over_fixed", "{:.2f}x"))]
    if any("tuned_graph_us" in r for r in rows):
        cols.append(("graph us", num("tuned_graph_us", "{:.2f}")))
    peers = list(dict.fromkeys(p for r in rows for p in _peers(r)))
    cols += [(f"vs {p}", ratio(p)) for p in peers]
    ceilings = list(dict.fromkeys(k[5:] for r in rows for k in r if k.startswith("frac_")))
    cols += [(f"% of {c}", num(f"frac_{c}", "{:.0%}")) for c in ceilings]
    if any("tuned_GBps" in r for r in rows):
        cols.append(("GB/s", num("tuned_GBps", "{:.0f}")))
    if any("tuned_TFLOPs" in r for r in rows):
        cols.append(("TFLOP/s", num("tuned_TFLOPs", "{:.1f}")))
    if any("host_us" in r for r in rows):
        cols.append(("host us", lambda r: "-" if "host_us" not in r else
                     f"{r['host_us']:.2f}" + (" bound" if r.get("host_bound") else "")))
    cols.append(("tuning s", num("first_call_s", "{:.2f}")))
    return cols


def print_table(rows):
    """One table per op (ratios > 1: the tuned op is faster; % of the ceiling's time)."""
    for i, op in enumerate(dict.fromkeys(r["op"] for r in rows)):
        mine = [r for r in rows if r["op"] == op]
        cols = _columns(mine)
        cells = [[f(r) for _, f in cols] for r in mine]
        widths = [max(len(h), *(len(c[i]) for c in cells)) for i, (h, _) in enumerate(cols)]

        def line(values):
            return "  ".join(v.ljust(w) if i < 2 else v.rjust(w)
                             for i, (v, w) in enumerate(zip(values, widths))).rstrip()
        print(("\n" if i else "") + f"{op}:")
        print("  " + line([h for h, _ in cols]))
        for c in cells:
            print("  " + line(c))


def plot(rows, path, title=None):
    """A PNG with one panel per op: per case, bars of the tuned op's speedup over its fixed
    default and over each baseline (time of the other / time of tuned; > 1: tuned is faster),
    and a line at 1.0. Returns False (and says so) when matplotlib is not installed."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("--plot ignored: matplotlib is not installed (pip install matplotlib)")
        return False
    ops = list(dict.fromkeys(r["op"] for r in rows))
    series = ["speedup_over_fixed"] + list(dict.fromkeys(
        f"vs_{p}" for r in rows for p in _peers(r)))
    names = {k: "fixed default" if k == "speedup_over_fixed" else k[3:] for k in series}
    palette = plt.get_cmap("tab20")
    colors = {k: palette(i % 20) for i, k in enumerate(series)}
    # Horizontal bars, a row per case: long case names stay readable. A log scale, since a
    # ratio of 12 (torch's eager RoPE) and one of 0.9 must both be legible.
    heights = [sum(len([k for k in series if k in r]) for r in rows if r["op"] == op) * 0.22
               + 1.2 for op in ops]
    fig, axes = plt.subplots(len(ops), 1, squeeze=False, figsize=(11.0, sum(heights) + 0.6),
                             gridspec_kw={"height_ratios": heights})
    for ax, op in zip(axes[:, 0], ops):
        mine = [r for r in rows if r["op"] == op]
        keys = [k for k in series if any(k in r for r in mine)]
        width = 0.8 / max(len(keys), 1)
        values = [r[k] for r in mine for k in keys if k in r]
        for i, k in enumerate(keys):
            ys = [j - 0.4 + width * (i + 0.5) for j in range(len(mine))]
            vals = [r.get(k, float("nan")) for r in mine]
            bars = ax.barh(ys, vals, width, label=names[k], color=colors[k])
            ax.bar_label(bars, labels=[f"{v:.2f}" if v == v else "" for v in vals],
                         fontsize=7, padding=2)
        ax.axvline(1.0, color="black", lw=1.0, ls="--")
        ax.set_xscale("log", base=2)
        lo, hi = min(values + [1.0]), max(values + [1.0])
        ax.set_xlim(min(lo / 1.3, 0.7), max(hi * 1.6, 1.5))
        ax.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_yticks(range(len(mine)), [f"{r['case']} {r['mode']}" for r in mine], fontsize=8)
        ax.set_ylim(len(mine) - 0.5, -0.5)          # first row on top
        ax.set_title(f"{op}: time of the other / time of tuned (> 1: tuned is faster)",
                     fontsize=10)
        ax.legend(fontsize=8, loc="center left", bbox_to_anchor=(1.01, 0.5))
    if title:
        fig.suptitle(title, fontsize=11)
    fig.tight_layout(rect=(0, 0, 1, 0.985) if title else None)
    fig.savefig(path, dpi=130)
    plt.close(fig)
    return True


def searches():
    """Exhaustive searches run in this process, over every Autotuner."""
    return sum(t.searches for t in autotune.tuners().values())


def _store_line():
    d = store.cache_dir()
    if d is None:
        return f"store: off (TILETUNE_CACHE_DIR={os.environ.get('TILETUNE_CACHE_DIR', '')})"
    return f"store: {d}"


def _host_line(op, h):
    return f"host overhead {op} (us per call): " + ", ".join(
        f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in h.items())


def print_summary(host):
    """Where the store is, the searches this process ran (one line per searched key), and the
    host overheads."""
    n = searches()
    print(f"{_store_line()}; {n} search{'' if n == 1 else 'es'} ran in this process")
    for op, recs in autotune.records().items():
        for k, r in recs.items():
            if r.source == "search":
                print(f"  {op} {[str(p) for p in k]}: {r.config} {r.best_us:.1f} us, "
                      f"{len(r.timings)} configs in {r.search_s:.1f}s, slowest "
                      f"{r.timings[-1]['mean_us']:.1f} us; final round"
                      + (f" ({r.final[0].get('timing', 'turns')}): " if r.final else ": ")
                      + (", ".join(f"{f['config']} {f['median_us']:.1f}" for f in r.final)
                         or "none"))
    for op, h in host.items():
        print(_host_line(op, h))


def _write(path, dev, rows, host, full=False):
    """The JSON file, replaced at once: a run stopped while it is written (Ctrl-C, an error)
    leaves the rows of the last write, not a truncated file."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    tmp = os.path.join(folder, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump({"device": dev, "torch": torch.__version__,
                       "date": time.strftime("%Y-%m-%d"), "full": full, "rows": rows,
                       "host_us": host, "searches": searches(),
                       "tuning": {op: {str(k): r.to_json() for k, r in recs.items()}
                                  for op, recs in autotune.records().items()}}, f, indent=1)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.remove(tmp)


def _matches(label, pattern):
    """pattern in label; a trailing "$" anchors it at the end ("d128 bf16 fwd$": not fwd+bwd)."""
    return label.endswith(pattern[:-1]) if pattern.endswith("$") else pattern in label


def main(ops=None, *, full=False, host=False, json_path=DEFAULT_JSON, plot_path=None, match=(),
         skip_peers=(), graph=False, sustained=False):
    """Benchmark the named ops (default: every registered op, in registration order).

    full: every row of each op (`bench_cases(full=True)`), not only its headline rows, and the
    host tables;
    host: only the host tables (`bench_host()`), no rows;
    match: keep only cases whose "name mode" contains one of these (case-insensitive; a
    trailing "$" anchors at the end);
    skip_peers: baseline labels not to time (e.g. "tilegym", whose own first-call tuning is
    slow);
    graph: time every row's candidates replayed from CUDA graphs too (`BenchCase.graph`);
    sustained: time every candidate in blocks of SUSTAINED_BLOCK_MS (`run_case`);
    json_path: written after every row and at the end (None: no JSON)."""
    modules = registry.ops()
    names = list(ops or modules)
    unknown = [n for n in names if n not in modules]
    if unknown:
        raise ValueError(f"unknown op(s) {', '.join(unknown)}; known: {', '.join(modules)}")
    for path, what in ((json_path, "--json"), (plot_path, "--plot")):
        reason = env.unwritable(os.path.abspath(path)) if path else ""
        if reason:                    # before any row is tuned and timed
            raise OutputNotWritable(f"{what} {path}: {reason}")
    dev = torch.cuda.get_device_name(0)
    precompile.warm()        # the compile workers start while the first rows set up
    print(f"device: {dev}, torch {torch.__version__}; "
          + ("host tables only (--host)" if host else "every row (--full)" if full
             else "headline rows (--full: every row)")
          + (f"; sustained blocks of {SUSTAINED_BLOCK_MS:.0f} ms (--sustained)"
             if sustained and not host else ""), flush=True)
    rows, tables, seen_peers, considered, failed = [], {}, set(), 0, 0
    for op in names:
        mod = modules[op]
        try:
            cases = [] if host else mod.bench_cases(full=full)
        except Exception as e:       # one op that cannot set up must not stop the others
            print(f"{op}: bench setup failed: {type(e).__name__}: {e}", flush=True)
            failed += 1
            continue
        for case in cases:
            considered += 1
            label = f"{case.name} {case.mode}".lower()
            if match and not any(_matches(label, m.lower()) for m in match):
                continue
            case.graph = case.graph or graph
            try:
                with autotune.searches_must_decide():     # a row's "tuned" is a winner
                    row = run_case(case, skip_peers, seen_peers, sustained)
            except Exception as e:
                print(f"{op} {case.name} {case.mode}: FAILED {type(e).__name__}: {e}", flush=True)
                failed += 1
                continue
            rows.append(row)
            print(progress_line(row), flush=True)
            if json_path:
                _write(json_path, dev, rows, tables, full)
        if (full or host) and hasattr(mod, "bench_host"):
            try:
                with fixed_configs():      # host cost does not depend on the config: no search
                    tables[op] = mod.bench_host()
            except Exception as e:
                print(f"{op}: host overhead failed: {type(e).__name__}: {e}", flush=True)
                failed += 1
            else:
                print(_host_line(op, tables[op]), flush=True)
        elif host:
            print(f"{op}: no host table (its case module has no bench_host)", flush=True)
    print()
    if rows:
        print_table(rows)
    elif match and not host:
        print(f"no row matched {' / '.join(match)} (of {considered}"
              + ("" if full else " headline rows; --full has more") + ")")
    elif not host:
        print("no rows")
    for peer in skip_peers:
        if peer not in seen_peers:
            print(f"--skip-peer {peer}: no row has that baseline "
                  f"(baselines: {', '.join(sorted(seen_peers)) or 'none'})")
    print()
    print_summary(tables)
    if json_path:
        _write(json_path, dev, rows, tables, full)
        print(f"wrote {json_path}")
    if plot_path:
        if not rows:
            print("--plot ignored: no rows to plot")
        elif plot(rows, plot_path, title=f"{dev}, torch {torch.__version__}"):
            print(f"wrote {plot_path}")
    if failed:
        print(f"{failed} row{'s' if failed > 1 else ''} or setup{'s' if failed > 1 else ''} "
              "failed (above): exit status 1")
    return 1 if failed else 0
