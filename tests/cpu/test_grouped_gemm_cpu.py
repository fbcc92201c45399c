"""Host side of grouped_mm without a GPU: the config spaces; the input checks (everything but the
device on CPU tensors, then CPU tensors refused); the launch path with ct.launch stubbed (one
persistent launch, a grid bounded for any offs, a key that does not depend on offs); the
autograd wiring with the kernels replaced by a per-group loop (gradients against torch's, the
weight gradient in w's layout); the bench's token splits."""
import re

import pytest
import torch

from tiletune.autotune import MAX_CONFIGS
from tiletune.cases import grouped_gemm as CASES
from tiletune.ops import grouped_gemm as GG
from tiletune.ops.grouped_gemm import grouped_mm

GENS = (GG.grouped_configs, GG.k_grouped_configs)


# ---------------------------------------------------------------------------------------------
# Config spaces.

@pytest.mark.parametrize("arch", ["sm_90", "sm_100", "sm_80", "sm_120"])
@pytest.mark.parametrize("gen", GENS, ids=lambda g: g.__name__)
def test_spaces_are_small_with_the_default_first(arch, gen):
    for shape in [(16384, 8, 4096, 14336), (32768, 128, 2048, 1536), (1, 256, 4096, 1000)]:
        cfgs = list(gen(arch, *shape))
        assert 1 <= len(cfgs) <= MAX_CONFIGS
        assert len({tuple(sorted(vars(c).items())) for c in cfgs}) == len(cfgs)   # no repeats
        assert vars(cfgs[0]) == vars(next(gen(arch, 16384, 8, 4096, 14336)))
        for c in cfgs:
            assert {"tm", "tn", "tk", "occupancy", "gather", "group_m", "num_ctas"} <= set(vars(c))
            assert c.num_ctas in (1, 2) and getattr(c, "num_worker_warps", 8) in (4, 8)
            assert 1 <= c.occupancy <= 32 and c.group_m >= 1
            assert all(v & (v - 1) == 0 for v in (c.tm, c.tn, c.tk))     # powers of two
            # sm_90's float32 accumulators: 128x128 per 4 worker warps, 128x256 per 8
            # (registers), per CTA of a cluster (sm_100 keeps them in tensor memory)
            assert arch != "sm_90" or \
                c.tm * c.tn <= 128 * 128 * getattr(c, "num_worker_warps", 4) // 4 * c.num_ctas


@pytest.mark.parametrize("arch", ["sm_90", "sm_100"])
def test_both_load_styles_are_searched_where_both_can_win(arch):
    """M-grouped: gather and per-group views; K-grouped: views (gathers ran 3-6x behind)."""
    assert {c.gather for c in GG.grouped_configs(arch, 16384, 8, 4096, 14336)} == {False, True}
    assert not any(c.gather for c in GG.k_grouped_configs(arch, 16384, 8, 4096, 14336))
    assert not any(getattr(c, "num_worker_warps", None)
                   for c in GG.grouped_configs("sm_100", 16384, 8, 4096, 14336))


def test_every_walk_is_searched_on_sm90():
    """The item loop leads at short K, the group loop at 128x256 with long K (and compiles in a
    tenth of the time there): sm_90's 128x256 entries, the default among them, keep the group
    loop (walk 0), the other tiles walk their items, 128x128 also from windows of 4 and 8
    offsets; 128x128 and 128x256 also read the schedule kernel's table, and so does every entry
    below 8 worker warps (on the item walk they spill). sm_100 walks one offset at a time or
    reads the table."""
    sm90 = list(GG.grouped_configs("sm_90", 16384, 8, 4096, 14336))
    assert sm90[0].walk == 0 and (sm90[0].tm, sm90[0].tn) == (128, 256)
    walks = [c for c in sm90 if c.walk != GG.TABLE]
    assert all((c.walk == 0) == ((c.tm, c.tn) == (128, 256)) for c in walks)
    assert {c.walk for c in sm90} == {0, 1, 4, 8, GG.TABLE}
    assert {c.walk for c in walks if c.walk > 1} == {4, 8}
    assert all((c.tm, c.tn, c.gather) == (128, 128, False) for c in walks if c.walk > 1)
    assert sorted((c.tm, c.tn, c.gather) for c in sm90 if c.walk == GG.TABLE and
                  getattr(c, "num_worker_warps", None) == 8) == [
        (64, 256, False), (128, 128, False), (128, 256, False)]
    assert all(c.walk == GG.TABLE for c in sm90 if not hasattr(c, "num_worker_warps"))
    assert {c.walk for c in GG.grouped_configs("sm_100", 16384, 8, 4096, 14336)} == {
        1, GG.TABLE}
    assert not any(hasattr(c, "walk") for c in GG.k_grouped_configs("sm_90", 16384, 8,
                                                                     4096, 14336))


def test_the_table_walk_only_where_one_tile_holds_every_group():
    many = GG.TABLE_MAX_GROUPS + 1
    assert any(c.walk == GG.TABLE for c in GG.grouped_configs("sm_90", 2**20, many - 1, 64, 64))
    assert not any(c.walk == GG.TABLE for c in GG.grouped_configs("sm_90", 2**20, many, 64, 64))


def test_tiles_taller_than_the_average_group_are_left_out():
    big = list(GG.grouped_configs("sm_90", 32768, 8, 4096, 4096))
    small = list(GG.grouped_configs("sm_90", 512, 64, 4096, 4096))      # 8 rows a group
    assert max(c.tm for c in big) == 256
    assert small[0] == big[0] and all(c.tm <= 64 for c in small[1:]) and len(small) > 3


def test_short_tiles_only_where_one_covers_the_average_group():
    """16-row tiles where groups average 16 rows or fewer; from 17 rows a group on, never."""
    for t, e, short in [(2048, 128, True), (1, 8, True), (128, 8, True), (2049, 128, False),
                        (4096, 128, False), (32768, 8, False)]:
        tiles = {c.tm for c in GG.grouped_configs("sm_90", t, e, 2048, 1536)}
        assert (16 in tiles) == short and 64 in tiles, (t, e)


# ---------------------------------------------------------------------------------------------
# Input checks.

def t(*shape, dtype=torch.bfloat16):
    return torch.zeros(shape, dtype=dtype)


def offsets(*ends):
    return torch.tensor(ends, dtype=torch.int32)


BAD = [
    ((t(8, 4), "w", None), TypeError, "w must be a torch.Tensor"),
    (([1.0], t(2, 4, 8), offsets(1, 2)), TypeError, "x must be a torch.Tensor"),
    ((t(8, 4), t(2, 4, 8, 1), offsets(1, 2)), ValueError, "got 2-D x 4-D"),
    ((t(2, 8, 4), t(4, 8), offsets(1, 2)), ValueError, "got 3-D x 2-D"),
    ((t(8, 4, dtype=torch.float32), t(2, 4, 8, dtype=torch.float32), offsets(1, 2)), TypeError,
     "x dtype torch.float32 is not supported"),
    ((t(8, 4), t(2, 4, 8, dtype=torch.float16), offsets(1, 2)), TypeError,
     "x is torch.bfloat16 but w is torch.float16"),
    ((t(8, 4), t(2, 5, 8), offsets(1, 2)), ValueError, "inner dims differ"),
    ((t(8, 4), t(2, 4, 8), None), ValueError, "offs is required"),
    ((t(8, 4), t(2, 4, 8), [4, 8]), TypeError, "offs must be a torch.Tensor"),
    ((t(8, 4), t(2, 4, 8), offsets(1, 2).long()), TypeError, "offs must be int32"),
    ((t(8, 4), t(2, 4, 8), offsets(1, 2)[None]), ValueError, "offs must be 1-D"),
    ((t(8, 4), t(2, 4, 8), offsets(1, 2, 8)), ValueError, "offs has 3 entries but w has 2"),
    ((t(4, 8), t(9, 6), offsets(1, 2)), ValueError, "inner dims differ"),
    ((t(2, 8, 4), t(2, 4, 6), offsets(1, 2)), ValueError, "offs must be None for 3-D x 3-D"),
    ((t(2, 8, 4), t(3, 4, 6), None), ValueError, "batch sizes differ"),
]


@pytest.mark.parametrize("args,error,message", BAD, ids=[b[2] for b in BAD])
def test_bad_input_is_refused_naming_the_argument(args, error, message):
    with pytest.raises(error, match="^grouped_mm: .*" + re.escape(message)):
        grouped_mm(*args)


def test_arrays_past_2_31_elements_are_refused(monkeypatch):
    """The grouped kernels index with int32: x, w or the result of more than 2^31 - 1
    elements is refused by name, with what shrinks it: fewer tokens, or fewer groups for the
    arrays with a dim per group (w of 2-D x 3-D, the (E, M, N) result of 2-D x 2-D). Meta
    tensors: no memory; the device check stubbed."""
    monkeypatch.setattr(GG.validate, "tensor", lambda op, name, t, **kw: t)
    big = dict(device="meta", dtype=torch.bfloat16)
    offs = torch.empty(4, device="meta", dtype=torch.int32)
    cases = [((2**20, 2**12), (4, 2**12, 8), "x has 4294967296 elements.*split the tokens"),
             ((8, 2**12), (4, 2**12, 2**18), "w has 4294967296 elements.*split the groups"),
             ((2**20, 8), (4, 8, 2**12), "the result has 4294967296 elements.*split the tokens"),
             ((8, 2**32), (2**32, 8), "x has 34359738368 elements.*split the tokens"),
             ((16, 2**16), (2**16, 2**16), "w has 4294967296 elements.*split the tokens"),
             ((2**16, 16), (16, 2**16), "the result has 17179869184 elements.*split the groups")]
    for xs, ws, message in cases:
        with pytest.raises(ValueError, match="^grouped_mm: " + message + "$"):
            GG._check(torch.empty(xs, **big), torch.empty(ws, **big), offs)
    GG._check(torch.empty(2**18, 2**12, **big), torch.empty(4, 2**12, 2**10, **big), offs)


def test_cpu_tensors_are_refused_after_every_other_check():
    for x, w, offs in [(t(8, 4), t(2, 4, 8), offsets(4, 8)), (t(4, 8), t(8, 6), offsets(4, 8)),
                       (t(2, 8, 4), t(2, 4, 6), None)]:
        with pytest.raises(ValueError, match="grouped_mm: x must be a CUDA tensor"):
            grouped_mm(x, w, offs)


def test_out_is_checked_before_any_work():
    x, w, offs = t(8, 4), t(2, 4, 6), offsets(4, 8)
    with pytest.raises(ValueError, match=r"grouped_mm: out has shape \(8, 5\) but the result is "
                                         r"\(8, 6\)"):
        GG._check_out(t(8, 5), GG._result_shape("2d3d", x, w, offs), x, w)
    with pytest.raises(TypeError, match="grouped_mm: out dtype"):
        GG._check_out(t(8, 6, dtype=torch.float16), (8, 6), x, w)
    assert GG._result_shape("2d2d", t(4, 8), t(8, 6), offsets(2, 8, 8)) == (3, 4, 6)
    assert GG._result_shape("3d3d", t(2, 8, 4), t(2, 4, 6), None) == (2, 8, 6)


# ---------------------------------------------------------------------------------------------
# The launch path, ct.launch stubbed.

DEV = "cpu"


def test_one_persistent_launch_with_a_grid_bounded_for_any_offs(launches, monkeypatch):
    x, w, offs, out = t(1000, 64), t(8, 64, 300), offsets(*range(100, 900, 100)), t(1000, 300)
    cfg = next(GG.grouped_configs("sm_90", 1024, 8, 64, 300))
    key = (8, 64, 300, 1000, torch.bfloat16, "row", "row", DEV)
    monkeypatch.setitem(GG._grouped.cache, GG._grouped.tune_key(key), (cfg, "kernel"))
    GG._grouped.launch(key, DEV, x, w, offs, out)
    # (cdiv(1000, 128) + 8 groups + the unowned rows) x cdiv(300, 256) = 34 work items at most
    assert (cfg.tm, cfg.tn) == (128, 256)
    assert launches == [((34,), "kernel", (x, w, offs, out, 128, 256, 64, 8, cfg.gather, False))]
    big = t(65536, 64)
    assert GG._grid(cfg, DEV, big, w, offs, t(65536, 300)) == (132,)   # SMs x occupancy
    k_cfg = next(GG.k_grouped_configs("sm_90", 1024, 8, 64, 300))
    assert (k_cfg.tm, k_cfg.tn) == (128, 256)
    assert GG._k_grid(k_cfg, DEV, t(64, 1000), t(1000, 300), offs, t(8, 64, 300)) == (8 * 2,)


def test_the_table_walk_launches_its_schedule_first(launches, monkeypatch):
    """The schedule kernel (one CTA per group and one for the unowned rows) writes the item
    table into a scratch buffer as wide as the grid's bound; the M-grouped kernel reads it."""
    x, w, offs, out = t(1000, 64), t(8, 64, 300), offsets(*range(100, 900, 100)), t(1000, 300)
    cfg = next(c for c in GG.grouped_configs("sm_90", 1024, 8, 64, 300)
               if c.walk == GG.TABLE and c.tn == 256)
    key = (8, 64, 300, 1000, torch.bfloat16, "row", "row", DEV)
    monkeypatch.setitem(GG._grouped.cache, GG._grouped.tune_key(key), (cfg, "kernel"))
    GG._grouped.launch(key, DEV, x, w, offs, out)
    (sgrid, skernel, sargs), (grid, kernel, args) = launches
    table = sargs[1]
    assert table.shape == (5, 34) and table.dtype == torch.int32
    assert sgrid == (9,) and skernel is GG.grouped_schedule_kernel
    assert sargs == (offs, table, 1000, 128, 2, 16, GG.SCHEDULE_CHUNK)
    assert grid == (34,) and kernel == "kernel"
    assert args == (x, w, offs, out, table, 128, 256, 64, 8, False)
    assert GG._grouped.base_kernel(cfg) is GG.grouped_mm_table_kernel


def test_the_key_holds_shapes_and_layouts_not_offs(monkeypatch):
    seen = []
    monkeypatch.setattr(GG._grouped, "launch", lambda key, dev, *inputs: seen.append(key))
    monkeypatch.setattr(GG._k_grouped, "launch", lambda key, dev, *inputs: seen.append(key))
    w_t = t(8, 300, 64).transpose(-2, -1)                 # an (E, N, K) weight seen transposed
    GG.launch(t(1000, 64), w_t, offsets(*range(125, 1001, 125)), t(1000, 300))
    GG.launch(t(900, 64), w_t, offsets(0, 0, 0, 0, 0, 0, 0, 900), t(900, 300))
    GG.launch_k(t(1000, 64).t(), t(1000, 300), offsets(*range(125, 1001, 125)), t(8, 64, 300))
    # launch keys hold T (the grid needs it); tuning keys its bucket
    assert seen == [(8, 64, 300, 1000, torch.bfloat16, "row", "col", -1),
                    (8, 64, 300, 900, torch.bfloat16, "row", "col", -1),
                    (8, 64, 300, 1000, torch.bfloat16, "col", "row", -1)]
    assert {GG._grouped.tune_key(k) for k in seen[:2]} == {
        (8, 64, 300, 1024, torch.bfloat16, "row", "col", -1)}


def test_empty_problems_launch_nothing(launches):
    assert GG._mgrouped(t(0, 64), t(8, 64, 300), offsets(*[0] * 8)).shape == (0, 300)
    assert GG._mgrouped(t(5, 0), t(2, 0, 3), offsets(2, 5)).abs().sum() == 0   # K = 0: zeros
    assert GG._kgrouped(t(4, 0), t(0, 3), offsets(0, 0)).abs().sum() == 0      # T = 0: zeros
    assert launches == []


# ---------------------------------------------------------------------------------------------
# Autograd, with the kernels replaced by a per-group loop.

def loop(x, w, offs):
    """x (T, K) @ w[g] on each group's rows, zeros past offs[-1]."""
    out, s = torch.zeros(x.shape[0], w.shape[2], dtype=x.dtype), 0
    for g, e in enumerate(offs.tolist()):
        out[s:e] = x[s:e] @ w[g]
        s = e
    return out


def k_loop(a, b, offs):
    out, s = torch.zeros(offs.shape[0], a.shape[0], b.shape[1], dtype=a.dtype), 0
    for g, e in enumerate(offs.tolist()):
        out[g] = a[:, s:e] @ b[s:e]
        s = e
    return out


@pytest.fixture
def kernels(monkeypatch):
    calls = []

    def launch(x, w, offs, out):
        calls.append(("m", GG.layout(x), GG.layout(w)))
        out.copy_(loop(x, w, offs))

    def launch_k(a, b, offs, out):
        calls.append(("k", GG.layout(a), GG.layout(b)))
        out.copy_(k_loop(a, b, offs))
    monkeypatch.setattr(GG, "launch", launch)
    monkeypatch.setattr(GG, "launch_k", launch_k)
    return calls


@pytest.mark.parametrize("w_t", [False, True], ids=["w", "w^T"])
def test_gradients_of_the_2d_3d_product(kernels, w_t):
    torch.manual_seed(0)
    offs = offsets(3, 3, 9, 10)                          # an empty group, 2 rows past the end
    x = torch.randn(12, 5, dtype=torch.float64, requires_grad=True)
    w = (torch.randn(4, 7, 5, dtype=torch.float64).transpose(-2, -1) if w_t
         else torch.randn(4, 5, 7, dtype=torch.float64)).requires_grad_()
    y = GG._grouped_op(x, w, offs)
    assert torch.equal(y, loop(x, w, offs)) and y[10:].abs().sum() == 0
    dy = torch.randn(12, 7, dtype=torch.float64)
    kernels.clear()
    gx, gw = torch.autograd.grad(y, (x, w), dy)
    ex, ew = torch.autograd.grad(loop(x, w, offs), (x, w), dy)
    assert torch.allclose(gx, ex) and torch.allclose(gw, ew)
    assert gw.stride() == w.stride()                     # the weight gradient in w's layout
    # dX: the M-grouped kernel on w's transposed view; dW: the K-grouped kernel, as dY^T x when
    # w is a transposed view (its output (E, N, K) is then w's storage order)
    assert kernels == [("m", "row", "row" if w_t else "col"),
                       ("k", "col", "row")]
    (gx_only,) = torch.autograd.grad(GG._grouped_op(x, w.detach(), offs), (x,), dy)
    assert torch.allclose(gx_only, ex)


@pytest.mark.parametrize("w_t", [False, True], ids=["w", "w^T"])
def test_an_operand_is_kept_only_for_the_other_ones_gradient(kernels, w_t):
    """Frozen experts keep no activations for the backward (x is read only by dW), a frozen x
    keeps no weight (w is read only by dX); each gradient is still right, in w's layout."""
    offs = offsets(3, 3, 9, 12)
    x0 = torch.randn(12, 5, dtype=torch.float64)
    w0 = (torch.randn(4, 7, 5, dtype=torch.float64).transpose(-2, -1) if w_t
          else torch.randn(4, 5, 7, dtype=torch.float64))
    dy = torch.randn(12, 7, dtype=torch.float64)
    for x_grad, w_grad in ((True, False), (False, True)):
        x, w = x0.clone().requires_grad_(x_grad), w0.clone().requires_grad_(w_grad)
        y = GG._grouped_op(x, w, offs)
        saved_x, saved_w, _ = y.grad_fn.saved_tensors
        assert (saved_x is None) is x_grad and (saved_w is None) is w_grad
        leaf = x if x_grad else w
        (g,) = torch.autograd.grad(y, leaf, dy)
        (e,) = torch.autograd.grad(loop(x, w, offs), leaf, dy)
        assert torch.allclose(g, e) and g.stride() == leaf.stride()
    a, b = x0.clone().requires_grad_(), torch.randn(12, 3, dtype=torch.float64)
    out = GG._k_grouped_op(a.t(), b, offs)
    assert out.grad_fn.saved_tensors[0] is None
    d = torch.randn(out.shape, dtype=torch.float64)
    assert torch.allclose(torch.autograd.grad(out, a, d)[0],
                          torch.autograd.grad(k_loop(a.t(), b, offs), a, d)[0])


def test_gradients_of_the_2d_2d_product(kernels):
    torch.manual_seed(0)
    offs = offsets(2, 2, 6)
    x = torch.randn(7, 4, dtype=torch.float64, requires_grad=True)
    b = torch.randn(7, 3, dtype=torch.float64, requires_grad=True)
    out = GG._k_grouped_op(x.t(), b, offs)
    assert out.shape == (3, 4, 3) and out[1].abs().sum() == 0
    assert torch.allclose(out, k_loop(x.t(), b, offs))
    d = torch.randn(3, 4, 3, dtype=torch.float64)
    gx, gb = torch.autograd.grad(out, (x, b), d)
    ex, eb = torch.autograd.grad(k_loop(x.t(), b, offs), (x, b), d)
    assert torch.allclose(gx, ex) and torch.allclose(gb, eb)


# ---------------------------------------------------------------------------------------------
# The bench's token splits.

def test_bench_splits():
    assert CASES.split(16384, 8, False) == [2048] * 8
    assert CASES.split(10, 4, False) == [3, 3, 2, 2]
    z = CASES.split(32768, 128, True)
    assert sum(z) == 32768 and z[-1] == 0 and z[0] > 10 * z[60] > 0


def test_nested_tensors_are_refused_by_name(monkeypatch):
    """A nested (jagged) x in each form: a TypeError naming grouped_mm and the argument (the
    ragged size failed inside torch, naming neither). The device check stubbed."""
    monkeypatch.setattr(GG.validate, "tensor", lambda op, name, t, **kw: t)
    jagged = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)],
                                        layout=torch.jagged, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"^grouped_mm: x is a nested tensor"):
        grouped_mm(jagged, t(2, 8, 6))                        # 3-D x 3-D
    with pytest.raises(TypeError, match=r"^grouped_mm: w is a nested tensor"):
        grouped_mm(t(2, 4, 8), jagged.transpose(1, 2))


def test_out_may_be_a_leaf_that_requires_grad_in_inference_mode(kernels, monkeypatch):
    """torch.inference_mode() records no graph, even under enable_grad, and torch's copy_ writes
    a leaf that requires grad there: so does out=. Where autograd records a graph it is still
    refused."""
    monkeypatch.setattr(GG.validate, "tensor", lambda op, name, t, **kw: t)   # CPU tensors
    x = torch.randn(8, 4, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(2, 4, 6, dtype=torch.bfloat16, requires_grad=True)
    offs = offsets(3, 8)
    want = loop(x.detach(), w.detach(), offs)
    out = torch.zeros(8, 6, dtype=torch.bfloat16, requires_grad=True)
    with torch.inference_mode(), torch.enable_grad():
        assert grouped_mm(x, w, offs, out=out) is out
    assert torch.equal(out.detach(), want) and out.grad_fn is None
    with pytest.raises(ValueError, match=r"^grouped_mm: out is a leaf tensor that requires "
                                         r"grad"):
        grouped_mm(x, w, offs, out=out)


# ---------------------------------------------------------------------------------------------
# gmm: Megatron's call (rows per group, possibly on the host) as the 2-D x 3-D form.

def sizes(*counts, dtype=torch.int64):
    return torch.tensor(counts, dtype=dtype)


GMM_BAD = [
    ((t(8, 4), t(2, 4, 6), [4, 4]), TypeError, "batch_sizes must be a torch.Tensor"),
    ((t(8, 4), t(2, 4, 6), sizes(4, 4, dtype=torch.float32)), TypeError,
     "batch_sizes must be int32 or int64"),
    ((t(8, 4), t(2, 4, 6), sizes(4, 4)[None]), ValueError, "batch_sizes must be 1-D"),
    ((t(8, 4), t(2, 4, 6), sizes(4, 2, 2)), ValueError,
     "batch_sizes has 3 entries but b has 2 groups"),
    ((t(8, 4), t(2, 4, 6), sizes(4, 3)), ValueError, "batch_sizes sum to 7 rows but a has 8"),
    ((t(8, 4), t(2, 4, 6), sizes(9, -1)), ValueError, "batch_sizes must not be negative"),
    ((t(8, 4), t(2, 6, 4), sizes(4, 4)), ValueError, "inner dims differ"),
    ((t(8, 4, 1), t(2, 4, 6), sizes(4, 4)), ValueError, "a must be 2-D"),
    ((t(8, 4), t(4, 6), sizes(4, 4)), ValueError, "b must be 3-D"),
    ((t(8, 4, dtype=torch.float32), t(2, 4, 6, dtype=torch.float32), sizes(4, 4)), TypeError,
     "a dtype torch.float32 is not supported"),
    ((t(8, 4), t(2, 4, 6, dtype=torch.float16), sizes(4, 4)), TypeError,
     "a is torch.bfloat16 but b is torch.float16"),
]


@pytest.mark.parametrize("args,error,message", GMM_BAD, ids=[b[2] for b in GMM_BAD])
def test_gmm_bad_input_is_refused_naming_the_argument(args, error, message):
    with pytest.raises(error, match="^gmm: .*" + re.escape(message)):
        GG.gmm(*args)


def test_gmm_checks_trans_b_and_then_the_device():
    with pytest.raises(TypeError, match="^gmm: trans_b must be a bool, got int"):
        GG.gmm(t(8, 4), t(2, 6, 4), sizes(4, 4), trans_b=1)
    with pytest.raises(ValueError, match=r"^gmm: inner dims differ: a \(8, 4\) @ b\^T "
                                         r"\(2, 6, 4\)$"):
        GG.gmm(t(8, 4), t(2, 4, 6), sizes(4, 4), trans_b=True)
    with pytest.raises(ValueError, match="^gmm: a must be a CUDA tensor"):
        GG.gmm(t(8, 4), t(2, 4, 6), sizes(4, 4))


@pytest.mark.parametrize("tracing_mode", ["fake", "symbolic"])
def test_gmm_with_host_batch_sizes_traces_under_a_fake_tensor_mode(monkeypatch, tracing_mode):
    """Host batch_sizes are checked by reading them, which a fake-tensor trace (make_fx, a
    FakeTensorMode memory estimator) cannot do: there the checks are skipped, as under
    torch.compile, and the trace gives the (T, N) result."""
    from torch.fx.experimental.proxy_tensor import make_fx
    monkeypatch.setattr(GG.validate, "tensor", lambda op, name, t, **kw: t)
    a, b = t(12, 5), t(4, 5, 7)
    graph = make_fx(lambda a, b, bs: GG.gmm(a, b, bs), tracing_mode=tracing_mode)(
        a, b, sizes(3, 0, 6, 3))
    out, = [n for n in graph.graph.nodes if n.op == "output"]
    assert tuple(out.args[0].meta["val"].shape) == (12, 7)


@pytest.mark.parametrize("trans_b", [False, True], ids=["b", "trans_b"])
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32])
def test_gmm_is_each_groups_product_with_its_gradients(kernels, monkeypatch, trans_b, dtype):
    """gmm against per-group torch products (an empty group among them): the result, and the
    gradients of a and b, in b's layout. The device check stubbed (CPU tensors)."""
    monkeypatch.setattr(GG.validate, "tensor", lambda op, name, t, **kw: t)
    torch.manual_seed(0)
    counts = [3, 0, 6, 3]
    a = torch.randn(12, 5, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(4, *((7, 5) if trans_b else (5, 7)), dtype=torch.bfloat16,
                    requires_grad=True)
    y = GG.gmm(a, b, sizes(*counts, dtype=dtype), trans_b=trans_b)
    want = torch.cat([a[s:s + c] @ (b[g].t() if trans_b else b[g])
                      for g, (s, c) in enumerate(zip([0, 3, 3, 9], counts))])
    assert torch.equal(y, want)
    dy = torch.randn(12, 7, dtype=torch.bfloat16)
    ga, gb = torch.autograd.grad(y, (a, b), dy)
    ea, eb = torch.autograd.grad(want, (a, b), dy)
    torch.testing.assert_close(ga, ea, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(gb, eb, atol=2e-2, rtol=2e-2)
    assert gb.shape == b.shape and gb[1].abs().sum() == 0          # the empty group's
