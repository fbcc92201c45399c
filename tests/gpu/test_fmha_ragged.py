"""FMHA with ragged key lengths on the GPU: the decode path (Sq <= 16, split-KV) with and without
per-batch cache lengths (`fmha(..., seqused_k=)`), and packed variable-length batches
(`fmha_varlen`, FlashAttention-2's varlen layout), against test_fmha's float64 reference of masked
softmax attention run per batch / per sequence on random data. Outputs come from an allocator
filled with NaN (poison_allocator), so anything left unwritten fails the finiteness check;
tolerances are test_fmha's, per row over D (test_fmha.assert_close)."""
import pytest
import torch

import tiletune
from tiletune.autotune import bucket
from tiletune.ops import fmha as FM

from .conftest import disable_autotune, each_config, poison_allocator, tuned_or_disabled
from .test_fmha import (TOL, assert_close, check, check_grads, expected_grads, make, reference,
                        rel)


def fmha_tuners():
    """Every fmha tuner created so far (the dense ones, the decode and the varlen ones)."""
    return [t for name, t in tiletune.tuners().items() if name.startswith("fmha")]


def searches():
    return sum(t.searches for t in fmha_tuners())


def expect_searches(disable):
    """DISABLE_AUTOTUNE: no search at all; tuned: at least one, every record from a search."""
    if disable:
        assert searches() == 0
    else:
        assert searches() >= 1
        assert all(r.source == "search" for t in fmha_tuners() for r in t.records.values())


def scale_of(q, scale):
    return q.shape[-1] ** -0.5 if scale is None else scale


# ---------------------------------------------------------------------------------------------
# Decode (Sq <= 16) and seqused_k.

def lens_tensor(lens):
    return torch.tensor(lens, dtype=torch.int32, device="cuda")


def cache_reference(q, k, v, causal, lens, scale):
    """Batch b attends to keys [0, lens[b]) of its cache, causal bottom-right within them
    (offset lens[b] - Sq); an empty cache gives zeros."""
    sq = q.shape[2]
    out = torch.zeros(q.shape, dtype=torch.float64, device=q.device)
    for b, n in enumerate(lens):
        if n > 0:
            out[b] = reference(q[b:b + 1], k[b:b + 1, :, :n], v[b:b + 1, :, :n], causal, n - sq,
                               scale)[0]
    return out


def check_decode(q, k, v, causal, lens=None, scale=None):
    """Forward only: fmha(seqused_k=lens) against cache_reference; rows that see no key (an
    empty cache, or causal with lens[b] < Sq) must be exactly 0."""
    B, _, sq, _ = q.shape
    sk = k.shape[2]
    used = None if lens is None else lens_tensor(lens)
    poison_allocator(torch)
    o = FM.fmha(q, k, v, causal=causal, scale=scale, seqused_k=used)
    assert o.shape == q.shape and o.dtype == q.dtype
    eff = [sk] * B if lens is None else [min(max(n, 0), sk) for n in lens]
    ref = cache_reference(q, k, v, causal, eff, scale_of(q, scale))
    assert_close(o, ref, TOL[q.dtype], "o")   # per row: one split of 16 missing reads 0.2-0.4
    for b, n in enumerate(eff):
        dead = sq if n == 0 else (min(max(sq - n, 0), sq) if causal else 0)
        assert (o[b, :, :dead] == 0).all(), f"batch {b}: rows that see no key must be 0"
    return o


DECODE_CASES = [  # B, Hq, Hkv, Sq, Sk, D, causal, dtype
    # (a) one query row: GQA 32/8, MQA 8/1, MHA 8/8
    (2, 32, 8, 1, 1, 128, False, torch.bfloat16),
    (2, 32, 8, 1, 77, 128, True, torch.float16),
    (1, 32, 8, 1, 1000, 64, False, torch.bfloat16),
    (2, 32, 8, 1, 4097, 128, True, torch.bfloat16),
    (3, 8, 1, 1, 4097, 64, False, torch.float16),
    (2, 8, 1, 1, 77, 128, False, torch.bfloat16),
    (1, 8, 1, 1, 1000, 128, True, torch.float16),
    (2, 8, 8, 1, 1000, 128, True, torch.bfloat16),
    (1, 8, 8, 1, 4097, 64, True, torch.float16),
    (4, 8, 8, 1, 1, 64, True, torch.bfloat16),
    (2, 8, 8, 1, 77, 64, False, torch.float16),
    (32, 32, 1, 1, 1000, 128, False, torch.bfloat16),    # 1024 heads: combine CTAs loop
    # (b) a few query rows, causal bottom-right and not
    (2, 8, 2, 2, 333, 128, False, torch.bfloat16),
    (2, 8, 2, 2, 333, 128, True, torch.bfloat16),
    (1, 16, 4, 5, 1000, 64, False, torch.float16),
    (1, 16, 4, 5, 1000, 64, True, torch.float16),
    (2, 4, 4, 16, 4097, 128, False, torch.bfloat16),
    (2, 4, 4, 16, 4097, 128, True, torch.bfloat16),
    (1, 8, 2, 16, 5, 64, True, torch.float16),            # Sk < Sq: rows 0..10 see no key
    (1, 8, 8, 5, 77, 80, True, torch.bfloat16),           # D 80 (zero-padded to 128)
    (1, 32, 8, 8, 8192, 96, False, torch.bfloat16),       # D 96, long cache: split, combine
]
DECODE_TUNED = {(2, 32, 8, 1, 4097, 128, True, torch.bfloat16),
                (2, 4, 4, 16, 4097, 128, True, torch.bfloat16)}


@pytest.mark.parametrize("case", DECODE_CASES, ids=str)
@pytest.mark.parametrize("disable", [False, True], ids=["tuned", "DISABLE_AUTOTUNE"])
def test_decode_forward(fresh, monkeypatch, case, disable):
    """(a), (b), (f): without seqused_k the decode path computes what fmha computes for Sq > 16
    (the dense reference, causal bottom-right)."""
    tuned_or_disabled(monkeypatch, disable, case, DECODE_TUNED)
    B, hq, hkv, sq, sk, d, causal, dt = case
    q, k, v = make(B, hq, hkv, sq, sk, d, dt, hf_layout=(sq + sk) % 2 == 0)
    o = check_decode(q, k, v, causal)
    if sq > 1:
        assert o.stride() == q.stride()         # laid out like q (HF views stay views)
    expect_searches(disable)
    if not disable:                             # the winner is cached: same key, no search
        n = searches()
        check_decode(q, k, v, causal)
        assert searches() == n


# Every config of the decode space (split kernels of every tile and split count, the plain
# forward), not only the searches' winners, on caches long enough that a split loops over many
# key tiles; with seqused_k, the space for cache lengths (no plain entry). MHA at B3 H5: 15
# partial rows a split (lse_part's rows padded to 16).
DECODE_EVERY = [(2, 32, 8, 1, 8193, 128, True, torch.bfloat16, None),
                (3, 8, 1, 1, 4097, 64, False, torch.float16, None),
                (3, 5, 5, 1, 2000, 128, True, torch.bfloat16, None),
                (2, 16, 4, 5, 3000, 128, True, torch.bfloat16, [2999, 1234])]


@pytest.mark.slow
@pytest.mark.parametrize("case", DECODE_EVERY, ids=str)
def test_decode_every_config_is_correct(fresh, monkeypatch, case):
    B, hq, hkv, sq, sk, d, causal, dt, lens = case
    q, k, v = make(B, hq, hkv, sq, sk, d, dt)
    space = list(FM.decode_configs("sm_90", FM.head_tile(d), sq, sk, kv_heads=B * hkv,
                                   causal=causal, used=lens is not None, group=hq // hkv))
    assert {c.kind for c in space} == ({"split"} if lens else {"split", "plain"})
    assert any(c.splits == 1 for c in space) and any(c.splits >= 16 for c in space)
    for cfg in each_config(monkeypatch, FM._decode, space):
        check_decode(q, k, v, causal, lens)
        assert [c for c, _ in FM._decode.cache.values()] == [cfg], vars(cfg)


@pytest.mark.parametrize("sq", [1, 7])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("tail", ["random", "nan_inf"])
def test_seqused_k_ragged(fresh, monkeypatch, sq, causal, tail):
    """(c) B=5 caches of 600 slots holding 600, 1, 0, 333 and 64 keys; the empty cache's rows are
    exactly 0; with tail="nan_inf" the slots past each cache's length hold NaN (k) and inf (v),
    which must not reach the output."""
    disable_autotune(monkeypatch)
    lens = [600, 1, 0, 333, 64]
    q, k, v = make(5, 8, 2, sq, 600, 128, torch.bfloat16)
    if tail == "nan_inf":
        for b, n in enumerate(lens):
            k[b, :, n:] = float("nan")
            v[b, :, n:] = float("inf")
    o = check_decode(q, k, v, causal, lens)
    assert (o[2] == 0).all()


@pytest.mark.parametrize("dt", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("disable", [False, True], ids=["tuned", "DISABLE_AUTOTUNE"])
def test_seqused_k_group_of_7(fresh, monkeypatch, dt, causal, disable):
    """(d) Qwen2-7B's decode: 28 query heads over 4 kv heads (a group of 7, not a power of two),
    D 128, one query row, ragged caches (garbage past their lengths)."""
    if disable:
        disable_autotune(monkeypatch)
    elif not (causal and dt == torch.bfloat16):
        pytest.skip("tuned for one case only")
    lens = [1000, 517, 1]
    q, k, v = make(3, 28, 4, 1, 1000, 128, dt)
    for b, n in enumerate(lens):
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("nan")
    check_decode(q, k, v, causal, lens)
    expect_searches(disable)


def test_seqused_k_full_and_clamped(fresh, monkeypatch):
    """seqused_k = Sk everywhere is the plain call; values outside [0, Sk] are clamped (-5 -> 0,
    10**6 -> Sk)."""
    disable_autotune(monkeypatch)
    q, k, v = make(3, 8, 2, 3, 50, 64, torch.float16)
    plain = check_decode(q, k, v, True)
    full = check_decode(q, k, v, True, [50, 50, 50])
    assert_close(full, plain, TOL[torch.float16], "o")
    o = check_decode(q, k, v, True, [-5, 10**6, 3])
    assert (o[0] == 0).all()


def test_seqused_k_bad_input(fresh, monkeypatch):
    """(e) seqused_k is forward only, int32, (B,), on q's device."""
    disable_autotune(monkeypatch)
    q, k, v = make(2, 8, 2, 1, 64, 64, torch.bfloat16)
    used = lens_tensor([64, 10])
    for grad in ("q", "k", "v"):
        args = {"q": q, "k": k, "v": v}
        args[grad] = args[grad].detach().requires_grad_()
        with pytest.raises(ValueError) as e:
            FM.fmha(args["q"], args["k"], args["v"], seqused_k=used)
        assert "fmha" in str(e.value) and "seqused_k" in str(e.value), str(e.value)
    with pytest.raises(TypeError, match="seqused_k"):
        FM.fmha(q, k, v, seqused_k=used.long())
    with pytest.raises(TypeError, match="seqused_k"):
        FM.fmha(q, k, v, seqused_k=used.float())
    with pytest.raises(ValueError, match="seqused_k"):
        FM.fmha(q, k, v, seqused_k=lens_tensor([64, 10, 5]))
    with pytest.raises(ValueError, match="seqused_k"):
        FM.fmha(q, k, v, seqused_k=lens_tensor([[64, 10]]))
    with pytest.raises((TypeError, ValueError), match="seqused_k"):
        FM.fmha(q, k, v, seqused_k=used.cpu())
    if torch.cuda.device_count() > 1:
        with pytest.raises((TypeError, ValueError), match="seqused_k"):
            FM.fmha(q, k, v, seqused_k=used.to("cuda:1"))
    # grad mode off: inputs that require grad are fine
    with torch.no_grad():
        qg = q.detach().requires_grad_()
        poison_allocator(torch)
        o = FM.fmha(qg, k, v, seqused_k=used)
    ref = cache_reference(q, k, v, False, [64, 10], 64 ** -0.5)
    assert_close(o, ref, TOL[torch.bfloat16], "o")


@pytest.mark.parametrize("disable", [False, True], ids=["tuned", "DISABLE_AUTOTUNE"])
def test_decode_backward(fresh, monkeypatch, disable):
    """Few query rows without seqused_k stay differentiable: dq, dk, dv against the reference's
    autograd (GQA 8/2, causal bottom-right), whichever forward path the search picks."""
    if disable:
        disable_autotune(monkeypatch)
    q, k, v = make(2, 8, 2, 4, 300, 128, torch.bfloat16)
    check(q, k, v, True)
    if disable:                                  # (tuned: one key; each search costs ~20 s)
        q, k, v = make(1, 8, 2, 1, 77, 64, torch.float16, seed=1)
        check(q, k, v, False)
    expect_searches(disable)


@pytest.mark.parametrize("case", [
    (2, 4, 2, 1, 1000, 256, True, torch.bfloat16),      # D 256: past the decode kernel's 128
    (1, 8, 2, 3, 333, 256, False, torch.float16),
    (1, 64, 1, 4, 1000, 128, True, torch.bfloat16),     # 64 heads x 4 rows a kv head
    (2, 48, 1, 3, 500, 64, False, torch.float16),       # group of 48: 64 x 4 rows padded
], ids=str)
def test_short_queries_the_decode_kernel_does_not_take(fresh, monkeypatch, case):
    """Sq <= 16 with a head dim over 128 or more than DECODE_MAX_ROWS query rows a kv head
    runs the dense kernels, forward and backward, and computes the same attention."""
    B, hq, hkv, sq, sk, d, causal, dt = case
    assert not FM.decodes(hq // hkv, sq, FM.head_tile(d))
    disable_autotune(monkeypatch)
    q, k, v = make(B, hq, hkv, sq, sk, d, dt, hf_layout=sq % 2 == 1)
    check(q, k, v, causal)
    assert not FM._decode.cache and FM._fwd.cache and FM._dq.cache and FM._dkdv.cache


def test_decode_example_pair_runs_and_agrees():
    """assets/examples/07: same result; the tuned split-KV step is not slower than the unsplit
    one (5% timing slack); its graph, replayed after the cache grew by a token, matches SDPA."""
    from .conftest import assert_pair_agrees, run_example_pair
    fixed, tuned = run_example_pair("07_decode_kv_cache")
    assert_pair_agrees(fixed, tuned)
    assert float(tuned["us"]) <= float(fixed["us"]) * 1.05, (fixed, tuned)
    assert float(tuned["next_token_max_err"]) < 2e-2


# ---------------------------------------------------------------------------------------------
# fmha_varlen: packed sequences.

def cu_seqlens(lengths):
    c = [0]
    for n in lengths:
        c.append(c[-1] + n)
    return torch.tensor(c, dtype=torch.int32, device="cuda")


def packed(lq, lk, hq, hkv, d, dt, seed=0):
    """Random q (sum(lq), Hq, D), k and v (sum(lk), Hkv, D)."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def t(n, h):
        return torch.randn(n, h, d, device="cuda", dtype=dt, generator=g)
    return t(sum(lq), hq), t(sum(lk), hkv), t(sum(lk), hkv)


def varlen_reference(q, k, v, lq, lk, causal, scale, lse=False):
    """test_fmha's reference per sequence (causal offset Lk - Lq); a sequence with no keys gives
    zeros (kept in q's graph so autograd sees every sequence). lse: also the rows' log-sum-exp
    (Tq, Hq), for test_fmha.expected_grads."""
    outs, lses, a, c = [], [], 0, 0
    for nq, nk in zip(lq, lk):
        qs, ks, vs = q[a:a + nq], k[c:c + nk], v[c:c + nk]
        a, c = a + nq, c + nk
        if nq == 0:
            continue
        if nk == 0:
            outs.append(qs.double() * 0)
            lses.append(qs.double().sum(-1) * 0)
            continue
        r, l = reference(qs.transpose(0, 1)[None], ks.transpose(0, 1)[None],
                         vs.transpose(0, 1)[None], causal, nk - nq, scale, lse=True)
        outs.append(r[0].transpose(0, 1))
        lses.append(l[0].transpose(0, 1))
    out = torch.cat(outs) if outs else q.double() * 0
    if lse:
        return out, (torch.cat(lses) if lses else q.double().sum(-1) * 0)
    return out


def dead_rows(lq, lk, causal):
    """Bool (Tq,): query rows that see no key (empty key sequence; causal with i < Lq - Lk)."""
    m = []
    for nq, nk in zip(lq, lk):
        dead = nq if nk == 0 else (min(max(nq - nk, 0), nq) if causal else 0)
        m += [True] * dead + [False] * (nq - dead)
    return torch.tensor(m, dtype=torch.bool, device="cuda")


def check_varlen(lq, lk, hq, hkv, d, dt, causal, scale=None, slack=0, backward=True, seed=0):
    """Forward (and dq/dk/dv of a random dO) of fmha_varlen against varlen_reference; rows that
    see no key must be exactly 0 with zero dq. slack: added to both max_seqlen (an upper bound is
    allowed)."""
    q, k, v = packed(lq, lk, hq, hkv, d, dt, seed)
    cq, ck = cu_seqlens(lq), cu_seqlens(lk)
    sc = d ** -0.5 if scale is None else scale
    qg, kg, vg = (t.detach().requires_grad_(backward) for t in (q, k, v))
    poison_allocator(torch)
    o = FM.fmha_varlen(qg, kg, vg, cq, ck, max(lq) + slack, max(lk) + slack, causal=causal,
                       scale=scale)
    assert o.shape == q.shape and o.dtype == dt
    q64, k64, v64 = (t.detach().double().requires_grad_(backward) for t in (q, k, v))
    ref, lse = varlen_reference(q64, k64, v64, lq, lk, causal, sc, lse=True)
    assert_close(o, ref, TOL[dt], "o")
    dead = dead_rows(lq, lk, causal)
    assert (o[dead] == 0).all(), "rows that see no key must be 0"
    if not backward:
        return
    grads = check_grads(o, ref, lse, (qg, kg, vg), (q64, k64, v64))
    assert (grads[0][dead] == 0).all(), "rows that see no key must get zero dq"


LENGTHS = [100, 0, 1, 513, 64]       # an empty sequence, a single token, one long among short
VARLEN_CASES = [  # Hq, Hkv, D, causal, dtype
    (8, 2, 128, True, torch.bfloat16),
    (8, 2, 64, False, torch.float16),
    (4, 4, 128, False, torch.bfloat16),
    (4, 4, 64, True, torch.float16),
    (8, 2, 64, True, torch.bfloat16),
    (4, 4, 128, True, torch.float16),
]
VARLEN_TUNED = {(8, 2, 128, True, torch.bfloat16)}


@pytest.mark.parametrize("case", VARLEN_CASES, ids=str)
@pytest.mark.parametrize("disable", [False, True], ids=["tuned", "DISABLE_AUTOTUNE"])
def test_varlen_same_lengths(fresh, monkeypatch, case, disable):
    """(a), (d), (e): lengths_q = lengths_k = [100, 0, 1, 513, 64], forward and backward."""
    tuned_or_disabled(monkeypatch, disable, case, VARLEN_TUNED)
    hq, hkv, d, causal, dt = case
    check_varlen(LENGTHS, LENGTHS, hq, hkv, d, dt, causal)
    expect_searches(disable)
    if not disable:                              # the winners are cached: no further search
        n = searches()
        check_varlen(LENGTHS, LENGTHS, hq, hkv, d, dt, causal, seed=1)
        assert searches() == n


@pytest.mark.parametrize("lq,lk", [([5, 300, 17], [50, 300, 1000]),
                                   ([40, 3, 7], [10, 0, 7])],   # causal: rows see no key
                         ids=["q_shorter", "no_keys"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_ragged_q_and_k(fresh, monkeypatch, lq, lk, causal):
    """(b), (d): per-sequence Lq != Lk (bottom-right per sequence), forward and backward; the
    second case has a sequence with no keys and (causal) a sequence with Lq > Lk."""
    disable_autotune(monkeypatch)
    check_varlen(lq, lk, 8, 2, 128, torch.bfloat16, causal)


@pytest.mark.parametrize("order", ["long_first", "long_last"])
def test_varlen_one_long_many_short(fresh, monkeypatch, order):
    """(c) one 2000-token sequence among thirty of 3 tokens (GQA 4/1, causal)."""
    disable_autotune(monkeypatch)
    lengths = [2000] + [3] * 30 if order == "long_first" else [3] * 30 + [2000]
    check_varlen(lengths, lengths, 4, 1, 128, torch.bfloat16, True)


def test_varlen_loose_max_seqlen_and_scale(fresh, monkeypatch):
    """max_seqlen_q/k only bound the lengths: larger ones give the same result; scale applies."""
    disable_autotune(monkeypatch)
    check_varlen([33, 7, 90], [33, 70, 9], 6, 3, 64, torch.float16, True, scale=0.3, slack=37)


class _RawBytes:
    """`n` bytes of device memory at `address`, for torch.as_tensor (CUDA array interface)."""

    def __init__(self, address, n):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1",
                                         "data": (address, False), "version": 3}


def free_bytes_after(t, n):
    """The first `n` bytes (at most) of the free allocator block right after t's block, read
    as uint8; fails if another block follows t (the check would then read live data)."""
    ptr = t.untyped_storage().data_ptr()
    for seg in torch.cuda.memory_snapshot():
        address = seg["address"]
        if not address <= ptr < address + seg["total_size"]:
            continue
        for block, following in zip(seg["blocks"], seg["blocks"][1:] + [None]):
            if address == ptr:
                assert following is not None and following["state"] == "inactive", \
                    "no free block after the tensor"
                return torch.as_tensor(_RawBytes(address + block["size"],
                                                 min(n, following["size"])), device="cuda")
            address += block["size"]
    raise AssertionError("tensor not found in the allocator's snapshot")


@pytest.mark.parametrize("cu", [[0, 200, 360], [-40, 200, 300]], ids=["past_end", "below_0"])
@pytest.mark.parametrize("causal", [False, True])
def test_varlen_offsets_outside_the_batch_write_nothing_outside(fresh, monkeypatch, cu, causal):
    """Offsets below 0 or past T (which the host does not read) clamp each sequence's span to
    the batch: the kernels write nothing past o, dq, dk or dv, and the sequence inside the batch
    is exact. The outputs come from a private memory pool whose one segment was filled with
    0xFF first, so o sits at its start and dq, dk, dv follow it: the free bytes after o and
    after dv must stay 0xFF. (The forward and backward are called on this thread, where the
    pool serves them; autograd would run the backward on its device thread.)"""
    disable_autotune(monkeypatch)
    hq, hkv, d, dt, T = 16, 16, 128, torch.bfloat16, 300
    q, k, v = packed([T], [T], hq, hkv, d, dt)
    do = torch.randn_like(q)
    offsets = torch.tensor(cu, dtype=torch.int32, device="cuda")
    scale = d ** -0.5
    overflow = 60 * hq * d * q.element_size()           # 60 rows past the end
    pool = torch.cuda.MemPool()
    with torch.cuda.use_mem_pool(pool):
        poison = torch.full(((64 << 20) // 4,), -1, dtype=torch.int32, device="cuda")
        del poison
        # 240: at least every span's length
        o, lse = FM._varlen_forward(q, k, v, offsets, offsets, 240, 240, causal, scale)
        torch.cuda.synchronize()
        assert (free_bytes_after(o, overflow) == 255).all(), "o: written past its end"
        dq, dk, dv = FM._varlen_backward(do, q, k, v, offsets, offsets, o, lse, 240, 240,
                                         causal, scale)
        torch.cuda.synchronize()
        assert (free_bytes_after(dv, overflow) == 255).all(), "dv: written past its end"
    # sequence 0 is rows [0, 200) either way (-40 clamps to 0): against the reference
    q64, k64, v64 = (t[:200].double().requires_grad_() for t in (q, k, v))
    ref, ref_lse = varlen_reference(q64, k64, v64, [200], [200], causal, scale, lse=True)
    assert_close(o[:200], ref, TOL[dt], "o")
    exact, given_o = expected_grads(o[:200], do[:200], ref, ref_lse, (q64, k64, v64))
    for name, got, exp, exp_o in zip("qkv", (dq, dk, dv), exact, given_o):
        assert rel(got[:200], exp) < TOL[dt], f"d{name}"
        assert_close(got[:200], exp_o, TOL[dt], f"d{name}")
    del o, lse, dq, dk, dv, pool                 # the pool's tensors before the pool


def test_varlen_bad_input():
    """(f)"""
    lq = [5, 7]
    q, k, v = packed(lq, lq, 4, 2, 64, torch.bfloat16)
    cu = cu_seqlens(lq)
    with pytest.raises(TypeError, match="cu_seqlens_q"):
        FM.fmha_varlen(q, k, v, cu.long(), cu, 7, 7)
    with pytest.raises(TypeError, match="cu_seqlens_k"):
        FM.fmha_varlen(q, k, v, cu, cu.long(), 7, 7)
    with pytest.raises(ValueError):
        FM.fmha_varlen(q[None], k, v, cu, cu, 7, 7)
    with pytest.raises(ValueError, match="max_seqlen_q"):
        FM.fmha_varlen(q, k, v, cu, cu, -1, 7)


# ---------------------------------------------------------------------------------------------
# Every config of the packed spaces, an explicit scale in decode, mostly empty caches.

VARLEN_EVERY = [([2000] + [3] * 30, 4, 1),      # one long among many short, MQA
                (LENGTHS, 8, 2)]                # an empty sequence, a single token, GQA


@pytest.mark.slow
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lengths,hq,hkv", VARLEN_EVERY, ids=["long_and_short", "with_empty"])
@pytest.mark.parametrize("tuner", ["fmha_fwd", "fmha_bwd_dq", "fmha_bwd_dkdv"])
def test_varlen_every_config_is_correct(fresh, monkeypatch, tuner, lengths, hq, hkv, causal):
    """Each sm_90 config of one kernel's packed space (the other two on their defaults), not
    only the ones searches picked, forward and backward; packed keys offer no pair kernel."""
    t = next(x for x in FM.TUNERS if x.name == tuner)
    d, m = 128, max(lengths)
    space = list(t.configs("sm_90", FM.head_tile(d), m, m, causal=causal, packed=True))
    assert not any(getattr(c, "pair", False) for c in space)
    for cfg in each_config(monkeypatch, t, space):
        check_varlen(lengths, lengths, hq, hkv, d, torch.bfloat16, causal)
        assert [c for c, _ in t.cache.values()] == [cfg], vars(cfg)


@pytest.mark.parametrize("sq", [1, 5])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("lens", [None, [333, 120, 0]], ids=["full", "seqused_k"])
def test_decode_scale(fresh, monkeypatch, sq, causal, lens):
    """An explicit scale (0.3, not D ** -0.5) reaches the decode kernels, with and without
    cache lengths."""
    disable_autotune(monkeypatch)
    q, k, v = make(3, 8, 2, sq, 333, 128, torch.bfloat16)
    check_decode(q, k, v, causal, lens, scale=0.3)


@pytest.mark.slow
@pytest.mark.parametrize("sq,causal", [(1, False), (5, True)])
def test_decode_every_config_mostly_empty_caches(fresh, monkeypatch, sq, causal):
    """Every config of the decode space for cache lengths (Sk and B x Hkv bucketed, as the tuner
    asks for it: up to 16 splits, most of them without a key in the short caches) on caches of
    600 slots holding 600, 1, 0, 333 and 64 keys, NaN keys and inf values past each length."""
    lens = [600, 1, 0, 333, 64]
    B, hq, hkv, sk, d = 5, 8, 2, 600, 128
    q, k, v = make(B, hq, hkv, sq, sk, d, torch.bfloat16)
    for b, n in enumerate(lens):
        k[b, :, n:] = float("nan")
        v[b, :, n:] = float("inf")
    space = list(FM.decode_configs("sm_90", FM.head_tile(d), sq, bucket(sk),
                                   kv_heads=bucket(B * hkv), causal=causal, used=True,
                                   group=hq // hkv))
    assert {c.kind for c in space} == {"split"} and any(c.splits >= 16 for c in space)
    for cfg in each_config(monkeypatch, FM._decode, space):
        o = check_decode(q, k, v, causal, lens)
        assert (o[2] == 0).all()
        assert [c for c, _ in FM._decode.cache.values()] == [cfg], vars(cfg)
