"""Per-sample sampling settings in one batch: the sampler, the engine, DTP ranks and the HTTP API.

Sample i of a mixed batch must give exactly the tokens it gives alone (n=1, its own settings and seed).
"""
import json
from dataclasses import asdict

import pytest
import torch
from fastapi.testclient import TestClient

from laneplay.engine import SampleSettings, SamplingParams, load_engine
from laneplay.engine.checkpoint import random_laneformer_tensors, tiny_laneformer_config, write_checkpoint
from laneplay.engine.sampling import make_generators, sample, sample_seeds
from laneplay.engine.server import create_app

# greedy, two seeded samples with their own temperature / top_p / top_k, and one that inherits everything
MIXED = [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.9, "seed": 5},
         {"temperature": 1.3, "top_k": 20, "min_p": 0.01, "seed": 11}, {}]
REQUEST = dict(temperature=0.8, top_p=0.95, seed=100)  # what the samples inherit; sample 3's seed is 100 + 3


def collect(eng, prompt, chat=False, **params):
    """(token ids, texts, final metrics), each by sample index."""
    ids, texts, finals = {}, {}, {}
    for ev in eng.generate(prompt, SamplingParams(**params), chat=chat):
        ids.setdefault(ev.sample_index, []).extend(ev.token_ids)
        texts[ev.sample_index] = texts.get(ev.sample_index, "") + ev.text
        if ev.finish_reason:
            finals[ev.sample_index] = ev.metrics
    return ids, texts, finals


def alone(params: SamplingParams, i: int) -> dict:
    """Sample i of `params` as a request of its own: its settings, its seed, n=1."""
    own = params.for_sample(i)
    return dict(max_tokens=own.max_tokens, temperature=own.temperature, top_p=own.top_p, top_k=own.top_k,
                min_p=own.min_p, seed=sample_seeds(params)[i], ignore_eos=own.ignore_eos)


# ---- the sampler ----------------------------------------------------------------------------------
def test_each_row_of_a_mixed_batch_samples_what_it_samples_alone():
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(0)) * 3
    samples = [*MIXED, {"temperature": 0.9, "top_p": 0.9}, {"top_k": 1, "temperature": 2.0}]  # rows 1, 4 share
    params = SamplingParams(**REQUEST, samples=samples).validate()
    seeds = sample_seeds(params)
    batch_gens = make_generators(seeds, "cpu")
    own_gens = make_generators(seeds, "cpu")
    for _ in range(20):  # generators advance step by step, in the batch as alone
        tokens = sample(logits, params, batch_gens).tolist()
        assert tokens == [sample(logits[i:i + 1], params.for_sample(i), [own_gens[i]]).item() for i in range(6)]
    assert tokens[0] == logits[0].argmax().item() and tokens[5] == logits[5].argmax().item()


def test_same_settings_for_every_sample_equal_plain_n():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))
    plain = SamplingParams(temperature=0.7, top_k=10, seed=3, n=3).validate()
    listed = SamplingParams(temperature=0.1, seed=3, samples=[{"temperature": 0.7, "top_k": 10}] * 3).validate()
    a, b = make_generators(sample_seeds(plain), "cpu"), make_generators(sample_seeds(listed), "cpu")
    assert [sample(logits, plain, a).tolist() for _ in range(5)] == [sample(logits, listed, b).tolist() for _ in range(5)]


def test_inheritance_seeds_and_the_trip_to_dtp_ranks():
    params = SamplingParams(**REQUEST, samples=MIXED).validate()
    assert params.n == 4 and sample_seeds(params) == [100, 5, 11, 103]
    assert params.settings() == [(0, 0.95, 0, 0.0), (0.9, 0.9, 0, 0.0), (1.3, 0.95, 20, 0.01), (0.8, 0.95, 0, 0.0)]
    assert not params.greedy and SamplingParams(samples=[{"temperature": 0}, {"top_k": 1, "temperature": 1}]).greedy
    rebuilt = SamplingParams(**asdict(params))  # what a rank does with the request it is sent
    assert rebuilt == params and all(isinstance(s, SampleSettings) for s in rebuilt.samples)
    random_base = sample_seeds(SamplingParams(samples=[{}, {"seed": 9}, {}]))
    assert random_base[1] == 9 and random_base[2] == random_base[0] + 2


@pytest.mark.parametrize("params,message", [
    (dict(samples=[{}, {}, {"temperature": -1}]), r"samples\[2\]\.temperature must be in \[0, 100\], got -1"),
    (dict(samples=[{"top_p": 0}]), r"samples\[0\]\.top_p must be in \(0, 1\], got 0"),
    (dict(samples=[{}, {"top_k": 1.5}]), r"samples\[1\]\.top_k must be an integer >= 0 \(0 = off\), got 1.5"),
    (dict(samples=[{"min_p": 2}]), r"samples\[0\]\.min_p must be in \[0, 1\], got 2"),
    (dict(samples=[{"seed": -1}]), r"samples\[0\]\.seed must be an integer in \[0, 2\^63\), got -1"),
    (dict(samples=[{"temperature": True}]), r"samples\[0\]\.temperature must be in \[0, 100\], got True"),
    (dict(samples=[{"temp": 1}]), r"samples\[0\] has unknown key\(s\) \['temp'\]; allowed: temperature, top_p"),
    (dict(samples=["hot"]), r"samples\[0\] must be an object of sample settings, got 'hot'"),
    (dict(samples=[]), r"samples must be a list of 1 to 16 sample settings, got 0 of them"),
    (dict(samples=[{}] * 17), r"samples must be a list of 1 to 16 sample settings, got 17 of them"),
    (dict(samples=[{}] * 3, n=2), r"n \(2\) must equal the number of samples \(3\)"),
    (dict(temperature=-1, samples=[{}]), r"^temperature must be in \[0, 100\]"),
])
def test_per_sample_values_are_validated_and_named(params, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**params).validate()


# ---- the engine: embedded default model, and DTP ranks ------------------------------------------------
def test_a_mixed_batch_gives_each_sample_its_tokens_alone(default_engine):
    prompt = "def is_prime(n):"
    params = SamplingParams(max_tokens=6, ignore_eos=True, **REQUEST, samples=MIXED[:3]).validate()
    ids, _, finals = collect(default_engine, prompt, **asdict(params))
    for i in range(3):
        own = collect(default_engine, prompt, **alone(params, i))[0]
        assert ids[i] == own[0] and len(ids[i]) == 6, f"sample {i}"
        m = finals[i]
        assert (m.seed, m.temperature, m.top_p, m.top_k, m.min_p) == (sample_seeds(params)[i], *params.settings()[i])
    assert len({tuple(t) for t in ids.values()}) > 1


@pytest.mark.slow
def test_dtp_ranks_sample_a_mixed_batch_like_one_process(tmp_path):
    raw = tiny_laneformer_config()
    path = write_checkpoint(tmp_path / "tiny", raw, random_laneformer_tensors(raw, seed=3))
    prompt = [3, 14, 15, 92, 65]
    mixed = SamplingParams(max_tokens=10, ignore_eos=True, **REQUEST, samples=MIXED).validate()
    greedy = SamplingParams(max_tokens=10, ignore_eos=True, samples=[{"temperature": 0}, {"top_k": 1, "temperature": 1}])
    single = load_engine(path, compile=False)
    try:
        ref = collect(single, prompt, **asdict(mixed))[0]
        ref_alone = [collect(single, prompt, **alone(mixed, i))[0][0] for i in range(4)]
        ref_greedy = collect(single, prompt, **asdict(greedy))[0]
    finally:
        single.close()
    assert [ref[i] for i in range(4)] == ref_alone and ref_greedy[0] == ref_greedy[1] == ref[0]
    eng = load_engine(path, world_size=2, timeout_s=60)
    try:
        assert collect(eng, prompt, **asdict(mixed))[0] == ref
        assert collect(eng, prompt, **alone(mixed, 2))[0][0] == ref[2]
        assert collect(eng, prompt, **asdict(greedy))[0] == ref_greedy  # every row greedy: per-shard top-1
    finally:
        eng.close()


# ---- the HTTP API -----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def http(default_engine):
    with TestClient(create_app(default_engine)) as client:
        yield client


API_SAMPLES = [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.9, "seed": 5}, {"top_k": 20}]


def test_chat_with_samples_gives_each_choice_its_own_settings(http, default_engine):
    messages = [{"role": "user", "content": "Name a fruit."}]
    r = http.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 6, "temperature": 0.7,
                                                "seed": 40, "samples": API_SAMPLES})
    assert r.status_code == 200, r.text
    body = r.json()
    params = SamplingParams(max_tokens=6, temperature=0.7, seed=40, samples=API_SAMPLES)
    ref = collect(default_engine, messages, chat=True, **asdict(params))[1]
    texts = [c["message"]["content"] for c in sorted(body["choices"], key=lambda c: c["index"])]
    assert texts == [ref[i] for i in range(3)]
    per_choice = body["laneplay"]["per_choice"]
    assert [(p["index"], p["seed"], p["temperature"], p["top_p"], p["top_k"]) for p in per_choice] == \
        [(0, 40, 0, 1.0, 0), (1, 5, 0.9, 0.9, 0), (2, 42, 0.7, 1.0, 20)]


def test_streamed_completion_with_samples(http, default_engine):
    body = {"prompt": "def fibonacci(n):", "max_tokens": 6, "seed": 7, "stream": True, "samples": API_SAMPLES}
    texts, finishing = {}, {}
    with http.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            for c in chunk["choices"]:
                texts[c["index"]] = texts.get(c["index"], "") + c["text"]
                if c["finish_reason"]:
                    finishing[c["index"]] = chunk["laneplay"]["per_choice"]
    ref = collect(default_engine, body["prompt"], max_tokens=6, temperature=1.0, seed=7, samples=API_SAMPLES)[1]
    assert texts == ref
    mine = {i: next(p for p in pcs if p["index"] == i) for i, pcs in finishing.items()}
    assert [(mine[i]["seed"], mine[i]["temperature"], mine[i]["top_k"]) for i in range(3)] == \
        [(7, 0, 0), (5, 0.9, 0), (9, 1.0, 20)]


@pytest.mark.parametrize("extra,param,pattern", [
    ({"samples": {"temperature": 0}}, "samples", "must be an array of objects"),
    ({"samples": [{}, 3]}, "samples[1]", "must be an object"),
    ({"samples": [{}, {"top_p": "high"}]}, "samples[1].top_p", "must be a number, got a string"),
    ({"samples": [{"top_k": 2.5}]}, "samples[0].top_k", "must be an integer"),
    ({"samples": [{"seed": True}]}, "samples[0].seed", "must be an integer, got a boolean"),
    ({"samples": [{"temperature": 0, "temprature": 1}]}, "samples[0]", "unknown key(s) 'temprature'"),
    ({"samples": [{}, {}], "n": 3}, "n", "'n' (3) must equal the number of 'samples' (2)"),
    ({"samples": [{}, {}], "n": 1}, "n", "'n' (1) must equal"),
    ({"samples": [{}, {}, {"temperature": 101}]}, "samples[2].temperature", "must be in [0, 100]"),
    ({"samples": [{"seed": -1}]}, "samples[0].seed", "must be an integer in [0, 2^63)"),
    ({"samples": []}, "samples", "1 to 16"),
    ({"samples": [{}] * 17}, "samples", "1 to 16"),
])
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_samples_are_a_400_naming_the_field(http, path, extra, param, pattern):
    body = {"prompt": "x"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "x"}]}
    r = http.post(path, json={**body, "max_tokens": 2, **extra})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and pattern in err["message"], err
