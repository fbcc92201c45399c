"""MoE routing without a GPU: the config spaces; the input checks (everything but the device on
CPU tensors, then CPU tensors refused); the routing indices (torch ops that run on CPU too:
order, stability, offsets, ids outside [0, E)); the launch path with ct.launch stubbed; the
row ops and their gradients with the kernels replaced by torch references (eager,
torch.compile(fullgraph=True) through the fake implementations, the fakes themselves); the
experts block against transformers' Qwen3MoeExperts in float64 with grouped_mm and swiglu
replaced by torch references; the AOT cases cover every config."""
import re

import pytest
import torch
import torch.nn.functional as F

from tiletune.autotune import MAX_CONFIGS
from tiletune.cases import moe as CASES
from tiletune.ops import moe as M
from tiletune.ops.moe import moe_experts, moe_permute, moe_unpermute
from tiletune.space import next_pow2

ARCHS = ("sm_90", "sm_100", "sm_120", "sm_80")
SHAPES = [(2048, 8), (4096, 8), (1000, 6), (4096, 1), (1000, 2), (7168, 8), (64, 1), (1, 1),
          (2048, 64), (100000, 4)]


# ---------------------------------------------------------------------------------------------
# Config spaces.

@pytest.mark.parametrize("arch", ARCHS)
def test_spaces_are_small_with_the_default_first(arch):
    for h, k in SHAPES:
        cfgs = list(M.configs(arch, h, k))
        assert 1 <= len(cfgs) <= MAX_CONFIGS
        assert len({tuple(sorted(vars(c).items())) for c in cfgs}) == len(cfgs)   # no repeats
        default = cfgs[0]
        assert default.occupancy == 4 and default.kp * default.tile_h * default.tile_t <= 8192
        for c in cfgs:
            assert set(vars(c)) == {"tile_t", "tile_h", "kp", "occupancy"}
            assert c.kp == next_pow2(k) and c.occupancy in (2, 4)
            assert all(v >= 1 and v & (v - 1) == 0 for v in (c.tile_t, c.tile_h))
            assert c.tile_h <= min(next_pow2(h), M.MAX_CHUNK) and c.tile_t <= M.MAX_TOKENS
            assert c.kp * c.tile_h * c.tile_t <= 16384
        if arch in ("sm_90", "sm_100"):
            assert len(cfgs) > 1 or c.kp * min(next_pow2(h), 128) > 16384
        else:
            assert len(cfgs) == 1                     # other archs: the default only


def test_the_space_spans_chunks_and_tokens_per_step():
    cfgs = list(M.configs("sm_90", 2048, 8))
    assert {c.tile_h for c in cfgs} == {2048, 1024}  # the two widest chunks that fit a step
    assert {c.occupancy for c in cfgs} == {2, 4}
    one = list(M.configs("sm_90", 4096, 1))          # k = 1: several tokens per step
    assert one[0].tile_t == 2 and max(c.tile_t for c in one) == 8
    wide_k = list(M.configs("sm_90", 2048, 64))      # k = 64: narrower chunks, still a space
    assert {c.tile_h for c in wide_k} == {256, 128}


# ---------------------------------------------------------------------------------------------
# Input checks.

def t(*shape, dtype=torch.bfloat16):
    return torch.zeros(shape, dtype=dtype)


def ids(*shape, dtype=torch.int32):
    return torch.zeros(shape, dtype=dtype)


BAD_PERMUTE = [
    (([1.0], ids(4, 2), 8), TypeError, "x must be a torch.Tensor"),
    ((t(4, 16), [[0, 1]], 8), TypeError, "topk_ids must be a torch.Tensor"),
    ((t(4, 16), ids(4, 2), 8.0), TypeError, "num_experts must be an int, got float"),
    ((t(4, 16), ids(4, 2), True), TypeError, "num_experts must be an int, got bool"),
    ((t(4, 16), ids(4, 2), 0), ValueError, "num_experts must be in [1, 2^31 - 2], got 0"),
    ((t(4, 16), ids(4, 2), 2**31 - 1), ValueError, "num_experts must be in [1, 2^31 - 2], got"),
    ((t(4, 16, 1), ids(4, 2), 8), ValueError, "x must be 2-D (tokens, hidden)"),
    ((t(4, 16), ids(8), 8), ValueError, "topk_ids must be 2-D (tokens, k)"),
    ((t(4, 16), ids(5, 2), 8), ValueError, "topk_ids has 5 rows but x has 4 tokens"),
    ((t(4, 16), ids(4, 0), 8), ValueError, "at least one expert per token"),
    ((t(4, 16, dtype=torch.float64), ids(4, 2), 8), TypeError, "x dtype torch.float64"),
    ((t(4, 16), ids(4, 2, dtype=torch.int16), 8), TypeError, "topk_ids dtype torch.int16"),
    ((t(4, 16), t(4, 2), 8), TypeError, "topk_ids dtype torch.bfloat16"),
]


@pytest.mark.parametrize("args,error,message", BAD_PERMUTE, ids=[b[2] for b in BAD_PERMUTE])
def test_moe_permute_refuses_bad_input_naming_the_argument(args, error, message):
    with pytest.raises(error, match="^moe_permute: .*" + re.escape(message)):
        moe_permute(*args)


BAD_UNPERMUTE = [
    ((t(8, 16), [[0]], t(4, 2)), TypeError, "inverse must be a torch.Tensor"),
    ((t(8, 16), ids(4, 2), None), TypeError, "topk_weights must be a torch.Tensor"),
    ((t(8), ids(4, 2), t(4, 2)), ValueError, "y_sorted must be 2-D (tokens * k, hidden)"),
    ((t(8, 16), ids(8), t(8)), ValueError, "inverse must be 2-D (tokens, k)"),
    ((t(8, 16), ids(4, 2), t(2, 4)), ValueError, "topk_weights has shape (2, 4) but inverse"),
    ((t(9, 16), ids(4, 2), t(4, 2)), ValueError, "y_sorted has 9 rows but inverse has 8 slots"),
    ((t(0, 16), ids(4, 0), t(4, 0)), ValueError, "at least one slot per token (k >= 1)"),
    ((t(8, 16, dtype=torch.int32), ids(4, 2), t(4, 2)), TypeError, "y_sorted dtype torch.int32"),
    ((t(8, 16), t(4, 2), t(4, 2)), TypeError, "inverse dtype torch.bfloat16"),
    ((t(8, 16), ids(4, 2), t(4, 2, dtype=torch.float16)), TypeError,
     "topk_weights dtype torch.float16 must be float32 or y_sorted's torch.bfloat16"),
]


@pytest.mark.parametrize("args,error,message", BAD_UNPERMUTE, ids=[b[2] for b in BAD_UNPERMUTE])
def test_moe_unpermute_refuses_bad_input_naming_the_argument(args, error, message):
    with pytest.raises(error, match="^moe_unpermute: .*" + re.escape(message)):
        moe_unpermute(*args)


def experts_args(T=4, H=16, I=8, E=3, k=2, dtype=torch.bfloat16):
    return [t(T, H, dtype=dtype), ids(T, k), t(T, k, dtype=dtype),
            t(E, 2 * I, H, dtype=dtype), t(E, H, I, dtype=dtype)]


def _replace(args, i, value):
    args = list(args)
    args[i] = value
    return args


BAD_EXPERTS = [
    (_replace(experts_args(), 3, "w"), TypeError, "gate_up_proj must be a torch.Tensor"),
    (_replace(experts_args(), 0, t(4, 16, 1)), ValueError, "hidden_states must be 2-D"),
    (_replace(experts_args(), 4, t(3, 16)), ValueError, "down_proj must be 3-D"),
    (_replace(experts_args(), 3, t(3, 16, 15)), ValueError,
     "gate_up_proj must be (experts >= 1, 2 * intermediate, 16)"),
    (_replace(experts_args(), 3, t(3, 15, 16)), ValueError, "2 * intermediate"),
    (_replace(experts_args(), 4, t(3, 16, 9)), ValueError, "down_proj must be (3, 16, 8)"),
    (_replace(experts_args(), 1, ids(5, 2)), ValueError, "top_k_index must be (4, k)"),
    (_replace(experts_args(), 2, t(4, 3)), ValueError, "top_k_weights has shape (4, 3)"),
    (experts_args(dtype=torch.float32), TypeError, "hidden_states dtype torch.float32"),
    (_replace(experts_args(), 1, t(4, 2)), TypeError, "top_k_index dtype torch.bfloat16"),
    (_replace(experts_args(), 4, t(3, 16, 8, dtype=torch.float16)), TypeError,
     "down_proj dtype torch.float16 differs from hidden_states dtype torch.bfloat16"),
    (_replace(experts_args(), 2, t(4, 2, dtype=torch.float16)), TypeError,
     "top_k_weights dtype torch.float16 must be float32"),
]


@pytest.mark.parametrize("args,error,message", BAD_EXPERTS, ids=[b[2] for b in BAD_EXPERTS])
def test_moe_experts_refuses_bad_input_naming_the_argument(args, error, message):
    with pytest.raises(error, match="^moe_experts: .*" + re.escape(message)):
        moe_experts(*args)


def test_cpu_tensors_are_refused_after_every_other_check():
    with pytest.raises(ValueError, match="moe_permute: x must be a CUDA tensor"):
        moe_permute(t(4, 16), ids(4, 2), 8)
    with pytest.raises(ValueError, match="moe_unpermute: y_sorted must be a CUDA tensor"):
        moe_unpermute(t(8, 16), ids(4, 2), t(4, 2, dtype=torch.float32))
    with pytest.raises(ValueError, match="moe_experts: hidden_states must be a CUDA tensor"):
        moe_experts(*experts_args())


def test_more_than_2_31_sorted_elements_are_refused():
    x = torch.empty(2**20, 1024, dtype=torch.bfloat16, device="meta")
    with pytest.raises(ValueError, match=r"moe_permute: 2097152 x 1024 sorted rows pass 2\^31"):
        M._check_permute(x, torch.empty(2**20, 2, dtype=torch.int32, device="meta"), 8)


def test_expert_weights_past_2_31_elements_are_refused_by_name():
    """Qwen3-Coder-480B's experts unsharded: (160, 5120, 6144) gate_up, more than the grouped
    GEMM indexes; refused before any launch, naming the weight."""
    meta = lambda *shape, dt=torch.bfloat16: torch.empty(*shape, dtype=dt, device="meta")
    args = (meta(4, 6144), torch.zeros(4, 2, dtype=torch.int32, device="meta"),
            meta(4, 2, dt=torch.float32), meta(160, 5120, 6144), meta(160, 6144, 2560))
    with pytest.raises(ValueError, match=r"^moe_experts: gate_up_proj has 5033164800 elements"):
        M._check_experts(*args)


# ---------------------------------------------------------------------------------------------
# The routing indices.

def expected_order(topk_ids, E):
    """Slots (t, j) sorted by (expert, t, j); invalid ids as expert E (last)."""
    T, k = topk_ids.shape
    key = lambda s: (topk_ids[s // k, s % k].item() if 0 <= topk_ids[s // k, s % k] < E else E,
                     s)
    return sorted(range(T * k), key=key)


@pytest.mark.parametrize("T,k,E", [(1, 1, 1), (7, 2, 8), (300, 8, 128), (64, 6, 5), (0, 2, 4)])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=str)
def test_routing_groups_by_expert_stably_with_end_offsets(T, k, E, dtype):
    gen = torch.Generator().manual_seed(T * k + E)
    topk_ids = torch.randint(0, E, (T, k), generator=gen).to(dtype)
    if T > 10:                               # experts that receive nothing
        topk_ids[topk_ids == E // 2] = 0
    offs, inverse = M._route(topk_ids, E)
    assert offs.dtype == torch.int32 and offs.shape == (E,)
    assert inverse.dtype == torch.int32 and inverse.shape == (T, k)
    order = expected_order(topk_ids, E)
    assert inverse.reshape(-1)[order].tolist() == list(range(T * k))     # row r holds order[r]
    counts = torch.bincount(topk_ids.reshape(-1).long(), minlength=E)
    assert offs.tolist() == counts.cumsum(0).tolist()


def test_ids_outside_the_experts_sort_last_past_the_offsets():
    topk_ids = torch.tensor([[3, -1], [8, 0], [2, 100], [-5, 3]])
    offs, inverse = M._route(topk_ids, 4)
    assert offs.tolist() == [1, 1, 2, 4]              # 4 valid slots: ids 0, 2, 3, 3
    rows = inverse.reshape(-1).tolist()
    assert [rows[s] for s in (3, 4, 0, 7)] == [0, 1, 2, 3]     # 0, 2, 3 (t0), 3 (t3)
    assert [rows[s] for s in (1, 2, 5, 6)] == [4, 5, 6, 7]     # invalid ids, in slot order


# ---------------------------------------------------------------------------------------------
# The launch path, ct.launch stubbed.

def test_launches_carry_the_config_and_a_persistent_grid(launches, monkeypatch):
    T, k, H = 1000, 8, 2048
    x, idx, out = t(T, H), ids(T, k), t(T * k, H)
    w = t(T, k, dtype=torch.float32)
    cfg = next(M.configs("sm_90", H, k))
    assert (cfg.tile_t, cfg.tile_h, cfg.kp, cfg.occupancy) == (1, 1024, 8, 4)
    dev = -1                                           # a CPU tensor's get_device()
    keys = {M._permute_fwd: (H, k, 1024, torch.bfloat16, torch.int32, dev),
            M._unpermute_fwd: (H, k, 1024, torch.bfloat16, torch.int32, torch.float32, dev),
            M._permute_bwd: (H, k, 1024, torch.bfloat16, torch.int32, dev),
            M._unpermute_bwd: (H, k, 1024, torch.bfloat16, torch.int32, torch.float32, False,
                               dev)}
    for tuner, key in keys.items():
        monkeypatch.setitem(tuner.cache, key, (cfg, tuner.name))
    M.launch_permute(x, idx, out)
    M.launch_unpermute(out, idx, w, x)
    M.launch_permute_bwd(out, idx, x)
    M.launch_unpermute_bwd(x, idx, w, out, out, None)   # no weights' gradient: DOT off
    grid = (min(T, 132 * 4),)
    assert launches == [
        (grid, "moe_permute", (x, idx, idx, x, out, idx, 1, 8, 1024, False, False)),
        (grid, "moe_unpermute", (out, idx, w, x, 1, 8, 1024, True)),
        (grid, "moe_permute_bwd", (out, idx, idx, x, 1, 8, 1024, False)),
        (grid, "moe_unpermute_bwd", (x, idx, w, out, out, w, 1, 8, 1024, True, False))]
    few = ids(3, k)
    assert M._grid(cfg, dev, t(3, H), few) == (3,)     # a CTA per token block at most


# ---------------------------------------------------------------------------------------------
# The row ops with the kernels replaced by torch references of what each computes.

def _rows(idx):
    return idx.reshape(-1).long()


def ref_permute(x, idx, out):
    out[_rows(idx)] = x.repeat_interleave(idx.shape[1], dim=0)


def ref_gather(src, idx, w, out):
    """As the kernels: an index outside src's rows reads zeros."""
    rows = _rows(idx)
    inside = (rows >= 0) & (rows < src.shape[0])
    v = torch.where(inside[:, None], src.double()[rows.clamp(0, src.shape[0] - 1)], 0.0)
    v = v.view(*idx.shape, -1)
    if w is not None:
        v = v * w.double()[..., None]
    out.copy_(v.sum(1))


def ref_unpermute_bwd(dout, idx, w, ys, dys, dw):
    """As the kernel: a scatter to the rows idx names; an index outside them writes nothing."""
    rows = _rows(idx)
    inside = (rows >= 0) & (rows < dys.shape[0])
    dys[rows[inside]] = (w.double()[..., None] * dout.double()[:, None]).reshape(
        -1, dout.shape[1])[inside].to(dys.dtype)
    if dw is not None:
        dw.copy_((dout.double()[:, None] * ys.double()[_rows(idx)].view(*idx.shape, -1)).sum(-1))


@pytest.fixture
def kernels(monkeypatch):
    calls = []

    def record(name, fn):
        def launch(*a):
            calls.append((name, a[-1] is not None) if name == "unpermute_bwd" else name)
            fn(*a)
        return launch
    monkeypatch.setattr(M, "launch_permute", record("permute", ref_permute))
    monkeypatch.setattr(M, "launch_permute_bwd", record(
        "permute_bwd", lambda src, idx, out: ref_gather(src, idx, None, out)))
    monkeypatch.setattr(M, "launch_unpermute", record("unpermute", ref_gather))
    monkeypatch.setattr(M, "launch_unpermute_bwd", record("unpermute_bwd", ref_unpermute_bwd))
    return calls


def reference(x, topk_ids, w, E):
    """out[t] = sum_j w[t, j] * x[t] through a per-slot loop in float64, with the sorted rows,
    from the ids alone (no inverse)."""
    T, k = topk_ids.shape
    order = expected_order(topk_ids, E)
    x_sorted = x[[s // k for s in order]]
    out = torch.zeros(T, x.shape[1], dtype=torch.float64)
    for r, s in enumerate(order):
        out[s // k] += w[s // k, s % k] * x_sorted[r]
    return x_sorted, out


def routed(T=37, k=3, E=6, H=20, dtype=torch.float64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(T, H, generator=gen).to(dtype)
    topk_ids = torch.randint(0, E, (T, k), generator=gen)
    topk_ids[5, 1] = E + 2                       # a slot no expert owns
    w = torch.rand(T, k, generator=gen).to(dtype)
    return x, topk_ids, w


def test_forward_values(kernels):
    x, topk_ids, w = routed()
    x_sorted, offs, inverse = M._permute(x, topk_ids, 6)
    ex_sorted, ex_out = reference(x, topk_ids, w, 6)
    assert torch.equal(x_sorted, ex_sorted)
    out = M._unpermute_op(x_sorted, inverse, w, True)
    assert torch.allclose(out, ex_out)
    assert kernels == ["permute", "unpermute"]


def test_gradients_against_torch_autograd(kernels):
    x, topk_ids, w = routed()
    x.requires_grad_()
    w.requires_grad_()
    x_sorted, offs, inverse = M._permute(x, topk_ids, 6)
    y = x_sorted * torch.linspace(0.5, 2.0, x.shape[1], dtype=torch.float64)  # "experts"
    out = M._unpermute_op(y, inverse, w, True)
    dout = torch.randn_like(out)
    gx, gw = torch.autograd.grad(out, (x, w), dout)
    ex_sorted, _ = reference(x, topk_ids, w, 6)
    ey = ex_sorted * torch.linspace(0.5, 2.0, x.shape[1], dtype=torch.float64)
    T, k = topk_ids.shape
    order = expected_order(topk_ids, 6)
    ex_out = torch.zeros(T, x.shape[1], dtype=torch.float64).index_add(
        0, torch.tensor([s // k for s in order]),
        ey * w.reshape(-1)[order][:, None])
    ex, ew = torch.autograd.grad(ex_out, (x, w), dout)
    assert torch.allclose(gx, ex) and torch.allclose(gw, ew)
    assert kernels[-2:] == [("unpermute_bwd", True), "permute_bwd"]


def test_only_what_needs_a_gradient_is_computed(kernels):
    x, topk_ids, w = routed()
    xs, offs, inverse = M._permute(x, topk_ids, 6)
    ys = xs.clone().requires_grad_()
    kernels.clear()
    dout = torch.ones(37, 20, dtype=x.dtype)
    out = M._unpermute_op(ys, inverse, w, True)
    assert out.grad_fn.saved_tensors[0] is None     # ys: read only by the weights' gradient
    (gy,) = torch.autograd.grad(out, (ys,), dout)
    assert kernels == ["unpermute", ("unpermute_bwd", False)]     # no dot products
    assert torch.allclose(gy, w.reshape(-1)[expected_order(topk_ids, 6)][:, None].expand(-1, 20))
    wg = w.clone().requires_grad_()
    (gw,) = torch.autograd.grad(M._unpermute_op(xs, inverse, wg, True).sum(), (wg,))
    assert torch.allclose(gw, x.sum(1, keepdim=True).expand(-1, 3))


def test_slots_that_no_entry_names_get_a_zero_gradient(kernels, monkeypatch):
    """moe_unpermute with a caller's inverse that drops slots (-1, as capacity-limited routers
    mark them): the forward skips them and their rows of dy_sorted are zero, not unwritten
    memory; moe_experts' own inverse (a permutation) needs no zeroing."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    ys = torch.randn(6, 4, requires_grad=True)
    inverse = torch.tensor([[0, -1], [2, 3], [-1, 5]], dtype=torch.int32)   # slots 1 and 4 dropped
    w = torch.rand(3, 2)
    new_empty = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty",
                        lambda self, *size, **kw: new_empty(self, *size, **kw).fill_(float("nan")))
    out = M.moe_unpermute(ys, inverse, w)
    (gy,) = torch.autograd.grad(out, ys, torch.ones_like(out))
    assert torch.equal(gy[[1, 4]], torch.zeros(2, 4))
    expect = torch.zeros(6, 4)
    for t, j in [(0, 0), (1, 0), (1, 1), (2, 1)]:
        expect[inverse[t, j]] = w[t, j]
    assert torch.equal(gy, expect)


def test_torch_compile_fullgraph_matches_eager(kernels):
    """The custom ops' fake implementations and autograd registration, traced by dynamo and
    AOT autograd (the aot_eager backend: no inductor code generation on CPU)."""
    x, topk_ids, w = routed()

    def f(x, topk_ids, w):
        x_sorted, offs, inverse = M._permute(x, topk_ids, 6)
        return M._unpermute_op(x_sorted * 2.0, inverse, w, True), offs

    xe, we = x.clone().requires_grad_(), w.clone().requires_grad_()
    out_e, offs_e = f(xe, topk_ids, we)
    ge = torch.autograd.grad(out_e, (xe, we), torch.ones_like(out_e))
    xc, wc = x.clone().requires_grad_(), w.clone().requires_grad_()
    out_c, offs_c = torch.compile(f, fullgraph=True, backend="aot_eager")(xc, topk_ids, wc)
    gc = torch.autograd.grad(out_c, (xc, wc), torch.ones_like(out_c))
    assert torch.equal(offs_c, offs_e) and torch.allclose(out_c, out_e)
    assert all(torch.allclose(a, b) for a, b in zip(gc, ge))


def test_fake_implementations_give_the_real_shapes_and_dtypes():
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        x = torch.empty(7, 20, dtype=torch.bfloat16)
        inverse = torch.empty(7, 3, dtype=torch.int32)
        w = torch.empty(7, 3, dtype=torch.float32)
        xs = M._permute_op._fwd_op(x, inverse)
        assert xs.shape == (21, 20) and xs.dtype == torch.bfloat16
        dx, none = M._permute_op._bwd_op([True, False], xs, inverse)
        assert dx.shape == (7, 20) and dx.dtype == torch.bfloat16 and none is None
        out = M._unpermute_op._fwd_op(xs, inverse, w, True)
        assert out.shape == (7, 20) and out.dtype == torch.bfloat16
        dys, none, dw = M._unpermute_op._bwd_op([True, False, True, False], out, xs, inverse, w,
                                                  True)
        assert dys.shape == (21, 20) and dys.dtype == torch.bfloat16 and none is None
        assert dw.shape == (7, 3) and dw.dtype == torch.float32
        dys, _, dw = M._unpermute_op._bwd_op([True, False, False, False], out, xs, inverse, w, True)
        assert dw is None


# ---------------------------------------------------------------------------------------------
# The experts block against transformers' module, float64, grouped_mm and swiglu replaced by
# torch references (rows past the last offset are zeros, as grouped_mm writes them).

def grouped_loop(x, w, offs):
    out, s = torch.zeros(x.shape[0], w.shape[2], dtype=x.dtype), 0
    for g, e in enumerate(offs.tolist()):
        out = out.index_put((torch.arange(s, e),), x[s:e] @ w[g])
        s = e
    return out


@pytest.mark.parametrize("T,H,I,E,k", [(19, 16, 8, 5, 2), (6, 12, 4, 8, 3), (4, 8, 4, 1, 1)])
def test_experts_block_matches_transformers(kernels, monkeypatch, T, H, I, E, k):
    monkeypatch.setattr(M, "grouped_mm", grouped_loop)
    monkeypatch.setattr(M, "swiglu", lambda gate, up: F.silu(gate) * up)
    gen = torch.Generator().manual_seed(T + E)
    x = torch.randn(T, H, generator=gen, dtype=torch.float64)
    topk_ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=gen, dtype=torch.float64)
    gate_up = torch.randn(E, 2 * I, H, generator=gen, dtype=torch.float64)
    down = torch.randn(E, H, I, generator=gen, dtype=torch.float64)
    m = CASES.hf_experts("eager", gate_up, down, k)
    params = [p.requires_grad_() for p in (x.clone(), w.clone(), gate_up.clone(), down.clone())]
    ours = M._experts(params[0], topk_ids, params[1], params[2], params[3])
    xr, wr = x.clone().requires_grad_(), w.clone().requires_grad_()
    theirs = m(xr, topk_ids, wr)
    assert torch.allclose(ours, theirs)
    dy = torch.randn(T, H, generator=gen, dtype=torch.float64)
    g_ours = torch.autograd.grad(ours, params, dy)
    g_theirs = torch.autograd.grad(theirs, (xr, wr, m.gate_up_proj, m.down_proj), dy)
    for a, b in zip(g_ours, g_theirs):
        assert torch.allclose(a, b)


def test_slots_without_an_expert_add_nothing(kernels, monkeypatch):
    """An id outside [0, E) (an expert-parallel sentinel) contributes zero, as if its weight
    were zero; the slot's weight gets a zero gradient."""
    monkeypatch.setattr(M, "grouped_mm", grouped_loop)
    monkeypatch.setattr(M, "swiglu", lambda gate, up: F.silu(gate) * up)
    T, H, I, E, k = 9, 8, 4, 4, 2
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(T, H, generator=gen, dtype=torch.float64)
    topk_ids = torch.stack([torch.randperm(E, generator=gen)[:k] for _ in range(T)])
    gate_up = torch.randn(E, 2 * I, H, generator=gen, dtype=torch.float64)
    down = torch.randn(E, H, I, generator=gen, dtype=torch.float64)
    w = torch.rand(T, k, generator=gen, dtype=torch.float64).requires_grad_()
    sentinel = topk_ids.clone()
    sentinel[2, 0], sentinel[7, 1] = E, -1
    out = M._experts(x, sentinel, w, gate_up, down)
    w0 = w.detach().clone()
    w0[2, 0] = w0[7, 1] = 0.0
    assert torch.allclose(out, M._experts(x, topk_ids, w0, gate_up, down))
    (gw,) = torch.autograd.grad(out.sum(), (w,))
    assert gw[2, 0] == 0 and gw[7, 1] == 0 and gw.abs().sum() > 0


# ---------------------------------------------------------------------------------------------
# The AOT cases.

def test_aot_cases_cover_every_config_of_every_variant():
    labels = [c.label for c in CASES.compile_cases()]
    assert len(labels) == len(set(labels))
    for T, k, H in ((16384, 8, 2048), (4097, 6, 1000)):
        for cfg in M.configs("sm_90", H, k):
            for v in CASES.VARIANTS:      # each config once, under the first shape that has it
                assert any(label.startswith(f"{v} T") and label.endswith(f"bf16 {vars(cfg)}")
                           for label in labels), (v, vars(cfg))
    assert list(M.configs("sm_100", 2048, 8)) == list(M.configs("sm_90", 2048, 8))


def test_the_bench_reference_computes_what_the_ops_compute(kernels):
    x, topk_ids, w = routed()
    topk_ids[5, 1] = 0                                # the bench routes valid ids only
    out, offs = CASES.torch_permute_unpermute(x, topk_ids, w, 6)
    x_sorted, our_offs, inverse = M._permute(x, topk_ids, 6)
    assert torch.equal(offs, our_offs.long())
    assert torch.allclose(out, M._unpermute_op(x_sorted, inverse, w, True))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.parametrize("layout", [torch.strided, torch.jagged])
def test_nested_tensors_are_refused_by_name(layout):
    """A nested tensor (either layout) to any MoE op: a TypeError naming the op and the
    argument; a strided one failed inside torch's shape read, naming neither."""
    nested = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)], layout=layout,
                                        dtype=torch.bfloat16)
    ids = torch.zeros(8, 2, dtype=torch.int32)
    with pytest.raises(TypeError, match=r"^moe_permute: x is a nested tensor"):
        moe_permute(nested, ids, 4)
    with pytest.raises(TypeError, match=r"^moe_unpermute: y_sorted is a nested tensor"):
        moe_unpermute(nested, ids, torch.ones(8, 2))
    with pytest.raises(TypeError, match=r"^moe_experts: hidden_states is a nested tensor"):
        moe_experts(nested, ids, torch.ones(8, 2), torch.randn(4, 16, 8), torch.randn(4, 8, 8))
