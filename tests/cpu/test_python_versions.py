"""The oldest Python that pyproject.toml accepts parses every source file of the package (a
newer syntax, such as a starred index `d[a, *b]`, is a SyntaxError there at import)."""
import glob
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _oldest_python():
    """(name, path) of an interpreter of the oldest Python pyproject.toml accepts, or (name,
    None): on PATH, or a pyenv install (whose shim on PATH may refuse to run it)."""
    text = (ROOT / "pyproject.toml").read_text()
    major, minor = re.search(r'requires-python\s*=\s*">=\s*(\d+)\.(\d+)"', text).groups()
    name = f"python{major}.{minor}"
    pyenv = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    for python in [*sorted(glob.glob(f"{pyenv}/versions/{major}.{minor}.*/bin/{name}")),
                   shutil.which(name)]:
        if python and subprocess.run([python, "-c", ""], capture_output=True).returncode == 0:
            return name, python
    return name, None


def test_every_source_file_parses_on_the_oldest_supported_python():
    name, python = _oldest_python()
    if python is None:
        pytest.skip(f"no {name} on this machine")
    files = [str(p) for d in ("tiletune", "ops", "suites", "cases", "tests", "assets")
             for p in sorted((ROOT / d).rglob("*.py"))]
    check = ("import ast, sys\n"
             "bad = []\n"
             "for f in sys.argv[1:]:\n"
             "    try:\n"
             "        ast.parse(open(f, encoding='utf-8').read(), f)\n"
             "    except SyntaxError as e:\n"
             "        bad.append(f'{f}:{e.lineno}: {e.msg}')\n"
             "print('\\n'.join(bad))\n")
    out = subprocess.run([python, "-c", check, *files], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "", f"{name} cannot parse:\n{out.stdout}"
