"""grouped_mm on the GPU against a float32 per-group loop on random data: token splits with empty
groups, one group with every row and rows past the last offset; E from 1 to 256, T = 1, odd K
and N; both weight layouts; bf16 and fp16; every config of both kernels (both load styles); one
tuned key per kernel (the rest under DISABLE_AUTOTUNE: searches are expensive); gradients;
torch.compile; a CUDA graph replayed with new offsets; bad input; Megatron's gmm."""
import cuda.tile as ct
import pytest
import torch

from tiletune.ops import grouped_gemm as GG
from tiletune.ops.grouped_gemm import grouped_mm
from tiletune.space import cdiv

from .conftest import assert_each_cta_loops, disable_autotune, each_config, poison_allocator

# Relative Frobenius error against the float32 reference rounded to the output's dtype: what
# is left is float32 accumulation order, at most 1.6e-4 (bf16) and 5.6e-5 (fp16) for every
# config on an H200; a bf16 accumulator or one wrong element in 10^5 would pass the unrounded
# 1e-2 that output rounding alone forces.
TOL = {torch.bfloat16: 5e-4, torch.float16: 2e-4}


def rel(a, b):
    a, b = a.double(), b.to(a.dtype).double()
    assert torch.isfinite(a).all()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def counts(T, E, kind, gen=None):
    """Rows per group: even; zipf (a few groups take most, the last ones none); one (every row
    in the middle group); short (random, with empty groups, 3 rows past the last offset)."""
    if kind == "even":
        return [T // E + (g < T % E) for g in range(E)]
    if kind == "one":
        return [T if g == E // 2 else 0 for g in range(E)]
    if kind == "zipf":
        share = [1.0 / (g + 1) ** 1.5 if g < E - max(1, E // 8) else 0.0 for g in range(E)]
        c = [int(T * s / sum(share)) for s in share]
        c[0] += T - sum(c)
        return c
    cut = sorted(torch.randint(0, max(T - 2, 0), (E - 1,), generator=gen).tolist())
    ends = cut + [max(T - 3, 0)]
    return [e - s for s, e in zip([0] + ends[:-1], ends)]


def offsets(c):
    return torch.tensor(c, device="cuda").cumsum(0).to(torch.int32)


def weight(E, K, N, dt, transposed):
    """(E, K, N): row-major, or the transposed view of an (E, N, K) nn.Linear-style weight."""
    if transposed:
        return torch.randn(E, N, K, device="cuda", dtype=dt).transpose(-2, -1)
    return torch.randn(E, K, N, device="cuda", dtype=dt)


def reference(x, w, c):
    out, s = torch.zeros(x.shape[0], w.shape[2], device="cuda"), 0
    for g, n in enumerate(c):
        out[s:s + n] = x[s:s + n].float() @ w[g].float()
        s += n
    return out


def k_reference(a, b, c):
    out, s = torch.zeros(len(c), a.shape[0], b.shape[1], device="cuda"), 0
    for g, n in enumerate(c):
        out[g] = a[:, s:s + n].float() @ b[s:s + n].float()
        s += n
    return out


CASES = [  # E, T, K, N, split
    (8, 2048, 512, 768, "even"), (8, 2048, 512, 768, "zipf"), (8, 1000, 256, 384, "one"),
    (16, 3000, 320, 200, "short"), (1, 700, 256, 256, "even"), (256, 4096, 256, 512, "zipf"),
    (256, 1000, 128, 256, "short"), (8, 1, 512, 256, "even"), (4, 1, 128, 128, "one"),
    (8, 2000, 4095, 1000, "short"), (3, 333, 1000, 4095, "even")]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "E{}-T{}-K{}-N{}-{}".format(*c))
@pytest.mark.parametrize("w_t", [False, True], ids=["w", "w^T"])
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16], ids=str)
def test_forward(fresh, monkeypatch, case, w_t, dt):
    disable_autotune(monkeypatch)
    E, T, K, N, kind = case
    gen = torch.Generator().manual_seed(E * T + K)
    c = counts(T, E, kind, gen)
    x, w = torch.randn(T, K, device="cuda", dtype=dt), weight(E, K, N, dt, w_t)
    poison_allocator(torch)                         # rows left unwritten show as NaN
    y = grouped_mm(x, w, offsets(c))
    assert y.shape == (T, N) and y.dtype == dt
    assert rel(y, reference(x, w, c)) < TOL[dt]
    assert not y[sum(c):].any()                     # rows past the last offset are zeros


K_CASES = [  # E, T, M, N, split
    (8, 2048, 512, 768, "zipf"), (16, 3000, 320, 200, "short"), (256, 1000, 128, 256, "short"),
    (4, 1, 128, 64, "one"), (8, 2000, 4095, 1000, "even")]


@pytest.mark.parametrize("E,T,M,N,kind", K_CASES, ids=lambda v: str(v))
@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16], ids=str)
def test_k_grouped(fresh, monkeypatch, E, T, M, N, kind, dt):
    """The weight-gradient form: a (M, T) as x.t(), b (T, N); empty groups are zeros."""
    disable_autotune(monkeypatch)
    c = counts(T, E, kind, torch.Generator().manual_seed(T))
    a = torch.randn(T, M, device="cuda", dtype=dt).t()
    b = torch.randn(T, N, device="cuda", dtype=dt)
    poison_allocator(torch)
    out = grouped_mm(a, b, offsets(c))
    assert out.shape == (E, M, N) and out.dtype == dt
    assert rel(out, k_reference(a, b, c)) < TOL[dt]
    assert all(not out[g].any() for g in range(E) if c[g] == 0)


def every_m_config(k, n):
    """Every config of the sm_90 M-grouped space: a key's space has the short tiles only where
    groups are small, so the union of a large-group and a small-group key's."""
    large, small = (list(GG.grouped_configs("sm_90", t, 6, k, n)) for t in (1024, 96))
    return large + [cfg for cfg in small if cfg not in large]


def test_every_config_is_correct(fresh, monkeypatch):
    """Each config of the sm_90 spaces of both kernels (both load styles, every tile) on a
    ragged problem: groups that start mid-tile, an empty one, rows past the end, K and N not
    multiples of any tile."""
    c = [37, 0, 300, 1, 150, 90]
    x = torch.randn(600, 333, device="cuda", dtype=torch.bfloat16)
    w = weight(6, 333, 270, torch.bfloat16, True)
    offs = offsets(c)
    ref = reference(x, w, c)
    assert len(every_m_config(333, 270)) == len(GG.SM90_SPACE)
    for cfg in each_config(monkeypatch, GG._grouped, every_m_config(333, 270)):
        poison_allocator(torch)
        y = grouped_mm(x, w, offs)
        assert rel(y, ref) < TOL[torch.bfloat16] and not y[578:].any(), vars(cfg)
    dy = torch.randn(600, 270, device="cuda", dtype=torch.bfloat16)
    k_ref = k_reference(dy.t(), x, c)
    for cfg in each_config(monkeypatch, GG._k_grouped,
                           list(GG.k_grouped_configs("sm_90", 1024, 6, 270, 333))):
        poison_allocator(torch)
        assert rel(grouped_mm(dy.t(), x, offs), k_ref) < TOL[torch.bfloat16], vars(cfg)


def test_every_config_loops_over_many_tiles(fresh, monkeypatch):
    """Each config of the sm_90 space (every launch is persistent) where every CTA (or cluster)
    makes at least three trips of its work-item loop (tileiras 13.4 built TMA loops of other
    kernels that went wrong only there: references/hardware-constraints.md); groups that start
    mid-tile and an empty one."""
    c = [1999, 0, 2501, 1, 3000, 2499, 3000, 3000]
    T, K, N = sum(c), 1000, 1999
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    w = weight(len(c), K, N, torch.bfloat16, True)
    offs = offsets(c)
    ref = reference(x, w, c)
    for cfg in each_config(monkeypatch, GG._grouped, every_m_config(K, N)):
        poison_allocator(torch)
        assert rel(grouped_mm(x, w, offs), ref) < TOL[torch.bfloat16], vars(cfg)
        assert_each_cta_loops(sum(cdiv(n, cfg.tm) for n in c) * cdiv(N, cfg.tn), cfg)


def test_the_table_walk_on_every_split(fresh, monkeypatch):
    """The table walk's schedule (one CTA per group, the item count in the table) on the splits
    of the forward cases: E 1 and 256, empty groups, one group with every row, T 1, odd K, N."""
    tables = {}     # one config per row-tile height: the schedule's items depend on it (and N)
    for cfg in every_m_config(512, 768):
        if cfg.walk == GG.TABLE:
            tables.setdefault(cfg.tm, cfg)
    table_cfgs = list(tables.values())
    assert sorted(tables) == [16, 64, 128]
    for cfg in each_config(monkeypatch, GG._grouped, table_cfgs):
        for E, T, K, N, kind in CASES:
            c = counts(T, E, kind, torch.Generator().manual_seed(E * T + K))
            x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
            w = weight(E, K, N, torch.bfloat16, True)
            poison_allocator(torch)
            y = grouped_mm(x, w, offsets(c))
            assert rel(y, reference(x, w, c)) < TOL[torch.bfloat16], (vars(cfg), E, T, kind)
            assert not y[sum(c):].any()


def scheduled_items(offs, T, E, tm, num_n):
    """The table walk's work items counted on the host, clamped as the kernels clamp offs."""
    items, start = [], 0
    for g in range(E + 1):
        end = min(max(offs[g] if g < E else T, start), T)
        items += [[g, start, end, tile] for tile in range(cdiv(end - start, tm) * num_n)]
        start = end
    return items


def test_the_schedule_lists_every_item_once(fresh):
    """The schedule kernel's table holds each group's items in order and their count, nothing
    for the groups it pads E + 1 to (rows past the last offset belong to group E alone), on
    good splits and on offsets that decrease or pass T."""
    cfg = next(c for c in GG.grouped_configs("sm_90", 4096, 8, 512, 768) if c.walk == GG.TABLE)
    splits = [(E, T, N, torch.tensor(counts(T, E, kind, torch.Generator().manual_seed(E * T)))
               .cumsum(0).tolist()) for E, T, K, N, kind in CASES]
    splits += [(6, 600, 96, [300, 100, 500, 200, 600, 0]), (6, 600, 96, [-50, -1, 100, 3, 2, 7]),
               (5, 1000, 300, [100, 900, 1200, 1300, 2**31 - 1])]
    for E, T, N, ends in splits:
        x = torch.empty(T, 8, device="cuda", dtype=torch.bfloat16)
        w = torch.empty(E, 8, N, device="cuda", dtype=torch.bfloat16)
        offs = torch.tensor(ends, device="cuda", dtype=torch.int32)
        table = torch.full((5, GG._most_items(cfg, x, w)), -7, device="cuda", dtype=torch.int32)
        ct.launch(torch.cuda.current_stream(), (E + 1,), GG.grouped_schedule_kernel,
                  GG._schedule_args(cfg, x, w, offs, table))
        want = scheduled_items(ends, T, E, cfg.tm, cdiv(N, cfg.tn))
        assert table[4, 0].item() == len(want), (E, T, ends)
        assert table[:4, :len(want)].t().tolist() == want, (E, T, ends)


def test_unchecked_bad_offsets_return(fresh, monkeypatch):
    """offs that decrease or pass T are not checked (a host sync): the result is wrong, but
    every config of the M-grouped space (every walk) and the K-grouped kernel return (ends are
    clamped: even 2^31 - 1 is no long loop), and the GPU stays usable."""
    x = torch.randn(600, 64, device="cuda", dtype=torch.bfloat16)
    w = weight(6, 64, 96, torch.bfloat16, True)
    bad = [torch.tensor(e, device="cuda", dtype=torch.int32) for e in
           ([300, 100, 500, 200, 600, 0], [100, 900, 1200, 1300, 5000, 2**31 - 1],
            [-50, -1, 100, 2**31 - 1, 3, 700])]
    for cfg in each_config(monkeypatch, GG._grouped, list(GG.grouped_configs("sm_90", 1024, 6,
                                                                             64, 96))):
        for offs in bad:
            assert grouped_mm(x, w, offs).shape == (600, 96)
        torch.cuda.synchronize()
    dy = torch.randn(600, 96, device="cuda", dtype=torch.bfloat16)
    for offs in bad:
        assert grouped_mm(dy.t(), x, offs).shape == (6, 96, 64)
    torch.cuda.synchronize()
    good = [100] * 6
    assert rel(grouped_mm(x, w, offsets(good)), reference(x, w, good)) < TOL[torch.bfloat16]


def test_tuned_and_the_next_split_does_not_search(fresh):
    """One search per kernel on a small key (the forward and the weight gradient); a new split
    and a T in the same bucket reuse them."""
    E, K, N = 8, 512, 384
    w = weight(E, K, N, torch.bfloat16, True).requires_grad_()
    for T, kind in [(1500, "even"), (1800, "zipf")]:
        c = counts(T, E, kind)
        x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
        y = grouped_mm(x, w, offsets(c))
        assert rel(y, reference(x, w, c)) < TOL[torch.bfloat16]
        dy = torch.randn_like(y)
        (gw,) = torch.autograd.grad(y, (w,), dy)
        assert rel(gw, k_reference(x.t(), dy, c)) < TOL[torch.bfloat16]
    assert GG._grouped.searches == 1 and GG._k_grouped.searches == 1
    assert {r.source for r in GG._grouped.records.values()} == {"search"}


@pytest.mark.parametrize("w_t", [False, True], ids=["w", "w^T"])
def test_gradients(fresh, monkeypatch, w_t):
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    E, T, K, N = 6, 900, 200, 300
    c = counts(T, E, "short", torch.Generator().manual_seed(1))
    offs = offsets(c)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = weight(E, K, N, torch.bfloat16, w_t).requires_grad_()
    dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
    gx, gw = torch.autograd.grad(grouped_mm(x, w, offs), (x, w), dy)
    xf, wf = x.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    ex, ew = torch.autograd.grad(reference(xf, wf, c), (xf, wf), dy.float())
    assert rel(gx, ex) < TOL[torch.bfloat16] and rel(gw, ew) < TOL[torch.bfloat16]
    assert gw.shape == w.shape and gw.stride() == w.stride()
    # the 2-D x 2-D product's gradients (M-grouped kernels on transposed views)
    a = x.detach().t().requires_grad_()
    b = torch.randn(T, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    d = torch.randn(E, K, 64, device="cuda", dtype=torch.bfloat16)
    ga, gb = torch.autograd.grad(grouped_mm(a, b, offs), (a, b), d)
    af, bf = a.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    ea, eb = torch.autograd.grad(k_reference(af, bf, c), (af, bf), d.float())
    assert rel(ga, ea) < TOL[torch.bfloat16] and rel(gb, eb) < TOL[torch.bfloat16]


@pytest.mark.parametrize("where", ["host", "device"])
@pytest.mark.parametrize("trans_b", [False, True], ids=["b", "trans_b"])
def test_gmm(fresh, monkeypatch, trans_b, where):
    """Megatron's gmm(a, b, batch_sizes, trans_b): int64 rows per group on the host (as that
    package passes them) or on the device, against the float32 loop, with gradients."""
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    E, T, K, N = 6, 900, 200, 300
    c = counts(T, E, "zipf")
    sizes = torch.tensor(c, device="cpu" if where == "host" else "cuda")
    a = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = weight(E, K, N, torch.bfloat16, False)
    b = (b.transpose(-2, -1).contiguous() if trans_b else b).requires_grad_()
    poison_allocator(torch)
    y = GG.gmm(a, b, sizes, trans_b=trans_b)
    dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
    ga, gb = torch.autograd.grad(y, (a, b), dy)
    af, bf = a.detach().float().requires_grad_(), b.detach().float().requires_grad_()
    want = reference(af, bf.transpose(-2, -1) if trans_b else bf, c)
    ea, eb = torch.autograd.grad(want, (af, bf), dy.float())
    assert rel(y, want) < TOL[torch.bfloat16]
    assert rel(ga, ea) < TOL[torch.bfloat16] and rel(gb, eb) < TOL[torch.bfloat16]
    assert gb.shape == b.shape


def test_batched_3d_and_out(fresh, monkeypatch):
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    a = torch.randn(4, 100, 64, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4, 64, 80, device="cuda", dtype=torch.bfloat16)
    assert rel(grouped_mm(a, b), a.float() @ b.float()) < TOL[torch.bfloat16]
    x, w, c = a[0], b, [30, 0, 50, 20]
    out = torch.empty(100, 80, device="cuda", dtype=torch.bfloat16)
    assert grouped_mm(x, w, offsets(c), out=out) is out
    assert rel(out, reference(x, w, c)) < TOL[torch.bfloat16]


def test_compile_fullgraph(fresh, monkeypatch):
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    E, T, K, N = 4, 512, 128, 192
    c = counts(T, E, "zipf")
    offs = offsets(c)
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    w = weight(E, K, N, torch.bfloat16, True).requires_grad_()
    dy = torch.randn(T, N, device="cuda", dtype=torch.bfloat16)
    eager = grouped_mm(x, w, offs)
    ex, ew = torch.autograd.grad(eager, (x, w), dy)
    compiled = torch.compile(lambda x, w, offs: grouped_mm(x, w, offs), fullgraph=True)
    y = compiled(x, w, offs)
    cx, cw = torch.autograd.grad(y, (x, w), dy)
    assert y.shape == (T, N) and rel(y, eager) < 1e-6
    assert rel(cx, ex) < 1e-6 and rel(cw, ew) < 1e-6 and cw.stride() == w.stride()


def test_cuda_graph_replays_with_new_offsets(fresh, monkeypatch):
    """Captured once; the split is only read on the device, so new offsets in the captured
    tensor change the result (default config: the capture is the point, not the search)."""
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    E, T, K, N = 8, 1024, 256, 256
    x = torch.randn(T, K, device="cuda", dtype=torch.bfloat16)
    w = weight(E, K, N, torch.bfloat16, True)
    offs = offsets(counts(T, E, "even"))
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        grouped_mm(x, w, offs)                       # builds the kernel outside the capture
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = grouped_mm(x, w, offs)
    for kind in ("zipf", "one", "short"):
        c = counts(T, E, kind, torch.Generator().manual_seed(3))
        offs.copy_(offsets(c))
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        assert rel(y, reference(x, w, c)) < TOL[torch.bfloat16], kind


def test_bad_input():
    x = torch.randn(8, 16, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(2, 16, 4, device="cuda", dtype=torch.bfloat16)
    offs = offsets([4, 4])
    with pytest.raises(ValueError, match="offs must be a CUDA tensor"):
        grouped_mm(x, w, offs.cpu())
    with pytest.raises(ValueError, match="CUDA"):
        grouped_mm(x.cpu(), w, offs)
    with pytest.raises(TypeError, match="offs must be int32"):
        grouped_mm(x, w, offs.long())
    with pytest.raises(ValueError, match="offs has 3 entries"):
        grouped_mm(x, w, offsets([2, 4, 4]))
    with pytest.raises(ValueError, match="inner dims"):
        grouped_mm(x, w[:, :15], offs)
    with pytest.raises(TypeError, match="w is torch.float16"):
        grouped_mm(x, w.half(), offs)


def test_example_pair_runs_and_agrees():
    """assets/examples/04: same result; the autotuned launch is not slower (5% timing slack)."""
    from .conftest import assert_pair_agrees, run_example_pair
    fixed, tuned = run_example_pair("04_grouped_gemm_moe")
    assert_pair_agrees(fixed, tuned)
    assert float(tuned["us"]) <= float(fixed["us"]) * 1.05, (fixed, tuned)
