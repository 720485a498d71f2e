"""The sampler over extreme but valid parameters and logits: every accepted value gives a token."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from laneplay.engine.sampling import GREEDY_TEMPERATURE, SamplingParams, make_generators, process_logits, sample

temperatures = st.one_of(st.just(0.0), st.just(5e-324), st.just(1e-300), st.just(1e-38), st.just(1e-45),
                         st.floats(min_value=0.0, max_value=100.0, allow_subnormal=True))
top_ps = st.one_of(st.just(1.0), st.just(5e-324), st.just(1e-12), st.floats(min_value=1e-300, max_value=1.0))
min_ps = st.one_of(st.just(0.0), st.just(1.0), st.floats(min_value=0.0, max_value=1.0))
top_ks = st.one_of(st.just(0), st.just(1), st.integers(min_value=0, max_value=10_000))
logit_values = st.one_of(st.floats(width=32, allow_nan=False, allow_infinity=False),
                         st.just(float("-inf")), st.just(3.4e38), st.just(-3.4e38), st.just(0.0))


@settings(max_examples=300, deadline=None)
@given(t=temperatures, p=top_ps, k=top_ks, m=min_ps,
       rows=st.lists(st.lists(logit_values, min_size=1, max_size=12), min_size=1, max_size=3),
       seed=st.integers(min_value=0, max_value=2**63 - 1))
def test_every_valid_parameter_set_samples_a_token(t, p, k, m, rows, seed):
    params = SamplingParams(temperature=t, top_p=p, top_k=k, min_p=m, seed=seed).validate()
    width = max(len(r) for r in rows)
    logits = torch.tensor([r + [float("-inf")] * (width - len(r)) for r in rows], dtype=torch.float32)
    tokens = sample(logits, params, make_generators([seed + i for i in range(len(rows))], "cpu"))
    assert tokens.shape == (len(rows),)
    for row, tok in zip(logits, tokens.tolist()):
        assert 0 <= tok < width
        finite = torch.isfinite(row)
        if finite.any():  # never a token the model ruled out while others were possible
            assert row[tok] > float("-inf")
    if not params.greedy:
        probs = process_logits(logits, params).softmax(-1)
        assert torch.isfinite(probs).all() and torch.allclose(probs.sum(-1), torch.ones(len(rows)))


@pytest.mark.parametrize("t", [1e-38, 1e-300, 5e-324, GREEDY_TEMPERATURE / 2])
def test_tiny_temperatures_are_greedy(t):
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.999]])
    params = SamplingParams(temperature=t).validate()
    assert params.greedy
    assert sample(logits, params, make_generators([0], "cpu")).tolist() == [1]


def test_small_temperature_above_the_threshold_is_still_sampling_and_sharp():
    params = SamplingParams(temperature=GREEDY_TEMPERATURE * 2, seed=3).validate()
    assert not params.greedy
    logits = torch.tensor([[0.0, 1.0, -5.0]])
    probs = process_logits(logits, params).softmax(-1)
    assert probs[0, 1] == pytest.approx(1.0) and math.isfinite(probs.sum().item())


def test_ties_huge_and_negative_logits():
    gens = make_generators([1, 2], "cpu")
    logits = torch.tensor([[3.4e38, 3.4e38, -3.4e38, float("-inf")], [-1e30, -1e30, -1e30, -1e30]])
    params = SamplingParams(temperature=0.7, top_p=0.5, top_k=3, min_p=0.2).validate()
    for _ in range(20):
        a, b = sample(logits, params, gens).tolist()
        assert a in (0, 1) and 0 <= b < 4
