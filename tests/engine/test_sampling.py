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


def _top_p_reference(logits, top_p):
    """top-p by sorting the whole row (the textbook way)."""
    probs = logits.softmax(-1)
    ranked, order = torch.sort(probs, dim=-1, descending=True)
    drop = (ranked.cumsum(-1) - ranked) >= top_p
    drop[..., 0] = False
    return torch.zeros_like(drop).scatter(-1, order, drop)


@pytest.mark.parametrize("spread", [0.05, 1.0, 3.0, 12.0])  # flat rows need thousands of candidates, peaked ones few
@pytest.mark.parametrize("top_p", [0.1, 0.5, 0.9, 0.99])
def test_top_p_ranks_a_few_candidates_but_keeps_what_a_full_sort_keeps(spread, top_p):
    from laneplay.engine.sampling import TOP_P_CANDIDATES, _top_p_drop

    g = torch.Generator().manual_seed(int(spread * 100 + top_p * 10))
    logits = torch.randn(3, 20_000, generator=g) * spread
    logits[1, :5] += 30.0  # one peaked row beside flat ones: the cut differs per row
    got, want = _top_p_drop(logits, top_p), _top_p_reference(logits, top_p)
    # ranks equal up to float rounding of the running sum: only a token right at the cut may differ
    assert int((got != want).sum()) <= 1
    assert (~got).sum(-1).min() >= 1
    if spread >= 3.0 and top_p <= 0.5:
        assert int((~got[1]).sum()) < TOP_P_CANDIDATES


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_p=0.8),
                                    SamplingParams(temperature=1.3, top_k=4, min_p=0.05)])
def test_draws_follow_the_processed_distribution(params):
    """20,000 draws from one seeded generator: each token's frequency within 4.5 standard errors of its
    probability, and never a token that the settings ruled out."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0, float("-inf"), -3.0, 1.5]])
    want = process_logits(logits, params.validate()).softmax(-1)[0].double()
    gens = make_generators([11], "cpu")
    draws = torch.cat([sample(logits.expand(1000, -1), params, gens * 1000) for _ in range(20)])
    freq = torch.bincount(draws, minlength=8).double() / len(draws)
    se = (want * (1 - want) / len(draws)).sqrt()
    assert ((freq - want).abs() <= 4.5 * se + 1e-12).all(), (freq, want)
    assert (freq[want == 0] == 0).all()
