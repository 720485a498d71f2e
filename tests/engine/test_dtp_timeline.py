"""The per-request DTP settings of the API ("laneplay": {"collectives", "timeline"}) and every rank's timeline.

A tiny random Laneformer (8 lanes, delay 2) on 2 CPU ranks (gloo), served by the real HTTP server: the
A/B of the delay is two requests, greedy tokens agree, and the timelines of both ranks add up.
"""
import httpx
import pytest

from laneplay.engine import SamplingParams, load_engine
from laneplay.engine.checkpoint import random_laneformer_tensors, tiny_laneformer_config, write_checkpoint
from laneplay.engine.dtp import STEP_COLUMNS, summarize_timeline
from laneplay.engine.server import create_app
from tests.engine.test_server import serve, sse_data

pytestmark = pytest.mark.slow

LANES8 = dict(num_lanes=8, num_attention_heads=16, num_key_value_heads=8, hidden_size=64, intermediate_size=128,
              broadcast_delay=2, use_early_comm=True)
TOKENS = 12
PROMPT = "def add(a, b):"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    raw = tiny_laneformer_config(**LANES8)
    return write_checkpoint(tmp_path_factory.mktemp("dtp-timeline"), raw, random_laneformer_tensors(raw, seed=3))


@pytest.fixture(scope="module")
def engine(checkpoint):
    eng = load_engine(checkpoint, world_size=2, timeout_s=60)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def server(engine):
    with serve(create_app(engine)) as url:
        yield url


def complete(url, **laneplay):
    body = {"prompt": PROMPT, "max_tokens": TOKENS, "temperature": 0, "ignore_eos": True}
    if laneplay:
        body["laneplay"] = laneplay
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def check_rank(tl: dict, rank: int, steps: int) -> None:
    """One rank's summary: its steps add up (a step holds its waits), and the totals are the steps' sums."""
    assert tl["rank"] == rank and tl["decode_steps"] == steps and tl["first_step"] == 0
    cols = tl["steps"]
    assert set(cols) == set(STEP_COLUMNS) and all(len(v) == steps for v in cols.values())
    for i in range(steps):
        blocked = cols["waited_ms"][i] + cols["exposed_ms"][i] + cols["blocking_ms"][i]
        assert cols["ms"][i] > 0 and cols["ms"][i] >= blocked - 1e-3 and cols["compute_ms"][i] >= -1e-3
        assert cols["blocking"][i] >= 1  # at least the gather that picks the step's token
    assert tl["step"]["count"] == steps and tl["step"]["ms"] == pytest.approx(sum(cols["ms"]), abs=1e-2)
    for kind, col in (("issue", "issued"), ("wait", "waits"), ("exposed", "exposed"), ("blocking", "blocking")):
        assert tl[kind]["count"] == sum(cols[col])
    assert tl["compute_ms"] == pytest.approx(sum(cols["compute_ms"]), abs=1e-2)


def test_delayed_and_wait_now_are_the_same_function_with_every_ranks_timeline(server, engine):
    delayed = complete(server, collectives="delayed", timeline=True)
    wait_now = complete(server, collectives="wait_now", timeline=True)
    assert delayed["choices"][0]["text"] == wait_now["choices"][0]["text"]
    assert delayed["usage"]["completion_tokens"] == wait_now["usage"]["completion_tokens"] == TOKENS
    for resp, mode in ((delayed, "delayed"), (wait_now, "wait_now")):
        lp = resp["laneplay"]
        assert lp["collectives"] == mode and lp["world_size"] == 2
        tl = lp["timeline"]
        assert tl["collectives"] == mode and [r["rank"] for r in tl["ranks"]] == [0, 1]
        for rank, summary in enumerate(tl["ranks"]):
            check_rank(summary, rank, TOKENS - 1)  # the first token comes from the prefill
        assert tl["step"] == tl["ranks"][0]["step"]  # the top-level totals are rank 0's
    for summary in delayed["laneplay"]["timeline"]["ranks"]:  # delayed: issued now, waited for d layers later
        assert summary["issue"]["count"] > 0 and summary["wait"]["count"] > 0 and summary["exposed"]["count"] == 0
    for summary in wait_now["laneplay"]["timeline"]["ranks"]:  # wait now: every wait at the issue point
        assert summary["exposed"]["count"] > 0 and summary["exposed"]["ms"] > 0
        assert summary["wait"]["count"] == 0 and summary["wait"]["ms"] == 0 and summary["issue"]["count"] == 0
    # the request's settings were its own: the engine is back to delayed, without recording
    assert engine.runner.wait_now is False and engine.runner.record_timeline is False
    plain = complete(server)
    assert "timeline" not in plain["laneplay"] and "collectives" not in plain["laneplay"]
    assert plain["choices"][0]["text"] == delayed["choices"][0]["text"]


def test_greedy_tokens_are_equal_in_both_modes(engine):
    tokens = {}
    for mode in ("delayed", "wait_now"):
        with engine.request_settings(mode, timeline=True) as used:
            assert used == mode
            tokens[mode] = [t for ev in engine.generate(PROMPT, SamplingParams(max_tokens=TOKENS, ignore_eos=True,
                                                                               temperature=0.0))
                            for t in ev.token_ids]
        assert engine.last_timeline["collectives"] == mode
    assert tokens["delayed"] == tokens["wait_now"] and len(tokens["delayed"]) == TOKENS


def test_a_stream_ends_with_the_timeline(server):
    for usage in (False, True):
        body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "stream": True,
                "laneplay": {"collectives": "wait_now", "timeline": True}}
        if usage:
            body["stream_options"] = {"include_usage": True}
        with httpx.stream("POST", server + "/v1/completions", json=body, timeout=120) as r:
            chunks = list(sse_data(r.iter_lines()))
        final = chunks[-1]["laneplay"]
        assert final["collectives"] == "wait_now" and len(final["timeline"]["ranks"]) == 2
        assert final["timeline"]["ranks"][1]["decode_steps"] == 5
        assert all("timeline" not in c.get("laneplay", {}) for c in chunks[:-1])
        assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"])


BAD = [
    ({"laneplay": "wait_now"}, "laneplay", "invalid_type"),
    ({"laneplay": {"collectives": "now"}}, "laneplay.collectives", "invalid_value"),
    ({"laneplay": {"collectives": 1}}, "laneplay.collectives", "invalid_type"),
    ({"laneplay": {"timeline": "yes"}}, "laneplay.timeline", "invalid_type"),
    ({"laneplay": {"collective": "delayed"}}, "laneplay.collective", "unknown_parameter"),
]


def test_bad_settings_are_400s_naming_the_field(server):
    with httpx.Client(base_url=server, timeout=60) as http:
        for extra, param, code in BAD:
            for path, body in (("/v1/completions", {"prompt": PROMPT}),
                               ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
                r = http.post(path, json={**body, "max_tokens": 2, **extra})
                assert r.status_code == 400, (extra, r.text)
                err = r.json()["error"]
                assert err["param"] == param and err["code"] == code and param in err["message"], (extra, err)
        assert http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2}).status_code == 200


def test_at_world_size_1_the_settings_are_refused_clearly(checkpoint):
    single = load_engine(checkpoint)
    with serve(create_app(single)) as url, httpx.Client(base_url=url, timeout=60) as http:
        for ext, param in (({"collectives": "delayed"}, "laneplay.collectives"),
                           ({"timeline": True}, "laneplay.timeline")):
            r = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "laneplay": ext})
            err = r.json()["error"]
            assert r.status_code == 400 and err["param"] == param and err["code"] == "unsupported_parameter"
            assert "world size 1" in err["message"] and "--world-size 2" in err["message"]
        ok = http.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 2, "laneplay": {"timeline": False}})
        assert ok.status_code == 200 and "timeline" not in ok.json()["laneplay"]
        health = http.get("/health").json()
        assert health["world_size"] == 1 and health["model_config"]["num_lanes"] == 8


def test_the_summary_keeps_the_last_steps_and_puts_prefill_apart():
    events = [("issue", 0.0, 0.001), ("blocking", 0.001, 0.002)]  # prefill and the first token's gather
    for i in range(100):
        t = 1.0 + i
        events += [("issue", t, t + 0.001), ("wait", t + 0.1, t + 0.3), ("blocking", t + 0.4, t + 0.5),
                   ("step", t, t + 0.5)]
    tl = summarize_timeline(events, rank=1, keep=64)
    assert tl["decode_steps"] == 100 and tl["first_step"] == 36
    assert all(len(v) == 64 for v in tl["steps"].values())
    assert tl["steps"]["ms"][0] == pytest.approx(500) and tl["steps"]["compute_ms"][0] == pytest.approx(200)
    assert tl["steps"]["waited_ms"][-1] == pytest.approx(200) and tl["steps"]["issued"][-1] == 1
    assert tl["wait"] == {"count": 100, "ms": pytest.approx(20000)}
    assert tl["prefill"]["issue"]["count"] == 1 and tl["prefill"]["blocking"]["count"] == 1
    assert tl["prefill"]["wait"]["count"] == 0
