"""The layer above the ops: each op's benchmark rows (against the peers it is measured with) and
its ahead-of-time compile cases, one module per op. `REGISTRY` is what `python -m tiletune bench`
and `compile` run, in this order (registered in pyproject.toml's `tiletune.cases` entry points)."""
from tiletune.cases import (fmha, fp8_gemm, gated_mlp, grouped_gemm, matmul, moe, rms_norm,
                            rms_norm_rope, rope, swiglu, train_step)

REGISTRY = {"rms_norm": rms_norm, "rope": rope, "rms_norm_rope": rms_norm_rope, "swiglu": swiglu,
            "matmul": matmul, "gated_mlp": gated_mlp, "grouped_gemm": grouped_gemm,
            "fp8_gemm": fp8_gemm, "fmha": fmha, "moe": moe, "train_step": train_step}
