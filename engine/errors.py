"""The engine's refusals of a request, typed, so that the server answers each by its kind (one table in
`engine/server.py`, `ENGINE_ERRORS`) and not by reading its sentence.

Each is a `ValueError` (what the engine raised before they had types: callers that catch that still do),
raised before any model work, with a sentence meant for the client and `param`: the request field it is
about (None: the prompt, or the messages of a chat).
"""
from __future__ import annotations


class RequestError(ValueError):
    """A request the engine refuses."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ParameterError(RequestError):
    """A sampling parameter out of its range or of the wrong type (`param`: which, e.g. "samples[2].top_p")."""


class PromptError(RequestError):
    """The prompt itself: empty, not text or token ids, token ids outside the vocabulary."""


class ContextLengthError(RequestError):
    """The prompt and max_tokens together pass the model's context."""


class KVBudgetError(RequestError):
    """The request's KV cache (n samples x positions) would pass the engine's KV budget."""
