"""Find kernels that lost vector loads: compile every AOT case of the named ops for sm_90 and list
those whose SASS has 1- or 2-byte global loads/stores (LDG/STG .U8/.U16/.S16), with their TMA
count. Needs no GPU; needs cuobjdump (pip install nvidia-cuda-cuobjdump; set CUOBJDUMP or PATH).

    python assets/scripts/sass_sweep.py rms_norm matmul fmha rope rms_norm_rope

On 2026-11-26 (tileiras 13.4.92) only inherently unaligned cases showed up: RMSNorm N=1001 and
the fp16 1000x1999x777 matmul (row strides not a multiple of 16 bytes) and RoPE at D80/R40;
before the rotary half width became a constant, every RoPE case did (see hardware-constraints).
"""
import collections
import importlib
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile

from cuda.tile.compilation import export_kernel

from tiletune.aot import signature

CUOBJDUMP = os.environ.get("CUOBJDUMP") or shutil.which("cuobjdump") or "cuobjdump"
MEMORY_OP = re.compile(r"\s((?:UTMA|LDG|STG)[\w.]*)")


def memory_ops(case):
    buf = io.BytesIO()
    export_kernel(case.kernel, [signature(case.params)], buf, gpu_code="sm_90", output_format="cubin")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(buf.getvalue())
        f.flush()
        sass = subprocess.run([CUOBJDUMP, "-sass", f.name], capture_output=True, text=True).stdout
    return collections.Counter(m.group(1) for m in MEMORY_OP.finditer(sass))


for op in sys.argv[1:]:
    for case in importlib.import_module(f"tiletune.ops.{op}").aot_cases():
        if "sm_100" in case.label:
            continue
        ops = memory_ops(case)
        narrow = {k: v for k, v in ops.items() if k.endswith((".U8", ".U16", ".S16"))}
        if narrow:
            tma = sum(v for k, v in ops.items() if k.startswith("UTMA"))
            print(f"{op}: {case.label}: {narrow}, TMA ops {tma}", flush=True)
