"""python -m tiletune {bench [ops...] | cache show|clear | compile [--arch sm_90] [ops...]}"""
import argparse
import importlib
import json
import os
import sys

from tiletune import OPS, store


def _modules(names):
    names = names or list(OPS)
    bad = [n for n in names if n not in OPS]
    if bad:
        sys.exit(f"unknown op(s) {bad}; known: {list(OPS)}")
    return [importlib.import_module(f"tiletune.ops.{n}") for n in names]


def cmd_compile(args):
    from tiletune.aot import compile_all
    os.environ.setdefault("CUDA_TILE_COMPILER_TIMEOUT_SEC", "120")
    from tiletune.aot import op_cases
    ops = [m.__name__.rsplit(".", 1)[1] for m in _modules(args.ops)]
    n = sum(len(op_cases(op)) for op in ops)
    archs = args.arch or ["sm_90"]
    print(f"compiling {n} kernel configs of {', '.join(ops)} for {', '.join(archs)} "
          f"({n * len(archs)} compiles, {args.jobs or os.cpu_count()} processes) ...", flush=True)
    report = compile_all(ops, archs, jobs=args.jobs)
    for label, err in report.failed:
        print(f"FAILED {label}: {err}")
    secs = sorted(s for _, s in report.ok)
    if secs:
        print(f"compiled {len(report.ok)}/{len(report.ok) + len(report.failed)}; "
              f"median {secs[len(secs) // 2]:.2f}s, max {secs[-1]:.2f}s per compile")
    return 1 if report.failed else 0


def cmd_cache(args):
    if args.action == "clear":
        print(f"removed {store.clear()} file(s) from {store.cache_dir()}")
        return 0
    print(f"store: {store.cache_dir()}")
    for op, entries in store.entries().items():
        print(f"{op}: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}")
        for key, e in entries.items():
            best = e.get("best_us")
            timings, failures = e.get("timings") or [], e.get("failures") or []
            print(f"  {key}\n    -> {json.dumps(e.get('config'))}"
                  + (f"  {best:.2f} us" if isinstance(best, (int, float)) else "")
                  + f"  ({len(timings)} configs timed, {len(failures)} failed,"
                    f" search {e.get('search_s', '?')} s)")
            if args.verbose:
                for t in timings:
                    print(f"       {t['mean_us']:9.2f} us  {json.dumps(t['config'])}")
                for f in failures:
                    print(f"       FAILED {json.dumps(f['config'])}: {f['error']}: "
                          f"{(f.get('message') or '').splitlines()[:1]}")
    return 0


def cmd_bench(args):
    import torch
    if not torch.cuda.is_available():
        print("No CUDA GPU here: benchmarks need one. Running the ahead-of-time compile of every "
              "kernel config for sm_90 instead.", flush=True)
        return cmd_compile(argparse.Namespace(ops=args.ops, arch=["sm_90"], jobs=None))
    from tiletune import bench
    return bench.main(args.ops or list(OPS), json_path=args.json, plot_path=args.plot,
                      match=args.match or (), skip_peers=args.skip_peer or ())


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m tiletune")
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("bench", help="A/B benchmarks on this GPU (tuned vs fixed vs baselines)")
    b.add_argument("ops", nargs="*")
    b.add_argument("--json", default="bench-results/bench.json")
    b.add_argument("--plot", default=None, help="write a PNG (needs matplotlib)")
    b.add_argument("--match", action="append", help="only cases whose 'name mode' contains this "
                   "(repeatable: any of them; case-insensitive; a trailing $ anchors at the end), e.g. "
                   "--match H32/8 --match 'D64 bf16 fwd$'")
    b.add_argument("--skip-peer", action="append", help="a baseline not to time (repeatable), "
                   "e.g. tilegym")
    c = sub.add_parser("cache", help="show or clear the persistent store")
    c.add_argument("action", choices=["show", "clear"])
    c.add_argument("-v", "--verbose", action="store_true", help="every timing and failure")
    k = sub.add_parser("compile", help="AOT-compile every config of every kernel (no GPU needed)")
    k.add_argument("ops", nargs="*")
    k.add_argument("--arch", action="append", help="sm_90, sm_100, ... (repeatable; default sm_90)")
    k.add_argument("--jobs", type=int, default=None)
    args = p.parse_args(argv)
    return {"bench": cmd_bench, "cache": cmd_cache, "compile": cmd_compile}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
