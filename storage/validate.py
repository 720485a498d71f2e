"""Input checks. Each raises `ValidationError` naming the field and, for sizes, the limit."""
from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

from laneplay.storage import limits


class ValidationError(ValueError):
    """Input is oversized or malformed; nothing was written."""


class NotFound(LookupError):
    """A write referred to a session or comparison that does not exist, or not to its owner."""


class LimitReached(ValidationError):
    """An owner holds as much as one owner may (sessions); nothing was written."""


def _limit(hi: int | float | str) -> tuple[int | float, str]:
    """A limit given by name (e.g. "MAX_SAMPLES") is looked up and quoted in messages."""
    if isinstance(hi, str):
        return getattr(limits, hi), f" ({hi})"
    return hi, ""


def text(field: str, value: Any, limit: str, *, optional: bool = False, min_chars: int = 0) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise ValidationError(f"{field}: expected a string, got {type(value).__name__}")
    hi, name = _limit(limit)
    if len(value) > hi:
        raise ValidationError(f"{field}: {len(value)} characters exceeds the limit of {hi}{name}")
    if len(value) < min_chars:
        raise ValidationError(f"{field}: must have at least {min_chars} character(s)")
    if "\x00" in value:
        raise ValidationError(f"{field}: contains a NUL character")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate ("\ud800"): JSON can carry it, UTF-8 cannot
        raise ValidationError(f"{field}: contains an unpaired surrogate at character {e.start}; "
                              "text must be valid Unicode") from None
    return str(value)


def integer(field: str, value: Any, lo: int, hi: int | str, *, optional: bool = False) -> int | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValidationError(f"{field}: expected an integer, got {type(value).__name__}")
    top, name = _limit(hi)
    if not lo <= value <= top:
        raise ValidationError(f"{field}: {value} is outside the allowed range {lo}..{top}{name}")
    return value


def number(field: str, value: Any, lo: float, hi: float | str, *, optional: bool = False,
           lo_open: bool = False) -> float | None:
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValidationError(f"{field}: expected a number, got {type(value).__name__}")
    top, name = _limit(hi)
    try:
        value = float(value)
    except OverflowError:  # an integer too large for a float (e.g. 400 digits)
        raise ValidationError(f"{field}: {str(value)[:20]}... is outside the allowed range "
                              f"[{lo}, {top}]{name}") from None
    if not math.isfinite(value) or value > top or value < lo or (lo_open and value == lo):
        low = f"({lo}" if lo_open else f"[{lo}"
        raise ValidationError(f"{field}: {value} is outside the allowed range {low}, {top}]{name}")
    return value


def boolean(field: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValidationError(f"{field}: expected true or false, got {type(value).__name__}")
    return value


def one_of(field: str, value: Any, choices: Sequence[str]) -> str:
    if value not in choices:
        raise ValidationError(f"{field}: {repr(value)[:40]} is not one of {', '.join(choices)}")
    return value


def items(field: str, value: Any, limit: int | str, *, min_items: int = 0) -> list:
    """A list/tuple (not a string, not a dict) of at most `limit` items."""
    if isinstance(value, (str, bytes, Mapping)) or not isinstance(value, Sequence):
        raise ValidationError(f"{field}: expected a list, got {type(value).__name__}")
    hi, name = _limit(limit)
    if len(value) > hi:
        raise ValidationError(f"{field}: {len(value)} items exceeds the limit of {hi}{name}")
    if len(value) < min_items:
        raise ValidationError(f"{field}: must have at least {min_items} item(s)")
    return list(value)


def keyed(field: str, value: Any, allowed: Sequence[str]) -> Mapping:
    """A mapping whose keys are all in `allowed` (None reads as empty); the caller checks the values."""
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ValidationError(f"{field}: expected a mapping, got {type(value).__name__}")
    unknown = sorted(set(value) - set(allowed), key=str)
    if unknown:
        raise ValidationError(f"{field}: unknown key(s) {unknown}; allowed: {', '.join(allowed)}")
    return value


def record(field: str, value: Any, names: Sequence[str]) -> dict[str, Any]:
    """Reads `names` from a mapping, a dataclass or any object with attributes (the engine's metrics
    record is attribute-access). A nested `metrics` (mapping or object) is merged in, so both
    flat records and {"text": ..., "metrics": ev.metrics} work. Other keys are ignored: the metrics
    record may carry more fields than storage keeps."""
    if isinstance(value, Mapping):
        read = value.get
    elif dataclasses.is_dataclass(value) or hasattr(value, "__dict__") or hasattr(value, "_fields"):
        read = lambda k, d=None: getattr(value, k, d)  # noqa: E731
    else:
        raise ValidationError(f"{field}: expected a mapping or a record object, got {type(value).__name__}")

    def get(k):
        try:
            return read(k)
        except Exception as e:  # a hostile mapping or property: its failure is bad input, not ours
            raise ValidationError(f"{field}.{k}: could not be read ({type(e).__name__})") from None

    out = {k: get(k) for k in names}
    metrics = get("metrics")
    if metrics is not None:
        nested = record(f"{field}.metrics", metrics, names)
        out.update({k: v for k, v in nested.items() if out[k] is None})
    return out


SAMPLING_PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "frequency_penalty",
                   "presence_penalty", "repetition_penalty")


def sampling_params(field: str, value: Any) -> dict[str, Any]:
    """The engine's SamplingParams as a dict; every key optional, no unknown keys."""
    value = keyed(field, value, SAMPLING_PARAMS)
    checks = {
        "max_tokens": lambda v: integer(f"{field}.max_tokens", v, 1, "MAX_TOKENS"),
        "temperature": lambda v: number(f"{field}.temperature", v, 0.0, "MAX_TEMPERATURE"),
        "top_p": lambda v: number(f"{field}.top_p", v, 0.0, 1.0, lo_open=True),
        "top_k": lambda v: integer(f"{field}.top_k", v, 0, "MAX_TOP_K"),
        "seed": lambda v: integer(f"{field}.seed", v, 0, "MAX_SEED", optional=True),
        "n": lambda v: integer(f"{field}.n", v, 1, "MAX_SAMPLES"),
        "frequency_penalty": lambda v: number(f"{field}.frequency_penalty", v, limits.MIN_PENALTY, "MAX_PENALTY"),
        "presence_penalty": lambda v: number(f"{field}.presence_penalty", v, limits.MIN_PENALTY, "MAX_PENALTY"),
        "repetition_penalty": lambda v: number(f"{field}.repetition_penalty", v, 0.0, "MAX_REPETITION_PENALTY",
                                               lo_open=True),
        "stop": lambda v: [text(f"{field}.stop[{i}]", s, "MAX_STOP_CHARS", min_chars=1)
                           for i, s in enumerate(items(f"{field}.stop", v, "MAX_STOP_SEQUENCES"))],
    }
    return {k: checks[k](v) for k, v in value.items()}
