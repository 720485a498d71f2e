"""The page's generation parameters, checked against the engine's own bounds (`laneplay.limits`).

A value accepted here is one the engine accepts, and the other way round (tests/app/test_limits.py sends
each bound through both); the page may offer a narrower slider, never a narrower check. Every error is
one sentence that names the bound.
"""
from __future__ import annotations


from laneplay import limits


class InputError(ValueError):
    """Bad input from the page: shown in #error; nothing is stored or sent."""


def parse_stops(text: str | None) -> list[str]:
    """Stop strings, one per line (escapes \\n and \\t allowed; empty lines are skipped)."""
    stops = []
    for line in str(text or "").splitlines():
        if not line:
            continue
        s = line.replace("\\n", "\n").replace("\\t", "\t")
        if len(s) > limits.MAX_STOP_LENGTH:
            raise InputError(f"A stop string is {len(s)} characters long; the limit is {limits.MAX_STOP_LENGTH}.")
        stops.append(s)
    if len(stops) > limits.MAX_STOP_STRINGS:
        raise InputError(f"{len(stops)} stop strings given; at most {limits.MAX_STOP_STRINGS} are allowed.")
    return stops


def number(name: str, v, lo, hi, *, integer: bool = False, lo_open: bool = False):
    """`v` (a number, or its text) within [lo, hi] ((lo, hi] with `lo_open`), else InputError naming the range.
    Integers stay exact (a seed of 2^63 - 1 is not rounded through a float)."""
    if v is None or v == "":
        raise InputError(f"{name} is empty.")
    if isinstance(v, bool):
        raise InputError(f"{name} must be a number.")
    x = v
    if not isinstance(v, (int, float)):
        try:
            x = int(str(v).strip())
        except ValueError:
            try:
                x = float(v)
            except (TypeError, ValueError, OverflowError):
                raise InputError(f"{name} must be a number.") from None
    inside = (lo < x if lo_open else lo <= x) and x <= hi
    if x != x or not inside:  # NaN
        raise InputError(f"{name} must be {'greater than' if lo_open else 'between'} {lo} "
                         f"{'and at most' if lo_open else 'and'} {hi} (got {v}).")
    if integer:
        if x != int(x):
            raise InputError(f"{name} must be a whole number (got {v}).")
        return int(x)
    return float(x)


def max_tokens_bound(info: dict | None) -> int:
    """The most tokens a request may ask for: the served model's context less one prompt token (the
    engine's check is prompt + max_tokens <= context); limits.MAX_TOKENS when the engine does not say."""
    context = (info or {}).get("context_length")
    return max(int(context) - 1, 1) if isinstance(context, int) and context > 1 else limits.MAX_TOKENS


PENALTIES = ("frequency_penalty", "presence_penalty", "repetition_penalty")  # the Sampling panel's, in order


def penalties(frequency_penalty=None, presence_penalty=None, repetition_penalty=None) -> dict:
    """Checked penalties as the engine API takes them; empty or neutral values (0, 0, 1) are left out."""
    out = {}
    if frequency_penalty not in (None, ""):
        out["frequency_penalty"] = number("Frequency penalty", frequency_penalty, limits.MIN_PENALTY, limits.MAX_PENALTY)
    if presence_penalty not in (None, ""):
        out["presence_penalty"] = number("Presence penalty", presence_penalty, limits.MIN_PENALTY, limits.MAX_PENALTY)
    if repetition_penalty not in (None, ""):
        out["repetition_penalty"] = number("Repetition penalty", repetition_penalty, 0, limits.MAX_REPETITION_PENALTY,
                                           lo_open=True)
    neutral = {"frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0}
    return {k: v for k, v in out.items() if v != neutral[k]}


def sampling(temperature, top_p, top_k, max_tokens, seed, stop_text, info: dict | None = None, *,
             min_p=None, n=None, frequency_penalty=None, presence_penalty=None, repetition_penalty=None) -> dict:
    """Checked sampling parameters as the engine API takes them. `info`: the engine's (its context bounds
    max_tokens); `min_p`, `n` and the penalties are checked when given."""
    out = {"temperature": number("Temperature", temperature, limits.MIN_TEMPERATURE, limits.MAX_TEMPERATURE),
           "top_p": number("Top-p", top_p, 0, 1, lo_open=True),
           "top_k": number("Top-k", top_k if top_k not in (None, "") else 0, 0, limits.MAX_TOP_K, integer=True),
           "max_tokens": number("Max tokens", max_tokens, 1, max_tokens_bound(info), integer=True)}
    if min_p not in (None, ""):
        out["min_p"] = number("Min-p", min_p, 0, 1)
    if n not in (None, ""):
        out["n"] = number("N", n, 1, limits.MAX_N, integer=True)
    if seed not in (None, ""):
        out["seed"] = number("Seed", seed, 0, limits.MAX_SEED, integer=True)
    out["stop"] = parse_stops(stop_text)
    out.update(penalties(frequency_penalty, presence_penalty, repetition_penalty))
    return out
