"""Small helpers every op uses to describe its search space and its grids."""
import itertools
from types import SimpleNamespace


def next_pow2(n):
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def cdiv(a, b):
    """Ceiling division of non-negative integers."""
    return -(-a // b)


INT32_MAX = 2**31 - 1        # kernels index with int32


def row_chunks(M, N, stride=None, limit=INT32_MAX):
    """(start, end) row ranges of an (M, N) array with row stride `stride` (default N) whose
    views each span at most `limit` elements (N <= limit): one range where the whole array fits.
    Rows per range are a multiple of 16 where at least 16 fit (a 16-byte-aligned view stays
    aligned); rows wider than limit / 16 go fewer at a time, down to one."""
    stride = N if stride is None else stride
    if (M - 1) * stride + N <= limit:
        return ((0, M),)
    rows = (limit - N) // stride + 1
    if rows >= 16:
        rows = rows // 16 * 16
    return tuple((s, min(s + rows, M)) for s in range(0, M, rows))


def f32_row(n):
    """n float32 elements rounded up to a multiple of 16 bytes: the row stride TMA can load
    (statistics and scales the kernels read in (1, T) slices are stored in such rows)."""
    return cdiv(n, 4) * 4


def product(default, **dims):
    """A config space: `default` first, then every combination of `dims` (name -> values) laid
    over it, without repeats. A value that is a dict sets several fields at once (tiles that
    go in pairs: `tiles=[dict(tile_m=8, tile_n=512), ...]`)."""
    seen = [default]
    yield default
    names = list(dims)
    for values in itertools.product(*(dims[n] for n in names)):
        fields = dict(vars(default))
        for name, v in zip(names, values):
            fields.update(v if isinstance(v, dict) else {name: v})
        cfg = SimpleNamespace(**fields)
        if cfg not in seen:
            seen.append(cfg)
            yield cfg


def table(fields, rows, **common):
    """A config space from a table: each row (a tuple in `fields` order, shorter rows take the
    remaining fields from `common`) becomes one config; a field whose value is None is left out
    (the compiler chooses)."""
    for row in rows:
        values = dict(zip(fields, row))
        for name, value in common.items():
            values.setdefault(name, value)
        yield SimpleNamespace(**{k: v for k, v in values.items() if v is not None})
