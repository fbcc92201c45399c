"""Every config of every kernel compiles ahead of time for sm_90 and sm_100 with the real tileiras."""
import pytest

from tiletune import registry
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
