"""Every config of every kernel compiles ahead of time for sm_90 and sm_100 with the real tileiras."""
import os

import pytest
import torch

from tiletune import aot, registry
from tiletune.aot import compile_all, op_cases

MODEL_ROWS = {"train_step"}       # whole-model bench rows: no kernels of their own

# GEMM and attention kernels keep their float32 accumulators in registers on sm_90, and a build
# that spills them ran 9-35x slower (references/hardware-constraints.md): their sm_90 builds
# must have no stack frame. Known frames, left to the search:
SPILL_FREE = {"matmul", "gated_mlp", "fp8_gemm", "fmha", "grouped_gemm"}
KNOWN_FRAMES = (
    "pre-Hopper", "sm_80", "sm_100",               # cases for other archs: sm_90 never runs them
    "matmul persistent batched fp16 ragged A^T",   # unaligned strides: no TMA, tiles in registers
    "grouped_mm odd K N", "grouped_mm table fp16 odd K N", "grouped_mm dW fp16 odd",  # likewise
    "grouped_mm x transposed",                     # a column-major x: no row TMA
    "fp8_mm block e4m3 x e5m2",                    # mixed formats widened to float16 in registers
    "fmha decode causal Sq5 GQA 32/8 row-major",   # row-major decode at 32 rows a CTA
    "fmha fwd D64 fp16 causal sm_90 space {'tm': 64, 'tn': 64, 'occupancy': 4",  # four CTAs an
                                                   # SM: 64 registers, 16 B stack
    "quantize ",                                   # FP8 quantizers: small frames, searched
)


def _spills(op, report):
    """sm_90 builds of a SPILL_FREE op with a stack frame, the known ones apart."""
    if op not in SPILL_FREE:
        return {}
    return {label: frame for label, frame in report.frames.items()
            if label.endswith("[sm_90]") and frame
            and not any(known in label for known in KNOWN_FRAMES)}


# The compile tests' builds start in one pool of their own when the tests are collected
# (tests/cpu/conftest.py), at the lowest CPU priority, and the tests run last: the rest of the
# suite runs while they compile. Run alone, a test compiles its own.
_pool = None
_started = {}          # (test name, op) -> aot.PendingCompiles


def start_compiles(tests):
    """Submit the builds of each (test name, op) in `tests` to one low-priority pool."""
    global _pool
    from concurrent.futures import ProcessPoolExecutor
    _pool = ProcessPoolExecutor(os.cpu_count() or 1, initializer=os.nice, initargs=(19,))
    for name, op in tests:
        archs, select = _builds(name, op)
        _started[name, op] = aot.start_compiles([op], archs, _pool, select)


def stop_compiles():
    """Drop the builds no test waited for (a run stopped early)."""
    if _pool is not None:
        _pool.shutdown(wait=False, cancel_futures=True)


def _builds(name, op):
    """(archs, select) of a compile test."""
    if name == "test_every_config_compiles":
        return ["sm_90", "sm_100"], None
    return OTHER_ARCHS.get(op, ["sm_80", "sm_120"]), _each_kernel_and_other_arch_cases()


def _report(name, op):
    pending = _started.pop((name, op), None)
    if pending is not None:
        return pending.report()
    archs, select = _builds(name, op)
    return compile_all([op], archs, select=select)


@pytest.mark.parametrize("op", [op for op in registry.ops() if op not in MODEL_ROWS])
def test_every_config_compiles(op):
    cases = op_cases(op)
    assert cases
    report = _report("test_every_config_compiles", op)
    assert not report.failed, "\n".join(f"{label}: {err}" for label, err in report.failed)
    assert len(report.ok) == len(aot.planned_cases([op], ["sm_90", "sm_100"]))
    # every case for sm_90; every config (kernel, hints, constants) for each arch whose space may
    # have it, and every sm_90 config of the op's spaces for sm_90, every sm_100 one for sm_100
    assert all(f"{c.label} [sm_90]" in report.frames
               for c in cases if aot.case_archs(c, ["sm_90"]))
    for arch in aot.SPACE_ARCHS:
        configs = {aot._config_of(c) for c in cases if aot.case_archs(c, [arch])}
        built = {aot._config_of(c) for c in cases if f"{c.label} [{arch}]" in report.frames}
        assert built == configs
        assert all(f"{c.label} [{arch}]" in report.frames for c in cases if arch in c.spaces)
    spills = _spills(op, report)
    assert not spills, "\n".join(f"{label}: {frame} bytes of stack"
                                 for label, frame in spills.items())


# Other archs get small conservative spaces that no GPU of ours runs. Each kernel's first case
# and every case written for those archs (labels naming them) compile for sm_80 and sm_120;
# FP8 for sm_120 alone (cuTile compiles no float8 below sm_90, sm_89 included: fp8_mm refuses it).
OTHER_ARCHS = {"fp8_gemm": ["sm_120"]}
OTHER_ARCH_LABELS = ("pre-Hopper", "sm_80", "sm_120")


def _each_kernel_and_other_arch_cases():
    seen = set()

    def select(op, index, case):
        fn = case.kernel._pyfunc
        first = (fn.__module__, fn.__qualname__) not in seen
        seen.add((fn.__module__, fn.__qualname__))
        return first or any(arch in case.label for arch in OTHER_ARCH_LABELS)
    return select


@pytest.mark.parametrize("op", [op for op in registry.ops() if op not in MODEL_ROWS])
def test_each_kernel_compiles_for_other_archs(op):
    report = _report("test_each_kernel_compiles_for_other_archs", op)
    assert report.ok
    assert not report.failed, "\n".join(f"{label}: {err}" for label, err in report.failed)


def test_frame_bytes_reads_the_stack_frame_of_a_cubin():
    """A kernel that spills (fmha's row-major decode at Sq 5: 336 bytes, what `cuobjdump
    -res-usage` reports as STACK) and one that does not (matmul's default at 4096^3)."""
    spilling = next(c for c in op_cases("fmha") if "decode causal Sq5 GQA 32/8 row-" in c.label)
    clean = next(c for c in op_cases("matmul") if "space 4096^3" in c.label)
    assert aot.compile_case(spilling, "sm_90")[1] == 336
    assert aot.compile_case(clean, "sm_90")[1] == 0


def test_the_registry_lists_every_op_module():
    """Each op module under tiletune.ops with a public op has its bench and compile cases; the
    registry also has whole-model rows (train_step), which compile nothing."""
    import pkgutil
    import tiletune.ops
    shared = {"partials", "rotary", "gemm_tiles", "rows"}   # helpers shared by ops, not ops
    modules = {m.name for m in pkgutil.iter_modules(tiletune.ops.__path__)} - shared
    assert set(registry.ops()) == modules | MODEL_ROWS
    for name, mod in registry.ops().items():
        assert callable(mod.bench_cases) and callable(mod.compile_cases)
        assert (not list(mod.compile_cases())) == (name in MODEL_ROWS)


def _dies_on_the_second_case(case, arch):
    if case.label == "case 1":
        os._exit(3)                      # a compile process killed mid-run
    return 0.1, 0


# The tests below stand in for `aot.compile_case`, not for the pool's `_compile_worker`: the
# compile tests' pool, started at collection, pickles that function by name while these run.


def test_a_dead_compile_process_is_reported_not_raised(monkeypatch):
    """A compile process that dies (killed, crashed) fails the cases it had and those still
    queued with a message, in the report; the cases done before it stay done."""
    from types import SimpleNamespace
    monkeypatch.setitem(aot._CASES, "fake", [SimpleNamespace(label=f"case {i}") for i in range(3)])
    monkeypatch.setattr(aot, "compile_case", _dies_on_the_second_case)
    report = aot.compile_all(["fake"], ["sm_90"], jobs=2)
    assert len(report.ok) + len(report.failed) == 3
    assert report.failed and all("BrokenProcessPool" in err for _, err in report.failed)
    assert ("case 1 [sm_90]" in dict(report.failed))


def test_cases_that_share_a_build_compile_it_once(monkeypatch):
    """Cases whose kernel function, hints and signature are equal (configs that differ only on
    the host) build one cubin: it compiles once per arch and each label gets its result."""
    from types import SimpleNamespace
    from tiletune.aot import jit_array

    def kernel(name, occupancy):
        return SimpleNamespace(_pyfunc=SimpleNamespace(__module__="m", __qualname__=name),
                               _compiler_options=f"occupancy={occupancy}")
    row = [jit_array(torch.float32, (64, 32))]
    cases = [SimpleNamespace(label="persistent", kernel=kernel("k", 2), params=row),
             SimpleNamespace(label="not persistent", kernel=kernel("k", 2), params=row),
             SimpleNamespace(label="occupancy 1", kernel=kernel("k", 1), params=row),
             SimpleNamespace(label="other kernel", kernel=kernel("j", 2), params=row)]
    monkeypatch.setitem(aot._CASES, "fake", cases)
    compiled = []

    def compile_case(case, arch):
        compiled.append((cases.index(case), arch))
        return 0.5, 8 * cases.index(case)
    monkeypatch.setattr(aot, "compile_case", compile_case)
    report = aot.compile_all(["fake"], ["sm_90", "sm_100"], jobs=1)
    assert sorted(compiled) == sorted(
        (i, a) for i in (0, 2, 3) for a in ("sm_90", "sm_100"))
    # (sm_100 compiles each config once: "not persistent" has no sm_100 case of its own)
    assert len(report.ok) == 7 and not report.failed
    assert "not persistent [sm_100]" not in report.frames
    assert report.frames["not persistent [sm_90]"] == report.frames["persistent [sm_90]"] == 0
    assert report.frames["occupancy 1 [sm_100]"] == 16


def test_a_space_config_compiles_for_the_archs_whose_space_lists_it(monkeypatch):
    """A config of sm_90's space alone compiles for sm_90, not sm_100 (never launched there),
    and still for other archs asked; one in both spaces for both; other cases for every arch
    (outside sm_90 once a config: the sm_100 copy of "both" has no sm_120 build)."""
    from types import SimpleNamespace
    from tiletune.aot import jit_array

    def case(label, name, spaces=()):
        kernel = SimpleNamespace(_pyfunc=SimpleNamespace(__module__="m", __qualname__=name),
                                 _compiler_options="")
        return SimpleNamespace(label=label, kernel=kernel, spaces=spaces,
                               params=[jit_array(torch.float32, (64, 32))])
    cases = [case("sm_90 only", "a", ("sm_90",)), case("both", "b", ("sm_90", "sm_100")),
             case("sm_100 only", "c", ("sm_100",)), case("any", "d"),
             case("sm_100 copy of both", "b", ("sm_100",))]   # the same build as "both"
    monkeypatch.setitem(aot._CASES, "fake", cases)
    compiled = []

    def compile_case(case, arch):
        compiled.append((cases.index(case), arch))
        return 0.5, 0
    monkeypatch.setattr(aot, "compile_case", compile_case)
    report = aot.compile_all(["fake"], ["sm_90", "sm_100", "sm_120"], jobs=1)
    assert sorted(compiled) == [(0, "sm_120"), (0, "sm_90"), (1, "sm_100"), (1, "sm_120"),
                                (1, "sm_90"), (2, "sm_100"), (2, "sm_120"), (3, "sm_100"),
                                (3, "sm_120"), (3, "sm_90")]
    assert sorted(label for label, _ in report.ok) == sorted(
        ["sm_90 only [sm_90]", "sm_90 only [sm_120]", "both [sm_90]", "both [sm_100]",
         "both [sm_120]", "sm_100 only [sm_100]", "sm_100 only [sm_120]", "any [sm_90]",
         "any [sm_100]", "any [sm_120]", "sm_100 copy of both [sm_100]"])


def test_other_archs_compile_each_config_once_and_every_case_of_their_spaces(monkeypatch):
    """sm_90 compiles every case. sm_100 compiles a config (kernel, hints, constant arguments)
    at its first case, its other cases (other arrays: a dtype, a width) not; a case whose space
    lists sm_100 compiles there even after another case of its config."""
    from types import SimpleNamespace
    from tiletune.aot import jit_array

    def case(label, name, tile, dtype, spaces=()):
        kernel = SimpleNamespace(_pyfunc=SimpleNamespace(__module__="m", __qualname__=name),
                                 _compiler_options="")
        return SimpleNamespace(label=label, kernel=kernel, spaces=spaces,
                               params=[jit_array(dtype, (64, 32)), tile])
    f32, bf16 = torch.float32, torch.bfloat16
    cases = [case("k 64 bf16", "k", 64, bf16), case("k 64 f32", "k", 64, f32),
             case("k 128 f32", "k", 128, f32), case("j 64 f32", "j", 64, f32),
             case("j 64 bf16 space", "j", 64, bf16, ("sm_90", "sm_100")),
             case("j 64 f16 sm_90 space", "j", 64, torch.float16, ("sm_90",))]
    monkeypatch.setitem(aot._CASES, "fake", cases)
    monkeypatch.setattr(aot, "compile_case", lambda case, arch: (0.5, 0))
    report = aot.compile_all(["fake"], ["sm_90", "sm_100"], jobs=1)
    assert not report.failed
    assert sorted(label for label, _ in report.ok) == sorted(
        [f"{c.label} [sm_90]" for c in cases]
        + ["k 64 bf16 [sm_100]", "k 128 f32 [sm_100]", "j 64 bf16 space [sm_100]"])
