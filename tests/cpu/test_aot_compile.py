"""Every config of every kernel compiles ahead of time for sm_90 and sm_100 with the real tileiras."""
import pytest

from tiletune import OPS
from tiletune.aot import compile_all, op_cases


@pytest.mark.parametrize("op", OPS)
def test_every_config_compiles(op):
    cases = op_cases(op)
    assert cases
    report = compile_all([op], ["sm_90", "sm_100"])
    assert not report.failed, "\n".join(f"{label}: {err}" for label, err in report.failed)
    assert len(report.ok) == 2 * len(cases)
