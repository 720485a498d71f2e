"""Chunked prefill: the same function as one pass, stoppable between chunks, on one process and on DTP ranks."""
import pytest
import torch

from laneplay.engine import SamplingParams, load_engine
from laneplay.engine.checkpoint import random_laneformer_tensors, tiny_laneformer_config, write_checkpoint
from laneplay.engine.model import kv_cache_bytes, request_kv_bytes
from laneplay.kernels import lowbit

PROMPT = list(range(3, 43))  # 40 tokens: several chunks, and past the sliding window (8)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    raw = tiny_laneformer_config(num_lanes=8, num_attention_heads=16, num_key_value_heads=8)
    return write_checkpoint(tmp_path_factory.mktemp("prefill"), raw, random_laneformer_tensors(raw, seed=3))


@pytest.mark.parametrize("chunk", [1, 3, 8, 13, 1000])
def test_chunked_prefill_is_the_same_function_as_one_pass(ckpt, chunk):
    eng = load_engine(ckpt)
    ids = torch.tensor([PROMPT])
    ref = eng.logits(ids)[:, -1]
    logits, cache = eng.model.prefill(ids, 2, 48, chunk=chunk)
    assert (logits - ref).abs().max() <= 1e-4 * ref.abs().max()
    # and the cache it leaves continues exactly like a full forward over prompt + next token
    nxt = torch.tensor([[7], [9]])
    step = eng.model.decode(nxt, len(PROMPT), cache)
    for b in range(2):
        full = eng.logits(torch.cat([ids, nxt[b:b + 1]], dim=1))[:, -1]
        assert (step[b] - full[0]).abs().max() <= 1e-4 * full.abs().max()


def _run(eng, prompt, **kw):
    reasons, tokens = {}, {}
    for ev in eng.generate(prompt, SamplingParams(**{"max_tokens": 6, **kw.pop("params", {})}), **kw):
        tokens.setdefault(ev.sample_index, []).extend(ev.token_ids)
        if ev.finish_reason:
            reasons[ev.sample_index] = ev.finish_reason
    return tokens, reasons


def test_generation_does_not_depend_on_the_chunk_size(ckpt):
    ref = _run(load_engine(ckpt, prefill_chunk=1000), PROMPT, params={"temperature": 0.9, "seed": 4, "n": 2})
    assert _run(load_engine(ckpt, prefill_chunk=5), PROMPT, params={"temperature": 0.9, "seed": 4, "n": 2}) == ref


def test_a_stop_between_chunks_ends_the_prefill_there(ckpt, monkeypatch):
    eng = load_engine(ckpt, prefill_chunk=8)
    chunks = []
    real = eng.model.hidden_states
    monkeypatch.setattr(eng.model, "hidden_states", lambda ids, *a, **k: chunks.append(ids.shape[1]) or real(ids, *a, **k))
    asked = []
    tokens, reasons = _run(eng, PROMPT, should_stop=lambda: asked.append(1) or len(asked) >= 2)
    assert chunks == [8, 8]  # two chunks ran, the other three never did
    assert reasons == {0: "cancelled"} and tokens == {0: []}
    assert eng.runner.cache is None  # nothing held after the request
    assert _run(eng, PROMPT)[1] == {0: "length"}  # and the engine serves the next one


@pytest.mark.slow
def test_dtp_ranks_chunk_and_stop_together(ckpt):
    single = _run(load_engine(ckpt), PROMPT)
    eng = load_engine(ckpt, world_size=2, prefill_chunk=6, timeout_s=30)
    try:
        assert _run(eng, PROMPT) == single
        # The front passes the stop on at once; rank 0 sees it at the first chunk boundary and every
        # rank leaves the prefill there (a collective agrees on it).
        tokens, reasons = _run(eng, PROMPT, should_stop=lambda: True)
        assert reasons == {0: "cancelled"} and tokens == {0: []}
        assert _run(eng, PROMPT) == single  # every rank left the prefill at the same chunk
    finally:
        eng.close()


@pytest.mark.parametrize("dtype,kv", [("float32", torch.float32), ("int4", torch.float16)])
def test_kv_bytes_match_what_the_cache_allocates(ckpt, dtype, kv):
    """The low-bit paths keep their KV cache in float16; the budget counts what the cache holds."""
    if dtype == "int4" and not lowbit.available():
        pytest.skip("the low-bit kernels are not built here")
    eng = load_engine(ckpt, dtype=dtype)
    assert eng.runtime.kv_dtype == eng.model.kv_dtype == kv
    size = kv.itemsize
    for batch, length in ((1, 5), (3, 40), (2, 128)):
        cache = eng.model.new_cache(batch, length)
        assert all(t.dtype == kv for t in cache.k + cache.v)
        real = sum(t.numel() * t.element_size() for t in cache.k + cache.v)
        assert kv_cache_bytes(eng.cfg, eng.cfg.num_lanes, batch, length, size) == real
    one = kv_cache_bytes(eng.cfg, eng.cfg.num_lanes, 1, 64, size)
    assert request_kv_bytes(eng.cfg, 1, 64, size) == one and request_kv_bytes(eng.cfg, 4, 64, size) == 5 * one


def test_the_kv_budget_refuses_before_any_work(ckpt, monkeypatch):
    one = request_kv_bytes(load_engine(ckpt).cfg, 1, len(PROMPT) + 6, 4)
    eng = load_engine(ckpt, kv_budget_gb=3 * one / 2**30)
    monkeypatch.setattr(eng.runner, "prefill", lambda *a, **k: pytest.fail("allocated past the budget"))
    with pytest.raises(ValueError, match=r"KV budget .*at this length at most n=2"):
        eng.generate(PROMPT, SamplingParams(max_tokens=6, n=3, temperature=1.0))
    monkeypatch.undo()
    assert _run(eng, PROMPT, params={"n": 2, "temperature": 1.0, "seed": 1})[1] == {0: "length", 1: "length"}
