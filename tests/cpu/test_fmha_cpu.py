"""FMHA pieces that need no GPU: config spaces per arch and head-dim tile, the FLOP count of the
causal mask, the AOT cases, what the host side launches (ct.launch stubbed), and input checks
that fail before any launch."""
import inspect
import itertools
from types import SimpleNamespace

import cuda.tile as ct
import pytest
import numpy as np
import torch

import tiletune
from tiletune import device, validate
from tiletune.autotune import MAX_CONFIGS, default_hints
from tiletune.cases import fmha as FC
from tiletune.ops import fmha as FM
from tiletune.space import next_pow2

GENS = {"fwd": FM.fwd_configs, "dq": FM.dq_configs, "dkdv": FM.dkdv_configs}


def spaces():
    for arch, td, (sq, sk), (kind, gen), causal in itertools.product(
            ("sm_90", "sm_100", "sm_120", "sm_80"), (16, 32, 64, 128, 256),
            ((4096, 4096), (1, 4096), (4096, 1), (64, 64), (128, 16384)), GENS.items(),
            (False, True)):
        yield (f"{kind} {arch} TD{td} Sq{sq} Sk{sk}{' causal' if causal else ''}", arch, sq, sk,
               list(gen(arch, td, sq, sk, causal=causal)))


@pytest.mark.parametrize("label,arch,sq,sk,cfgs", list(spaces()),
                         ids=lambda v: v if isinstance(v, str) and " " in v else "")
def test_space(label, arch, sq, sk, cfgs):
    assert 1 <= len(cfgs) <= MAX_CONFIGS
    assert len({tuple(sorted(vars(c).items())) for c in cfgs}) == len(cfgs), "repeated config"
    for c in cfgs:
        h = default_hints(c)
        assert 1 <= h["occupancy"] <= 32 and h.get("num_worker_warps", 4) in (4, 8)
        assert h["num_ctas"] in (1, 2, 4, 8)
        assert c.tm * c.tn <= 128 * 256
        for v in (c.tm, c.tn):
            assert v >= 16 and v & (v - 1) == 0
        assert c.tm <= max(64, next_pow2(sq)) and c.tn <= max(64, next_pow2(sk))
    if arch not in ("sm_90", "sm_100"):
        assert len(cfgs) <= 2 and all(c.num_ctas == 1 for c in cfgs)


def test_sm90_defaults():
    assert next(FM.fwd_configs("sm_90", 128)) == SimpleNamespace(
        tm=128, tn=128, occupancy=1, num_ctas=1, num_worker_warps=8)
    assert next(FM.dq_configs("sm_90", 128)).tm == 128
    assert next(FM.dkdv_configs("sm_90", 128)).tn == 128
    assert next(FM.fwd_configs("sm_90", 128, 1, 4096)).tm == 64     # decode: no 128-row tiles


def test_aot_covers_every_sm90_and_sm100_config_at_d128_and_every_sm90_one_at_d64():
    labels = [c.label for c in FC.compile_cases()]
    for kind, gen in GENS.items():
        for arch, td in (("sm_90", 128), ("sm_100", 128), ("sm_90", 64)):
            for cfg in gen(arch, td, causal=True):
                assert any(f"fmha {kind} " in lb and str(vars(cfg)) in lb for lb in labels), \
                    (kind, arch, td, vars(cfg))
    assert len(labels) <= 111, "keep the CI's FMHA builds near 150 (two archs)"


def test_d64_forward_offers_four_ctas_an_sm_on_sm90_only():
    # 64 registers a thread let four 256-thread CTAs share an SM: the entry that won the D64
    # forwards (spilling 16 bytes); at D128 the O accumulator alone takes 64 registers
    four = SimpleNamespace(tm=64, tn=64, occupancy=4, num_worker_warps=4, num_ctas=1)
    assert four in list(FM.fwd_configs("sm_90", 64)) and four in list(FM.fwd_configs("sm_90", 32))
    assert four not in list(FM.fwd_configs("sm_90", 128))
    assert four not in list(FM.fwd_configs("sm_100", 64))   # (compiled: the AOT-coverage test)


def test_causal_forward_runs_heaviest_tiles_first_with_one_space():
    """The query-tile order is no config field: a causal forward runs each head's heaviest tile
    first (the kernel derives the order from CAUSAL), and causal keys search the same configs
    (and, on sm_90, the two-tile entries' two-loop forms)."""
    for arch in ("sm_90", "sm_100"):
        plain = [vars(c) for c in FM.fwd_configs(arch, 128)]
        causal = [vars(c) for c in FM.fwd_configs(arch, 128, causal=True)]
        assert [c for c in causal if not c.get("split")] == plain
        assert len(causal) - len(plain) == (2 if arch == "sm_90" else 0)
        assert not any("heavy_first" in c for c in plain)
    q, k, v = _qkv(sq=100, sk=100, d=64)
    lse2 = FM._flat(torch.empty(2, 4, 100))
    cu = torch.zeros(1, dtype=torch.int32)
    c = next(FM.fwd_configs("sm_90", 64))
    for causal in (False, True):
        inputs = (q, k, v, torch.empty_like(q), lse2, cu, cu, 0.125 * FM.LOG2E, 0, 64, causal,
                  None)
        assert FM._fwd_args(c, *inputs)[-2:] == (causal, False)


def test_pair_forward_on_sm90_dense_keys_only():
    """The two-tile forward: sm_90 only, every head-dim tile, never for a packed batch (its
    build spills there) or where two query tiles pass the bucketed Sq; grid over tile pairs."""
    for td in (16, 64, 128, 256):
        pairs = [c for c in FM.fwd_configs("sm_90", td) if getattr(c, "pair", False)]
        assert len(pairs) == (2 if td == 128 else 1)
        assert all(FM.fwd_kernel_for(c) is FM.fmha_fwd_pair_kernel for c in pairs)
        # each entry also in its two-loop form for causal keys where that build was measured
        # (D64 spills, D256 overflows shared memory), passed as the kernel's last constant
        assert not any(c.split for c in pairs)
        causal = [c for c in FM.fwd_configs("sm_90", td, causal=True) if getattr(c, "pair", False)]
        assert [c.split for c in causal] == ([False, True] if td == 128 else [False]) * len(pairs)
        assert all(FM._fwd_args(c, *[None] * 12)[-1] is c.split for c in causal)
        assert not any(getattr(c, "pair", False) for c in FM.fwd_configs(
            "sm_90", td, packed=True, causal=True))
    assert FM.fwd_kernel_for(next(FM.fwd_configs("sm_90", 128))) is FM.fmha_fwd_kernel
    assert not any(getattr(c, "pair", False) for c in FM.fwd_configs("sm_90", 128, 64, 4096))
    assert not any(getattr(c, "pair", False) for c in FM.fwd_configs("sm_100", 128))
    assert not any(getattr(c, "pair", False) for arch in ("sm_90", "sm_100")
                   for c in itertools.chain(FM.dq_configs(arch, 128), FM.dkdv_configs(arch, 128)))
    pair = SimpleNamespace(tm=64, tn=128, occupancy=1, num_worker_warps=4, num_ctas=1, pair=True)
    q = torch.empty(2, 3, 4097, 128)
    with pytest.MonkeyPatch.context() as mp:
        mp.setitem(device._SM_COUNT, 0, 132)
        # 65 query tiles in 33 pairs; (heads a round, tiles, rounds)
        assert FM._query_grid(pair, 0, q, True, None) == (3, 33, 2)
        assert FM._query_grid(pair, 0, q, False, None) == (1, 33, 6)
        assert FM._query_grid(SimpleNamespace(tm=64, occupancy=2), 0, q, True, None) == \
            (3, 65, 2)


def test_causal_grids_start_every_heads_heavy_tiles_before_light_ones():
    """(heads a round, tiles, rounds): a round of about as many heads as the SMs hold tiles of
    at once, a divisor of the heads; the GPU starts CTAs x first, and the kernels read tile
    bid(1) of head bid(2) * num_blocks(0) + bid(0): every (tile, head) once, and in the
    start order no tile of a round runs before a heavier (lower) one of that round."""
    assert FM._round_grid(32, 32, 132, True) == (4, 32, 8)      # B2 H16, TM 128, 1 CTA an SM
    assert FM._round_grid(64, 16, 264, True) == (4, 64, 4)      # dK/dV, B2 Hkv8, 2 CTAs an SM
    assert FM._round_grid(16, 512, 264, True) == (16, 16, 32)
    assert FM._round_grid(64, 7, 132, True) == (1, 64, 7)       # nearest divisor of a prime
    assert FM._round_grid(4096, 32, 132, True) == (1, 4096, 32)  # long: head after head
    assert FM._round_grid(32, 32, 132, False) == (1, 32, 32)     # no mask: head after head
    for tiles, heads, slots in ((32, 32, 132), (5, 12, 264), (64, 6, 132), (3, 1, 132)):
        per, nt, rounds = FM._round_grid(tiles, heads, slots, True)
        start_order = [(y, z * per + x) for z in range(rounds) for y in range(nt)
                       for x in range(per)]
        assert sorted(start_order) == [(t, h) for t in range(tiles) for h in range(heads)]
        for r in range(rounds):
            ranks = [t for t, h in start_order if h // per == r]
            assert ranks == sorted(ranks)


def brute_pairs(sq, sk, causal, offset):
    return sum(1 for i in range(sq) for j in range(sk) if not causal or j <= i + offset)


@pytest.mark.parametrize("sq,sk", list(itertools.product((0, 1, 2, 7, 33), (0, 1, 5, 33))))
def test_visible_pairs(sq, sk):
    for causal, offset in ((False, 0), (True, sk - sq), (True, 0), (True, -3), (True, 4)):
        assert FM.visible_pairs(sq, sk, causal, offset) == brute_pairs(sq, sk, causal, offset)


def test_head_tile():
    assert [FM.head_tile(d) for d in (1, 16, 17, 64, 80, 96, 128, 129, 256)] == \
        [16, 16, 32, 64, 128, 128, 128, 256, 256]


def test_rejects_cpu_and_bad_types_without_a_gpu():
    q = torch.randn(1, 2, 4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        FM.fmha(q, q, q)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        FM.fmha([1.0], q, q)
    with pytest.raises(ValueError, match="dropout_p"):
        FM.scaled_dot_product_attention(q, q, q, dropout_p=0.5)


@pytest.fixture
def stubbed_launch(monkeypatch):
    """DISABLE_AUTOTUNE on a pretend sm_90 with ct.launch recorded: (kernel name, grid, the
    kernel's arguments by parameter name) per launch. CPU tensors pass for device 0."""
    monkeypatch.setenv("DISABLE_AUTOTUNE", "1")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.Tensor, "get_device", lambda self: 0)
    monkeypatch.setattr(device, "arch", lambda d=None: "sm_90")
    monkeypatch.setitem(device._SM_COUNT, 0, 132)
    monkeypatch.setattr(device, "current_stream", lambda dev: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    launches = []

    def launch(stream, grid, kernel, args):
        names = list(inspect.signature(kernel._pyfunc).parameters)
        assert len(args) == len(names), kernel._pyfunc.__name__
        launches.append((kernel._pyfunc.__name__, grid, dict(zip(names, args))))
    monkeypatch.setattr(ct, "launch", launch)
    tiletune.clear_cache()
    yield launches
    tiletune.clear_cache()


def _qkv(B=2, hq=4, hkv=2, sq=100, sk=300, d=80):
    """bf16 CPU tensors in HF's layout ((B, S, H, D) storage seen as (B, H, S, D))."""
    def t(h, s):
        return torch.randn(B, s, h, d, dtype=torch.bfloat16).transpose(1, 2)
    return t(hq, sq), t(hkv, sk), t(hkv, sk)


def test_host_launches(stubbed_launch):
    """Forward, then backward through autograd: each kernel's grid and arguments under the sm_90
    defaults (D80 -> TD 128; GQA 2:1; causal bottom-right, offset Sk - Sq = 200); the backward
    gets the forward's o and lse, and the dK/dV kernel reads the delta the dQ kernel wrote."""
    q, k, v = _qkv()
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    o = FM._fmha(qg, kg, vg, True, 200, 0.5)
    assert o.shape == q.shape and o.stride() == q.stride()
    do = torch.randn_like(o)
    dq, dk, dv = torch.autograd.grad(o, (qg, kg, vg), do)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    (fk, fgrid, f), (qk, qgrid, g), (kk, kgrid, h) = stubbed_launch
    assert (fk, qk, kk) == ("fmha_fwd_kernel", "fmha_bwd_dq_kernel", "fmha_bwd_dkdv_kernel")
    # defaults at TD 128: forward 128x128, dQ 128x64, dK/dV query tile 64 x key tile 128
    # grids (heads a round, tiles, rounds): causal, so a round holds every head here
    assert fgrid == (8, 1, 1) and qgrid == (8, 1, 1) and kgrid == (4, 3, 1)
    assert (f["TM"], f["TN"], f["TD"], f["CAUSAL"]) == (128, 128, 128, True)
    assert (g["TM"], g["TN"], h["TM"], h["TN"]) == (128, 64, 64, 128)
    assert f["q"] is qg and f["k"] is kg and f["v"] is vg and f["o"] is o
    assert f["lse"].shape == (8, 100) and f["offset"] == 200 == g["offset"] == h["offset"]
    assert f["qk_scale"] == pytest.approx(0.5 * FM.LOG2E) == g["qk_scale"] == h["qk_scale"]
    assert g["scale"] == 0.5 == h["scale"]
    same = lambda a, b: a.data_ptr() == b.data_ptr() and a.shape == b.shape
    assert same(g["o"], o) and same(g["q"], q) and same(h["k"], k) and same(h["v"], v)
    assert g["do"] is do and h["do"] is do and h["delta"] is g["delta"]
    assert same(g["dq"], dq) and same(h["dk"], dk) and same(h["dv"], dv)
    assert g["lse"].data_ptr() == f["lse"].data_ptr() == h["lse"].data_ptr()
    assert g["delta"].shape == (8, 100) and g["delta"].dtype == torch.float32
    # the split plan: dK/dV adds nothing into a dQ (its dq32 slot holds dq, unread)
    assert (h["ADD_DQ"], h["SEES_PAST_SK"], h["PACKED"]) == (False, False, False)
    assert same(h["dq32"], dq)


@pytest.mark.parametrize("sq,sk,offset,past", [
    (100, 300, 200, False),         # bottom-right (fmha): every row's last key is below Sk
    (300, 100, -200, False),        # bottom-right, Sq > Sk
    (100, 300, 0, False),           # top-left, Sq < Sk
    (300, 100, 0, True),            # top-left (SDPA), Sq > Sk: rows 100.. see every key
    (100, 100, 1, True),            # a diagonal one key past bottom-right
])
def test_dq_masks_keys_past_sk_where_a_causal_row_sees_past_them(stubbed_launch, sq, sk,
                                                                 offset, past):
    """The dQ kernel's SEES_PAST_SK: where some row's last visible key is at or past Sk, the
    causal mask alone would keep the zero-padded keys of the last tile (their P overflows dS
    for a row of far-negative scores), so the tail mask joins it; elsewhere the build is the
    causal one without it."""
    q, k, v = _qkv(sq=sq, sk=sk, d=64)
    qg = q.detach().requires_grad_()
    torch.autograd.grad(FM._fmha(qg, k, v, True, offset, 0.125), qg, torch.randn_like(q))
    (dq,) = [a for n, _, a in stubbed_launch if n == "fmha_bwd_dq_kernel"]
    assert dq["SEES_PAST_SK"] is past and dq["CAUSAL"] is True
    stubbed_launch.clear()
    torch.autograd.grad(FM._fmha(qg, k, v, False, 0, 0.125), qg, torch.randn_like(q))
    (dq,) = [a for n, _, a in stubbed_launch if n == "fmha_bwd_dq_kernel"]
    assert dq["SEES_PAST_SK"] is False


def test_row_statistics_have_16_byte_rows(stubbed_launch):
    """LSE2 and delta rows padded to 16 bytes at Sq = 77: the backward loads their slices with
    TMA (an unaligned row is staged through shared memory, which racecheck reports)."""
    qg, kg, vg = (t.detach().requires_grad_() for t in _qkv(sq=77, sk=77))
    o = FM._fmha(qg, kg, vg, True, 0, 0.5)
    torch.autograd.grad(o, (qg, kg, vg), torch.randn_like(o))
    (_, _, f), (_, _, g), (_, _, h) = stubbed_launch
    for rows in (f["lse"], g["lse"], g["delta"], h["delta"]):
        assert rows.shape == (8, 77) and rows.stride() == (80, 1)


def test_host_launches_plain_call_and_tuner_space(stubbed_launch):
    """Without gradients one forward launch; the tuners' space is what the generators take
    (bucketed lengths, TD, causal)."""
    q, k, v = _qkv(sq=100, sk=333, d=64)
    o = FM._fmha(q, k, v, False, 0, 0.125)
    assert o.shape == q.shape and len(stubbed_launch) == 1
    name, grid, f = stubbed_launch[0]
    assert grid == (1, 1, 8) and (f["TM"], f["TD"], f["CAUSAL"]) == (128, 64, False)
    lse2 = FM._flat(torch.empty(2, 4, 100))
    cu = torch.zeros(1, dtype=torch.int32)
    inputs = (q, k, v, o, lse2, cu, cu, 0.125 * FM.LOG2E, 0, 64, False, None)
    assert FM._shape(*inputs) == dict(td=64, sq=128, sk=512, causal=False, packed=False)
    assert FM._pair_work(4.0)(*inputs).flops == 4.0 * 2 * 4 * 64 * 100 * 333


def test_host_launches_decode(stubbed_launch, monkeypatch):
    """Sq <= 16: the decode family. Its default splits the key range (B * Hkv = 4 CTAs alone
    would leave most SMs idle) into one 128-key tile per split, then combines the partials;
    the group's heads and query rows are packed into the CTA's rows (the transposed products:
    TG 2 x TQ 4 = 8). Cache lengths reach the kernel as USED; without them its stand-in array
    is never read."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **kw: empty(*a, **kw))
    q, k, v = _qkv(sq=3, sk=333, d=64)
    o = FM._fmha(q, k, v, True, 330, 0.125)
    assert o.shape == q.shape
    (n1, g1, f1), (n2, g2, f2) = stubbed_launch
    assert (n1, g1, n2, g2) == ("fmha_decode_kernel", (4, 4), "fmha_decode_combine_kernel",
                                (8, 1))
    assert (f2["TS"], f2["SP"], f2["TDC"]) == (4, 4, 64)    # Sq 3: 4 rows a head
    assert (f1["GROUP"], f1["TG"], f1["TQ"], f1["TS"], f1["TN"], f1["TD"]) == (2, 2, 4, 4, 128, 64)
    assert (f1["CAUSAL"], f1["USED"], f1["SPLIT"], f1["KEYS_M"]) == (True, False, True, True)
    assert f1["offset"] == 330
    # the partials hold each head's 4 rows (2 x 2 kv heads x 2 heads x 4 rows)
    assert f1["o_part"].shape == (4, 32, 64) and f1["lse_part"].shape == (4, 32)
    assert f2["o_part"] is f1["o_part"] and f2["o"] is f1["o"]
    assert (f2["GROUP"], f2["TG"]) == (2, 2) and "TQ" not in f2
    stubbed_launch.clear()
    used = torch.tensor([333, 7], dtype=torch.int32)
    FM._fmha(q, k, v, True, 330, 0.125, used)
    assert stubbed_launch[0][2]["used"] is used and stubbed_launch[0][2]["USED"] is True
    space = list(FM.decode_configs("sm_90", 64, 3, 512, kv_heads=4, causal=True, used=False,
                                   group=2))
    assert (space[0].tn, space[0].splits, space[0].occupancy) == (128, 4, 2)
    assert {c.kind for c in space} == {"split", "plain"}
    assert all(c.kind == "split" for c in
               FM.decode_configs("sm_90", 64, 3, 512, kv_heads=4, causal=True, used=True,
                                 group=2))
    # 1024 q heads: the combine's CTAs stride over them, 4 per SM of the 132
    stubbed_launch.clear()
    q, k, v = _qkv(B=32, hq=32, hkv=1, sq=1, sk=2048, d=128)
    FM._fmha(q, k, v, False, 0, 0.125)
    (n1, g1, _), (n2, g2, f2) = stubbed_launch
    assert n2 == "fmha_decode_combine_kernel" and g2 == (4 * 132, 128 // f2["TDC"])


def test_host_launches_under_torch_compile(stubbed_launch, monkeypatch):
    """The custom ops' schemas and fake functions: fullgraph forward and backward (aot_eager)
    launch what the eager call resolved (tracing with no GPU visible)."""
    q, k, v = _qkv(sq=64, sk=64, d=64)
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))

    def f(a, b, c):
        return FM._fmha(a, b, c, True, 0, 0.125)
    torch.autograd.grad(f(qg, kg, vg), (qg, kg, vg), torch.randn_like(q))   # resolves the keys
    eager = list(stubbed_launch)
    stubbed_launch.clear()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    o = torch.compile(f, backend="aot_eager", fullgraph=True)(qg, kg, vg)
    grads = torch.autograd.grad(o, (qg, kg, vg), torch.randn_like(o))
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert [(n, g) for n, g, _ in stubbed_launch] == [(n, g) for n, g, _ in eager]
    assert [n for n, _, _ in eager] == ["fmha_fwd_kernel", "fmha_bwd_dq_kernel",
                                        "fmha_bwd_dkdv_kernel"]


@pytest.mark.parametrize("arch", ["sm_90", "sm_100", "sm_80"])
def test_decode_space(arch):
    """At most MAX_CONFIGS, no repeats, splits within one key tile each and DECODE_MAX_CTAS in
    all, the plain forward's entry only without cache lengths; the default takes the fewest
    splits that reach 264 CTAs (as many as the key tiles allow). On sm_90, where a group's rows
    stay short of 64 (GQA 32/8, MHA, Sq 5 at group 4), the transposed products replace the
    row-major key tiles but (64, occupancy 2) and give the default; they are absent from MQA
    32/1's space."""
    for kv_heads, sk, used, (group, sq) in itertools.product(
            (1, 8, 256, 4096), (1, 64, 4096, 65536), (False, True),
            ((4, 1), (32, 1), (1, 1), (4, 5))):
        cfgs = list(FM.decode_configs(arch, 128, sq, sk, kv_heads=kv_heads, used=used,
                                      group=group))
        assert 1 <= len(cfgs) <= MAX_CONFIGS
        assert len({tuple(sorted(vars(c).items())) for c in cfgs}) == len(cfgs)
        split = [c for c in cfgs if c.kind == "split"]
        for c in split:
            if c.splits > 1:
                assert c.splits <= -(-sk // c.tn) and c.splits * kv_heads <= FM.DECODE_MAX_CTAS
        assert sum(c.kind == "plain" for c in cfgs) == (0 if used else 1)
        first = cfgs[0]
        offered = arch == "sm_90" and group != 32
        default = ("split", 128, 2, True) if offered else ("split", 64, 2, False)
        assert (first.kind, first.tn, first.occupancy, first.keys_m) == default
        tiles = -(-sk // first.tn)
        want = next((s for s in FM.DECODE_SPLITS if s * kv_heads >= 264), 64)
        allowed = [s for s in FM.DECODE_SPLITS
                   if s == 1 or (s <= tiles and s * kv_heads <= FM.DECODE_MAX_CTAS)]
        assert first.splits == max(s for s in allowed if s <= want)
        transposed = {(c.tn, c.occupancy) for c in split if c.keys_m}
        row_major = {(c.tn, c.occupancy) for c in split if not c.keys_m}
        if offered:
            assert transposed == set(FM.DECODE_KEYS_M_TILES) and row_major == {(64, 2)}
        else:
            assert not transposed and row_major == set(FM.DECODE_TILES)
        # the search times a split entry with its combine; the kernel alone is no measure
        assert all(FM._decode._timed_by_run(c) == (c.kind == "split" and c.splits > 1)
                   for c in cfgs)
    assert FM._decode._partly_timed is None
    assert FM.decode_rows(32, 1) == (32, 2) and FM.decode_rows(7, 3) == (8, 4)
    assert FM.decode_rows(1, 1) == (1, 16) and FM.decodes(32, 16, 128) is False
    assert FM.decode_rows(4, 1, keys_m=True) == (4, 2) and FM.decode_rows(1, 1, True) == (1, 8)
    assert FM.decode_rows(8, 1, keys_m=True) == (8, 1) and FM.decode_rows(8, 3, True) == (8, 4)
    # partials: TG x TS rows per kv head (Sq rounded up, not TQ); lse_part's rows padded to 4
    assert FM.partial_rows(15, 1, 1) == (15, 16) and FM.partial_rows(32, 32, 1) == (1024, 1024)
    assert FM.partial_rows(4, 7, 3) == (128, 128) and FM.partial_rows(3, 2, 1) == (6, 8)


def test_more_heads_than_the_grid_takes_are_refused_by_name():
    """The dense, packed and decode kernels' grids hold batch x query heads on an axis CUDA
    caps at 65535: past it, a ValueError before any launch instead of a launch error."""
    q = torch.zeros(1, 1, 1, 16).expand(2048, 32, 4, 16)           # 65536 rows, no memory
    kv = torch.zeros(1, 1, 1, 16).expand(2048, 8, 512, 16)
    for launch in (lambda: FM.launch_fwd(q, q, q, q, q, True, 0, 0.25),
                   lambda: FM.launch_bwd(q, q, q, q, q, q, q, q, q, q, True, 0, 0.25),
                   lambda: FM.launch_fwd(q[:1], q, q, q, q, True, 0, 0.25, (2048 * 32, 4, 4)),
                   lambda: FM.launch_decode(q[:, :, :1], kv, kv, None, q[:, :, :1], q[..., 0],
                                            False, 0, 0.25)):
        with pytest.raises(ValueError,
                           match=r"fmha: batch x query heads = \d+ x 32 = \d+ is more than"):
            launch()
    assert FM._key(q[:, :31], q, True, 0, 0, None)[0] == 63488        # fine


def test_the_public_functions_name_themselves_and_their_arguments_at_the_grid_limits(
        monkeypatch):
    monkeypatch.setattr(validate, "tensor", lambda op, name, t, **kw: t)
    q = torch.zeros(1, 1, 1, 16, dtype=torch.bfloat16).expand(2048, 32, 4, 16)
    for op, call in (("fmha", lambda: FM.fmha(q, q, q)),
                     ("scaled_dot_product_attention",
                      lambda: FM.scaled_dot_product_attention(q, q, q))):
        with pytest.raises(ValueError, match=rf"^{op}: batch x query heads = 2048 x 32 = 65536"):
            call()
    packed = torch.zeros(1, 1, 16, dtype=torch.bfloat16).expand(64, 32, 16)
    cu = torch.zeros(2049, dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^fmha_varlen: sequences x query heads = 2048 x 32"):
        FM.fmha_varlen(packed, packed, packed, cu, cu, 1, 1)
    for name, n, error in (("max_seqlen_q", FM.MAX_SEQ + 1, ValueError),
                           ("max_seqlen_k", -1, ValueError), ("max_seqlen_q", 2.0, TypeError),
                           ("max_seqlen_k", True, TypeError)):
        kw = {"max_seqlen_q": 1, "max_seqlen_k": 1, name: n}
        with pytest.raises(error, match=rf"^fmha_varlen: {name} must be"):
            FM.fmha_varlen(packed, packed, packed, cu[:2], cu[:2], **kw)
    for tiny_or_huge in (1e-300, 1e300, 10 ** 400):  # 0 or inf once in float32; past float's
        with pytest.raises(ValueError, match="scale must be a finite number > 0"):
            FM._check("fmha", q[:1], q[:1], q[:1], tiny_or_huge)
    assert FM._check_max("x", "n", np.int64(7)) == 7 and FM._check("x", q[:1], q[:1], q[:1],
                                                                     np.float32(0.5)) == 0.5


def test_varlen_takes_buffers_longer_than_their_sequences(stubbed_launch, monkeypatch):
    """As FlashAttention-2: a key/value buffer longer than the sequences (a preallocated cache)
    and a padded query buffer (static shapes) reach the kernels, which read the offsets on the
    device; a tensor max_seqlen is refused (reading it would sync the host)."""
    monkeypatch.setattr(validate, "tensor", lambda op, name, t, **kw: t)
    two = torch.tensor([0, 4, 10], dtype=torch.int32)
    q = torch.randn(16, 4, 16, dtype=torch.bfloat16)           # rows 10..15: padding
    kv = torch.randn(64, 2, 16, dtype=torch.bfloat16)          # a cache of 64 rows, 10 used
    o = FM.fmha_varlen(q, kv, kv, two, two, 6, 6)
    assert o.shape == q.shape and stubbed_launch
    with pytest.raises(TypeError, match=r"^fmha_varlen: max_seqlen_k must be a Python int, got "
                                        r"a tensor"):
        FM.fmha_varlen(q, kv, kv, two, two, 6, torch.tensor(6))


def test_longer_sequences_than_the_grid_takes_are_refused_by_name():
    """A head's tiles lie on a grid axis CUDA caps at 65535: with the spaces' smallest tile (32)
    that is 2,097,120 query or key tokens; past it a ValueError before any launch (dense and
    packed)."""
    assert FM.MAX_SEQ == 65535 * 32
    long = torch.zeros(1, 1, 1, 16).expand(1, 2, FM.MAX_SEQ + 1, 16)   # no memory
    short = long[:, :, :16]
    for launch in (lambda: FM.launch_fwd(short, long, long, short, short[..., 0], True, 0, 0.25),
                   lambda: FM.launch_fwd(long, short, short, long, long[..., 0], False, 0, 0.25),
                   lambda: FM.launch_fwd(short, short, short, short, short[..., 0], True, 0,
                                         0.25, (1, 16, FM.MAX_SEQ + 1))):
        with pytest.raises(ValueError, match=r"fmha: a sequence of 2097121 tokens is more than"):
            launch()
    assert FM._key(long[:, :, :FM.MAX_SEQ], short, False, 0, 0, None)[1] == FM.MAX_SEQ


def test_the_public_functions_refuse_longer_sequences_by_their_names(monkeypatch):
    """fmha and scaled_dot_product_attention refuse a sequence past MAX_SEQ before any launch,
    naming themselves and the argument: a decode-shaped call (Sq 1) with a longer cache too,
    which the forward's decode kernels would take and its backward could not."""
    monkeypatch.setattr(validate, "tensor", lambda op, name, t, **kw: t)
    long = torch.zeros(1, 1, 1, 16, dtype=torch.bfloat16).expand(1, 2, FM.MAX_SEQ + 1, 16)
    one = long[:, :, :1]
    for op, call, name in (
            ("fmha", lambda: FM.fmha(one, long, long), "k"),
            ("fmha", lambda: FM.fmha(long, one, one), "q"),
            ("scaled_dot_product_attention",
             lambda: FM.scaled_dot_product_attention(one, long, long), "key"),
            ("scaled_dot_product_attention",
             lambda: FM.scaled_dot_product_attention(long, long, long, is_causal=True),
             "query")):
        with pytest.raises(ValueError, match=rf"^{op}: {name} has 2097121 tokens, more than"):
            call()


def test_nested_tensors_are_refused_by_name(monkeypatch):
    """Nested (jagged) tensors, which torch's SDPA takes, in either layout ((B, j, H, D) and its
    (B, H, j, D) transpose) and as any argument: a TypeError naming the function and the
    argument (their ragged size failed the shape checks' arithmetic with "ge: relation is
    indeterminate" or an AttributeError, naming neither)."""
    monkeypatch.setattr(validate, "tensor", lambda op, name, t, **kw: t)

    def jagged(heads):
        return torch.nested.nested_tensor([torch.randn(5, heads, 64), torch.randn(7, heads, 64)],
                                          layout=torch.jagged, dtype=torch.bfloat16)
    q, kv = jagged(4), jagged(2)
    dense = torch.randn(2, 4, 6, 64, dtype=torch.bfloat16)
    for layout in (lambda t: t, lambda t: t.transpose(1, 2)):
        for which, (a, b) in (("q", (layout(q), layout(kv))), ("k", (dense, layout(kv))),
                              ("v", (dense, dense[:, :2]))):
            c = layout(kv) if which == "v" else b
            with pytest.raises(TypeError, match=rf"^fmha: {which} is a nested tensor"):
                FM.fmha(a, b, c)
            name = {"q": "query", "k": "key", "v": "value"}[which]
            with pytest.raises(TypeError, match=rf"^scaled_dot_product_attention: {name} is a "
                                                r"nested tensor"):
                FM.scaled_dot_product_attention(a, b, c, enable_gqa=True)


def test_seqused_k_refusal_counts_the_rows_the_decode_kernel_packs(monkeypatch):
    """At Sq 1 the decode kernel still packs two query rows per head (row-major products): 128
    q heads per kv head are 256 rows, past the limit of 128, and the message says so (it gave
    the rule as Sq x q heads per kv head, 1 x 128 = 128, which reads as within it)."""
    monkeypatch.setattr(validate, "tensor", lambda op, name, t, **kw: t)
    q = torch.zeros(1, 1, 1, 64, dtype=torch.bfloat16).expand(1, 128, 1, 64)
    kv = torch.zeros(1, 1, 8, 64, dtype=torch.bfloat16)
    used = torch.tensor([8], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^fmha: seqused_k takes decode shapes.*Sq to at least "
                                         r"2\); got Sq=1, head_dim=64, 128 q heads per kv head: "
                                         r"128 x 2 = 256 rows"):
        FM.fmha(q, kv, kv, seqused_k=used)
    assert not FM.decodes(128, 1, 64) and FM.decodes(64, 1, 64)


def test_seqused_k_takes_inputs_that_require_grad_in_inference_mode(stubbed_launch, monkeypatch):
    """torch.inference_mode() records no graph, even under enable_grad: there seqused_k takes q,
    k and v that require grad (the decode kernels run, nothing is saved), as torch's own ops
    do; where autograd records a graph it is still refused."""
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **kw: empty(*a, **kw))
    monkeypatch.setattr(validate, "tensor", lambda op, name, t, **kw: t)     # CPU tensors
    q, k, v = (t.requires_grad_() for t in _qkv(sq=3, sk=333, d=64))
    used = torch.tensor([333, 7], dtype=torch.int32)
    with torch.inference_mode(), torch.enable_grad():
        o = FM.fmha(q, k, v, causal=True, seqused_k=used)
    assert o.shape == q.shape and o.grad_fn is None and not o.requires_grad
    assert [n for n, _, _ in stubbed_launch] == ["fmha_decode_kernel",
                                                 "fmha_decode_combine_kernel"]
    assert stubbed_launch[0][2]["used"] is used
    with pytest.raises(ValueError, match=r"^fmha: seqused_k is for inference"):
        FM.fmha(q, k, v, causal=True, seqused_k=used)


def test_buffers_made_under_a_fake_tensor_mode_are_not_kept(monkeypatch):
    """A dense call traced under a fake-tensor mode (make_fx, a FakeTensorMode memory estimator)
    hands the kernels fake int32 offsets and a fake LSE stand-in; the next real call on that
    device gets real ones, not the fakes kept from the trace (which every later launch would
    take, training ones too)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    monkeypatch.setattr(FM, "_UNREAD", {})
    monkeypatch.setattr(FM, "_NO_LSE", type(FM._NO_LSE)(FM._NO_LSE._make))
    q = torch.empty(1, 4, 64, 16, dtype=torch.bfloat16)
    with FakeTensorMode() as mode:
        fq = mode.from_tensor(q)
        fakes = FM._unread(fq, 0), FM._lse_rows(None, fq, 0, 4, 64)
    assert all(type(t) is not torch.Tensor for t in fakes)
    unread, lse = FM._unread(q, 0), FM._lse_rows(None, q, 0, 4, 64)
    assert type(unread) is torch.Tensor and type(lse) is torch.Tensor
    assert FM._unread(q, 0) is unread and FM._lse_rows(None, q, 0, 4, 64) is lse


def test_fused_backward_entries_are_dense_d128_sm90_only():
    """The fused backward joins the dK/dV space where it was measured: sm_90, dense, D128."""
    fused = [c for c in FM.dkdv_configs("sm_90", 128, causal=True) if getattr(c, "fused", False)]
    assert [(c.tm, c.tn, c.occupancy, c.num_worker_warps) for c in fused] == [(64, 128, 1, 8)]
    for arch, td, packed in (("sm_90", 64, False), ("sm_90", 256, False), ("sm_90", 128, True),
                             ("sm_100", 128, False)):
        assert not any(getattr(c, "fused", False)
                       for c in FM.dkdv_configs(arch, td, causal=True, packed=packed))


@pytest.mark.parametrize("causal", [True, False])
def test_fused_backward_plan(stubbed_launch, monkeypatch, causal):
    """A fused dK/dV winner is the whole backward: prep (delta, the float32 dQ zeroed), the
    fused kernel adding into that dQ, the cast into dq; the dQ kernel never runs, on a key's
    first call or later. Without a causal mask the padded keys past Sk are masked."""
    fused = next(c for c in FM.dkdv_configs("sm_90", 128, causal=causal)
                 if getattr(c, "fused", False))
    monkeypatch.setattr(FM._dkdv, "configs", lambda *a, **kw: iter([fused]))
    qg, kg, vg = (t.detach().requires_grad_() for t in _qkv(sq=100, sk=100, d=128))
    for _ in range(2):
        stubbed_launch.clear()
        o = FM._fmha(qg, kg, vg, causal, 0, 0.5)
        do = torch.randn_like(o)
        dq, dk, dv = torch.autograd.grad(o, (qg, kg, vg), do)
        names = [n for n, _, _ in stubbed_launch]
        assert names == ["fmha_fwd_kernel", "fmha_bwd_prep_kernel", "fmha_bwd_dkdv_kernel",
                         "fmha_bwd_cast_kernel"]
        (_, pgrid, p), (_, fgrid, f), (_, cgrid, c) = stubbed_launch[1:]
        assert pgrid == cgrid == (2, 8)
        assert p["dq32"] is f["dq32"] is c["dq32"]
        assert p["dq32"].shape == qg.shape and p["dq32"].dtype == torch.float32
        assert p["delta"] is f["delta"] and p["o"].data_ptr() == o.data_ptr() and p["do"] is do
        assert c["dq"].data_ptr() == dq.data_ptr() and c["scale"] == 0.5
        assert f["dk"].data_ptr() == dk.data_ptr() and f["dv"].data_ptr() == dv.data_ptr()
        assert (f["TM"], f["TN"], f["CAUSAL"], f["PACKED"], f["ADD_DQ"], f["SEES_PAST_SK"]) \
            == (64, 128, causal, False, True, not causal)
        assert fgrid == FM._key_grid(fused, 0, qg, kg, causal, None)


def test_deterministic_algorithms_take_the_split_backward(stubbed_launch, monkeypatch):
    """Under torch.use_deterministic_algorithms the dK/dV key is a key of its own whose space
    leaves the fused entry out (its reduce-add into dQ sums in no fixed order): the backward
    runs the dQ kernel, then dK/dV without ADD_DQ, while the same shape outside that mode keeps
    its fused winner. Here the fused entry is put first, so it is the untuned winner."""
    def fused_first(*a, **kw):
        return iter(sorted(FM.dkdv_configs(*a, **kw), key=lambda c: not getattr(c, "fused", 0)))
    monkeypatch.setattr(FM._dkdv, "configs", fused_first)
    qg, kg, vg = (t.detach().requires_grad_() for t in _qkv(sq=100, sk=100, d=128))

    def backward_kernels():
        stubbed_launch.clear()
        o = FM._fmha(qg, kg, vg, True, 0, 0.5)
        torch.autograd.grad(o, (qg, kg, vg), torch.randn_like(o))
        return [(n, a.get("ADD_DQ")) for n, _, a in stubbed_launch[1:]]
    fused = [("fmha_bwd_prep_kernel", None), ("fmha_bwd_dkdv_kernel", True),
             ("fmha_bwd_cast_kernel", None)]
    split = [("fmha_bwd_dq_kernel", None), ("fmha_bwd_dkdv_kernel", False)]
    assert backward_kernels() == fused
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert backward_kernels() == split
        assert backward_kernels() == split          # the key's cached plan, second call
    finally:
        torch.use_deterministic_algorithms(was)
    assert backward_kernels() == fused
    keys = list(FM._dkdv.cache)
    assert len(keys) == 2 and sum("deterministic" in k for k in keys) == 1
    assert not any(getattr(c, "fused", False)
                   for c in FM.dkdv_configs("sm_90", 128, causal=True, deterministic=True))
