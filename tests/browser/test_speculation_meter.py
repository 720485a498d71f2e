"""Speculative decoding on the Playground's meter, in a real browser: with the toggle on, a greedy
completion of code that repeats itself speculates, and the meter's tokens per step and acceptance are the
engine's own counts for that request (the same request sent to the engine's API gives the same counts:
the controller reads no clock, so a greedy request's drafts depend on its tokens alone)."""
from __future__ import annotations

import json
import urllib.request

import pytest

from laneplay.app.context import request_body
from laneplay.app.params import sampling
from laneplay.app.playground import with_logprobs, with_speculation
from .conftest import fill_editor
from .test_playground import open_playground, set_field, wait_state

pytestmark = pytest.mark.slow
MAX_TOKENS = 40
CODE = "".join(f"def get_{n}(self):\n    return self.{n}\n\n" for n in ("alpha", "beta", "gamma", "delta", "eps"))


def engine_counts(server) -> dict:
    params = sampling(0.0, 1.0, 0, MAX_TOKENS, 0, "", None)
    body, chat = request_body("complete", CODE, "", params, None)
    body = with_speculation(with_logprobs(body, chat), True)
    req = urllib.request.Request(server.status()["url"] + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_the_meter_shows_the_engines_speculation_counts(new_context, server):
    server.wait_ready()
    ctx, rec, page = open_playground(new_context, server)
    assert page.is_checked("#speculative input")
    page.locator("#mode input[value=complete]").check()
    fill_editor(page, "#code", CODE)
    assert page.input_value("#temperature input[type=number]") == "0"  # greedy: "auto" speculates it
    set_field(page, "max-tokens", str(MAX_TOKENS))
    page.click("#generate")
    wait_state(page, ("done",))
    shown = page.eval_on_selector("#meter", "m => ({perStep: m.dataset.acceptedPerStep, acceptance: "
                                            "m.dataset.acceptance, tokens: Number(m.dataset.tokens)})")
    reply = engine_counts(server)
    lp, usage = reply["laneplay"], reply["usage"]
    assert lp["speculative"] == "lookup" and usage["draft_tokens"] > 0, lp
    steps, tokens = lp["decode_steps"], usage["completion_tokens"]
    assert shown["perStep"] == f"{(tokens - 1) / steps:.3f}"
    assert shown["acceptance"] == f"{usage['accepted_tokens'] / usage['draft_tokens']:.3f}"
    assert float(shown["perStep"]) > 1.0  # the repeated code was drafted and kept
    rec.check()
