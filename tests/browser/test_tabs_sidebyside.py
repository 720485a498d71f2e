"""The Side by side tab in a real browser against a real `laneplay serve`: three columns with their own
settings stream at once from one batched request, then "Run tests", "Use this" and the share page; and two
greedy columns of one code edit, speculation on in one and off in the other, as one request per column."""
from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest

from laneplay.app.playground import with_logprobs
from laneplay.app.sidebyside import column_code, engine_requests, settings
from tests.engine.test_server import scrape, speculation_counts

from .conftest import fill_editor, screenshot
from .test_playground import meter, set_field, wait_state

pytestmark = pytest.mark.slow
CODE = "def add(a, b):\n"
INSTRUCTION = "Write a Python function add(a, b) that returns the sum of a and b."
TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\n"
COLUMNS = 3
OUTCOMES = ("pass", "fail", "error", "timeout", "memory")


def editor_text(page, elem: str) -> str:
    return page.eval_on_selector(f"{elem} .cm-content", "el => el.cmTile ? el.cmTile.view.state.doc.toString() "
                                                         ": el.innerText")


def meters(page) -> list[dict]:
    return [meter(page, f"#sbs-meter-{i}") for i in range(COLUMNS)]


def choose_preset(page, column: int, name: str) -> None:
    box = page.locator(f"#sbs-preset-{column} input")
    box.click()
    page.locator(f"#{box.get_attribute('aria-controls')} [role=option][aria-label='{name}']").click()
    temperature = "0" if name == "greedy" else name.removeprefix("T=")
    page.wait_for_function(f"() => document.querySelector('#sbs-temp-{column} input').value === '{temperature}'")


def show_columns(page) -> None:
    page.evaluate("document.querySelector('#sbs-aggregate').scrollIntoView({block: 'start'})")


def result(page, column: int) -> str:
    page.wait_for_function(f"() => {list(OUTCOMES) + ['invalid', 'unavailable']}.includes("
                           f"document.querySelector('#sbs-result-{column}')?.dataset.status)", timeout=60_000)
    return page.get_attribute(f"#sbs-result-{column}", "data-status")


def open_side_by_side(server, new_context, code: str, instruction: str, shows: str, columns: int):
    """A fresh browser on the Playground with this code and instruction, then the Side by side tab (once
    its prompt line shows `shows`) set to `columns` columns."""
    ctx, rec = new_context()
    page = ctx.new_page()
    page.goto(server.url + "/")
    page.wait_for_selector("#meter")
    server.wait_ready()
    fill_editor(page, "#code", code)
    page.locator("#instruction textarea").fill(instruction)
    page.get_by_role("tab", name="Side by side").click()
    page.wait_for_function("s => (document.querySelector('#sbs-prompt')?.innerText || '').includes(s)", arg=shows)
    page.locator("#sbs-columns label").filter(has_text=re.compile(rf"^\s*{columns}\s*$")).click()
    return ctx, rec, page


def test_three_columns_stream_as_one_batch_then_test_use_and_share(server, new_context):
    ctx, rec, page = open_side_by_side(server, new_context, CODE, INSTRUCTION, "add(a, b)", 3)
    assert page.locator("#sbs-col-3").is_hidden() and page.locator("#sbs-col-2").is_visible()
    choose_preset(page, 1, "T=0.8")  # column 0 stays greedy (its default)
    choose_preset(page, 2, "T=1.2")
    set_field(page, "sbs-seed-1", "1")
    set_field(page, "sbs-seed-2", "2")
    set_field(page, "sbs-max-tokens", "48")
    wait_state(page, ["idle"], timeout=30, elem="#sbs-meter-0")

    page.click("#sbs-generate")
    show_columns(page)
    started, together, shot = time.monotonic(), None, False
    while time.monotonic() - started < 120 and not shot:  # all three decode at once, each with a live rate
        ms = meters(page)
        running = all(m["state"] == "running" and m["tokens"] > 0 for m in ms)
        together = together or (ms if running else None)
        if together and (not running or min(m["tokens"] for m in ms) >= 12):  # a screenshot with some text
            screenshot(page, "side-by-side-running")
            shot = True
        assert together or not any(m["state"] in ("done", "error") for m in ms), f"never all running at once: {ms}"
        time.sleep(0.03)
    assert together is not None, page.inner_text("#sbs-error")
    done = [wait_state(page, ["done", "error"], elem=f"#sbs-meter-{i}") for i in range(COLUMNS)]
    assert all(m["state"] == "done" and m["tokens"] >= 1 and m["ttft"] > 0 for m in done), \
        (done, page.inner_text("#sbs-error"))
    page.wait_for_function("() => document.querySelector('#sbs-aggregate').dataset.state === 'done'")
    assert page.get_attribute("#sbs-aggregate", "data-columns") == "3"
    assert float(page.get_attribute("#sbs-aggregate", "data-batch-tps")) > 0
    # The batch-1 reference is this page's own measurement: none yet (the other browsers' Playground runs on
    # this server do not count), so nothing is estimated.
    assert page.get_attribute("#sbs-aggregate", "data-single-ms-per-token") == ""
    assert "run one Playground generation in this page" in page.inner_text("#sbs-aggregate")
    texts = [editor_text(page, f"#sbs-col-{i}") for i in range(COLUMNS)]
    assert all(t.strip() for t in texts) and len(set(texts)) == COLUMNS, texts

    # Run tests: bad tests are a message and nothing runs; good ones give an outcome from the sandbox.
    fill_editor(page, "#sbs-tests", "x = 1\n")
    page.click("#sbs-test-1")
    assert result(page, 1) == "invalid" and "no assert" in page.inner_text("#sbs-result-1")
    fill_editor(page, "#sbs-tests", TESTS)
    page.click("#sbs-test-0")
    assert result(page, 0) in OUTCOMES, page.inner_text("#sbs-result-0")
    show_columns(page)
    screenshot(page, "side-by-side-done")

    # Use this: the column's code block goes into the Playground's editor.
    page.click("#sbs-use-0")
    page.wait_for_selector("#generate", state="visible")
    expected = column_code("chat", CODE, INSTRUCTION, texts[0], "add")
    assert expected.strip()
    page.wait_for_function("want => { const el = document.querySelector('#code .cm-content'); const t = el.cmTile ? "
                           "el.cmTile.view.state.doc.toString() : el.innerText; return t.trim() === want; }",
                           arg=expected.strip(), timeout=10_000)

    # The share page shows the batch read-only as columns, each with its settings, meter and test status.
    page.click("#share")
    page.wait_for_selector("#share-link")
    viewer = ctx.new_page()
    assert viewer.goto(page.get_attribute("#share-link", "href")).status == 200
    assert viewer.locator(".lp-sbs-share-col").count() == COLUMNS
    assert viewer.locator(".lp-sbs-share .lp-meter[data-state=done]").count() == COLUMNS
    assert "greedy" in viewer.inner_text(".lp-sbs-share-col[data-column='0']")
    assert viewer.get_attribute(".lp-sbs-share-col[data-column='0'] .lp-result", "data-status") in OUTCOMES

    # After a Playground generation in this page, its ms/token is the reference of the next batch.
    page.get_by_role("tab", name="Playground").click()
    set_field(page, "max-tokens", "16")
    page.click("#generate")
    alone = wait_state(page, ["done", "error", "stopped"], timeout=120)
    assert alone["state"] == "done", page.inner_text("#error")
    alone_ms = float(page.get_attribute("#meter", "data-ms-per-token"))
    page.get_by_role("tab", name="Side by side").click()
    set_field(page, "sbs-max-tokens", "8")
    page.click("#sbs-generate")
    page.wait_for_function("() => { const a = document.querySelector('#sbs-aggregate').dataset; "
                           "return a.state === 'done' && Number(a.tokens) <= 3 * 8; }", timeout=120_000)  # the new batch
    assert float(page.get_attribute("#sbs-aggregate", "data-single-ms-per-token")) == pytest.approx(alone_ms, abs=0.01)
    assert "this page's last Playground generation" in page.inner_text("#sbs-aggregate")
    assert rec.hosts == {"127.0.0.1"}, rec.hosts


SPEC_TOKENS = 40
SPEC_CODE = "".join(f"    def get_{n}(self):\n        return self.{n}\n\n" for n in ("alpha", "beta", "gamma", "delta"))
SPEC_CODE = "class Box:\n" + SPEC_CODE
SPEC_INSTRUCTION = "Add a docstring to every method of this class. Reply with the whole class."


def spec_meter(page, column: int) -> dict:
    return page.eval_on_selector(f"#sbs-meter-{column}", "m => ({perStep: m.dataset.acceptedPerStep, acceptance: "
                                                         "m.dataset.acceptance, tokens: Number(m.dataset.tokens)})")


def engine_idle(server, timeout: float = 30) -> None:
    """Until the engine runs and queues nothing (what earlier tests left ends first), or the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with urllib.request.urlopen(server.status()["url"] + "/health", timeout=10) as r:
            h = json.loads(r.read())
        if not h["running"] and not h["queue_depth"]:
            return
        time.sleep(0.2)


def alone(server) -> dict:
    """Column 0's request as the tab sends it, straight to the engine, alone."""
    shared, cols = settings(2, [0, 0], [1, 1], [0, 0], [0, 1], SPEC_TOKENS, "")
    (col, body, chat), _ = engine_requests(True, "chat", SPEC_CODE, SPEC_INSTRUCTION, shared, cols, [True, False])
    assert col == 0 and body["laneplay"] == {"speculative": "lookup"} and chat
    req = urllib.request.Request(server.status()["url"] + "/v1/chat/completions",
                                 data=json.dumps(with_logprobs(body, chat)).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def test_two_greedy_columns_with_speculation_on_and_off_give_the_same_text(server, new_context):
    ctx, rec, page = open_side_by_side(server, new_context, SPEC_CODE, SPEC_INSTRUCTION, "get_alpha", 2)
    page.locator("#sbs-col-2").wait_for(state="hidden")
    choose_preset(page, 1, "greedy")  # column 0 is greedy already: both are now the same request
    assert [page.input_value(f"#sbs-{k}-{i} input") for i in (0, 1) for k in ("temp", "top-p", "top-k")] == \
        ["0", "1", "0"] * 2
    assert not page.is_checked("#sbs-speculative-0 input") and not page.is_checked("#sbs-speculative-1 input")
    assert "greedy" in page.inner_text("#sbs-speculative-0")  # the hint: speculation applies to greedy columns
    page.locator("#sbs-speculative-0 input").check()
    set_field(page, "sbs-max-tokens", str(SPEC_TOKENS))
    wait_state(page, ["idle"], timeout=30, elem="#sbs-meter-0")

    engine_idle(server)
    before = scrape(server.status()["url"])
    page.click("#sbs-generate")
    done = [wait_state(page, ["done", "error", "stopped"], elem=f"#sbs-meter-{i}") for i in (0, 1)]
    assert all(m["state"] == "done" and m["tokens"] > 1 for m in done), (done, page.inner_text("#sbs-error"))
    page.wait_for_function("() => document.querySelector('#sbs-aggregate').dataset.state === 'done'")
    agg = page.eval_on_selector("#sbs-aggregate", "a => ({...a.dataset, text: a.innerText})")
    assert agg["requests"] == "per-column" and agg["speculative"] == "0" and agg["columns"] == "2", agg
    assert "2 requests, one per column (speculation on in column 1)" in agg["text"] and float(agg["batchTps"]) > 0
    texts = [editor_text(page, f"#sbs-col-{i}") for i in (0, 1)]
    assert texts[0].strip() and texts[0] == texts[1], texts  # greedy is exact, speculating or not

    shown, plain = spec_meter(page, 0), spec_meter(page, 1)
    deadline = time.monotonic() + 10  # the engine counts a request once it has ended, all its counts at once
    while time.monotonic() < deadline:
        after = scrape(server.status()["url"])
        spec, off = speculation_counts(before, after, "lookup"), speculation_counts(before, after, "off")
        if spec["draft_tokens"] and off["decode_steps"]:
            break
        time.sleep(0.1)
    assert spec["draft_tokens"] > 0 and off["draft_tokens"] == 0 and off["step_tokens"] == plain["tokens"] - 1, \
        (spec, off, plain)
    assert shown["tokens"] == spec["step_tokens"] + 1, (shown, spec)
    assert shown["perStep"] == f"{spec['step_tokens'] / spec['decode_steps']:.3f}", (shown, spec)
    assert shown["acceptance"] == f"{spec['accepted_tokens'] / spec['draft_tokens']:.3f}", (shown, spec)
    assert float(shown["perStep"]) > 1.0  # the class was drafted from the prompt and kept
    assert alone(server)["choices"][0]["message"]["content"] == texts[0]  # what the request gets alone
    assert plain["perStep"] == "" and plain["acceptance"] == "", plain  # column 1 did not speculate

    # The run is stored with each column's speculation and shown so in its share page.
    page.get_by_role("tab", name="Playground").click()
    page.click("#share")
    page.wait_for_selector("#share-link")
    viewer = ctx.new_page()
    assert viewer.goto(page.get_attribute("#share-link", "href")).status == 200
    cols = viewer.locator(".lp-sbs-share-col")
    assert cols.count() == 2 and "one request per column" in viewer.inner_text(".lp-sbs-share h3")
    assert [cols.nth(i).get_attribute("data-speculative") for i in (0, 1)] == ["1", "0"]
    assert "speculation on" in cols.nth(0).inner_text() and "speculation off" in cols.nth(1).inner_text()
    rec.check()
