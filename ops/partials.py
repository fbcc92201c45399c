# Float32 partial sums, one row per CTA, reduced over the rows and cast: the weight-gradient
# reduction of the normalization ops (rms_norm, rms_norm_rope), in one launch instead of a torch
# `sum` + `to` (two launches and their host time).
#
# No `from __future__ import annotations` here: it would hide the ct.Constant annotations.
from types import SimpleNamespace

import cuda.tile as ct

from tiletune.autotune import Autotuner, Work, bucketed
from tiletune.space import cdiv, product

ZERO = ct.PaddingMode.ZERO


@ct.kernel
def column_sum(partial, out, TILE_G: ct.Constant[int], TILE_N: ct.Constant[int]):
    """out[n] = sum_g partial[g, n] over float32 partials (G, N), cast to out's dtype."""
    col = ct.bid(0)
    acc = ct.zeros((TILE_G, TILE_N), ct.float32)
    for g in range(ct.cdiv(partial.shape[0], TILE_G)):
        acc = acc + ct.load(partial, (g, col), (TILE_G, TILE_N), padding_mode=ZERO)
    ct.store(out, (col,), ct.sum(acc, axis=0).astype(out.dtype))


def column_sum_configs(arch, n_cols):
    yield from product(SimpleNamespace(tile_g=16, tile_n=64, occupancy=4),
                       tile_g=(16, 64), tile_n=(16, 32, 64, 128))


_column_sum = Autotuner(
    "column_sum", column_sum, column_sum_configs,
    default=SimpleNamespace(tile_g=16, tile_n=64, occupancy=4),
    space=lambda partial, out: dict(n_cols=partial.shape[1]),
    grid=lambda c, dev, partial, out: (cdiv(partial.shape[1], c.tile_n),),
    args=lambda c, partial, out: (partial, out, c.tile_g, c.tile_n), tune_key=bucketed(1),
    work=lambda partial, out: Work(bytes=partial.numel() * 4 + out.numel() * out.element_size()))
TUNERS = (_column_sum,)


def sum_rows(partial, out):
    """out (N,) = partial (G, N) float32 summed over G, in out's dtype."""
    G, N = partial.shape
    dev = partial.get_device()
    _column_sum.launch((N, G, out.dtype, dev), dev, partial, out)
