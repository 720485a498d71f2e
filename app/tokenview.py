"""The token view: a generation's tokens, each shaded by the model's probability of it, with its most likely
alternatives (static/tokenview.js shows them on hover, focus or click).

The numbers are the engine's `logprobs` (the model's log-softmax over the whole vocabulary of the raw
logits: what the model thought of each token, before temperature, penalties and truncation). Each token is
an element with `data-logprob` (its log-probability) and `data-top` (JSON: [{"token", "logprob", "p"}], the
alternatives, best first, p = exp(logprob)); the tokens' texts concatenate to the answer.
"""
from __future__ import annotations

import html
import json
import math

TOP_LOGPROBS = 5  # alternatives the Playground and Side by side ask for


def _p(logprob) -> float | None:
    return math.exp(logprob) if isinstance(logprob, (int, float)) else None


def render(tokens: list[dict], elem_id: str = "token-view") -> str:
    """The view of `tokens` (api_client.tokens_of records) as one element `elem_id`."""
    spans = []
    for i, t in enumerate(tokens):
        p = _p(t.get("logprob"))
        top = [{"token": a["token"], "logprob": a["logprob"], "p": _p(a["logprob"])} for a in t.get("top") or []
               if _p(a.get("logprob")) is not None]
        shade = f' style="--p:{p:.4f}"' if p is not None else ""
        logprob = "" if p is None else f"{t['logprob']:.6g}"
        spans.append(f'<span class="lp-tok" tabindex="0" data-i="{i}" data-logprob="{logprob}" '
                     f'data-top="{html.escape(json.dumps(top), quote=True)}"{shade}>{html.escape(t.get("token", ""))}</span>')
    note = "" if tokens else '<span class="lp-tokens-note">Generate to see each token and the alternatives the model weighed.</span>'
    return (f'<div id="{elem_id}" class="lp-tokview" data-tokens="{len(tokens)}" aria-label="tokens by probability">'
            f'{"".join(spans)}{note}</div>')
