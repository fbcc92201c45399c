"""python -m tiletune {bench [ops...] | compile [--arch sm_90] [ops...] | cache show|clear|prune}

The ops are those registered in tiletune.registry (`--help` lists them)."""
import argparse
import json
import os
import re
import sys

import tiletune
from tiletune import store

KNOWN_MAJORS = (8, 9, 10, 11, 12)      # compute capability majors tileiras compiles for


class _Parser(argparse.ArgumentParser):
    """An ArgumentParser whose epilog may be a function, called only when help is printed (the
    registry loads every case module: `cache show` need not pay for it)."""

    def format_help(self):
        epilog = self.epilog
        if callable(epilog):
            self.epilog = epilog()
        try:
            return super().format_help()
        finally:
            self.epilog = epilog


def _registered():
    """{op name: case module}, or raises what the registry raised."""
    from tiletune import registry
    return registry.ops()


def _ops_epilog():
    try:
        names = list(_registered())
    except Exception as e:
        return (f"ops: cannot load the registered ops ({type(e).__name__}: "
                f"{str(e).strip().splitlines()[0] if str(e).strip() else ''})")
    return f"ops: {', '.join(names)}"


def _arch(value):
    """argparse type of --arch: sm_<major><minor> with a major tileiras knows."""
    m = re.fullmatch(r"sm_(\d{2,3})", value)
    if not m or int(m.group(1)) // 10 not in KNOWN_MAJORS:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not an arch of the form sm_<major><minor> with major in "
            f"{', '.join(map(str, KNOWN_MAJORS))} (e.g. sm_80, sm_90, sm_100, sm_120)")
    return value


def _ops(parser, names):
    """The named ops (default: all registered), checked against the registry: one error that
    lists the known ops for unknown names."""
    try:
        known = _registered()
    except Exception as e:
        sys.exit(f"tiletune: cannot load the registered ops ({type(e).__name__}: {e})")
    names = list(dict.fromkeys(names)) or list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        parser.error(f"unknown op{'s' if len(unknown) > 1 else ''} {', '.join(unknown)}; "
                     f"known: {', '.join(known)}")
    return names


def _compile(ops, archs, jobs):
    from tiletune import aot
    os.environ.setdefault("CUDA_TILE_COMPILER_TIMEOUT_SEC", "120")
    n = sum(len(aot.op_cases(op)) for op in ops)
    compiles = n * len(archs)
    if not compiles:
        print(f"nothing to compile: no compile cases in {', '.join(ops)}")
        return 0
    procs = min(jobs or os.cpu_count() or 1, compiles)
    print(f"compiling {n} kernel configs of {', '.join(ops)} for {', '.join(archs)} "
          f"({compiles} compiles, {procs} process{'' if procs == 1 else 'es'}) ...", flush=True)
    report = aot.compile_all(ops, archs, jobs=procs)
    for label, err in report.failed:
        print(f"FAILED {label}: {err}")
    secs = sorted(s for _, s in report.ok)
    total = len(report.ok) + len(report.failed)
    if secs:
        print(f"compiled {len(report.ok)}/{total}; "
              f"median {secs[len(secs) // 2]:.2f}s, max {secs[-1]:.2f}s per compile")
    else:
        print(f"compiled 0/{total}")
    return 1 if report.failed else 0


def cmd_compile(args):
    return _compile(args.ops, list(dict.fromkeys(args.arch or ["sm_90"])), args.jobs)


def _installed_versions():
    """(cuda-tile version or None, tileiras version): what Autotuner.store_key puts in keys."""
    import importlib.metadata
    try:
        import cuda.tile as ct
        cuda_tile = ct.__version__
    except Exception:
        cuda_tile = None
    try:
        tileiras = importlib.metadata.version("nvidia-cuda-tileiras")
    except importlib.metadata.PackageNotFoundError:
        tileiras = "unknown"
    return cuda_tile, tileiras


def _prune(d, older_than_days):
    cuda_tile, tileiras = _installed_versions()
    if cuda_tile is None:
        print("cuda-tile cannot be imported: its version is not checked")
    removed = store.prune(cuda_tile, tileiras,
                          None if older_than_days is None else older_than_days * 86400.0)
    for op, n in removed.items():
        print(f"  {op}: removed {n} entr{'y' if n == 1 else 'ies'}")
    total = sum(removed.values())
    age = "" if older_than_days is None else f", or saved over {older_than_days:g} days ago"
    print(f"pruned {total} entr{'y' if total == 1 else 'ies'} from {d} (keyed by other than "
          f"cuda-tile {cuda_tile or '?'} / tileiras {tileiras}{age})")
    return 0


def _days(text):
    try:
        days = float(text)
    except ValueError:
        days = -1.0
    if not days >= 0 or days == float("inf"):
        raise argparse.ArgumentTypeError(f"not a number of days >= 0: {text!r}")
    return days


def cmd_cache(args):
    """`cache show [-v]` / `cache clear` / `cache prune [--older-than DAYS]`. Prints what it can
    of a store written by anyone: an entry, timing or failure of the wrong shape is marked as
    skipped, never raised on."""
    d = store.cache_dir()
    if args.action in ("clear", "prune"):
        if d is None:
            print(f"store is off (TILETUNE_CACHE_DIR={os.environ.get('TILETUNE_CACHE_DIR', '')}):"
                  f" nothing to {args.action}")
        elif args.action == "prune":
            return _prune(d, args.older_than)
        else:
            n = store.clear()
            print(f"removed {n} entr{'y' if n == 1 else 'ies'} from {d}")
        return 0
    if d is None:
        print(f"store is off (TILETUNE_CACHE_DIR={os.environ.get('TILETUNE_CACHE_DIR', '')})")
        return 0
    found = {op: entries for op, entries in store.entries().items()
             if isinstance(entries, dict) and entries}
    if not found:
        print(f"store at {d} is empty")
        return 0
    total = sum(len(e) for e in found.values())
    print(f"store at {d}: {total} entr{'y' if total == 1 else 'ies'}")
    width = max(len(op) for op in found)
    for op, entries in found.items():
        print(f"  {op.ljust(width)}  {len(entries)}")
    for op, entries in found.items():
        print(f"\n{op}: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}")
        for key, e in entries.items():
            for line in _entry_lines(key, e, args.verbose):
                print(line)
    return 0


def _dumps(value):
    """json.dumps, or "<unprintable>" when that fails (nested too deep, not JSON)."""
    try:
        return json.dumps(value)
    except Exception:
        return "<unprintable>"


def _number(value):
    """value when it is a real number (bool is not), else None."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _entry_lines(key, e, verbose):
    """The lines `cache show` prints for one stored entry: a malformed entry is one line that
    says so; malformed timings or failures inside a good one are one line each."""
    if not isinstance(e, dict):
        return [f"  {key}\n    malformed entry skipped (a {type(e).__name__}, not a dict)"]
    try:
        best = _number(e.get("best_us"))
        timings, failures = e.get("timings") or [], e.get("failures") or []
        timings = timings if isinstance(timings, list) else None
        failures = failures if isinstance(failures, list) else None
        search_s = e.get("search_s", "?")
        search_s = search_s if _number(search_s) is not None or search_s == "?" else "?"
        lines = [f"  {key}\n    -> {_dumps(e.get('config'))}"
                 + (f"  {best:.2f} us" if best is not None else "")
                 + f"  ({'?' if timings is None else len(timings)} configs timed, "
                   f"{'?' if failures is None else len(failures)} failed, search {search_s} s)"]
        if e.get("best_us") is not None and best is None:      # None: no timing, not malformed
            lines.append(f"    malformed best_us skipped: {_dumps(e['best_us'])[:80]}")
        if timings is None:
            lines.append("    malformed timings skipped (not a list)")
        if failures is None:
            lines.append("    malformed failures skipped (not a list)")
        if verbose:
            for t in timings or []:
                mean = _number(t.get("mean_us")) if isinstance(t, dict) else None
                if mean is None:
                    lines.append(f"       malformed timing skipped: {_dumps(t)[:80]}")
                else:
                    lines.append(f"       {mean:9.2f} us  {_dumps(t.get('config'))}")
            for f in failures or []:
                if not isinstance(f, dict):
                    lines.append(f"       malformed failure skipped: {_dumps(f)[:80]}")
                    continue
                message = f.get("message")
                first = message.splitlines()[:1] if isinstance(message, str) else []
                lines.append(f"       FAILED {_dumps(f.get('config'))}: {f.get('error', '?')}: "
                             f"{first}")
        return lines
    except Exception as exc:            # anything the checks above did not foresee
        return [f"  {key}\n    malformed entry skipped ({type(exc).__name__})"]


def cmd_bench(args):
    import torch
    if not torch.cuda.is_available():
        print("No CUDA GPU here: benchmarks need one. Running the ahead-of-time compile of every "
              "kernel config for sm_90 instead.", flush=True)
        given = [flag for flag, value in (("--full", args.full), ("--json", args.json),
                                          ("--plot", args.plot), ("--match", args.match),
                                          ("--skip-peer", args.skip_peer)) if value]
        if given:
            print(f"{', '.join(given)} ignored: no GPU to benchmark", flush=True)
        return _compile(args.ops, ["sm_90"], None)
    from tiletune import bench
    return bench.main(args.ops, full=args.full, json_path=args.json or bench.DEFAULT_JSON,
                      plot_path=args.plot, match=args.match or (),
                      skip_peers=args.skip_peer or ())


def parser():
    p = _Parser(prog="python -m tiletune", epilog=_ops_epilog,
                description="cuTile kernels that tune once per shape: benchmarks, ahead-of-time "
                            "compiles and the store of tuned configs.")
    p.add_argument("--version", action="version", version=f"tiletune {tiletune.__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{bench,compile,cache}")
    b = sub.add_parser("bench", epilog=_ops_epilog,
                       help="A/B benchmarks on this GPU (tuned vs fixed default vs peers)",
                       description="Time each op's rows on this GPU: tuned vs its fixed default "
                                   "config vs the peers installed here. Ratios > 1: tuned is "
                                   "faster. Without a GPU: the sm_90 compile instead.")
    b.add_argument("ops", nargs="*", help="ops to run (default: all)")
    b.add_argument("--full", action="store_true",
                   help="every row of each op and the host overhead per call (default: the "
                        "headline rows)")
    b.add_argument("--json", metavar="PATH", default=None,
                   help="rows as JSON, written after every row (default: bench-results/bench.json)")
    b.add_argument("--plot", metavar="PNG", default=None,
                   help="a bar chart of the ratios (needs matplotlib)")
    b.add_argument("--match", action="append", metavar="TEXT",
                   help="only rows whose 'case mode' contains this (repeatable: any of them; "
                        "case-insensitive; a trailing $ anchors at the end), e.g. "
                        "--match H32/8 --match 'D64 bf16 fwd$'")
    b.add_argument("--skip-peer", action="append", metavar="LABEL",
                   help="a baseline not to time (repeatable), e.g. tilegym")
    k = sub.add_parser("compile", epilog=_ops_epilog,
                       help="AOT-compile every config of every kernel (no GPU needed)")
    k.add_argument("ops", nargs="*", help="ops to compile (default: all)")
    k.add_argument("--arch", action="append", type=_arch, metavar="sm_XY",
                   help="target arch, sm_<major><minor>: sm_80, sm_90, sm_100, sm_120, ... "
                        "(repeatable; default sm_90)")
    k.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="compile processes (default: one per CPU core, at most one per compile)")
    c = sub.add_parser("cache", help="show, clear or prune the persistent store")
    c.add_argument("action", choices=["show", "clear", "prune"],
                   help="prune: delete entries keyed by other cuda-tile or tileiras versions "
                        "than the installed ones")
    c.add_argument("-v", "--verbose", action="store_true", help="every timing and failure")
    c.add_argument("--older-than", type=_days, default=None, metavar="DAYS",
                   help="prune: also delete entries saved more than DAYS days ago")
    return p, {"bench": b, "compile": k, "cache": c}


def main(argv=None):
    p, subs = parser()
    args = p.parse_args(argv)
    if args.cmd == "compile" and args.jobs is not None and args.jobs < 1:
        subs["compile"].error(f"--jobs must be >= 1 (got {args.jobs})")
    if args.cmd in ("bench", "compile"):
        args.ops = _ops(subs[args.cmd], args.ops)
    return {"bench": cmd_bench, "cache": cmd_cache, "compile": cmd_compile}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
