"""Log-probabilities through the OpenAI API: the official client's view, the values against the independent
naive reference, the token texts against the answer (split characters, stop strings), and the DTP ranks.

What `logprobs` are (engine/sampling.py, README): the model's log-softmax over the whole vocabulary of the raw
logits, before bias, penalties, temperature and truncation.
"""
import json
import math

import httpx
import openai
import pytest
import torch

from laneplay.engine import SamplingParams, load_engine
from laneplay.engine.checkpoint import random_laneformer_tensors, tiny_laneformer_config, write_checkpoint
from laneplay.engine.server import create_app
from .naive_reference import naive_logits
from .test_server import serve, sse_data

RAW = tiny_laneformer_config()
SEED = 5
CHAT = [{"role": "user", "content": "hello"}]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_checkpoint(tmp_path_factory.mktemp("logprobs") / "ckpt", RAW, random_laneformer_tensors(RAW, SEED))


@pytest.fixture(scope="module")
def tiny(checkpoint):
    eng = load_engine(checkpoint, compile=False)  # float32
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def url(tiny):
    with serve(create_app(tiny, model_name="tiny")) as u:
        yield u


@pytest.fixture(scope="module")
def client(url):
    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)


def reference_logprobs(tiny, messages) -> torch.Tensor:
    """The first answer token's log-probabilities from the naive reference model, in float64."""
    ids = tiny.tokenizer.encode_chat(messages)
    logits = naive_logits(RAW, random_laneformer_tensors(RAW, SEED), torch.tensor([ids]))[0, -1]
    return torch.log_softmax(logits.double(), -1)


def test_the_openai_client_gets_logprobs_that_spell_the_answer_and_match_the_reference(client, tiny):
    r = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=24, temperature=0, logprobs=True,
                                       top_logprobs=5)
    choice = r.choices[0]
    content = choice.logprobs.content
    assert "".join(t.token for t in content) == choice.message.content and content
    for t in content:
        assert len(t.top_logprobs) == 5
        assert sum(math.exp(a.logprob) for a in t.top_logprobs) <= 1 + 1e-6
        assert [a.logprob for a in t.top_logprobs] == sorted((a.logprob for a in t.top_logprobs), reverse=True)
        assert t.logprob <= t.top_logprobs[0].logprob + 1e-6
    ref = reference_logprobs(tiny, CHAT)
    first, best = content[0], int(ref.argmax())
    assert first.bytes == list(tiny.tokenizer.token_bytes(best))  # greedy: the reference's most likely token
    assert abs(first.logprob - ref[best].item()) < 1e-3
    top = torch.topk(ref, 5)
    assert [a.logprob for a in first.top_logprobs] == pytest.approx(top.values.tolist(), abs=1e-3)
    assert [list(a.bytes) for a in first.top_logprobs] == [list(tiny.tokenizer.token_bytes(i)) for i in
                                                             top.indices.tolist()]


def test_streamed_logprobs_spell_the_streamed_text(client):
    text, tokens = "", []
    stream = client.chat.completions.create(model="tiny", messages=CHAT, max_tokens=40, temperature=1.3, seed=4,
                                            logprobs=True, top_logprobs=2, stream=True)
    for chunk in stream:
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.logprobs is not None and c.logprobs.content:
                tokens += c.logprobs.content
    assert text and "".join(t.token for t in tokens) == text
    assert all(len(t.top_logprobs) == 2 for t in tokens)


@pytest.mark.parametrize("seed", range(6))
def test_token_texts_cover_the_answer_exactly_through_split_characters_and_stops(tiny, seed):
    """The byte-level model writes arbitrary bytes (characters split over tokens, invalid UTF-8); with and
    without a stop string, the tokens' texts concatenate to the text, and nothing after a stop is listed."""
    for stop in ([], ["e"], ["\ufffd"]):
        params = SamplingParams(max_tokens=48, temperature=2.0, seed=seed, stop=stop, logprobs=1, ignore_eos=True)
        text, tokens, ids = "", [], []
        for ev in tiny.generate([104, 101, 108, 108, 111], params):
            text += ev.text
            tokens += ev.logprobs
            ids += ev.token_ids
        assert "".join(t.text for t in tokens) == text, (seed, stop)
        assert [t.token_id for t in tokens] == ids[:len(tokens)]
        if not stop:
            assert len(tokens) == len(ids) == 48
            # each token's bytes are its own (a split character's pieces included): together, the answer's bytes
            assert b"".join(bytes(t.bytes) for t in tokens) == b"".join(tiny.tokenizer.token_bytes(i) for i in ids)


def test_completions_logprobs_have_openai_shape_and_offsets(url):
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 12, "temperature": 0, "logprobs": 3}
    whole = httpx.post(url + "/v1/completions", json=body, timeout=60).json()["choices"][0]
    lp = whole["logprobs"]
    assert "".join(lp["tokens"]) == whole["text"]
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(lp["tokens"]))]
    assert all(isinstance(d, dict) and len(d) <= 3 for d in lp["top_logprobs"])
    assert len(lp["token_logprobs"]) == len(lp["tokens"])
    with httpx.stream("POST", url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        chunks = [c["choices"][0] for c in sse_data(r.iter_lines()) if c["choices"]]
    tokens = [t for c in chunks if c["logprobs"] for t in c["logprobs"]["tokens"]]
    offsets = [o for c in chunks if c["logprobs"] for o in c["logprobs"]["text_offset"]]
    assert tokens == lp["tokens"] and offsets == lp["text_offset"]  # greedy: the same answer, streamed
    echoed = httpx.post(url + "/v1/completions", json={**body, "logprobs": None, "echo": True}, timeout=60).json()
    assert echoed["choices"][0]["text"] == "hello" + whole["text"]


def test_logprob_requests_are_checked(url):
    cases = [({"messages": CHAT, "top_logprobs": 3}, "top_logprobs"),
             ({"messages": CHAT, "logprobs": True, "top_logprobs": 21}, "top_logprobs"),
             ({"messages": CHAT, "logprobs": 3}, "logprobs")]
    for body, param in cases:
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
    for body, param in [({"prompt": "x", "logprobs": 21}, "logprobs"), ({"prompt": "x", "logprobs": True}, "logprobs"),
                        ({"prompt": "x", "logprobs": 2, "echo": True}, "echo")]:
        r = httpx.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_dtp_ranks_give_the_same_tokens_and_logprobs_with_penalties(checkpoint, tiny):
    """Penalties, bias and logprobs need whole logits on the ranks (no per-shard argmax): the DTP engine
    gives exactly the single process's tokens, and its logprobs within float32 rounding."""
    params = dict(max_tokens=12, temperature=0.0, ignore_eos=True, frequency_penalty=1.0, repetition_penalty=1.3,
                  logit_bias={101: 3.0}, logprobs=3)

    def run(eng):
        toks = []
        for ev in eng.generate([104, 101, 108, 108, 111], SamplingParams(**params)):
            toks += [(t.token_id, t.logprob, [i for i, *_ in t.top]) for t in ev.logprobs]
        return toks

    want = run(tiny)
    dtp = load_engine(checkpoint, world_size=2, timeout_s=60)
    try:
        got = run(dtp)
    finally:
        dtp.close()
    assert [(t, top) for t, _, top in got] == [(t, top) for t, _, top in want]
    assert [lp for _, lp, _ in got] == pytest.approx([lp for _, lp, _ in want], abs=1e-4)
    assert json.dumps(want)  # plain numbers (no inf) for the API
