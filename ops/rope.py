# Rotary position embedding (HF "rotate_half" convention) for q (B, Hq, S, D) and k (B, Hkv, S, D).
#
#   x1, x2 = x[..., :R/2], x[..., R/2:R]        (R = rotary width <= D; dims R..D pass through)
#   out1 = x1 * cos1 - x2 * sin1,  out2 = x2 * cos2 + x1 * sin2
# with cos/sin rows (R,) split the same way. The backward is the transpose:
#   dx1 = dy1 * cos1 + dy2 * sin2,  dx2 = dy2 * cos2 - dy1 * sin1
# i.e. the forward with (sin1, sin2) -> (-sin2, -sin1).
#
# No `from __future__ import annotations` here: it would hide the ct.Constant annotations.
import cuda.tile as ct
import torch

from tiletune import validate
from tiletune.autotune import Autotuner, Work, bucket
from tiletune.ops.rotary import ctas, load_tile, math_tile, position_tile_at, prepare, store_tile
from tiletune.space import cdiv, next_pow2, table
from tiletune.torch_op import TrainableOp, records_graph, tracing

_increment_version = torch.autograd.graph.increment_version

ZERO = ct.PaddingMode.ZERO

# ---------------------------------------------------------------------------------------------
# Kernels. One CTA handles TILE_S consecutive positions of one batch row at a time: all q heads
# and all k heads, so each cos/sin row is read once. Arrays are 4-D views (B, H, S, D) with any
# strides; tiles are [1, TILE_H, TILE_S, TILE_R] over heads, positions and one rotary half.
# With position_ids (HAS_POS) the cos/sin rows are gathered one position at a time: TILE_S = 1.
# The cos/sin gathering is shared with rms_norm_rope (ops/rotary.py).


def _halves(x, b, st, half, shape, LATENCY, HALVES_AS_TILES, WHOLE):
    """The two rotary halves of x[b, :, st*TILE_S : (st+1)*TILE_S, :] as tiles of `shape`.
    HALVES_AS_TILES (a half fills its tile): tiles 0 and 1 of x along D, else slices of x."""
    if HALVES_AS_TILES:
        return (load_tile(x, (b, 0, st, 0), shape, WHOLE, LATENCY),
                load_tile(x, (b, 0, st, 1), shape, WHOLE, LATENCY))
    return (load_tile(x.slice(3, 0, half), (b, 0, st, 0), shape, WHOLE, LATENCY),
            load_tile(x.slice(3, half, 2 * half), (b, 0, st, 0), shape, WHOLE, LATENCY))


def _rotate(x, out, b, st, half, c1, c2, s1, s2, TILE_H, TILE_S, TILE_R, TILE_P, COPY_REST,
            LATENCY, MATH_F32, HALVES_AS_TILES, WHOLE):
    """Rotate the first 2*half dims of x[b, :, st*TILE_S : (st+1)*TILE_S, :] into out; copy the
    rest. Positions past S load as zeros and their stores are dropped. LATENCY is ct.load's
    DRAM-latency hint (1-10) for the q/k loads; MATH_F32: the arithmetic in float32 (one
    rounding at the store), else in x's dtype. HALVES_AS_TILES: each half read and written as a
    whole tile of x itself, not of a slice of it (see `rope_tile_configs`). WHOLE: every tile
    of the halves lies inside x and out (no bounds checks: ops/rotary.py, load_tile)."""
    shape = (1, TILE_H, TILE_S, TILE_R)
    x1, x2 = _halves(x, b, st, half, shape, LATENCY, HALVES_AS_TILES, WHOLE)
    x1, x2 = math_tile(x1, x, MATH_F32), math_tile(x2, x, MATH_F32)
    y1, y2 = (x1 * c1 - x2 * s1).astype(out.dtype), (x2 * c2 + x1 * s2).astype(out.dtype)
    # (both forms written out: through a helper returning (array, tile index) for either, the
    # sm_90 in-place build of the tile form had 7 barriers a position against these 5, f32 math)
    if HALVES_AS_TILES:
        store_tile(out, (b, 0, st, 0), y1, WHOLE)
        store_tile(out, (b, 0, st, 1), y2, WHOLE)
    else:
        store_tile(out.slice(3, 0, half), (b, 0, st, 0), y1, WHOLE)
        store_tile(out.slice(3, half, 2 * half), (b, 0, st, 0), y2, WHOLE)
    if COPY_REST:
        rest = ct.load(x.slice(3, 2 * half, x.shape[3]), (b, 0, st, 0), (1, TILE_H, TILE_S, TILE_P),
                       padding_mode=ZERO, latency=LATENCY)
        ct.store(out.slice(3, 2 * half, x.shape[3]), (b, 0, st, 0), rest)


@ct.kernel
def rope_kernel(q, k, cos, sin, pos, q_out, k_out, half: ct.Constant[int],
                TILE_HQ: ct.Constant[int], TILE_HK: ct.Constant[int], TILE_S: ct.Constant[int],
                TILE_R: ct.Constant[int], TILE_P: ct.Constant[int], HAS_POS: ct.Constant[bool],
                COPY_REST: ct.Constant[bool], BACKWARD: ct.Constant[bool],
                LATENCY: ct.Constant[int], MATH_F32: ct.Constant[bool],
                HALVES_AS_TILES: ct.Constant[bool], WHOLE: ct.Constant[bool]):
    """Out of place: q_out, k_out = rope(q), rope(k). cos/sin (Bc, S', R) with Bc in {1, B}
    (a stride-0 batch dim when shared); pos (B, S) int32 rows of cos/sin when HAS_POS. WHOLE:
    every tile of the rotary halves and of their cos/sin rows lies inside its array (`_whole`)."""
    S = q.shape[2]
    for t in range(ct.bid(0), q.shape[0] * ct.cdiv(S, TILE_S), ct.num_blocks(0)):
        b, st, c1, c2, s1, s2 = position_tile_at(t, S, cos, sin, pos, half, TILE_S, TILE_R,
                                                 HAS_POS, BACKWARD, q, MATH_F32, WHOLE)
        _rotate(q, q_out, b, st, half, c1, c2, s1, s2, TILE_HQ, TILE_S, TILE_R, TILE_P, COPY_REST,
                LATENCY, MATH_F32, HALVES_AS_TILES, WHOLE)
        _rotate(k, k_out, b, st, half, c1, c2, s1, s2, TILE_HK, TILE_S, TILE_R, TILE_P, COPY_REST,
                LATENCY, MATH_F32, HALVES_AS_TILES, WHOLE)


@ct.kernel
def rope_inplace_kernel(q, k, cos, sin, pos, half: ct.Constant[int],
                        TILE_HQ: ct.Constant[int], TILE_HK: ct.Constant[int],
                        TILE_S: ct.Constant[int], TILE_R: ct.Constant[int],
                        HAS_POS: ct.Constant[bool], BACKWARD: ct.Constant[bool],
                        LATENCY: ct.Constant[int], MATH_F32: ct.Constant[bool],
                        HALVES_AS_TILES: ct.Constant[bool], WHOLE: ct.Constant[bool]):
    """In place: q, k = rope(q), rope(k) (each element is read before it is written, by the
    same CTA; pass-through dims are left alone)."""
    S = q.shape[2]
    for t in range(ct.bid(0), q.shape[0] * ct.cdiv(S, TILE_S), ct.num_blocks(0)):
        b, st, c1, c2, s1, s2 = position_tile_at(t, S, cos, sin, pos, half, TILE_S, TILE_R,
                                                 HAS_POS, BACKWARD, q, MATH_F32, WHOLE)
        _rotate(q, q, b, st, half, c1, c2, s1, s2, TILE_HQ, TILE_S, TILE_R, 1, False, LATENCY,
                MATH_F32, HALVES_AS_TILES, WHOLE)
        _rotate(k, k, b, st, half, c1, c2, s1, s2, TILE_HK, TILE_S, TILE_R, 1, False, LATENCY,
                MATH_F32, HALVES_AS_TILES, WHOLE)


# ---------------------------------------------------------------------------------------------
# Configs: grid shape x occupancy x ct.load latency hint on the q/k loads x positions per tile,
# and 8-warp CTAs where a position holds many heads (EIGHT_WARPS).
# Default: one CTA per position at occupancy 2 where a position's tiles are whole (heads and
# the rotary half powers of two), else a persistent grid (SMs x occupancy CTAs), occupancy 4,
# latency 1, the winner at B4 Hq32 Hkv8 S4096 D128 bf16 while every tile checked its bounds.
# TILE_S > 1 only where one position is little work (at most MAX_MULTI_POSITION elements of q:
# 8 heads at D64, 4 at D128), bounded by registers: from 16 heads at D64 up, multi-position
# tiles won no search (H100: 32/8 heads at D64 and D128, 1024-8192 tokens, their best 12-37%
# behind; H200 at the three bench shapes: 20-35% behind; with whole tiles 0.3-51% behind one
# CTA a position) while making up most of the space. Measurements:
# references/parameter-space-design.md ("RoPE") and kernel-type-templates.md ("Whole tiles").

MAX_TILE_ELEMS = 16384     # fp32 elements of one q tile (both halves)
MAX_RESIDENT_ELEMS = 32768  # tile elements x occupancy: beyond this, sm_90 cubins spill 150+ B
MAX_MULTI_POSITION = 512    # TILE_S > 1 up to this many q elements a position (padded)
EIGHT_WARPS = 8192          # from this many q elements a position (padded): 8-warp CTAs
FIELDS = ("occupancy", "persistent", "tile_s", "latency", "num_worker_warps", "halves_as_tiles")


def _power_of_two(n):
    return n > 0 and not n & (n - 1)


def half_fills_tile(half):
    """A rotary half of this width fills its tile (a power of two), so tile 1 along D is the
    second half: where the halves-as-tiles entry applies."""
    return _power_of_two(half)


def _heads_fill_tiles(heads, half):
    """The heads and the rotary half fill their tiles (powers of two): the position's tiles are
    whole (`_whole`)."""
    return _power_of_two(heads) and half_fills_tile(half)


BASE_ROWS = ((4, True, 1, 1), (4, True, 1, 5), (4, True, 1, 10), (2, True, 1, 5), (8, True, 1, 1),
             (8, True, 1, 5), (2, False, 1, 1))
ONE_CTA_A_POSITION = (2, False, 1, 1)


def rope_tile_configs(arch, heads, rot, has_pos=False):
    """heads: q heads; rot: rotary width. Default first: the best measured config."""
    # Where the heads and the half are powers of two a position's tiles are whole (no bounds
    # checks, `_whole`), and one CTA a position at occupancy 2 led every entry or came within
    # 0.8% of the best at 32 and 64 heads (D128) and 16 (D64), in place and out (H100); at 128
    # heads out of place it took 1.37x the 8-warp entry's time, so there the persistent default
    # stays first.
    per_position = next_pow2(heads) * 2 * next_pow2(max(rot // 2, 1))
    rows = BASE_ROWS
    if _heads_fill_tiles(heads, rot // 2) and MAX_MULTI_POSITION < per_position < 2 * EIGHT_WARPS:
        rows = (ONE_CTA_A_POSITION,) + tuple(r for r in BASE_ROWS if r != ONE_CTA_A_POSITION)
    yield from table(FIELDS, rows)
    # Halves as tiles (where a half fills its tile): each half loaded and stored as tile 0 or 1 of
    # q or k itself. Through slices of one array tileiras 13.4 cannot tell the slices' stores
    # from the next loads and fences them: 5 barriers a position in the in-place sm_90 build
    # (bf16 math) against 2, and every load of the position then issues before the first
    # store. One CTA a position in place: 1.5-3.6% faster at 32/8 heads, D128 (H100), level at
    # 64 heads, behind at D64 and on persistent grids; out of place, level or behind.
    if half_fills_tile(rot // 2):
        yield from table(FIELDS, ((2, False, 1, 1, None, True),))
    # Many heads a position: two 8-warp CTAs an SM hold as many threads as four 4-warp ones with
    # room for twice the registers a thread. sm_90 builds (tileiras 13.4): 64 heads at D128, out
    # of place, spill 24 bytes at 4 warps and occupancy 4 and take 106 registers, no stack, at 8
    # warps and occupancy 2; 128 heads spill 464 bytes against none at 8 warps (exactly 128
    # registers). Where 8 warps at occupancy 2 spill too (64 heads at D256: 24 bytes), one
    # 8-warp CTA an SM does not. Out of place at B1 Hq64 S16384 the 8-warp entry ran 1.12x the
    # default (H100); at 32 heads it lost (parameter-space-design.md, "RoPE").
    if per_position >= EIGHT_WARPS:
        yield from table(FIELDS, ((2, True, 1, 1, 8),))
    if per_position >= 2 * EIGHT_WARPS:
        yield from table(FIELDS, ((1, True, 1, 1, 8),))
        # One 8-warp CTA a position at occupancy 2, halves as tiles: in place at B1 Hq128 Hkv8
        # S8192 D128 (whole tiles, H100) 196.4 us against the persistent 8-warp entry's 204.6
        # (a copy of q and k 195.5); out of place level with the 8-warp entries.
        if half_fills_tile(rot // 2):
            yield from table(FIELDS, ((2, False, 1, 1, 8, True),))
    if per_position > MAX_MULTI_POSITION:
        return
    for tile_s in (2, 4, 8, 16):
        elems = tile_s * per_position
        if has_pos or elems > MAX_TILE_ELEMS:
            break
        occs = [o for o in (1, 2, 4) if elems * o <= MAX_RESIDENT_ELEMS]
        rows = [(occ, True, tile_s, 5) for occ in occs[-2:]] + [(occs[-1], False, tile_s, 5)]
        yield from table(FIELDS, rows)


DEFAULT = next(table(FIELDS, BASE_ROWS))

# ---------------------------------------------------------------------------------------------
# Launches. Both tuners take the inputs (q, k, cos, sin, pos, q_out, k_out, rot, backward, f32):
# cos/sin (B, S', rot) views, pos (B, S) int32 or None; q_out/k_out None means in place; f32:
# the arithmetic in float32 (else in q's dtype). The in-place tuner's search rotates copies of
# q and k (made once per miss), so q and k keep their values until the one in-place launch. It
# times the in-place kernel itself: the out-of-place kernel ran 9-12% slower than the in-place
# one at D128 on an H200 and ranked the configs differently (references/kernel-type-templates.md,
# "Elementwise in place").


def _space(q, k, cos, sin, pos, q_out, k_out, rot, backward, f32):
    return dict(heads=q.shape[1], rot=rot, has_pos=pos is not None)


def _grid(c, dev, q, *rest):
    return (ctas(c, q.shape[0] * cdiv(q.shape[2], c.tile_s), dev),)


def _halves_as_tiles(c, half):
    """The config's halves_as_tiles where a half fills its tile (the space offers it only
    there)."""
    return getattr(c, "halves_as_tiles", False) and half_fills_tile(half)


def _whole(c, q_heads, k_heads, S, half):
    """Every tile of the rotary halves lies inside q and k (head counts and the half powers of
    two, S a multiple of the position tile), and so do the tiles' cos/sin rows where no
    position ids pick them (`prepare` checks that cos/sin hold S rows)."""
    return _heads_fill_tiles(q_heads, half) and _power_of_two(k_heads) and S % c.tile_s == 0


def _out_args(c, q, k, cos, sin, pos, q_out, k_out, rot, backward, f32):
    half = rot // 2
    Hq, Hk, S = q.shape[1], k.shape[1], q.shape[2]
    return (q, k, cos, sin, cos if pos is None else pos, q_out, k_out, half,   # pos unused: cos
            next_pow2(Hq), next_pow2(Hk), c.tile_s, next_pow2(half),
            next_pow2(max(q.shape[3] - rot, 1)), pos is not None, rot < q.shape[3], backward,
            c.latency, f32, _halves_as_tiles(c, half), _whole(c, Hq, Hk, S, half))


def _inplace_args(c, q, k, cos, sin, pos, q_out, k_out, rot, backward, f32):
    half = rot // 2
    Hq, Hk, S = q.shape[1], k.shape[1], q.shape[2]
    return (q, k, cos, sin, cos if pos is None else pos, half, next_pow2(Hq), next_pow2(Hk),
            c.tile_s, next_pow2(half), pos is not None, backward, c.latency, f32,
            _halves_as_tiles(c, half), _whole(c, Hq, Hk, S, half))


def _scratch_copies(q, k, cos, sin, pos, q_out, k_out, rot, backward, f32):
    return (q.clone(), k.clone(), cos, sin, pos, None, None, rot, backward, f32)


def _work(q, k, cos, sin, pos, q_out, k_out, rot, backward, f32):
    return Work(bytes=2 * (q.numel() + k.numel()) * q.element_size()
                + 2 * q.shape[2] * rot * cos.element_size())


def _tune_key(key):
    """Launch key (Hq, Hk, D, rot, B, S, ...) -> tuning key (Hq, Hk, D, rot, bucket(B * S), ...):
    the grid needs B and S, the search only their product."""
    return (*key[:4], bucket(key[4] * key[5]), *key[6:])


_rope = Autotuner("rope", rope_kernel, rope_tile_configs, default=DEFAULT, space=_space,
                  grid=_grid, args=_out_args, work=_work, tune_key=_tune_key)
_rope_inplace = Autotuner("rope_inplace", rope_inplace_kernel, rope_tile_configs, default=DEFAULT,
                          space=_space, grid=_grid, args=_inplace_args, work=_work,
                          search_inputs=_scratch_copies, tune_key=_tune_key)
TUNERS = (_rope, _rope_inplace)


def launch(q, k, cos, sin, pos, q_out, k_out, rot, backward, f32):
    """Rotate q, k into q_out, k_out, or in place when they are None (B * S > 0)."""
    dev = q.get_device()
    key = (q.shape[1], k.shape[1], q.shape[3], rot, q.shape[0], q.shape[2], q.dtype, cos.dtype,
           pos is not None, backward, f32, dev)
    tuner = _rope_inplace if q_out is None else _rope
    tuner.launch(key, dev, q, k, cos, sin, pos, q_out, k_out, rot, backward, f32)


# ---------------------------------------------------------------------------------------------
# Host side: outputs, empty inputs. Validation and cos/sin/position_ids normalization are shared
# with rms_norm_rope (ops/rotary.py: prepare).

def _rope_out(q, k, cos, sin, pos, rot, backward, f32):
    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    if q.shape[0] * q.shape[2]:
        launch(q, k, cos, sin, pos, q_out, k_out, rot, backward, f32)
    return q_out, k_out


def _forward(q, k, cos, sin, pos, rot, f32, inplace):
    """(q_embed, k_embed): new tensors, or q and k themselves rotated in place."""
    if not inplace:
        return _rope_out(q, k, cos, sin, pos, rot, False, f32)
    if q.shape[0] * q.shape[2]:
        launch(q, k, cos, sin, pos, None, None, rot, False, f32)
        # Written by the kernel, not by torch: bump the version counters so that a graph that
        # saved q or k refuses its backward (the autograd Function's mark_dirty does it too).
        if not q.is_inference():
            _increment_version(q)
        if not k.is_inference():
            _increment_version(k)
    return q, k


# ---------------------------------------------------------------------------------------------
# Autograd, custom op and the public functions. The backward is the rotation with BACKWARD.

_rope_op = TrainableOp(
    "tiletune::rope", forward=_forward,
    forward_schema="(Tensor q, Tensor k, Tensor cos, Tensor sin, Tensor? pos, int rot, "
                   "bool f32, bool inplace) -> (Tensor, Tensor)",
    forward_fake=lambda q, k, cos, sin, pos, rot, f32, inplace: (torch.empty_like(q),
                                                                 torch.empty_like(k)),
    save=lambda args, results: ((args[2], args[3], args[4]), (args[5], args[6])),
    backward=lambda needs, dq, dk, cos, sin, pos, rot, f32: _rope_out(dq, dk, cos, sin, pos, rot,
                                                                      True, f32),
    backward_schema="(bool[] needs, Tensor dq, Tensor dk, Tensor cos, Tensor sin, Tensor? pos, "
                    "int rot, bool f32) -> (Tensor, Tensor)",
    backward_fake=lambda needs, dq, dk, cos, sin, pos, rot, f32: (torch.empty_like(dq),
                                                                  torch.empty_like(dk)),
    outputs=2)


def apply_rope(q, k, cos, sin, *, position_ids=None, rotary_dim=None, inplace=False,
               compute_dtype=torch.float32):
    """Rotary position embedding, HF "rotate_half" convention, for q and k together.

    q: (B, Hq, S, D), k: (B, Hkv, S, D) with Hq a multiple of Hkv (GQA/MQA); any strides (e.g.
    the transposed views HF produces); float32/float16/bfloat16 (q and k alike).
    cos, sin: (S', R), (1, S', R), (B, S', R) or (B, 1, S', R), any of the three dtypes; R is the
    rotary width (`rotary_dim`, default cos's last dim; even, <= D): the first R dims of each head
    rotate, the rest pass through. Wider cos/sin: their first R columns serve (so a table built
    for a wider rotation does not rotate the first R dims correctly: build it R wide). Row s of
    cos/sin serves position s, or position_ids[b, s] when `position_ids` (B, S) / (1, S) / (S,)
    is given (range checked on the host: one sync the first time a tensor is passed, and again
    after torch writes it in place, so layers sharing one position_ids tensor sync once; not
    under CUDA graph capture or torch.compile, nor after writes torch does not count, such as
    a graph replay's: there ids in [0, rows of cos/sin) are the caller's contract, and an id
    outside gives unspecified values in its position's rotated dims).
    inplace=False returns new (q_embed, k_embed) laid out like q and k where those are dense
    (HF's transposed views), else contiguous; inplace=True writes q and
    k in place (marked dirty for autograd) and returns them; in place, q and k must not share
    memory (k is q, overlapping views) nor have overlapping elements (a stride-0 expanded dim),
    and neither may be a leaf that requires grad, nor a view of one: ValueError. (Disjoint views
    of one buffer, such as the q and k columns of a fused qkv projection, are fine.)
    Differentiable in q and k. Works under torch.compile(fullgraph=True). In place under
    torch.compile, and on views that need a gradient (autograd's rule for in-place writes to
    views), the out-of-place op runs and its results are copied back. Under torch.compile the
    memory checks above do not run (torch.compile does not trace addresses): q and k sharing
    memory there leave k's rotation in the shared elements.
    compute_dtype: the rotation's arithmetic, forward and backward. torch.float32 (default):
    q, k, cos and sin widened, one rounding to q's dtype at the store. q.dtype: cos/sin rounded
    to q's dtype and the arithmetic in it, as HF's eager code, Liger and TileGym compute with
    16-bit q and cos (a product, then a fused multiply-add, where HF's eager code rounds each
    product: within one ulp of q's dtype of it and of the float32 result; faster where the
    float32 widening is what a kernel waits on). Any other dtype: ValueError.
    """
    cos, sin, pos, rot = prepare("apply_rope", q, k, cos, sin, position_ids, rotary_dim)
    f32 = compute_dtype == torch.float32
    if not f32 and compute_dtype != q.dtype:
        raise ValueError(f"apply_rope: compute_dtype must be torch.float32 or q's dtype "
                         f"({q.dtype}), got {compute_dtype}")
    if not inplace:
        return _rope_op(q, k, cos, sin, pos, rot, f32, False)
    compiling = tracing()
    if not compiling:   # (cos/sin are not checked against q and k: microseconds on every call)
        validate.inplace("apply_rope", {"q": q, "k": k})
    # The custom op has no in-place form, and autograd takes an in-place write to a view from
    # a Function with one output only: there, rotate out of place and copy back.
    if compiling or ((q._is_view() or k._is_view()) and (q.requires_grad or k.requires_grad)
                     and records_graph()):
        qo, ko = _rope_op(q, k, cos, sin, pos, rot, f32, False)
        return q.copy_(qo), k.copy_(ko)
    return _rope_op(q, k, cos, sin, pos, rot, f32, True)


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """HF-compatible functional form (transformers 4.x argument order: pass `unsqueeze_dim` by
    keyword, as transformers 5 dropped `position_ids`): returns (q_embed, k_embed) in q's
    dtype. cos/sin as HF passes them: (B, S, D) rows already gathered per position, in which
    case `position_ids` is ignored (as transformers 4.38 and later ignore it), or (S', D) and
    (1, 1, S', D) tables, whose rows `position_ids` picks (as earlier versions index them); a
    position_ids that is not a tensor (an unsqueeze_dim passed in its place) is a TypeError;
    `unsqueeze_dim` is accepted for signature compatibility (q/k must be (B, H, S, D), i.e.
    unsqueeze_dim=1).
    The rotation's arithmetic is in the dtype HF's code computes it in (torch's promotion of
    q's and cos's dtypes). The transformers suite patches models with its own wrapper of
    transformers 5's signature."""
    if unsqueeze_dim != 1:
        raise ValueError("apply_rotary_pos_emb: only unsqueeze_dim=1 ((B, H, S, D) q/k) is supported")
    for name, t in (("q", q), ("cos", cos)):     # (apply_rope checks the rest)
        if not isinstance(t, torch.Tensor):
            validate.is_tensor("apply_rotary_pos_emb", name, t)
    if position_ids is not None and not isinstance(position_ids, torch.Tensor):
        raise TypeError("apply_rotary_pos_emb: position_ids must be a tensor or None, got "
                        f"{type(position_ids).__name__} (pass unsqueeze_dim by keyword)")
    # tables: (S', D), or (1, 1, S', D) as transformers 4.31-4.35 pass them
    table = cos.dim() == 2 or (cos.dim() == 4 and cos.shape[0] == 1 and cos.shape[1] == 1)
    try:
        return apply_rope(q, k, cos, sin, position_ids=position_ids if table else None,
                          compute_dtype=hf_compute_dtype(q, cos))
    except (TypeError, ValueError) as e:
        # apply_rope's checks name apply_rope: the caller called this function
        prefix = "apply_rope: "
        if type(e) in (TypeError, ValueError) and str(e).startswith(prefix):
            raise type(e)("apply_rotary_pos_emb: " + str(e)[len(prefix):]) from None
        raise


def hf_compute_dtype(q, cos):
    """The dtype HF's rotate_half code computes the rotation in: torch's promotion of q's and
    cos's dtypes (bf16 for a bf16 model's tables, float32 if either is). Liger's kernel agrees
    where q and cos share a dtype; with float32 q and 16-bit tables it computes in the tables'
    dtype, less exactly than this."""
    return torch.promote_types(q.dtype, cos.dtype)
