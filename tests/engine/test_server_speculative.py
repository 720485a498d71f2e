"""The API's speculation: the "laneplay.speculative" request field, the counts in usage and the final
"laneplay" object, and the live counts streamed as SSE comments (what the meter shows)."""
import time
from pathlib import Path

import httpx
import pytest

from laneplay.engine import SamplingParams
from laneplay.engine.server import create_app
from tests.engine.test_server import scrape, serve, speculation_counts, sse_data

# Code followed by the start of its copy: the lookup finds the rest of it.
CODE = ("def area(width, height):\n    return width * height\n\n\ndef perimeter(width, height):\n"
        "    return 2 * (width + height)\n\n\n# The same two functions again:\ndef area(width, height):\n")


@pytest.fixture(scope="module")
def server(default_engine):
    with serve(create_app(default_engine, model_name="m")) as url:
        yield url


@pytest.mark.parametrize("value", ["fast", 1, None])
def test_a_bad_speculative_mode_is_a_400_naming_the_field(server, value):
    r = httpx.post(server + "/v1/completions", timeout=60,
                   json={"prompt": "x", "max_tokens": 2, "laneplay": {"speculative": value}})
    if value is None:  # null is "not given": the default
        assert r.status_code == 200, r.text
        return
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "laneplay.speculative"


def test_counts_in_usage_and_laneplay_equal_the_engines(server, default_engine):
    body = {"prompt": CODE, "max_tokens": 40, "temperature": 0, "ignore_eos": True}
    want = {}
    for mode in ("lookup", "off"):
        finals = [ev.metrics for ev in default_engine.generate(
            CODE, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), speculative=mode) if ev.finish_reason]
        want[mode] = finals[0]
        r = httpx.post(server + "/v1/completions", timeout=120, json={**body, "laneplay": {"speculative": mode}})
        assert r.status_code == 200, r.text
        usage, lp = r.json()["usage"], r.json()["laneplay"]
        m = want[mode]
        assert (usage["draft_tokens"], usage["accepted_tokens"]) == (m.draft_tokens, m.accepted_tokens)
        assert (lp["draft_tokens"], lp["accepted_tokens"], lp["decode_steps"]) == (
            m.draft_tokens, m.accepted_tokens, m.decode_steps)
        assert lp["speculative"] == mode
        assert lp["per_choice"][0]["accepted_tokens"] == m.accepted_tokens
    assert want["lookup"].accepted_tokens > 5 and want["off"].draft_tokens == 0
    assert r.json()["laneplay"]["speculative_reason"] == "off by request"
    assert r.json()["laneplay"]["acceptance"] is None and r.json()["laneplay"]["accepted_per_step"] == 1.0


def test_the_stream_carries_the_live_counts_and_they_end_at_the_final_ones(server):
    body = {"prompt": CODE, "max_tokens": 40, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}, "laneplay": {"speculative": "lookup"}}
    with httpx.stream("POST", server + "/v1/completions", json=body, timeout=120) as s:
        lines = list(s.iter_lines())
    live = [tuple(map(int, line.split()[4:])) for line in lines if line.startswith(": laneplay speculative 0 ")]
    final = [c for c in sse_data(lines) if c.get("usage")][-1]
    lp = final["laneplay"]
    assert len(live) > 1 and live == sorted(live)  # counts only grow
    drafts, accepted, steps, tokens, paused_steps, paused = live[-1]
    assert (drafts, accepted, steps, tokens) == (lp["draft_tokens"], lp["accepted_tokens"], lp["decode_steps"], 40)
    assert paused_steps == paused == lp["paused_steps"] == 0  # alone: never held back
    assert lp["acceptance"] == round(accepted / drafts, 3)
    assert lp["accepted_per_step"] == round((tokens - 1) / steps, 3) > 1


def test_two_requests_at_once_get_the_tokens_one_gets_alone_and_the_metrics_count_their_speculation():
    """Side by side's case on the CPU default path (int4, fused low-bit step): the same greedy chat request
    twice at once, one speculating and one not, shares the engine's steps (the verify rows join the other
    request's row), and each gets the text the request gets alone. /metrics counts what each speculation
    mode did, as the requests' own counts say."""
    import threading

    from laneplay.engine import load_engine
    from laneplay.kernels import lowbit

    code = "class Box:\n" + "".join(f"    def get_{n}(self):\n        return self.{n}\n\n"
                                    for n in ("alpha", "beta", "gamma", "delta"))
    content = "Add a docstring to every method of this class. Reply with the whole class.\n\n```python\n" + code + "```"
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": 40, "temperature": 0,
            "logprobs": True, "top_logprobs": 5}
    engine = load_engine("smollm2-135m-instruct", dtype="int4")
    try:
        with serve(create_app(engine, model_name="m")) as url:
            def ask(mode: str) -> dict:
                r = httpx.post(url + "/v1/chat/completions", json={**body, "laneplay": {"speculative": mode}},
                               timeout=120)
                assert r.status_code == 200, r.text
                return r.json()

            alone = ask("off")["choices"][0]["message"]["content"]
            before = scrape(url)
            replies = {}
            threads = [threading.Thread(target=lambda m=m: replies.__setitem__(m, ask(m))) for m in ("lookup", "off")]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            done = ("laneplay_generations_total", (("outcome", "completed"),))
            deadline = time.monotonic() + 10
            while (after := scrape(url))[done] - before[done] < 2 and time.monotonic() < deadline:
                time.sleep(0.05)
    finally:
        engine.close()
    texts = {m: r["choices"][0]["message"]["content"] for m, r in replies.items()}
    info = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    cpu = next((ln.split(":", 1)[1].strip() for ln in info.splitlines() if ln.startswith("model name")), "?")
    where = f"{cpu}: kernel {lowbit.kernel_name()} of {lowbit.kernels()}"
    assert texts["lookup"] == texts["off"] == alone, (where, texts, alone)
    lp = replies["lookup"]["laneplay"]
    assert lp["speculative"] == "lookup" and lp["draft_tokens"] > 0 and lp["accepted_per_step"] > 1, lp
    for mode, reply in replies.items():
        lp, got = reply["laneplay"], speculation_counts(before, after, mode)
        assert got == {"draft_tokens": lp["draft_tokens"], "accepted_tokens": lp["accepted_tokens"],
                       "decode_steps": lp["decode_steps"],
                       "step_tokens": reply["usage"]["completion_tokens"] - 1}, (mode, got, lp)
