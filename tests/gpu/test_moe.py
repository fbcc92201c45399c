"""MoE routing on the GPU against float64 torch references: moe_permute's rows, offsets and
inverse (exact), moe_unpermute's weighted sums, both backward passes against torch autograd of
the reference; k 1, 2, 6, 8; E 1, 8, 128 with experts that receive nothing; T 1, 7, 4097;
bf16, fp16, float32; ids outside [0, E); every config of every kernel; tuned once and
DISABLE_AUTOTUNE; no host synchronization; torch.compile; a CUDA graph replayed with new ids;
moe_experts against transformers' Qwen3MoeExperts (bf16 and a float32 loop); bad input."""
import pytest
import torch

from tiletune.cases.moe import hf_experts
from tiletune.ops import moe as M
from tiletune.ops.moe import moe_experts, moe_permute, moe_unpermute

from .conftest import assert_rows_close, disable_autotune, each_config, poison_allocator

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# relative error of one rounding of a float32 sum (out, dweights) or of a product
# (dy_sorted = w * dout), per row (a token's H values, a sorted slot's, a token's k dweights):
# one token missing one slot of 8 at T 4097 moves the whole tensor by 0.004-0.0055 (against
# 0.008), its row by about 0.24
TOL = {torch.bfloat16: 8e-3, torch.float16: 2e-3, torch.float32: 1e-6}


def rel(a, b):
    a, b = a.double(), b.double()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def make_ids(T, k, E, kind="random", seed=0):
    """(T, k) int64 expert ids: distinct per token where k <= E; "few": only the experts 1 and
    E - 2 (the others receive nothing); "sentinel": a few ids outside [0, E)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "few":
        ids = torch.tensor([1, max(E - 2, 0)])[torch.randint(0, 2, (T, k), generator=g)]
    elif k <= E:
        ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else \
            torch.empty(0, k, dtype=torch.int64)
    else:
        ids = torch.randint(0, E, (T, k), generator=g)
    if kind == "sentinel" and T:
        ids.view(-1)[::5] = E
        ids.view(-1)[2::7] = -1
    return ids.cuda()


def ref_route(ids, E):
    """(order, offs): slots sorted by expert then slot (CPU stable sort), ids outside [0, E)
    last; cumulative end offsets."""
    flat = ids.reshape(-1).cpu()
    key = torch.where((flat >= 0) & (flat < E), flat, E)
    order = torch.sort(key, stable=True).indices
    offs = torch.bincount(key, minlength=E + 1)[:E].cumsum(0)
    return order.cuda(), offs.cuda()


def ref_unpermute(y_sorted, order, w):
    """float64: out[t] = sum_j w[t, j] * y_sorted[row of slot (t, j)], from the order alone."""
    T, k = w.shape
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(order.numel(), device=order.device)
    return (y_sorted.double()[inverse.view(T, k)] * w.double()[..., None]).sum(1)


CASES = [  # T, k, E, kind
    (4097, 8, 128, "random"), (4097, 2, 8, "random"), (4097, 1, 1, "random"),
    (7, 8, 128, "random"), (7, 2, 8, "few"), (1, 8, 128, "random"), (1, 1, 8, "random"),
    (1, 2, 1, "random"), (333, 6, 8, "random"), (500, 8, 128, "few"), (999, 2, 8, "sentinel"),
    (0, 2, 8, "random")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "T{}-k{}-E{}-{}".format(*c))
@pytest.mark.parametrize("dt", DTYPES, ids=str)
def test_forward(fresh, monkeypatch, case, dt):
    disable_autotune(monkeypatch)
    T, k, E, kind = case
    H = 1000 if dt == torch.float32 else 2048
    x = torch.randn(T, H, device="cuda", dtype=dt)
    ids = make_ids(T, k, E, kind, seed=T + k + E)
    poison_allocator(torch)                              # unwritten rows show as NaN
    x_sorted, offs, inverse = moe_permute(x, ids, E)
    order, ref_offs = ref_route(ids, E)
    assert x_sorted.shape == (T * k, H) and x_sorted.dtype == dt
    assert offs.dtype == torch.int32 and torch.equal(offs.long(), ref_offs)
    assert inverse.shape == (T, k) and inverse.dtype == torch.int32
    assert torch.equal(inverse.view(-1)[order].long(), torch.arange(T * k, device="cuda"))
    assert torch.equal(x_sorted, x[order // k])                          # an exact copy
    w = torch.rand(T, k, device="cuda", dtype=dt)
    y = torch.randn_like(x_sorted)
    out = moe_unpermute(y, inverse, w)
    assert out.shape == (T, H) and out.dtype == dt
    if T:
        assert_rows_close(out, ref_unpermute(y, order, w), TOL[dt], "out")


def reference_step(x, ids, w, scale, E):
    """float64 torch autograd of the permute -> per-row scale -> unpermute chain."""
    T, k = ids.shape
    order, _ = ref_route(ids, E)
    xs = x.double()[order // k] * scale
    out = torch.zeros(T, x.shape[1], device="cuda", dtype=torch.float64)
    return out.index_add(0, order // k, xs * w.double().reshape(-1)[order, None])


@pytest.mark.parametrize("case", [(4097, 8, 128, "random"), (7, 2, 8, "few"), (1, 1, 1, "random"),
                                  (333, 6, 8, "random"), (999, 2, 8, "sentinel")],
                         ids=lambda c: "T{}-k{}-E{}-{}".format(*c))
@pytest.mark.parametrize("dt", DTYPES, ids=str)
@pytest.mark.parametrize("w_f32", [False, True], ids=["w-like-x", "w-f32"])
def test_gradients(fresh, monkeypatch, case, dt, w_f32):
    """dx (a gather-and-sum of the sorted gradient), dy_sorted (a scatter of w * dout) and
    dweights (dot products) against torch autograd of the float64 reference; a per-row scale
    between the two ops makes every gradient depend on the row order."""
    disable_autotune(monkeypatch)
    T, k, E, kind = case
    H = 1000 if dt == torch.float32 else 2048
    x = torch.randn(T, H, device="cuda", dtype=dt, requires_grad=True)
    ids = make_ids(T, k, E, kind, seed=T * k)
    w = torch.rand(T, k, device="cuda", dtype=torch.float32 if w_f32 else dt,
                   requires_grad=True)
    scale = torch.rand(T * k, 1, device="cuda", dtype=dt) + 0.5
    dout = torch.randn(T, H, device="cuda", dtype=dt)
    poison_allocator(torch)
    x_sorted, offs, inverse = moe_permute(x, ids, E)
    out = moe_unpermute(x_sorted * scale, inverse, w)
    gx, gw = torch.autograd.grad(out, (x, w), dout)
    assert gx.dtype == dt and gw.dtype == w.dtype
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = reference_step(xr, ids, wr, scale.double(), E)
    ex, _ = torch.autograd.grad(ref, (xr, wr), dout.double())
    # dweights: dot products of dout with the rows the unpermute read, x_sorted * scale as torch
    # rounded it to dt (not its float64 value: at T 1 a dot product that cancels to a tenth of
    # its terms' scale moved by 2% with that rounding alone)
    rows = (x_sorted * scale).detach().double()[inverse.long()]           # (T, k, H)
    ew = (rows * dout.double()[:, None, :]).sum(-1)
    tol = max(TOL[dt], TOL[w.dtype])
    assert_rows_close(out, ref, tol, "out")
    assert_rows_close(gx, ex, 2 * tol, "dx")
    if tol > TOL[torch.float32]:
        assert_rows_close(gw, ew, 2 * tol, "dweights")
    else:   # float32's: the summation order of a float32 dot product of H products alone reads
        # up to ~1.6x of it in a token's row (sequential sums), and one wrong value moves the
        # whole tensor by far more than that already
        assert rel(gw, ew) < 2 * tol
    # the sorted rows' gradient on its own: dy_sorted[inverse[t, j]] = w[t, j] * dout[t]
    ys = x_sorted.detach().requires_grad_()
    (gy,) = torch.autograd.grad(moe_unpermute(ys, inverse, w.detach()), (ys,), dout)
    order, _ = ref_route(ids, E)
    ey = w.detach().double().reshape(-1)[order, None] * dout.double()[order // k]
    assert_rows_close(gy, ey, TOL[dt], "dy_sorted")


def test_int64_inverse_and_expanded_gradients(fresh, monkeypatch):
    """inverse as int64 gives the same result; a stride-0 output gradient (from .sum()) works."""
    disable_autotune(monkeypatch)
    x = torch.randn(300, 512, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = make_ids(300, 4, 16)
    w = torch.rand(300, 4, device="cuda", dtype=torch.float32)
    x_sorted, offs, inverse = moe_permute(x, ids, 16)
    out = moe_unpermute(x_sorted, inverse, w)
    assert torch.equal(moe_unpermute(x_sorted, inverse.long(), w), out)
    (gx,) = torch.autograd.grad(out.float().sum(), (x,))
    assert rel(gx, w.sum(1, keepdim=True).expand(-1, 512)) < TOL[torch.bfloat16]


def test_every_config_is_correct(fresh, monkeypatch):
    """Each config of each kernel's sm_90 space on a ragged problem (H 1000, k 6: padded slots,
    a partial token block, partial column chunks), forward and backward, per token row."""
    T, k, E, H = 333, 6, 8, 1000
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = make_ids(T, k, E)
    w = torch.rand(T, k, device="cuda", dtype=torch.float32, requires_grad=True)
    scale = torch.rand(T * k, 1, device="cuda", dtype=torch.bfloat16) + 0.5
    dout = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
    ref = reference_step(xr, ids, wr, scale.double(), E)
    ex, ew = torch.autograd.grad(ref, (xr, wr), dout.double())
    space = list(M.configs("sm_90", H, k))
    for tuner in M.TUNERS:
        for cfg in each_config(monkeypatch, tuner, space):
            poison_allocator(torch)
            x_sorted, _, inverse = moe_permute(x, ids, E)
            out = moe_unpermute(x_sorted * scale, inverse, w)
            gx, gw = torch.autograd.grad(out, (x, w), dout)
            what = f"{tuner.name} {vars(cfg)}"
            assert_rows_close(out, ref, TOL[torch.bfloat16], f"out, {what}")
            assert_rows_close(gx, ex, 2 * TOL[torch.bfloat16], f"dx, {what}")
            assert rel(gw, ew) < 2 * TOL[torch.bfloat16], what
            # per token against the rows the unpermute read (x_sorted * scale as torch rounded
            # it, as in test_gradients): against the float64 rows, that rounding alone read up
            # to 0.63 of the tolerance in a token's 6 dot products
            rows = (x_sorted * scale).detach().double()[inverse.long()]
            assert_rows_close(gw, (rows * dout.double()[:, None, :]).sum(-1),
                              2 * TOL[torch.bfloat16], f"dweights, {what}")


def test_tuned_once_then_cached(fresh):
    """One search per kernel; a T in the same bucket and new ids reuse them."""
    E, k, H = 16, 4, 1024
    w = None
    for T in (1500, 1800):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        ids = make_ids(T, k, E, seed=T)
        w = torch.rand(T, k, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        x_sorted, _, inverse = moe_permute(x, ids, E)
        out = moe_unpermute(x_sorted, inverse, w)
        dout = torch.randn_like(out)
        gx, gw = torch.autograd.grad(out, (x, w), dout)
        xr, wr = x.detach().double().requires_grad_(), w.detach().double().requires_grad_()
        ref = reference_step(xr, ids, wr, torch.ones(1, device="cuda", dtype=torch.float64), E)
        ex, ew = torch.autograd.grad(ref, (xr, wr), dout.double())
        assert_rows_close(out, ref, TOL[torch.bfloat16], "out")
        assert_rows_close(gx, ex, 2 * TOL[torch.bfloat16], "dx")
        assert_rows_close(gw, ew, 2 * TOL[torch.bfloat16], "dweights")
    assert [t.searches for t in M.TUNERS] == [1, 1, 1, 1]
    assert all(r.source == "search" for t in M.TUNERS for r in t.records.values())


def test_no_host_synchronization(fresh, monkeypatch):
    """Forward and backward run without a synchronizing call (after a first call resolved the
    configs): torch's sync debug mode raises on .item(), nonzero, blocking copies..."""
    disable_autotune(monkeypatch)
    x = torch.randn(1000, 1024, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = make_ids(1000, 8, 128)
    w = torch.rand(1000, 8, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dout = torch.randn(1000, 1024, device="cuda", dtype=torch.bfloat16)

    def step():
        x_sorted, offs, inverse = moe_permute(x, ids, 128)
        return torch.autograd.grad(moe_unpermute(x_sorted, inverse, w), (x, w), dout)
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()


def test_compile_fullgraph(fresh, monkeypatch):
    disable_autotune(monkeypatch)
    T, k, E, H = 512, 4, 16, 768
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    ids = make_ids(T, k, E, "sentinel")
    w = torch.rand(T, k, device="cuda", dtype=torch.float32, requires_grad=True)
    dout = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)

    def f(x, ids, w):
        x_sorted, offs, inverse = moe_permute(x, ids, E)
        return moe_unpermute(x_sorted * 2, inverse, w), offs

    out, offs = f(x, ids, w)
    ex, ew = torch.autograd.grad(out, (x, w), dout)
    c_out, c_offs = torch.compile(f, fullgraph=True)(x, ids, w)
    cx, cw = torch.autograd.grad(c_out, (x, w), dout)
    assert torch.equal(c_offs, offs) and torch.equal(c_out, out)
    assert torch.equal(cx, ex) and rel(cw, ew) < 1e-6


def test_cuda_graph_replays_with_new_ids(fresh, monkeypatch):
    """Captured once; the routing is computed on the device, so new ids in the captured tensor
    change the result."""
    disable_autotune(monkeypatch)
    T, k, E, H = 1024, 8, 64, 512
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    ids = make_ids(T, k, E)
    w = torch.rand(T, k, device="cuda", dtype=torch.bfloat16)
    scale = torch.rand(T * k, 1, device="cuda", dtype=torch.bfloat16) + 0.5

    def f():
        x_sorted, offs, inverse = moe_permute(x, ids, E)
        return moe_unpermute(x_sorted * scale, inverse, w), offs

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        f()                                            # builds the kernels outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out, offs = f()
    for seed, kind in [(1, "random"), (2, "few"), (3, "sentinel")]:
        ids.copy_(make_ids(T, k, E, kind, seed))
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        order, ref_offs = ref_route(ids, E)
        assert torch.equal(offs.long(), ref_offs), kind
        assert_rows_close(out, ref_unpermute(x[order // k] * scale, order, w),
                          TOL[torch.bfloat16], f"out, {kind} ids")


# ---------------------------------------------------------------------------------------------
# The experts block against transformers' Qwen3MoeExperts.

EXPERT_CASES = [(512, 256, 128, 16, 4, "random"), (64, 512, 192, 64, 2, "few"),
                (300, 384, 96, 8, 8, "random"), (1, 256, 64, 8, 2, "random")]


@pytest.mark.parametrize("case", EXPERT_CASES, ids=lambda c: "T{}-H{}-I{}-E{}-k{}-{}".format(*c))
def test_experts_match_transformers(fresh, monkeypatch, case):
    """Forward and the gradients of hidden_states, top_k_weights and both weights, bf16,
    against transformers' loop on the same parameters in bf16 and in float32. Tolerances
    (relative Frobenius error) against the float32 loop: no further than the bf16 loop is from
    it, plus 5e-3 (our weighting and sum over k are float32, the loop's bf16), and 3e-2 at
    most. Over 12 seeds per case on an H100 every tensor was within 6e-3 of float32 except at
    T = 1 the routing weights' 2-element gradient: ours up to 2.19e-2, the bf16 loop's up to
    1.97e-2 (bf16 inputs and intermediates: the grouped GEMMs' outputs, swiglu's)."""
    disable_autotune(monkeypatch)
    T, H, I, E, k, kind = case
    bf = torch.bfloat16
    gen = torch.Generator(device="cuda").manual_seed(T + E)
    x = torch.randn(T, H, device="cuda", generator=gen).to(bf)
    ids = make_ids(T, k, E, kind, seed=E)
    w = torch.rand(T, k, device="cuda", generator=gen)
    w = (w / w.sum(-1, keepdim=True)).to(bf)             # what Qwen3's router returns
    gate_up = (torch.randn(E, 2 * I, H, device="cuda", generator=gen) / H ** 0.5).to(bf)
    down = (torch.randn(E, H, I, device="cuda", generator=gen) / I ** 0.5).to(bf)
    dy = torch.randn(T, H, device="cuda", generator=gen).to(bf)

    ours_in = [t.clone().requires_grad_() for t in (x, w, gate_up, down)]
    ours = moe_experts(ours_in[0], ids, ours_in[1], ours_in[2], ours_in[3])
    g_ours = torch.autograd.grad(ours, ours_in, dy)
    assert ours.shape == (T, H) and ours.dtype == bf
    assert [g.shape for g in g_ours] == [t.shape for t in ours_in]
    assert g_ours[2].stride() == gate_up.stride() and g_ours[3].stride() == down.stride()

    def run_hf(dtype):
        m = hf_experts("eager", gate_up.to(dtype), down.to(dtype), k)
        xi, wi = x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
        out = m(xi, ids, wi)
        return out, torch.autograd.grad(out, (xi, wi, m.gate_up_proj, m.down_proj),
                                        dy.to(dtype))
    hf, g_hf = run_hf(bf)
    ref, g_ref = run_hf(torch.float32)
    names = ("out", "d_hidden_states", "d_top_k_weights", "d_gate_up_proj", "d_down_proj")
    for name, a, b, r in zip(names, (ours, *g_ours), (hf, *g_hf), (ref, *g_ref)):
        ours_err, hf_err = rel(a, r), rel(b, r)
        assert ours_err < hf_err + 5e-3, (name, ours_err, hf_err)
        assert ours_err < 3e-2, (name, ours_err, hf_err)
        assert rel(a, b) < 3e-2, name


def test_experts_drop_ids_outside_the_experts(fresh, monkeypatch):
    """An id outside [0, E) (an expert-parallel sentinel) adds nothing: the same as a zero
    weight on a valid id; its weight's gradient is zero."""
    disable_autotune(monkeypatch)
    T, H, I, E, k = 200, 256, 128, 8, 2
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    gate_up = torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) / 16
    down = torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) / 11
    ids = make_ids(T, k, E)
    w = torch.rand(T, k, device="cuda", dtype=torch.float32, requires_grad=True)
    bad = ids.clone()
    bad[::3, 0] = E
    bad[1::5, 1] = -1
    out = moe_experts(x, bad, w, gate_up, down)
    w0 = torch.where(bad == ids, w.detach(), 0.0)
    assert rel(out, moe_experts(x, ids, w0, gate_up, down)) < 1e-6
    (gw,) = torch.autograd.grad(out.float().sum(), (w,))
    assert not gw[bad != ids].any() and gw[bad == ids].abs().min() > 0


def test_bad_input():
    x = torch.randn(8, 16, device="cuda", dtype=torch.bfloat16)
    ids = torch.zeros(8, 2, device="cuda", dtype=torch.int32)
    with pytest.raises(ValueError, match="moe_permute: topk_ids must be a CUDA tensor"):
        moe_permute(x, ids.cpu(), 4)
    with pytest.raises(ValueError, match="moe_permute: x must be a CUDA tensor"):
        moe_permute(x.cpu(), ids, 4)
    with pytest.raises(TypeError, match="moe_permute: topk_ids dtype torch.float32"):
        moe_permute(x, ids.float(), 4)
    xs, offs, inverse = moe_permute(x, ids, 4)
    with pytest.raises(ValueError, match="moe_unpermute: topk_weights must be a CUDA"):
        moe_unpermute(xs, inverse, torch.ones(8, 2).cpu())
    with pytest.raises(TypeError, match="moe_unpermute: topk_weights dtype torch.float16"):
        moe_unpermute(xs, inverse, torch.ones(8, 2, device="cuda", dtype=torch.float16))
    with pytest.raises(ValueError, match="moe_unpermute: y_sorted has 8 rows"):
        moe_unpermute(xs[:8], inverse, torch.ones(8, 2, device="cuda"))
