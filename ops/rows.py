# Rows of the memory-bound ops: an (..., N) tensor whose leading dims merge into rows is handed
# to a kernel as it is, and the kernel makes its (M, N) view itself (`as_rows`): a view made on
# the host costs 1-2 us of host time a tensor, one made in the kernel a few integer instructions
# (the TMA descriptors are built in the kernel either way; the sm_90 builds of both forms have
# the same loads, stores and barriers, references/hardware-constraints.md). Tensors whose dims do
# not merge (`row_stride` 0) come as (M, N) views or copies made on the host.
import cuda.tile as ct


def as_rows(a):
    """In a kernel: a as (M, N) rows, M the product of its leading dims; a itself where 2-D.
    Valid where the host found row_stride(a) > 0."""
    if a.ndim == 2:
        return a
    rows = a.shape[0]
    for i in ct.static_iter(range(1, a.ndim - 1)):
        rows = rows * a.shape[i]
    return ct.Array.from_foreign(a.foreign_pointer, (rows, a.shape[a.ndim - 1]),
                                 (a.strides[a.ndim - 2], a.strides[a.ndim - 1]))


def row_stride(t):
    """On the host: the row stride of t's rows where t (at least 2-D) has a unit last stride and
    its leading dims merge into rows spaced by the second-last dim's stride (as_rows' view);
    0 where not. (On every call's path: 2-D and 3-D are written out.)"""
    strides = t.stride()
    last = len(strides) - 1
    if last < 1 or strides[last] != 1:
        return 0
    if last == 1:
        return strides[0]
    shape = t.shape
    if last == 2:
        return strides[1] if shape[0] == 1 or strides[0] == shape[1] * strides[1] else 0
    # each leading dim of size > 1 steps over the rows of the dims after it (a size-1 dim's
    # stride is arbitrary, so the rows it holds are counted, not its stride)
    row = strides[last - 1]
    step = row
    for i in range(last - 2, -1, -1):
        step *= shape[i + 1]
        if shape[i] != 1 and strides[i] != step:
            return 0
    return row


def host_rows(t, N):
    """On the host: (t2, row stride), t2 being t itself where row_stride(t) finds rows, else t's
    (M, N) rows with unit column stride: a view, or one copy (also for a row stride of 0, an
    expanded tensor, which the kernels take only as a 2-D array)."""
    stride = row_stride(t)
    if stride:
        return t, stride
    t2 = unit_last_stride(t.reshape(-1, N))
    return t2, t2.stride()[0]


def unit_last_stride(t):
    """On the host: t with a last-dim stride of 1, for kernels that take it as 1: t itself, a
    view (a one-column t: torch counts it contiguous whatever its column stride, so
    contiguous() keeps `randn(1, M).t()` as it is) or one copy."""
    strides = t.stride()
    if strides[-1] == 1:
        return t
    if t.shape[-1] == 1:
        return t.as_strided(t.shape, strides[:-1] + (1,))
    return t.contiguous()
