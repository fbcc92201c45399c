"""Multi-GPU tuning on two GPUs: tests/gpu/distributed_2gpu.py under torchrun (skipped with fewer
than two GPUs). A cold run (DDP training with random sequence lengths, an extra key on one rank),
a warm run from its store with the devices swapped, and (slow) the tuning wall time of one step
on one GPU against two sharing the search."""
import json
import os
import subprocess
import sys

import pytest
import torch

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "distributed_2gpu.py")
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(SCRIPT)))

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")


def torchrun(nproc, *args, timeout=1500):
    """Run the script on `nproc` GPUs; (exit status, output). The output is echoed (pytest -s)."""
    env = {k: v for k, v in os.environ.items() if k not in ("DISABLE_AUTOTUNE",)}
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          f"--nproc_per_node={nproc}", SCRIPT, *map(str, args)],
                         capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)
    text = out.stdout + out.stderr
    print(text[-6000:])
    return out.returncode, text


def test_two_ranks_agree_share_the_search_and_warm_start(tmp_path):
    rc, text = torchrun(2, "--dir", tmp_path)
    assert rc == 0 and "RESULT: PASS" in text, text[-4000:]
    rc, text = torchrun(2, "--dir", tmp_path, "--warm", "--swap-devices")
    assert rc == 0 and "RESULT: PASS" in text, text[-4000:]


def _measure(text):
    (line,) = [ln for ln in text.splitlines() if ln.startswith("MEASURE ")]
    return json.loads(line[len("MEASURE "):])


@pytest.mark.slow
def test_tuning_wall_time_of_two_ranks_against_one(tmp_path):
    """One training step's tuning on one GPU (no group) and on two (share, replicate), each with
    a fresh store and compile cache, on the same machine; then two ranks warm-started from the
    one-GPU store time nothing. Prints the numbers; asserts only that sharing is faster."""
    runs = {}
    for name, nproc, extra in (("one", 1, ["--no-group"]), ("share", 2, []),
                               ("replicate", 2, ["--mode", "replicate"])):
        rc, text = torchrun(nproc, "--measure", "--dir", tmp_path / name, *extra)
        assert rc == 0, text[-4000:]
        runs[name] = _measure(text)
    rc, text = torchrun(2, "--measure", "--warm", "--dir", tmp_path / "one")
    assert rc == 0, text[-4000:]
    runs["warm"] = _measure(text)
    one = runs["one"]["tuning_s"]
    for name, r in runs.items():
        waits = [round(x["wait_s"], 2) for x in r["ranks"]]
        print(f"{name:10s} ranks {r['world']}  tuning {r['tuning_s']:7.1f} s  "
              f"({r['tuning_s'] / one:.2f} of one GPU)  configs timed "
              f"{[x['configs_timed'] for x in r['ranks']]}  waiting {waits} s")
    assert runs["share"]["tuning_s"] < one
    assert all(x["configs_timed"] == 0 and x["searches"] == 0 for x in runs["warm"]["ranks"])
