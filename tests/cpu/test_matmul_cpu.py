"""Host side of matmul with ct.launch stubbed (no GPU): a plain config is one launch into the
output; a split-K config launches its partials into the scratch buffer and then their sum into
the output, and the search times the same arguments; persistent grids count SMs; the backward
computes only the gradients asked for, through the same launch on transposed views."""
import pytest
import torch

from tiletune.ops import matmul as MM

DEV = "cpu"   # the device the engine allocates scratch on here (the grids take it as an index)


def problem():
    """Z = 2 batches of (16, 300) @ (300, 256): 2 output tiles of 128x128, long enough K for
    split-K configs."""
    a3, b3 = torch.randn(2, 16, 300), torch.randn(2, 300, 256)
    cfgs = list(MM.matmul_configs("sm_90", 16, 256, 300))
    return a3, b3, torch.empty(2, 16, 256), cfgs


def cached(monkeypatch, cfg):
    """A launch key (M, N, K, Z, ...) whose tuning key's cache entry is (cfg, "kernel"): the
    launch takes it without a search."""
    key = (16, 256, 300, 2, "test", id(cfg))
    monkeypatch.setitem(MM._matmul.cache, MM._matmul.tune_key(key), (cfg, "kernel"))
    monkeypatch.setattr(MM._matmul, "_plans", {})
    return key


def test_plain_config_is_one_launch_into_the_output(launches, monkeypatch):
    a3, b3, c3, cfgs = problem()
    plain = cfgs[0]
    assert MM.split_of(plain) == 1 and not plain.persistent
    buf = MM._matmul.launch(cached(monkeypatch, plain), DEV, a3, b3, c3)
    assert launches == [((2, 2), "kernel", (a3, b3, c3, 128, 128, 64, 8))]
    assert buf is None                       # whole-K configs allocate no scratch


def test_split_k_launches_partials_into_scratch_then_their_sum(launches, monkeypatch):
    a3, b3, c3, cfgs = problem()
    split = next(c for c in cfgs if MM.split_of(c) > 1)
    w = MM._matmul.launch(cached(monkeypatch, split), DEV, a3, b3, c3)
    assert w.shape == (split.split * 2, 16, 256) and w.dtype == torch.float32
    (g1, k1, args1), (g2, k2, args2) = launches
    tiles = MM.cdiv(16, split.tm) * MM.cdiv(256, split.tn)
    assert g1 == (tiles, 2, split.split) and k1 == "kernel"
    assert args1 == (a3, b3, w, split.tm, split.tn, split.tk, split.group_m, split.split)
    assert k2 is MM.splitk_reduce_kernel and g2 == (MM.cdiv(16, 8) * MM.cdiv(256, 64), 2)
    assert args2 == (w, c3, *MM.SUM_TILE, split.split)


def test_persistent_grids_count_sms(launches):
    cfgs = list(MM.matmul_configs("sm_90", 4096, 4096, 4096))
    a3, b3 = torch.empty(1, 4096, 64, device="meta"), torch.empty(1, 64, 4096, device="meta")
    c3 = torch.empty(1, 4096, 4096, device="meta")
    by_tile = {(c.tm, c.tn, c.num_ctas): c for c in cfgs if c.persistent}
    # 32 x 32 tiles of 128x128 over 132 SMs at occupancy 1
    assert MM._grid(by_tile[128, 128, 1], DEV, a3, b3, c3, None) == (132, 1)
    # 2-CTA clusters: the grid counts clusters, half as many
    assert MM._grid(by_tile[256, 256, 2], DEV, a3, b3, c3, None) == (66, 1)
    # fewer tiles (x batches) than SMs: one CTA each
    a3s, b3s, c3s, small = problem()
    assert MM._grid(small[1], DEV, a3s, b3s, c3s, None) == (4, 1)


def test_the_search_times_the_arguments_launch_uses(launches):
    """The engine's search over matmul's declared functions: split-K configs are partly timed
    (their sum is left out of the search), share one scratch allocation, and the final round's
    run times the partials with the search's arguments and then the sum into the output."""
    a3, b3, c3, cfgs = problem()
    plain = cfgs[0]
    splits = [c for c in cfgs if MM.split_of(c) > 1]
    inputs = (a3, b3, c3)
    s = MM._matmul._search_for(DEV, inputs, MM._matmul._space(*inputs), cfgs)
    assert s.shape == dict(m=16, n=256, k=300, z=2)
    assert s.work.flops == 2.0 * 2 * 16 * 256 * 300
    assert not s.partly_timed(plain) and all(s.partly_timed(c) for c in splits)
    assert s.args_fn(plain) == (a3, b3, c3, 128, 128, 64, 8)
    ws = [s.args_fn(c)[2] for c in splits]
    assert {w.untyped_storage().data_ptr() for w in ws} == {ws[0].untyped_storage().data_ptr()}
    split = splits[0]
    assert ws[0].shape == (split.split * 2, 16, 256) and s.args_fn(split)[2] is ws[0]
    s.run_fn(split, "kernel")
    (g1, k1, args1), (g2, k2, args2) = launches
    assert (g1, k1, args1) == (s.grid_fn(split), "kernel", s.args_fn(split))
    assert k2 is MM.splitk_reduce_kernel and args2[0] is ws[0] and args2[1] is c3


def test_key_buckets_m_and_names_layouts(monkeypatch):
    seen = []
    monkeypatch.setattr(MM._matmul, "launch", lambda key, dev, *inputs: seen.append(key))
    a3 = torch.randn(1, 300, 64)
    b3 = torch.randn(1, 128, 64).transpose(1, 2)        # column-major B
    MM.launch(a3, b3, torch.empty(1, 300, 128))
    MM.launch(torch.randn(3, 64, 300).transpose(1, 2), torch.randn(3, 64, 128),
              torch.empty(3, 300, 128))
    # the launch key holds M and the batch; the tuning key buckets both: a config tuned for
    # few products (split-K scratch) is not reused for many
    assert seen == [(300, 128, 64, 1, torch.float32, "row", "col", -1),
                    (300, 128, 64, 3, torch.float32, "col", "row", -1)]
    assert [MM._matmul.tune_key(k) for k in seen] == [
        (512, 128, 64, 1, torch.float32, "row", "col", -1),
        (512, 128, 64, 4, torch.float32, "col", "row", -1)]


def test_a_batch_past_the_grid_axis_runs_in_chunks(monkeypatch):
    """Non-persistent configs put the batch on the grid's second axis (CUDA caps it at 65535):
    a larger batch runs as launches of at most that many products, covering every one once."""
    seen = []
    monkeypatch.setattr(MM._matmul, "launch",
                        lambda key, dev, a3, b3, c3: seen.append((key[3], c3.data_ptr())))
    Z = 2 * MM.MAX_BATCH + 7
    a3 = torch.empty(Z, 2, 4, device="meta")
    b3 = torch.empty(Z, 4, 3, device="meta")
    c3 = torch.empty(Z, 2, 3)
    MM.launch(a3, b3, c3)
    assert [z for z, _ in seen] == [MM.MAX_BATCH, MM.MAX_BATCH, 7]
    step = MM.MAX_BATCH * 2 * 3 * c3.element_size()
    assert [ptr - c3.data_ptr() for _, ptr in seen] == [0, step, 2 * step]


def test_backward_computes_only_the_gradients_needed(monkeypatch):
    products = []

    def launch(a, b, c):              # stands in for the kernel
        products.append((a.shape, MM.layout(a), MM.layout(b)))
        c.copy_(a @ b)
    monkeypatch.setattr(MM, "launch", launch)
    a = torch.randn(5, 7, requires_grad=True)
    b = torch.randn(7, 3)
    c = MM._matmul_op(a, b)
    assert torch.allclose(c, a @ b)
    saved_a, saved_b = c.grad_fn.saved_tensors      # a is read only by dB: not kept
    assert saved_a is None and saved_b.data_ptr() == b.data_ptr()
    dc = torch.randn(5, 3)
    products.clear()
    (da,) = torch.autograd.grad(c, (a,), dc)
    assert torch.allclose(da, dc @ b.t(), atol=1e-6)
    assert products == [((5, 3), "row", "col")]   # dA = dC @ B^T on B's transposed view, 2-D
    b.requires_grad_()
    c = MM._matmul_op(a, b)
    products.clear()
    da, db = torch.autograd.grad(c, (a, b), dc)
    assert torch.allclose(db, a.t() @ dc, atol=1e-6) and len(products) == 2


def test_nested_tensors_are_refused_by_name(monkeypatch):
    """Nested (jagged) tensors, which torch.matmul takes, as either operand: a TypeError naming
    matmul and the argument (the ragged size failed the output's allocation inside torch,
    naming neither). The device check stubbed: CPU tensors."""
    monkeypatch.setattr(MM.validate, "tensor", lambda op, name, t, **kw: t)
    jagged = torch.nested.nested_tensor([torch.randn(3, 8), torch.randn(5, 8)],
                                        layout=torch.jagged, dtype=torch.bfloat16)
    dense_a = torch.randn(2, 4, 8, dtype=torch.bfloat16)
    dense_b = torch.randn(2, 8, 6, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"^matmul: a is a nested tensor"):
        MM.matmul(jagged, dense_b)
    with pytest.raises(TypeError, match=r"^matmul: b is a nested tensor"):
        MM.matmul(dense_a, jagged.transpose(1, 2))


def test_out_may_be_a_leaf_that_requires_grad_in_inference_mode(monkeypatch):
    """torch.inference_mode() records no graph, even under enable_grad, and torch's copy_ writes
    a leaf that requires grad there (or a view of one, or memory an operand that requires grad
    shares): so does out=. Where autograd records a graph the leaf is still refused."""
    monkeypatch.setattr(MM.validate, "tensor", lambda op, name, t, **kw: t)   # CPU tensors
    monkeypatch.setattr(MM, "launch", lambda a, b, c: c.copy_(a @ b))
    a = torch.randn(4, 6, dtype=torch.bfloat16, requires_grad=True)
    b = torch.randn(6, 4, dtype=torch.bfloat16)
    want = a.detach() @ b
    leaf = torch.zeros(4, 4, dtype=torch.bfloat16, requires_grad=True)
    view_of_leaf = torch.zeros(8, 4, dtype=torch.bfloat16, requires_grad=True)[4:]
    square = torch.randn(4, 4, dtype=torch.bfloat16, requires_grad=True)
    want_square = square.detach() @ b[:4]
    with torch.inference_mode(), torch.enable_grad():
        for out in (leaf, view_of_leaf):
            assert MM.matmul(a, b, out=out) is out and torch.equal(out, want)
        assert leaf.grad_fn is None
        assert MM.matmul(square, b[:4], out=square) is square        # out is the operand a
        assert torch.equal(square, want_square)
    with pytest.raises(ValueError, match=r"^matmul: out is a leaf tensor that requires grad"):
        MM.matmul(a, b, out=leaf)
    with pytest.raises(ValueError, match=r"^matmul: out is a view of a leaf tensor"):
        MM.matmul(a, b, out=view_of_leaf)
