"""The app under its security headers, in a real browser: every tab works under the Content-Security-Policy
with no violation, the headers are on every kind of answer, and "Forget this browser" deletes what the
browser had and gives it a new identity."""
from __future__ import annotations

import urllib.request

import pytest

from .conftest import VIEWPORT, Recorder

pytestmark = pytest.mark.slow
TABS = ["Playground", "Side by side", "pass@N", "DTP", "History"]


def headers_of(url: str, method: str = "GET") -> dict:
    req = urllib.request.Request(url, method=method)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return {k.lower(): v for k, v in r.headers.items()}
    except urllib.error.HTTPError as e:
        return {k.lower(): v for k, v in e.headers.items()}


def test_every_tab_runs_under_the_csp_and_every_answer_carries_the_headers(server, browser):
    ctx = browser.new_context(viewport=VIEWPORT)
    rec = Recorder()
    rec.attach(ctx)
    page = ctx.new_page()
    violations = []
    page.on("console", lambda m: violations.append(m.text) if "Content Security Policy" in m.text else None)
    page.on("pageerror", lambda e: violations.append(str(e)))
    response = page.goto(server.url + "/")
    page.wait_for_selector("#meter")
    csp = response.headers["content-security-policy"]
    assert "frame-ancestors 'none'" in csp and "'nonce-" in csp and "default-src 'self'" in csp
    assert "http:" not in csp and "https:" not in csp and "*" not in csp  # no outside hosts
    for name in TABS:
        page.get_by_role("tab", name=name).click()
        page.wait_for_timeout(300)
    page.get_by_role("tab", name="Playground").click()
    page.wait_for_function("() => ['idle', 'loading'].includes(document.querySelector('#meter').dataset.state)")
    assert not violations, violations
    ctx.close()
    rec.check()
    for url in (server.url + "/", server.url + "/s/" + "A" * 43, server.url + "/gradio_api/info",
                server.url + "/api/status", server.url + "/static/lp/meter.js"):
        h = headers_of(url)
        assert h.get("x-content-type-options") == "nosniff", url
        assert h.get("x-frame-options") == "DENY" and h.get("referrer-policy") == "no-referrer", url
    assert "frame-ancestors 'none'" in headers_of(server.url + "/s/" + "A" * 43)["content-security-policy"]


def test_forget_this_browser_deletes_its_sessions_and_its_cookie(server, browser):
    from .test_playground import generate, history_rows, wait_state

    server.wait_ready()
    ctx = browser.new_context(viewport=VIEWPORT)
    page = ctx.new_page()
    page.goto(server.url + "/")
    page.wait_for_selector("#meter")
    generate(page, max_tokens=4)
    wait_state(page, ["done"], timeout=120)
    assert len(history_rows(page)) == 1
    before = {c["name"]: c["value"] for c in ctx.cookies()}["laneplay_owner"]
    page.click("#history-forget summary")
    with page.expect_navigation():
        page.click("#history-forget-confirm")
    assert page.url.rstrip("/") == server.url, (page.url, page.content()[:500])
    page.wait_for_selector("#meter")
    after = {c["name"]: c["value"] for c in ctx.cookies()}.get("laneplay_owner")
    assert after and after != before  # a new identity
    assert history_rows(page) == []
    ctx.close()
