"""Ahead-of-time compilation of kernels without a GPU (CI), with the signatures the JIT would infer.

The JIT specializes each array argument on facts it reads off the real tensor (unit strides,
16-byte divisibility of strides and shapes, size-1 dims, base alignment). A CI compile must state
the same facts, or it compiles a different kernel (no TMA, no wgmma) than the GPU runs.
`jit_array` states them; a GPU test checks it against `KernelSignature.from_kernel_args`.
"""
import io
import re
import struct
import time
from dataclasses import dataclass, field

import cuda.tile as ct
from cuda.tile.compilation import ArrayConstraint, ScalarConstraint, export_kernel

from tiletune.autotune import message_lines
from tiletune.precompile import launch_signature, usable_cpus

TORCH_TO_CT = {}  # filled lazily: torch dtype -> ct dtype


def ct_dtype(torch_dtype):
    if not TORCH_TO_CT:
        import torch
        TORCH_TO_CT.update({torch.float32: ct.float32, torch.float16: ct.float16,
                            torch.bfloat16: ct.bfloat16, torch.float64: ct.float64,
                            torch.int32: ct.int32, torch.int64: ct.int64,
                            torch.float8_e4m3fn: ct.float8_e4m3fn,
                            torch.float8_e5m2: ct.float8_e5m2})
    return TORCH_TO_CT[torch_dtype]


def jit_array(dtype, shape, strides=None, *, base_aligned=True, index_dtype=ct.int32):
    """ArrayConstraint for an array of this dtype/shape/strides as the JIT would specialize it.

    `dtype` is a ct dtype or a torch dtype; `strides` default to C-contiguous (in elements).
    Every size-1 dim is a constant 1: `ct.launch` on an H100 compiled a (1,) buffer, a (M, 1)
    column and a (1, N) row so (a cubin precompiled for that signature was found by the launch).
    Only the cutile_python_v2 reading of the arguments shows these constants; v1 cannot express
    them.
    """
    if not isinstance(dtype, ct.DType):
        dtype = ct_dtype(dtype)
    shape = tuple(int(s) for s in shape)
    if strides is None:
        strides, acc = [], 1
        for s in reversed(shape):
            strides.append(acc)
            acc *= max(s, 1)
        strides = tuple(reversed(strides))
    nbytes = dtype.bitwidth // 8
    elems_per_16b = max(16 // nbytes, 1)
    return ArrayConstraint(
        dtype, len(shape),
        index_dtype=index_dtype,
        stride_lower_bound_incl=0,
        alias_groups=(),
        # a stride-0 dim of size > 1 (an expanded tensor) makes elements share memory
        may_alias_internally=any(st == 0 and sh > 1 for st, sh in zip(strides, shape)),
        stride_constant=tuple(1 if st == 1 else None for st in strides),
        shape_constant=tuple(1 if sh == 1 else None for sh in shape),
        stride_divisible_by=tuple(elems_per_16b if (st * nbytes) % 16 == 0 and st != 1 else 1
                                  for st in strides),
        shape_divisible_by=tuple(16 if sh % 16 == 0 and sh != 1 else 1 for sh in shape),
        base_addr_divisible_by=16 if base_aligned else 1,
    )


F32 = ScalarConstraint(ct.float32)   # a Python float argument


def tightest(cfgs):
    """The first config (the default), then each other config that differs from it in more
    than occupancy once, at its highest occupancy: occupancy only caps registers per thread, so
    the tightest cap is the compile that can spill or fail. For the extra keys of an op's
    compile cases (every config compiles at its main key)."""
    cfgs = list(cfgs)
    best = {}
    for c in cfgs:
        pair = tuple(sorted((k, v) for k, v in vars(c).items() if k != "occupancy"))
        if pair not in best or c.occupancy > best[pair].occupancy:
            best[pair] = c
    return cfgs[:1] + [c for c in best.values() if c != cfgs[0]]


signature = launch_signature


@dataclass
class CompileCase:
    """One kernel, one config, one signature: what the JIT would compile for one launch."""
    op: str
    kernel: object          # a ct.kernel, hints already applied
    params: list            # constraints, constants in place
    label: str = ""
    spaces: tuple = ()      # the SPACE_ARCHS whose config spaces list the config (space_archs)


# The archs with spaces of their own: a config of one of their spaces compiles for the archs of
# SPACE_ARCHS whose spaces list it (the engine never launches it on the other), and for any
# other arch asked. Every other case compiles for every arch asked.
SPACE_ARCHS = ("sm_90", "sm_100")


def space_archs(configs_of):
    """cfg -> the SPACE_ARCHS whose space, `configs_of(arch)`, lists cfg (each space listed
    once)."""
    spaces = {a: list(configs_of(a)) for a in SPACE_ARCHS}
    return lambda cfg: tuple(a for a in SPACE_ARCHS if cfg in spaces[a])


def case_archs(case, archs):
    """The archs of `archs` that `case` may compile for, by its spaces (planned_cases then
    picks)."""
    spaces = getattr(case, "spaces", ())
    return [a for a in archs if not spaces or a not in SPACE_ARCHS or a in spaces]


# The archs our GPUs are: every case compiles for them, each signature the ops launch (dtypes,
# ragged widths, strides, ranks). For another arch a case compiles where its own space lists that
# arch or where it is its config's first case: a config's other cases differ from it only in
# their arrays, and on a compile-only arch one build per config says the config compiles there.
EVERY_CASE_ARCHS = ("sm_90",)


def _kernel_of(case):
    """The case's kernel function and compiler options (the hints), or None where cuTile's
    attributes for them are missing (then every case is its own config and build)."""
    kernel = getattr(case, "kernel", None)
    fn, options = getattr(kernel, "_pyfunc", None), getattr(kernel, "_compiler_options", None)
    if fn is None or options is None:
        return None
    return fn.__module__, fn.__qualname__, repr(options)


def _config_of(case):
    """What makes a case's config: its kernel and hints and the constant arguments (tiles and
    flags), not its arrays and scalars."""
    kernel = _kernel_of(case)
    if kernel is None:
        return id(case)
    return kernel + (tuple(repr(p) for p in case.params
                           if not isinstance(p, (ArrayConstraint, ScalarConstraint))),)


@dataclass
class CompileReport:
    ok: list = field(default_factory=list)      # (label, seconds)
    failed: list = field(default_factory=list)  # (label, error)
    frames: dict = field(default_factory=dict)  # label -> stack frame bytes (see frame_bytes)


COMPILE_TIMEOUT_SEC = 120    # per compile: a hung tileiras fails its case, not the command


def compile_case(case, arch):
    """Compile one case to a cubin for `arch` with the real tileiras. Returns (seconds taken,
    the cubin's stack frame in bytes)."""
    import cuda.tile as ct
    t0 = time.perf_counter()
    cubin = io.BytesIO()
    # (a context, not CUDA_TILE_COMPILER_TIMEOUT_SEC: cuTile read its settings at import)
    with ct.compiler_timeout(COMPILE_TIMEOUT_SEC):
        export_kernel(case.kernel, [signature(case.params)], cubin, gpu_code=arch,
                      output_format="cubin")
    return time.perf_counter() - t0, frame_bytes(cubin.getvalue())


_FRAME_SIZE = 0x11      # EIATTR_FRAME_SIZE: (function symbol, bytes), both uint32


def frame_bytes(cubin):
    """The largest per-thread stack frame among a cubin's functions (local memory, which on
    sm_90 means spilled registers): what `cuobjdump -res-usage` reports as STACK, read from the
    EIATTR_FRAME_SIZE entries of the ELF's .nv.info sections. Entries are (format, attribute)
    bytes, then a 16-bit size and that many bytes (format 4), a 16-bit value (2 and 3), or
    nothing."""
    shoff, = struct.unpack_from("<Q", cubin, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<I20xQQ", cubin, shoff + i * shentsize)
                for i in range(shnum)]     # (name's offset in the name table, offset, size)
    names = sections[shstrndx][1]
    frame = 0
    for name, offset, size in sections:
        if not cubin.startswith(b".nv.info", names + name):
            continue
        p, end = offset, offset + size
        while p < end:
            fmt, attr = cubin[p], cubin[p + 1]
            if fmt == 4:
                n, = struct.unpack_from("<H", cubin, p + 2)
                if attr == _FRAME_SIZE:
                    frame = max(frame, struct.unpack_from("<I", cubin, p + 8)[0])
                p += 4 + n
            else:
                p += 4 if fmt in (2, 3) else 2
    return frame


_CASES = {}   # per process: op name -> its list of cases (kernels cannot be pickled)


def op_cases(op):
    """The compile cases the op's registered case module yields (see tiletune.registry)."""
    if op not in _CASES:
        from tiletune import registry
        _CASES[op] = list(registry.ops()[op].compile_cases())
    return _CASES[op]


def error_text(e):
    """"Type: message" of a failed compile, its message_lines, the lines after the first
    indented."""
    lines = message_lines(e)
    return ": ".join([type(e).__name__, *(["\n  ".join(lines)] if lines else [])])


def _compile_worker(args):
    op, index, arch = args
    case = op_cases(op)[index]
    try:
        return (case.label, arch, *compile_case(case, arch), None)
    except Exception as e:  # a failed compile is a result to report, not a crash
        return case.label, arch, None, None, error_text(e)


def _build_of(case):
    """What decides a case's cubin: the kernel's function, its compiler options (the hints) and
    the signature. Cases of configs that differ only on the host (a persistent grid or not, a
    space listed for two archs) build the same cubin."""
    kernel = _kernel_of(case)
    if kernel is None:
        return id(case)
    return kernel + (repr(signature(case.params)),)


_ARCH_FORM = re.compile(r"sm_\d{2,3}[a-z]?")


def _request(who, ops, archs):
    """(ops, archs) as lists without repeats, or a TypeError / ValueError naming `who` and the
    argument: a str where a list belongs (its letters would be taken for names), an op that no
    case module registers, an arch not of the form sm_<major><minor>."""
    lists = []
    for name, value in (("ops", ops), ("archs", archs)):
        try:
            names = None if isinstance(value, str) else list(dict.fromkeys(value))
        except TypeError:           # not iterable, or of unhashable items
            names = None
        if names is None or not all(isinstance(n, str) for n in names):
            raise TypeError(f"{who}: {name} must be a list of names (str), got {value!r}")
        lists.append(names)
    ops, archs = lists
    unknown = [op for op in ops if op not in _CASES]
    if unknown:
        from tiletune import registry
        known = registry.ops()
        unknown = [op for op in unknown if op not in known]
        if unknown:
            raise ValueError(f"{who}: unknown op{'s' if len(unknown) > 1 else ''} "
                             f"{', '.join(map(repr, unknown))} in ops; known: {', '.join(known)}")
    bad = [a for a in archs if not _ARCH_FORM.fullmatch(a)]
    if bad:
        raise ValueError(f"{who}: archs {', '.join(map(repr, bad))} are not of the form "
                         f"sm_<major><minor> (e.g. sm_90, sm_100)")
    return ops, archs


def compile_all(ops, archs, jobs=None, select=None):
    """Compile the AOT cases of the named ops for the archs `planned_cases` gives them, in
    `jobs` processes (default: one per CPU this process may run on; compiles are serialized
    inside one process), each distinct build once: a case whose build another case already has
    gets that build's result (seconds, stack frame or error) under its own label.
    `select(op, index, case)`, given, picks the cases (a ValueError where it picks none).
    Returns a CompileReport, each build's stack frame in it."""
    from concurrent.futures import ProcessPoolExecutor
    if jobs is not None and (isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1):
        raise ValueError(f"compile_all: jobs must be an int >= 1 or None (one process per usable "
                         f"CPU), got {jobs!r}")
    ops, archs = _request("compile_all", ops, archs)
    jobs = jobs or usable_cpus()
    if jobs == 1:
        pending = PendingCompiles(ops, archs, select, who="compile_all")
        return pending.report([_compile_worker(w) for w in pending.work])
    pool = ProcessPoolExecutor(jobs)
    try:
        return start_compiles(ops, archs, pool, select, who="compile_all").report()
    except BaseException:     # Ctrl-C: a plain shutdown would run every compile still queued
        stop_compiles(pool)
        raise
    finally:
        pool.shutdown()


def stop_compiles(pool):
    """Drop the compiles still queued in `pool` and end the processes running the others."""
    running = list((getattr(pool, "_processes", None) or {}).values())   # (shutdown forgets them)
    pool.shutdown(wait=False, cancel_futures=True)
    for process in running:
        process.terminate()


def start_compiles(ops, archs, pool, select=None, *, who="start_compiles"):
    """compile_all's builds submitted to `pool` (a concurrent.futures executor) without waiting:
    `.report()` of the result waits for them. Several calls may share one pool. `who`: the
    public function its argument errors name."""
    pending = PendingCompiles(ops, archs, select, who=who)
    pending.futures = [pool.submit(_compile_worker, w) for w in pending.work]
    return pending


def planned_cases(ops, archs, select=None, *, who="planned_cases"):
    """(op, case index, arch) of every compile of the named ops' cases (`select`ed): each case
    for each arch of `case_archs`, on archs outside EVERY_CASE_ARCHS only the cases whose space
    lists the arch and the first case of every other config. A select that picks none of the
    cases is a ValueError (naming `who`, the public function called)."""
    ops, archs = _request(who, ops, archs)
    cases = [(op, i, case) for op in ops for i, case in enumerate(op_cases(op))]
    chosen = [(op, i, case) for op, i, case in cases if select is None or select(op, i, case)]
    if cases and not chosen:
        raise ValueError(f"{who}: select picked none of the {len(cases)} compile cases of "
                         f"{', '.join(ops)}")
    claimed = {(_config_of(case), arch) for _, _, case in chosen
               for arch in getattr(case, "spaces", ()) if arch not in EVERY_CASE_ARCHS}
    planned = []
    for op, i, case in chosen:
        config = _config_of(case)
        for arch in case_archs(case, archs):
            if arch not in EVERY_CASE_ARCHS and arch not in getattr(case, "spaces", ()):
                if (config, arch) in claimed:
                    continue
                claimed.add((config, arch))
            planned.append((op, i, arch))
    return planned


class PendingCompiles:
    """The distinct builds of some ops' cases (`work`: (op, case index, arch)), and which
    cases repeat a build (`same_as`), planned in the calling process."""

    def __init__(self, ops, archs, select=None, who="PendingCompiles"):
        first = {}                  # (build, arch) -> (op, index) of the first case that has it
        self.same_as = []           # ((op, index) of a repeated build, arch, its first case)
        self.work = []
        for op, i, arch in planned_cases(ops, archs, select, who=who):
            owner = first.setdefault((_build_of(op_cases(op)[i]), arch), (op, i))
            if owner == (op, i):
                self.work.append((op, i, arch))
            else:
                self.same_as.append(((op, i), arch, owner))
        self.futures = []

    def report(self, results=None):
        """The CompileReport, from `results` (one per build of `work`) or the futures."""
        if results is None:
            results = []
            for (op, i, arch), f in zip(self.work, self.futures):
                try:
                    results.append(f.result())
                except Exception as e:   # a compile process died (killed, crashed): reported
                    results.append((op_cases(op)[i].label, arch, None, None,
                                    f"{type(e).__name__}: {e or 'a compile process died'}"))
        by_case = {(op, i, arch): r for (op, i, arch), r in zip(self.work, results)}
        results = list(results)
        for (op, i), arch, (first_op, first_i) in self.same_as:
            _, _, secs, frame, err = by_case[first_op, first_i, arch]
            results.append((op_cases(op)[i].label, arch, secs, frame, err))
        report = CompileReport()
        for label, arch, secs, frame, err in results:
            if err is None:
                report.ok.append((f"{label} [{arch}]", secs))
                report.frames[f"{label} [{arch}]"] = frame
            else:
                report.failed.append((f"{label} [{arch}]", err))
        return report
