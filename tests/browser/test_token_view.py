"""The token view and the penalties in a real browser: each token of a generation shaded by its probability,
its alternatives on hover matching the API's top_logprobs for that position, the penalties in the request
and in the share link."""
from __future__ import annotations

import json
import math
import urllib.request

import pytest

from laneplay.app.context import request_body
from laneplay.app.params import sampling
from laneplay.app.playground import with_logprobs
from .test_playground import generate, open_playground, output_text, set_field, wait_state

pytestmark = pytest.mark.slow
MAX_TOKENS = 24


def editor_text(page) -> str:
    return page.eval_on_selector("#code .cm-content", "el => el.cmTile ? el.cmTile.view.state.doc.toString() "
                                                        ": el.innerText")


def api_answer(server, code: str, instruction: str) -> dict:
    """The engine's answer to the request the page makes (same prompt, settings and logprobs)."""
    params = sampling(0.0, 1.0, 0, MAX_TOKENS, 0, "", None, frequency_penalty=0.5, repetition_penalty=1.3)
    body, chat = request_body("chat", code, instruction, params, None)
    req = urllib.request.Request(server.status()["url"] + "/v1/chat/completions",
                                 data=json.dumps(with_logprobs(body, chat)).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())["choices"][0]


def test_hovering_a_token_shows_the_alternatives_the_api_gives(new_context, server):
    server.wait_ready()
    ctx, rec, page = open_playground(new_context, server)
    page.fill("#frequency-penalty input[type=number]", "0.5")
    page.locator("#frequency-penalty input[type=number]").press("Tab")
    set_field(page, "repetition-penalty", "1.3")
    assert page.is_checked("#show-tokens input")
    generate(page, max_tokens=MAX_TOKENS)
    wait_state(page, ("done",))
    page.wait_for_selector("#token-view .lp-tok")
    assert page.locator("#token-view").count() == 1
    shown = page.eval_on_selector_all("#token-view .lp-tok", "els => els.map(e => ({text: e.textContent, "
                                      "logprob: Number(e.dataset.logprob), top: JSON.parse(e.dataset.top)}))")
    assert "".join(t["text"] for t in shown) == output_text(page)

    choice = api_answer(server, editor_text(page), page.input_value("#instruction textarea"))
    content = choice["logprobs"]["content"]
    assert [t["token"] for t in content] == [t["text"] for t in shown]
    assert "".join(t["token"] for t in content) == choice["message"]["content"] == output_text(page)
    # the position where the model hesitated most: its alternatives say the most
    k = min(range(len(content)), key=lambda i: content[i]["top_logprobs"][0]["logprob"] - (
        content[i]["top_logprobs"][1]["logprob"] if len(content[i]["top_logprobs"]) > 1 else -99))
    page.hover(f'#token-view .lp-tok[data-i="{k}"]')
    page.wait_for_selector("#token-alternatives:not([hidden])")
    assert page.get_attribute("#token-alternatives", "data-for") == f"token-view:{k}"
    rows = page.eval_on_selector_all("#token-alternatives .lp-alt", "rows => rows.map(r => ({token: r.dataset.token, "
                                     "p: Number(r.dataset.p), shown: r.querySelector('.lp-alt-p').textContent}))")
    want = content[k]["top_logprobs"]
    assert [r["token"] for r in rows] == [a["token"] for a in want] and len(rows) == 5
    for r, a in zip(rows, want):
        assert abs(r["p"] - math.exp(a["logprob"])) < 1e-6
        assert r["shown"] == f"{100 * math.exp(a['logprob']):.2f}%"
    assert sum(r["p"] for r in rows) <= 1 + 1e-6
    assert abs(shown[k]["logprob"] - content[k]["logprob"]) < 1e-5

    page.click("#share")  # the penalties are stored with the session and shown in its share link
    page.wait_for_selector("#share-link")
    viewer = ctx.new_page()
    viewer.goto(page.get_attribute("#share-link", "href"))
    text = viewer.inner_text("body")
    assert "frequency_penalty=0.5" in text and "repetition_penalty=1.3" in text

    page.get_by_role("tab", name="Side by side").click()  # each column its own view, the Playground's stays unique
    page.click("#sbs-generate")
    page.wait_for_selector("#sbs-token-view-0 .lp-tok", timeout=180_000)
    page.wait_for_selector("#sbs-token-view-1 .lp-tok", timeout=180_000)
    assert page.locator("#token-view").count() == 1
