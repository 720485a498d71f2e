"""One source for limits: each sampling bound, just inside and just outside, gets the same verdict from the
page's check (`app.params.sampling`, what Generate, Side by side, DTP and pass@N run) and from the engine's
(its HTTP request parser, `SamplingParams.validate` and the context check); a refusal on the page names
the bound."""
import math

import pytest

from laneplay import limits
from laneplay.app.params import InputError, sampling
from laneplay.engine.generate import check_context
from laneplay.engine.server import APIError, parse_request

CONTEXT = 2048
INFO = {"context_length": CONTEXT}
S = "x" * limits.MAX_STOP_LENGTH

# (parameter, value, the engine accepts it?, the bound a refusal names)
CASES = [
    ("temperature", -0.01, False, "0"), ("temperature", 0.0, True, ""), ("temperature", 2.5, True, ""),
    ("temperature", limits.MAX_TEMPERATURE, True, ""), ("temperature", limits.MAX_TEMPERATURE + 0.01, False, "100"),
    ("temperature", math.nan, False, "100"),
    ("top_p", 0.0, False, "0"), ("top_p", 1e-9, True, ""), ("top_p", 1.0, True, ""), ("top_p", 1.0001, False, "1"),
    ("top_k", -1, False, "0"), ("top_k", 0, True, ""), ("top_k", 1, True, ""), ("top_k", 10**9, True, ""),
    ("top_k", 1.5, False, "whole number"),
    ("min_p", -0.01, False, "0"), ("min_p", 0.0, True, ""), ("min_p", 1.0, True, ""), ("min_p", 1.01, False, "1"),
    ("seed", -1, False, "0"), ("seed", 0, True, ""), ("seed", limits.MAX_SEED, True, ""),
    ("seed", limits.MAX_SEED + 1, False, str(limits.MAX_SEED)),
    ("max_tokens", 0, False, "1"), ("max_tokens", 1, True, ""), ("max_tokens", CONTEXT - 1, True, ""),
    ("max_tokens", CONTEXT, False, str(CONTEXT - 1)),
    ("n", 0, False, "1"), ("n", 1, True, ""), ("n", limits.MAX_N, True, ""), ("n", limits.MAX_N + 1, False, "16"),
    ("stop", [S] * limits.MAX_STOP_STRINGS, True, ""),
    ("stop", [S] * (limits.MAX_STOP_STRINGS + 1), False, str(limits.MAX_STOP_STRINGS)),
    ("stop", ["y" * (limits.MAX_STOP_LENGTH + 1)], False, str(limits.MAX_STOP_LENGTH)),
    *[(name, value, ok, bound) for name in ("frequency_penalty", "presence_penalty") for value, ok, bound in
      [(limits.MIN_PENALTY - 0.01, False, "-2"), (limits.MIN_PENALTY, True, ""), (0.0, True, ""),
       (limits.MAX_PENALTY, True, ""), (limits.MAX_PENALTY + 0.01, False, "2"), (math.nan, False, "2")]],
    ("repetition_penalty", 0.0, False, "0"), ("repetition_penalty", 1e-6, True, ""),
    ("repetition_penalty", 1.0, True, ""), ("repetition_penalty", limits.MAX_REPETITION_PENALTY, True, ""),
    ("repetition_penalty", limits.MAX_REPETITION_PENALTY + 0.01, False, "10"),
]


def page_verdict(name, value) -> tuple[bool, str]:
    args = {"temperature": 0.0, "top_p": 1.0, "top_k": 0, "max_tokens": 16, "seed": None, "stop_text": ""}
    extra = {}
    if name in ("min_p", "n", "frequency_penalty", "presence_penalty", "repetition_penalty"):
        extra[name] = value
    elif name == "stop":
        args["stop_text"] = "\n".join(value)
    else:
        args[name] = value
    try:
        sampling(*args.values(), INFO, **extra)
    except InputError as e:
        return False, str(e)
    return True, ""


def engine_verdict(name, value) -> bool:
    """The engine's HTTP path: the request parser, the parameter rules, the context (a one-token prompt)."""
    body = {"prompt": "x", "max_tokens": 16, "temperature": 0.0, name: value}
    try:
        params = parse_request(body, chat=False).params.validate()
        check_context(1, params, CONTEXT)
    except (APIError, ValueError):
        return False
    return True


@pytest.mark.parametrize("name,value,accepted,bound", CASES, ids=[f"{c[0]}={str(c[1])[:12]}" for c in CASES])
def test_the_page_and_the_engine_give_each_bound_the_same_verdict(name, value, accepted, bound):
    assert engine_verdict(name, value) is accepted  # the engine's rule is as this table says
    ok, message = page_verdict(name, value)
    assert ok is accepted, message
    if not ok:
        assert bound in message, message  # the page's error names the bound


def test_storage_keeps_whatever_the_engine_accepted():
    from laneplay.storage import limits as stored

    assert (stored.MAX_SEED, stored.MAX_TEMPERATURE, stored.MAX_STOP_SEQUENCES, stored.MAX_STOP_CHARS,
            stored.MAX_SAMPLES, stored.MAX_TOP_K) == (limits.MAX_SEED, limits.MAX_TEMPERATURE, limits.MAX_STOP_STRINGS,
                                                      limits.MAX_STOP_LENGTH, limits.MAX_N, limits.MAX_TOP_K)
    assert stored.MAX_TOKENS >= CONTEXT
    assert (stored.MIN_PENALTY, stored.MAX_PENALTY, stored.MAX_REPETITION_PENALTY) == \
        (limits.MIN_PENALTY, limits.MAX_PENALTY, limits.MAX_REPETITION_PENALTY)
