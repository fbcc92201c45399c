"""python -m tiletune {bench [ops...] | compile [--arch sm_90] [ops...] | cache show|clear|prune |
tune --preset NAME [--seq N ...] [--export PATH]}

The ops are those registered in tiletune.registry (`--help` lists them)."""
import argparse
import json
import os
import re
import sqlite3
import sys

import tiletune
from tiletune import env, store

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
    from tiletune import aot, precompile
    n = sum(len(aot.op_cases(op)) for op in ops)
    compiles = len(aot.planned_cases(ops, archs))
    if not compiles:
        print(f"nothing to compile: no compile cases in {', '.join(ops)}")
        return 0
    procs = min(jobs or precompile.usable_cpus(), compiles)
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
    """(cuda-tile version, tileiras version or None): what Autotuner.store_key puts in keys;
    None where this environment cannot tell (then prune does not check that part: pruning
    against "unknown" would delete every entry a real compiler wrote)."""
    import cuda.tile as ct
    from tiletune.autotune import tileiras_version
    tileiras = tileiras_version()
    return ct.__version__, None if tileiras == "unknown" else tileiras


def _visible_gpus():
    """The names of the GPU models this process sees (an empty set without CUDA)."""
    import torch
    from tiletune import device
    if not torch.cuda.is_available():
        return set()
    return {device.gpu_name(i) for i in range(torch.cuda.device_count())}


def _prune(d, older_than_days, other_gpus=False):
    gpus = None
    if other_gpus:
        if os.environ.get("CUDA_VISIBLE_DEVICES") is not None:
            # the models this process sees may not be all the machine has
            print("CUDA_VISIBLE_DEVICES is set: the GPU models this process sees may not be all "
                  "this machine has; unset it for --other-gpus; nothing pruned")
            return 1
        gpus = _visible_gpus()
        if not gpus:
            print("no GPU is visible here: --other-gpus would delete every entry; nothing pruned")
            return 1
    cuda_tile, tileiras = _installed_versions()
    if tileiras is None:
        print("tileiras version unknown here (no compiler found): it is not checked")
    try:
        removed = store.prune(cuda_tile, tileiras,
                              None if older_than_days is None else older_than_days * 86400.0,
                              gpus, strict=True)
    except (OSError, sqlite3.Error) as e:
        print(f"cannot prune {d}: {type(e).__name__}: {e}; nothing pruned")
        return 1
    for op, n in removed.items():
        print(f"  {op}: removed {n} entr{'y' if n == 1 else 'ies'}")
    total = sum(removed.values())
    also = "" if older_than_days is None else f", or saved over {older_than_days:g} days ago"
    if gpus is not None:
        also += ", or of GPU models other than " + ", ".join(sorted(gpus))
    print(f"pruned {total} entr{'y' if total == 1 else 'ies'} from {d} (keyed by other than "
          f"cuda-tile {cuda_tile} / tileiras {tileiras or 'any'}{also})")
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
    unreadable = "" if d is None else _unreadable(d)
    if args.action in ("clear", "prune"):
        if d is None:
            print(f"store is off (TILETUNE_CACHE_DIR={os.environ.get('TILETUNE_CACHE_DIR', '')}):"
                  f" nothing to {args.action}")
        elif unreadable:
            print(f"cannot {args.action} {d}: {unreadable}; nothing "
                  f"{'removed' if args.action == 'clear' else 'pruned'}")
            return 1
        elif args.action == "prune":
            return _prune(d, args.older_than, args.other_gpus)
        else:
            try:
                n = store.clear(strict=True)
            except (OSError, sqlite3.Error) as e:
                print(f"cannot clear {d}: {type(e).__name__}: {e}; nothing removed")
                return 1
            print(f"removed {n} entr{'y' if n == 1 else 'ies'} from {d}")
        return 0
    if d is None:
        print(f"store is off (TILETUNE_CACHE_DIR={os.environ.get('TILETUNE_CACHE_DIR', '')})")
        _show_shipped()
        return 0
    if unreadable:
        print(f"cannot read the store at {d}: {unreadable}", file=sys.stderr)
        return 1
    found = {op: entries for op, entries in store.entries().items()
             if isinstance(entries, dict) and entries}
    if not found:
        print(f"store at {d} is empty")
        _show_shipped()
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
    print()
    _show_shipped()
    return 0


def _unreadable(d):
    """Why the store in folder `d` cannot be read, or "": `store.entries` reads a database it
    cannot use (not sqlite, another program's) or a `d` that is a file as an empty store, with
    a warning, which `cache show` must not report as "empty"."""
    if not os.path.exists(d):
        return ""
    if not os.path.isdir(d):
        return "not a folder"
    path = store.db_path()
    if not os.path.exists(path):              # no store yet
        return ""
    try:
        with store._db(path):                 # opened as entries() opens it
            pass
    except (OSError, sqlite3.Error) as e:
        return f"{type(e).__name__}: {e}"
    return ""


def _entries(n):
    return f"{n} entr{'y' if n == 1 else 'ies'}"


def _show_shipped():
    """`cache show`'s count of the shipped winners (read-only, used where the store has no
    row): per file, per GPU and software they were tuned with, and per op."""
    source = store.shipped_source()
    if source is None:
        print(f"shipped winners: off (TILETUNE_SHIPPED={os.environ.get('TILETUNE_SHIPPED')})")
        return
    files = store.shipped_files()
    total = sum(len(rows) for _, _, rows in files)
    if not total:
        print(f"shipped winners: none at {source}")
        return
    cuda_tile, tileiras = _installed_versions()
    usable = sum(1 for _, _, rows in files for _, key, _ in rows
                 if (store.key_facts(key) or ("",) * 4)[2:] == (cuda_tile, tileiras))
    print(f"shipped winners (read-only; the store's own rows win) at {source}: "
          f"{_entries(total)} in {len(files)} file{'' if len(files) == 1 else 's'}, {usable} "
          f"for the installed cuda-tile {cuda_tile or '?'} / tileiras {tileiras}")
    per_op = {}
    for path, _, rows in files:
        groups = {}
        for op, key, _ in rows:
            facts = store.key_facts(key)
            label = "other keys" if facts is None else \
                f"{facts[0]} {facts[1]} cuda-tile {facts[2]} tileiras {facts[3]}"
            groups[label] = groups.get(label, 0) + 1
            per_op[op] = per_op.get(op, 0) + 1
        for label, n in sorted(groups.items()):
            print(f"  {os.path.basename(path)}: {label}: {_entries(n)}")
    width = max(len(op) for op in per_op)
    for op, n in sorted(per_op.items()):
        print(f"  {op.ljust(width)}  {n}")


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
    from tiletune.autotune import message_lines
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
                # (a compiler error's first line is "Return code 1": its lines follow)
                text = message_lines(message) if isinstance(message, str) else []
                lines.append(f"       FAILED {_dumps(f.get('config'))}: {f.get('error', '?')}: "
                             f"{text[0] if text else ''}")
                lines += [f"         {line}" for line in text[1:]]
        return lines
    except Exception as exc:            # anything the checks above did not foresee
        return [f"  {key}\n    malformed entry skipped ({type(exc).__name__})"]


def cmd_bench(args):
    import torch
    if not torch.cuda.is_available():
        print("No CUDA GPU here: benchmarks need one. Running the ahead-of-time compile of every "
              "kernel config for sm_90 instead.", flush=True)
        given = [flag for flag, value in (("--full", args.full), ("--host", args.host),
                                          ("--json", args.json),
                                          ("--plot", args.plot), ("--match", args.match),
                                          ("--skip-peer", args.skip_peer),
                                          ("--graph", args.graph),
                                          ("--sustained", args.sustained)) if value]
        if given:
            print(f"{', '.join(given)} ignored: no GPU to benchmark", flush=True)
        return _compile(args.ops, ["sm_90"], None)
    from tiletune import autotune, bench
    if autotune.disabled() and not args.host:
        print("tiletune bench: DISABLE_AUTOTUNE=1 is set: every tuned column would time the "
              "default configs. Unset it (the fixed column times the defaults).",
              file=sys.stderr, flush=True)
        return 2
    try:
        return bench.main(args.ops, full=args.full, host=args.host,
                          json_path=args.json or bench.DEFAULT_JSON,
                          plot_path=args.plot, match=args.match or (),
                          skip_peers=args.skip_peer or (), graph=args.graph,
                          sustained=args.sustained)
    except bench.OutputNotWritable as e:      # refused before any row is tuned and timed
        print(f"tiletune bench: {e}", file=sys.stderr, flush=True)
        return 2


def _positive(text):
    """argparse type of the model's sizes: an integer >= 1."""
    try:
        n = int(text, 10)
    except ValueError:
        n = 0
    if n < 1:
        raise argparse.ArgumentTypeError(f"not an integer >= 1: {text!r}")
    return n


def _tune_specs(parser, args):
    """The model specs `tune` was given, or a parser error (exit 2) saying what is wrong."""
    from tiletune import pretune
    shape = {k: getattr(args, k) for k in pretune.SHAPE_FLAGS}
    try:
        specs = pretune.specs(args.preset, **shape)
    except ValueError as e:
        parser.error(str(e))
    if args.all and not args.export:
        parser.error("--all goes with --export PATH (it exports every row of this GPU)")
    # the defaults here: "extend" would add the values given to a default list
    args.seq, args.batch = args.seq or [4096], args.batch or [1]
    return specs


def _tune_fail(message):
    print(f"tiletune tune: {message}", file=sys.stderr, flush=True)
    return 2


def cmd_tune(args):
    """Tune every key of the given model shapes on this GPU (or, under torchrun, on the job's
    GPUs, each rank a share of the shapes), save them to the store, and optionally export the
    winners as a shipped file."""
    import torch
    from tiletune import autotune, pretune
    if not torch.cuda.is_available():
        return _tune_fail("no CUDA GPU here: tune runs the model's kernels on one to time them; "
                          "nothing was tuned. Run it on the GPU model the winners are for.")
    if autotune.disabled():
        return _tune_fail("DISABLE_AUTOTUNE=1 is set: nothing would be searched. Unset it to tune.")
    path = store.db_path()
    if path is None:
        return _tune_fail(f"the store is off (TILETUNE_CACHE_DIR="
                          f"{os.environ.get('TILETUNE_CACHE_DIR', '')}): the winners would not be "
                          "saved. Point TILETUNE_CACHE_DIR at a folder.")
    unwritable = env.unwritable(path)
    if unwritable:
        return _tune_fail(f"the store at {path} cannot be written ({unwritable}): the winners "
                          "would not be saved. Point TILETUNE_CACHE_DIR at a writable folder.")
    if args.export:
        unwritable = env.unwritable(os.path.abspath(args.export))
        if unwritable:
            return _tune_fail(f"cannot export to {args.export} ({unwritable})")
    import importlib.util
    if importlib.util.find_spec("transformers") is None:
        return _tune_fail("tune builds transformers models, and transformers is not installed: "
                          "pip install 'tiletune[hf]'")
    if args.export and os.path.exists(args.export):
        try:                          # before the searches: the file is merged into at the end
            store.read_shipped(args.export)
        except (OSError, ValueError) as e:
            return _tune_fail(f"cannot export to {args.export}: {type(e).__name__}: {e}")
    rank, world = pretune.start_job()     # under torchrun: the ranks share the work out
    try:
        with autotune.searches_must_decide():
            return _tune_job(args, path, rank, world)
    finally:
        pretune.end_job(world)


def _tune_job(args, path, rank, world):
    """cmd_tune on this rank of a job of `world` ranks (1: this GPU alone): rank 0 prints the
    header, the job's summary and writes the export; every rank prints its own keys."""
    import torch
    from tiletune import autotune, device, pretune
    gpu = device.gpu_name(torch.cuda.current_device())
    arch = device.arch()
    seqs = list(dict.fromkeys(args.seq))
    batches = list(dict.fromkeys(args.batch))
    lead, tag = rank == 0, (f"[rank {rank}] " if world > 1 else "")
    if lead:
        gpus = f"{world} x {gpu}" if world > 1 else gpu
        print(f"tuning on {gpus} ({arch}) at batch {', '.join(map(str, batches))} x seq "
              f"{', '.join(map(str, seqs))}, {args.dtype}, "
              f"{'forward only' if args.no_backward else 'forward + backward'}"
              f"{f', then generating {args.generate} tokens' if args.generate else ''}"
              f"{' under deterministic algorithms' if args.deterministic else ''}; "
              f"store: {path}", flush=True)
        for spec in args.specs:
            print(f"  {spec.describe()}", flush=True)
    report, failed, unsaved = pretune.Report(), None, store.unsaved()
    was_deterministic = (torch.are_deterministic_algorithms_enabled(),
                         torch.is_deterministic_algorithms_warn_only_enabled())
    try:
        if args.deterministic:
            # cuBLAS refuses that mode without a workspace setting (the model's own GEMMs)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            torch.use_deterministic_algorithms(True)
        report = pretune.run(args.specs, seqs, batches, pretune.DTYPES[args.dtype],
                             not args.no_backward, out=lambda line: print(tag + line, flush=True),
                             share=(rank, world), generate=args.generate)
    except autotune.TuningFailedError as e:
        failed = str(e)
    except Exception as e:           # in a job: reported at the gather, the others not left
        if world == 1:
            raise
        failed = f"{type(e).__name__}: {e}"
    finally:
        torch.use_deterministic_algorithms(was_deterministic[0], warn_only=was_deterministic[1])
    # every rank takes part in the gather, a failed one too: no rank waits for one that left
    mine = {"failed": failed, "search": report.count("search"), "search_s": report.search_s(),
            "store": report.count("store"), "shipped": report.count(store.SHIPPED),
            "wall_s": report.wall_s, "unsaved": store.unsaved() - unsaved,
            "rows": pretune.used_rows() if args.export and not args.all else []}
    parts = pretune.gather(mine, world)
    if failed:
        print(tag + failed, file=sys.stderr)
    if any(p["failed"] for p in parts):
        return 1
    if not lead:
        return 0
    n = sum(p["search"] for p in parts)
    ranks = f" on {world} ranks" if world > 1 else ""
    print(f"{n} key{'' if n == 1 else 's'} tuned in {sum(p['search_s'] for p in parts):.1f}s of "
          f"search{ranks} ({sum(p['store'] for p in parts)} already in the store, "
          f"{sum(p['shipped'] for p in parts)} shipped); "
          f"{max(p['wall_s'] for p in parts):.1f}s in all; store: {path}")
    lost = sum(p["unsaved"] for p in parts)
    if lost:
        print(f"tiletune tune: {lost} winner{'' if lost == 1 else 's'} could not be saved to the "
              f"store at {path} (the warning above says why); nothing was exported",
              file=sys.stderr, flush=True)
        return 1
    if args.export:
        cuda_tile, tileiras = _installed_versions()
        if args.all:
            rows = pretune.gpu_rows(gpu, arch, cuda_tile, tileiras)
        else:                  # each key once: the rank that decided it saved it
            merged = {}
            for p in parts:
                for op, key, entry in p["rows"]:
                    merged.setdefault((op, key), (op, key, entry))
            rows = list(merged.values())
        try:
            written, kept = pretune.export(args.export, rows)
        except (OSError, ValueError) as e:
            return _tune_fail(f"cannot export to {args.export}: {type(e).__name__}: {e}")
        print(f"exported {_entries(len(rows))} to {args.export} ({written} rows in the file"
              + (f", {kept} of them kept from it" if kept else "") + ")")
    return 0


def parser():
    p = _Parser(prog="python -m tiletune", epilog=_ops_epilog,
                description="cuTile kernels that tune once per shape: benchmarks, ahead-of-time "
                            "compiles and the store of tuned configs.")
    p.add_argument("--version", action="version", version=f"tiletune {tiletune.__version__}")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{bench,compile,cache,tune}")
    b = sub.add_parser("bench", epilog=_ops_epilog,
                       help="A/B benchmarks on this GPU (tuned vs fixed default vs peers)",
                       description="Time each op's rows on this GPU: tuned vs its fixed default "
                                   "config vs the peers installed here. Ratios > 1: tuned is "
                                   "faster. Without a GPU: the sm_90 compile instead.")
    b.add_argument("ops", nargs="*", help="ops to run (default: all)")
    b.add_argument("--full", action="store_true",
                   help="every row of each op and the host overhead per call (default: the "
                        "headline rows)")
    b.add_argument("--host", action="store_true",
                   help="only each op's host cost per call at a tiny shape, against torch's "
                        "(no rows)")
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
    b.add_argument("--graph", action="store_true",
                   help="also time every row's candidates replayed from a CUDA graph (the "
                        "decode rows always are): the kernels' time without the eager call's "
                        "host time")
    b.add_argument("--sustained", action="store_true",
                   help="time each candidate in 100 ms blocks (half of each untimed), in turns: "
                        "every kernel at the clock its own sustained load settles at, as in "
                        "long training runs or triton's do_bench (default: blocks of 10 runs, "
                        "where a slow or host-bound peer's idle gaps let the clocks rise)")
    k = sub.add_parser("compile", epilog=_ops_epilog,
                       help="AOT-compile every config of every kernel (no GPU needed)")
    k.add_argument("ops", nargs="*", help="ops to compile (default: all)")
    k.add_argument("--arch", action="append", type=_arch, metavar="sm_XY",
                   help="target arch, sm_<major><minor>: sm_80, sm_90, sm_100, sm_120, ... "
                        "(repeatable; default sm_90)")
    k.add_argument("--jobs", type=int, default=None, metavar="N",
                   help="compile processes (default: one per CPU core this process may run on, "
                        "at most one per compile)")
    c = sub.add_parser("cache", help="show, clear or prune the persistent store")
    c.add_argument("action", choices=["show", "clear", "prune"],
                   help="prune: delete entries keyed by other cuda-tile or tileiras versions "
                        "than the installed ones")
    c.add_argument("-v", "--verbose", action="store_true", help="every timing and failure")
    c.add_argument("--older-than", type=_days, default=None, metavar="DAYS",
                   help="prune: also delete entries saved more than DAYS days ago")
    c.add_argument("--other-gpus", action="store_true",
                   help="prune: also delete entries of GPU models this machine does not have "
                        "(refused where no GPU is visible or CUDA_VISIBLE_DEVICES is set)")
    t = _tune_parser(sub)
    return p, {"bench": b, "compile": k, "cache": c, "tune": t}


def _tune_parser(sub):
    from tiletune import pretune
    t = sub.add_parser(
        "tune", help="tune every key of a transformers model's shape on this GPU ahead of "
                     "training (saved to the store; --export writes a shipped file)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Build the model's family with one decoder layer and a small vocabulary\n"
                    "on this GPU, patch it with apply_tiletune, and run a forward and backward\n"
                    "at each --batch and --seq: every op key of that shape is searched once and\n"
                    "saved to the store (keys do not depend on the number of layers or the\n"
                    "vocabulary); --generate N adds the keys of generating N tokens after each\n"
                    "prompt. Under torchrun (torchrun --nproc_per_node N -m tiletune tune ...)\n"
                    "every rank steps the first (model, --batch, --seq) shape, splitting each\n"
                    "key's configs, then every N-th of the rest; rank 0 prints the job's summary\n"
                    "and writes --export.",
        epilog="presets:\n" + "\n".join(f"  {s.describe()}" for s in pretune.PRESETS.values()))
    # (lists extend when a flag repeats, as compile's --arch: `--seq 1024 --seq 2048` is both)
    t.add_argument("--preset", nargs="+", action="extend", choices=list(pretune.PRESETS),
                   metavar="NAME", help=f"one or more of: {', '.join(pretune.PRESETS)}")
    t.add_argument("--model", type=pretune.family, metavar="FAMILY",
                   help=f"the model family: {', '.join(pretune.FAMILIES)}")
    for flag, what in (("--hidden", "hidden size"), ("--intermediate", "MLP intermediate size"),
                       ("--heads", "attention heads"),
                       ("--kv-heads", "key/value heads (default: --heads)"),
                       ("--head-dim", "head dim (default: the preset's, else hidden / heads)"),
                       ("--experts", "qwen3_moe: experts"),
                       ("--top-k", "qwen3_moe: experts per token"),
                       ("--moe-intermediate", "qwen3_moe: an expert's intermediate size")):
        t.add_argument(flag, type=_positive, metavar="N", help=what)
    t.add_argument("--seq", nargs="+", action="extend", type=_positive, metavar="N",
                   help="sequence lengths, each tuned (default 4096)")
    t.add_argument("--batch", nargs="+", action="extend", type=_positive, metavar="N",
                   help="batch sizes, each tuned (default 1)")
    t.add_argument("--dtype", choices=list(pretune.DTYPES), default="bf16",
                   help="model dtype (default bf16)")
    t.add_argument("--no-backward", action="store_true",
                   help="forward only, without gradients (the keys inference meets)")
    t.add_argument("--generate", type=_positive, default=0, metavar="N",
                   help="also tune what generating N tokens after each --seq prompt meets: "
                        "the prompt's forward with a KV cache, then one decoding step at each "
                        "cache length where the decode keys change (the first new token, then "
                        "each next power of two up to seq + N)")
    t.add_argument("--deterministic", action="store_true",
                   help="step under torch.use_deterministic_algorithms(True), as a training "
                        "run in that mode does: attention's backward then has keys of its own "
                        "(searched among its deterministic plans)")
    t.add_argument("--export", metavar="PATH",
                   help="write the winners this run resolved to PATH as a shipped file "
                        "(rows already there are kept unless replaced; a PATH ending in .gz "
                        "is written gzip-compressed, as the package's files are)")
    t.add_argument("--all", action="store_true",
                   help="with --export: every store row of this GPU and the installed "
                        "cuda-tile / tileiras, not only this run's (in a job: rank 0's store, "
                        "which on node-local stores holds only its node's rows)")
    return t


def main(argv=None):
    p, subs = parser()
    args = p.parse_args(argv)
    if args.cmd == "compile" and args.jobs is not None and args.jobs < 1:
        subs["compile"].error(f"--jobs must be >= 1 (got {args.jobs})")
    if args.cmd in ("bench", "compile"):
        args.ops = _ops(subs[args.cmd], args.ops)
    if args.cmd == "tune":
        args.specs = _tune_specs(subs["tune"], args)
    if args.cmd == "cache" and args.action != "prune":
        for flag, given in (("--older-than", args.older_than is not None),
                            ("--other-gpus", args.other_gpus)):
            if given:
                subs["cache"].error(f"{flag} is an option of prune, not of {args.action}")
    if args.cmd == "cache" and args.action != "show" and args.verbose:
        subs["cache"].error(f"-v is an option of show, not of {args.action}")
    return {"bench": cmd_bench, "cache": cmd_cache, "compile": cmd_compile,
            "tune": cmd_tune}[args.cmd](args)


if __name__ == "__main__":
    try:
        sys.exit(main())
    except BrokenPipeError:      # `... | head` left early: no traceback (Python's own advice)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
