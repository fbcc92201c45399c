"""RoPE's host side on CPU tensors, ct.launch stubbed (nothing is computed): what reaches the
kernels, and what autograd is told."""
from types import SimpleNamespace

import pytest
import torch

from tiletune import autotune, device, validate
from tiletune.ops import rms_norm_rope as RR
from tiletune.ops import rope as RP
from tests.cpu.stand_ins import resolve_misses_to_default


@pytest.fixture
def host_only(launches, monkeypatch):
    resolve_misses_to_default(monkeypatch, lambda tuner, dev: f"{tuner.name} kernel")
    monkeypatch.setitem(device._SM_COUNT, -1, 132)      # a CPU tensor's device index
    monkeypatch.setattr(validate, "tensor", lambda op, name, t, **kw: t)
    autotune.clear_cache()
    yield launches
    autotune.clear_cache()


def _qk(B=2, S=5, D=8):
    return torch.randn(B, 4, S, D), torch.randn(B, 2, S, D)


def test_hf_form_reads_position_ids_only_for_tables(host_only, monkeypatch):
    """transformers 4.38 and later pass cos/sin already gathered per position ((B, S, D)) and
    no longer read position_ids; earlier versions passed (S', D) tables indexed by them."""
    seen = []
    monkeypatch.setattr(RP, "apply_rope", lambda q, k, cos, sin, **kw: seen.append(kw))
    q, k = _qk()
    pos = torch.tensor([[0, 1, 2, 0, 1]] * 2)
    RP.apply_rotary_pos_emb(q, k, torch.randn(2, 5, 8), torch.randn(2, 5, 8), pos)
    RP.apply_rotary_pos_emb(q, k, torch.randn(9, 8), torch.randn(9, 8), pos)
    RP.apply_rotary_pos_emb(q, k, torch.randn(1, 1, 9, 8), torch.randn(1, 1, 9, 8), pos)  # 4.31
    RP.apply_rotary_pos_emb(q, k, torch.randn(2, 1, 5, 8), torch.randn(2, 1, 5, 8), pos)
    assert seen[0]["position_ids"] is None and seen[1]["position_ids"] is pos
    assert seen[2]["position_ids"] is pos and seen[3]["position_ids"] is None
    assert seen[0]["compute_dtype"] == torch.float32


def test_hf_form_refuses_an_unsqueeze_dim_in_place_of_position_ids():
    """transformers 5's order (q, k, cos, sin, unsqueeze_dim) put into the 4.x signature binds
    the int to position_ids: refused (it was dropped, and (B, S, H, D) read as (B, H, S, D))."""
    q, k = _qk()
    with pytest.raises(TypeError, match=r"^apply_rotary_pos_emb: position_ids must be a tensor "
                                        r"or None, got int \(pass unsqueeze_dim by keyword\)"):
        RP.apply_rotary_pos_emb(q, k, torch.randn(2, 5, 8), torch.randn(2, 5, 8), 2)


def test_hf_form_names_a_non_tensor_argument():
    with pytest.raises(TypeError, match="apply_rotary_pos_emb: q"):
        RP.apply_rotary_pos_emb(None, None, torch.randn(5, 8), torch.randn(5, 8))


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad mode"])
def test_in_place_rotation_bumps_the_version_counters(host_only, grad):
    """The kernel writes q and k behind torch's back: their version counters move, so a graph
    that saved them refuses its backward instead of reading the rotated values."""
    q, k = _qk()
    cos, sin = torch.randn(5, 8), torch.randn(5, 8)
    w = torch.randn(8, requires_grad=True)
    z = (q * w).sum()                      # saves q
    with torch.set_grad_enabled(grad):
        RP.apply_rope(q, k, cos, sin, inplace=True)
    assert [kernel for _, kernel, _ in host_only] == ["rope_inplace kernel"]
    assert q._version > 0 and k._version > 0
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        z.backward()


def test_in_place_rotation_bumps_k_when_q_is_an_inference_tensor(host_only):
    """Each counter on its own: an inference-mode q (which has none) does not leave a normal k's
    version unmoved (under inference mode, where both may be written); outside inference mode
    the inference q is refused, as torch refuses that write."""
    with torch.inference_mode():
        q, _ = _qk()
    _, k = _qk()
    with torch.inference_mode():
        RP.apply_rope(q, k, torch.randn(5, 8), torch.randn(5, 8), inplace=True)
    assert k._version > 0
    with pytest.raises(ValueError, match="apply_rope: inplace=True on q, an inference tensor"):
        RP.apply_rope(q, k, torch.randn(5, 8), torch.randn(5, 8), inplace=True)


def test_cos_and_sin_that_require_grad_are_refused(host_only):
    """The backward gives q and k their gradients only: a learned cos/sin table would get
    none, silently, so it is refused in grad mode (and accepted under no_grad)."""
    q, k = _qk()
    cos, sin = torch.randn(5, 8, requires_grad=True), torch.randn(5, 8)
    w = torch.ones(8)
    for call in (lambda: RP.apply_rope(q, k, cos, sin),
                 lambda: RP.apply_rope(q, k, sin, cos),
                 lambda: RR.rms_norm_rope(q, k, w, w, cos, sin)):
        with pytest.raises(ValueError, match="cos and sin must not require grad"):
            call()
        with torch.no_grad():
            call()


def test_q_without_heads_is_refused(host_only):
    """A q of zero heads would launch tiles wholly outside q (k still has rows to rotate)."""
    q, k = torch.zeros(2, 0, 5, 8), torch.zeros(2, 2, 5, 8)
    cos = torch.zeros(5, 8)
    with pytest.raises(ValueError, match=r"apply_rope: q heads \(0\) must be a positive"):
        RP.apply_rope(q, k, cos, cos)


def test_cos_and_sin_may_take_different_documented_forms(host_only):
    from tiletune.ops.rotary import prepare
    q, k = _qk()
    cos, sin = torch.randn(5, 8), torch.randn(1, 5, 8)
    c, s_, _, rot = prepare("apply_rope", q, k, cos, sin, None, None)
    assert c.shape == s_.shape == (2, 5, 8) and rot == 8
    with pytest.raises(ValueError, match=r"apply_rope: cos \(5, 8\) and sin \(1, 4, 8\)"):
        prepare("apply_rope", q, k, cos, sin[:, :4], None, None)


def test_tables_reach_the_kernels_as_batch_by_rotary_width_views(host_only):
    """(B, S', rot) views of the tables: a shared table expanded over the batch (stride 0), a
    wider one narrowed to the rotary width; a table already in that form is passed as it is (no
    view made: about 1 us of host time each)."""
    from tiletune.ops.rotary import prepare
    q, k = _qk()
    shared = torch.randn(5, 8)
    c, s_, _, rot = prepare("apply_rope", q, k, shared, shared, None, None)
    assert c.shape == (2, 5, 8) and c.stride() == (0, 8, 1) and rot == 8
    wide = torch.randn(2, 5, 8)
    c, s_, _, rot = prepare("apply_rope", q, k, wide, wide, None, 4)
    assert c.shape == s_.shape == (2, 5, 4) and rot == 4 and torch.equal(c, wide[..., :4])
    c, s_, _, rot = prepare("apply_rope", q, k, wide, wide, None, None)
    assert c is wide and s_ is wide and rot == 8


@pytest.mark.parametrize("strided", ["cos", "sin", "both"])
def test_cos_and_sin_reach_the_kernels_with_unit_column_strides(host_only, strided):
    """Each table is checked on its own: a transposed sin next to a contiguous cos (or the
    reverse) reaches the kernels with unit column strides (a layout their compile cases cover
    and their row loads read through TMA), with the same values."""
    q, k = _qk()
    table = lambda: torch.randn(5, 8)
    transposed = lambda: torch.randn(8, 5).t()
    cos = transposed() if strided in ("cos", "both") else table()
    sin = transposed() if strided in ("sin", "both") else table()
    RP.apply_rope(q, k, cos, sin)
    ((_, _, args),) = host_only
    c, s_ = args[2], args[3]
    assert c.stride(-1) == 1 and s_.stride(-1) == 1
    assert torch.equal(c[0], cos) and torch.equal(s_[0], sin)


def test_position_ids_range_check_reads_the_device_once(host_only, monkeypatch):
    """Both bounds of position_ids come back to the host in one read (min and max read one at
    a time would be two), once per tensor: later calls with the same tensor (a model's layers
    share one) read nothing until it is written in place; inference tensors, which count no
    versions, are read every call. Ids outside cos/sin are refused by name on every call."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    reads = []
    for name in ("__int__", "__index__", "__bool__", "__float__", "item", "tolist"):
        def counted(self, *args, real=getattr(torch.Tensor, name), name=name):
            reads.append(name)
            return real(self, *args)
        monkeypatch.setattr(torch.Tensor, name, counted)
    q, k = _qk()
    cos, w = torch.randn(9, 8), torch.ones(8)
    for pos in (torch.tensor([3, 1, 0, 8, 2]), torch.tensor([[0, 1, 2, 3, 4]] * 2,
                                                            dtype=torch.int32)):
        calls = (lambda: RP.apply_rope(q, k, cos, cos, position_ids=pos),
                 lambda: RR.rms_norm_rope(q, k, w, w, cos, cos, position_ids=pos))
        for n, call in enumerate(calls * 2):
            reads.clear()
            call()
            assert len(reads) == (1 if n == 0 else 0), reads
        pos[..., 0] = 4                 # written in place: read again
        reads.clear()
        calls[0]()
        assert len(reads) == 1, reads
    with torch.inference_mode():
        pos = torch.tensor([3, 1, 0, 8, 2])
    for _ in range(2):
        reads.clear()
        RP.apply_rope(q, k, cos, cos, position_ids=pos)
        assert len(reads) == 1, reads
    for bad, bounds in (([-1, 0, 1, 2, 3], r"\[-1, 3\]"), ([0, 1, 9, 2, 3], r"\[0, 9\]")):
        ids = torch.tensor(bad)
        for _ in range(2):
            with pytest.raises(ValueError, match=rf"^apply_rope: position_ids range {bounds} is "
                                                 r"outside the 9 rows of cos/sin"):
                RP.apply_rope(q, k, cos, cos, position_ids=ids)


def test_position_ids_reach_the_kernels_as_they_are_now(host_only, monkeypatch):
    """The ids a call passes are position_ids' values at that call (only their range is kept
    between calls): written in place after a first call, or by a write torch does not count,
    the next call passes the new values."""
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    q, k = _qk()
    cos = torch.randn(9, 8)
    ids = torch.tensor([3, 1, 0, 8, 2])
    for expect in ([3, 1, 0, 8, 2], [7, 1, 0, 8, 2], [6, 1, 0, 8, 2]):
        host_only.clear()
        RP.apply_rope(q, k, cos, cos, position_ids=ids)
        ((_, _, args),) = host_only
        assert args[4].dtype == torch.int32 and args[4].tolist() == [expect, expect]
        if expect[0] == 3:
            ids[0] = 7
        else:
            ids.data[0] = 6             # (.data: a write autograd's version counter misses)


def test_in_place_rotation_of_tensors_that_require_grad_in_inference_mode(host_only):
    """torch.inference_mode() records no graph, even under enable_grad, and torch writes a leaf
    that requires grad in place there (as it does a view, with no copy-back needed): so does
    inplace=True, with the in-place kernel. Where autograd records a graph the leaf is still
    refused."""
    cos, sin = torch.randn(5, 8), torch.randn(5, 8)
    q, k = (t.requires_grad_() for t in _qk())
    qkv = torch.randn(2, 6, 5, 8, requires_grad=True) * 1    # not a leaf: views of it are fine
    q_view, k_view = qkv[:, :4], qkv[:, 4:]
    with torch.inference_mode(), torch.enable_grad():
        q_out, k_out = RP.apply_rope(q, k, cos, sin, inplace=True)
        RP.apply_rope(q_view, k_view, cos, sin, inplace=True)
    assert q_out is q and k_out is k
    assert [kernel for _, kernel, _ in host_only] == ["rope_inplace kernel"] * 2
    assert q._version > 0 and k._version > 0 and q.grad_fn is None
    with pytest.raises(ValueError, match=r"^apply_rope: inplace=True on q, a leaf tensor that "
                                         r"requires grad"):
        RP.apply_rope(q, k, cos, sin, inplace=True)


def test_tables_that_require_grad_are_taken_in_inference_mode(host_only):
    """No graph is recorded inside torch.inference_mode(), even under enable_grad: cos and sin
    that require grad need no gradient there, as under no_grad."""
    cos, sin = (torch.randn(5, 8, requires_grad=True) for _ in range(2))
    q, k = _qk()
    with torch.inference_mode(), torch.enable_grad():
        RP.apply_rope(q, k, cos, sin)
    assert [kernel for _, kernel, _ in host_only] == ["rope kernel"]
    with pytest.raises(ValueError, match=r"^apply_rope: cos and sin must not require grad"):
        RP.apply_rope(q, k, cos, sin)


@pytest.mark.parametrize("rot", [2, 32, 40, 64, 80, 96, 128, 256])
@pytest.mark.parametrize("heads", [1, 8, 32, 64])
def test_halves_as_tiles_only_where_a_half_fills_its_tile(rot, heads):
    """A half of 20 in a 32-wide tile would read and write tile 1 from column 32, not 20: the
    entry is offered only where half is a power of two, and the flag reaches a kernel only
    there."""
    half = rot // 2
    fills = half & (half - 1) == 0
    space = list(RP.rope_tile_configs("sm_90", heads, rot))
    as_tiles = [c for c in space if getattr(c, "halves_as_tiles", False)]
    many_heads = heads * 2 * RP.next_pow2(half) >= 2 * RP.EIGHT_WARPS   # an 8-warp one too
    assert len(as_tiles) == ((2 if many_heads else 1) if fills else 0)
    for c in space:
        assert RP._halves_as_tiles(c, half) == (fills and c in as_tiles)
        assert RP._halves_as_tiles(c, 20) is False


@pytest.mark.parametrize("inplace", [False, True], ids=["out_of_place", "inplace"])
@pytest.mark.parametrize("heads,kv_heads,S,D,rot,whole", [
    (4, 2, 5, 8, 8, True), (4, 2, 5, 8, 4, True), (6, 2, 5, 8, 8, False), (4, 1, 5, 8, 8, True),
    (4, 2, 5, 12, 12, False), (4, 2, 5, 12, 8, True)])
def test_bounds_checks_are_dropped_only_where_every_tile_is_whole(host_only, inplace, heads,
                                                                  kv_heads, S, D, rot, whole):
    """WHOLE (no bounds checks on the rotary halves' loads and stores, nor on their cos/sin
    rows) reaches the kernel only where head counts and the half are powers of two: with 6
    heads an 8-head tile reads past q, with a half of 6 an 8-wide tile past it."""
    q, k = torch.randn(2, heads, S, D), torch.randn(2, kv_heads, S, D)
    cos = sin = torch.randn(S, rot)
    RP.apply_rope(q, k, cos, sin, inplace=inplace)
    ((_, _, args),) = host_only
    assert args[-1] is whole


def test_whole_tiles_need_positions_that_fill_the_position_tile():
    """A tile of several positions over an S that is not a multiple of it reaches past S."""
    for tile_s, S, whole in ((1, 423, True), (4, 423, False), (4, 424, True), (16, 4096, True)):
        assert RP._whole(SimpleNamespace(tile_s=tile_s), 4, 1, S, 32) is whole
    assert RP._whole(SimpleNamespace(tile_s=1), 4, 3, 64, 32) is False
    assert RP._whole(SimpleNamespace(tile_s=1), 4, 1, 64, 20) is False


@pytest.mark.parametrize("heads,rot,first_is_one_cta", [
    (32, 128, True), (64, 128, True), (16, 64, True), (8, 128, True), (128, 128, False),
    (40, 128, False), (32, 80, False), (4, 64, False)])
def test_one_cta_a_position_leads_where_tiles_are_whole(heads, rot, first_is_one_cta):
    """The default (the space's first row) is one CTA a position at occupancy 2 where the
    tiles are whole and a position is neither a multi-position tile's nor a 128-head one's."""
    first = next(RP.rope_tile_configs("sm_90", heads, rot))
    one_cta = (first.occupancy, first.persistent, first.tile_s) == (2, False, 1)
    assert one_cta is first_is_one_cta
    assert first == RP.DEFAULT or first_is_one_cta
