"""`python -m tiletune tune --generate` (pretune.run with generate) on a small transformers model:
after it, generating that many tokens with transformers' `generate` searches nothing, while
generating past them does (so generation does reach the tuned decode kernels)."""
import pytest
import torch

pytest.importorskip("transformers")

from tiletune import autotune, pretune  # noqa: E402
from tiletune.suites import hf  # noqa: E402

SPEC = pretune.ModelSpec("llama", 256, 512, 4, 2, 64)
BATCH, PROMPT, NEW = 2, 100, 200


def searches():
    return sum(t.searches for t in autotune.tuners().values())


def generate(new_tokens):
    model = hf.build_model(SPEC, PROMPT + new_tokens, torch.bfloat16)
    ids = torch.randint(0, hf.VOCAB, (BATCH, PROMPT), device="cuda")
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                         min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    assert out.shape == (BATCH, PROMPT + new_tokens)


def test_tune_generate_leaves_generation_nothing_to_search(fresh):
    report = pretune.run([SPEC], [PROMPT], [BATCH], torch.bfloat16, backward=False,
                         out=lambda line: None, generate=NEW)
    decode = [r.key for r in report.records if r.op == "fmha_decode"]
    # cache lengths 101-300: the tuning keys' buckets 128, 256 and 512, one search each
    assert sorted(key[2] for key in decode) == [128, 256, 512], decode
    before = searches()
    generate(NEW)
    assert searches() == before
    generate(2 * NEW + PROMPT)           # cache lengths past 512: a new bucket is searched
    assert searches() > before
