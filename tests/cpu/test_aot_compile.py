"""Every config of every kernel compiles ahead of time for sm_90 and sm_100 with the real tileiras."""
import os

import pytest

from tiletune import aot, registry
from tiletune.aot import compile_all, op_cases

MODEL_ROWS = {"train_step"}       # whole-model bench rows: no kernels of their own


@pytest.mark.parametrize("op", [op for op in registry.ops() if op not in MODEL_ROWS])
def test_every_config_compiles(op):
    cases = op_cases(op)
    assert cases
    report = compile_all([op], ["sm_90", "sm_100"])
    assert not report.failed, "\n".join(f"{label}: {err}" for label, err in report.failed)
    assert len(report.ok) == 2 * len(cases)


def test_the_registry_lists_every_op_module():
    """Each op module under tiletune.ops with a public op has its bench and compile cases; the
    registry also has whole-model rows (train_step), which compile nothing."""
    import pkgutil
    import tiletune.ops
    shared = {"partials", "rotary", "gemm_tiles"}   # helpers shared by ops, not ops of their own
    modules = {m.name for m in pkgutil.iter_modules(tiletune.ops.__path__)} - shared
    assert set(registry.ops()) == modules | MODEL_ROWS
    for name, mod in registry.ops().items():
        assert callable(mod.bench_cases) and callable(mod.compile_cases)
        assert (not list(mod.compile_cases())) == (name in MODEL_ROWS)


def _dies_on_the_second_case(args):
    op, index, arch = args
    if index == 1:
        os._exit(3)                      # a compile process killed mid-run
    return f"case {index}", arch, 0.1, None


def test_a_dead_compile_process_is_reported_not_raised(monkeypatch):
    """A compile process that dies (killed, crashed) fails the cases it had and those still
    queued with a message, in the report; the cases done before it stay done."""
    from types import SimpleNamespace
    monkeypatch.setitem(aot._CASES, "fake", [SimpleNamespace(label=f"case {i}") for i in range(3)])
    monkeypatch.setattr(aot, "_compile_worker", _dies_on_the_second_case)
    report = aot.compile_all(["fake"], ["sm_90"], jobs=2)
    assert len(report.ok) + len(report.failed) == 3
    assert report.failed and all("BrokenProcessPool" in err for _, err in report.failed)
    assert ("case 1 [sm_90]" in dict(report.failed))
