"""Penalties and logit_bias: each changes a greedy answer exactly as an independent reimplementation predicts,
alone and as a row of a batch of differing rows (separate requests sharing steps, and one request's samples).

The prediction uses nothing of the engine: the naive reference model's logits (tests/engine/naive_reference.py)
and the rules written out in plain Python, in engine.sampling's order: bias, then repetition_penalty over
prompt + output, then frequency and presence penalties over the output.
"""
from collections import Counter

import pytest
import torch

from laneplay.engine import SamplingParams, load_engine
from laneplay.engine.checkpoint import random_laneformer_tensors, tiny_laneformer_config, write_checkpoint
from .naive_reference import naive_logits
from .test_batching import alone, run_together

RAW = tiny_laneformer_config()
SEED = 3
PROMPT = [104, 101, 108, 108, 111, 32, 104, 101, 108, 108, 111]  # bytes of "hello hello"
STEPS = 14
CASES = {
    "frequency": dict(frequency_penalty=1.5),
    "presence": dict(presence_penalty=1.5),
    "negative frequency, presence": dict(frequency_penalty=-0.5, presence_penalty=2.0),
    "repetition": dict(repetition_penalty=1.8),
    "repetition below 1": dict(repetition_penalty=0.5),
    "bias": "bias",  # made from the plain answer: its first token banned, its third favoured
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = write_checkpoint(tmp_path_factory.mktemp("penalties") / "ckpt", RAW, random_laneformer_tensors(RAW, SEED))
    eng = load_engine(path, compile=False)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def weights():
    return random_laneformer_tensors(RAW, SEED)


def predicted(weights, prompt, steps, frequency_penalty=0.0, presence_penalty=0.0, repetition_penalty=1.0,
              logit_bias=None) -> list[int]:
    """Greedy decoding with the penalties applied by hand to the naive model's logits."""
    ids, out = list(prompt), []
    for _ in range(steps):
        row = naive_logits(RAW, weights, torch.tensor([ids]))[0, -1].double().tolist()
        for t, b in (logit_bias or {}).items():
            row[t] += b
        for t in set(prompt) | set(out):
            row[t] = row[t] / repetition_penalty if row[t] > 0 else row[t] * repetition_penalty
        for t, c in Counter(out).items():
            row[t] -= frequency_penalty * c + presence_penalty
        first, second = sorted(range(len(row)), key=row.__getitem__, reverse=True)[:2]
        assert row[first] - row[second] > 1e-3, "a near tie: this prompt cannot tell implementations apart"
        out.append(first)
        ids.append(first)
    return out


def settings(case, plain) -> dict:
    return {"logit_bias": {plain[0]: -100.0, plain[2]: 4.0}} if case == "bias" else dict(case)


def greedy(**extra) -> SamplingParams:
    return SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, **extra)


@pytest.fixture(scope="module")
def plain(tiny, weights):
    got = alone(tiny, PROMPT, greedy())[0]
    assert got == predicted(weights, PROMPT, STEPS)
    return got


@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
def test_each_setting_changes_the_greedy_answer_as_predicted(tiny, weights, plain, case):
    extra = settings(case, plain)
    got = alone(tiny, PROMPT, greedy(**extra))[0]
    assert got == predicted(weights, PROMPT, STEPS, **extra)
    assert got != plain  # it did change the answer


def test_rows_of_a_batch_each_get_their_own_settings(tiny, weights, plain):
    """Separate requests with different settings share decode steps (and one of them samples at a
    temperature); each greedy row is what the reimplementation predicts, the sampled one what it gets alone."""
    requests = [(PROMPT, greedy(**settings(case, plain))) for case in CASES.values()]
    requests.append((PROMPT[:6], greedy()))
    sampled = (PROMPT, SamplingParams(max_tokens=STEPS, temperature=0.9, seed=7, ignore_eos=True,
                                      frequency_penalty=0.7, logit_bias={plain[1]: -5.0}))
    requests.append(sampled)
    got = run_together(tiny, requests)
    assert max(job.rows_per_step for _, _, job in got) > 4  # they shared steps
    for (prompt, params), (tokens, _, job) in zip(requests[:-1], got):
        extra = {k: getattr(params, k) for k in ("frequency_penalty", "presence_penalty", "repetition_penalty",
                                                  "logit_bias")}
        assert tokens[0] == predicted(weights, prompt, STEPS, **extra), extra
    assert got[-1][0] == alone(tiny, *sampled)


def test_samples_of_one_request_each_get_their_own_penalties(tiny, weights, plain):
    rows = [{"frequency_penalty": 1.5}, {}, {"repetition_penalty": 1.8, "presence_penalty": 0.5}]
    params = SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True, logit_bias={plain[2]: 4.0},
                            samples=rows)
    for engine_path in ("alone", "batched"):
        got = alone(tiny, PROMPT, params) if engine_path == "alone" else run_together(tiny, [(PROMPT, params)])[0][0]
        for i, row in enumerate(rows):
            assert got[i] == predicted(weights, PROMPT, STEPS, logit_bias={plain[2]: 4.0}, **row), (engine_path, row)


def test_low_bit_rows_with_penalties_give_what_they_give_alone():
    """The CPU low-bit path: differing penalty rows in shared steps equal each request alone, and change it."""
    from laneplay.kernels import lowbit

    if not lowbit.available():
        pytest.skip("the low-bit kernels are not built")
    eng = load_engine("smollm2-135m-instruct", dtype="int4")
    try:
        prompt = "def repeat(x):\n    return x, x, x, x"
        base = dict(max_tokens=24, temperature=0.0, ignore_eos=True)
        plain = alone(eng, prompt, SamplingParams(**base))
        requests = [(prompt, SamplingParams(**base, frequency_penalty=2.0, presence_penalty=2.0)),
                    (prompt, SamplingParams(**base, repetition_penalty=1.5)),
                    (prompt, SamplingParams(**base, logit_bias={plain[0][0]: -100.0})),
                    (prompt, SamplingParams(**base))]
        got = run_together(eng, requests)
        answers = [alone(eng, prompt, params) for _, params in requests]
        assert [tokens for tokens, _, _ in got] == answers
        assert answers[-1] == plain and all(a != plain for a in answers[:-1])
    finally:
        eng.close()
