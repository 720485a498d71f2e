"""The one client of our API (`laneplay.api_client`) and the protocol words it shares with the server
(`laneplay.protocol`), without a server: the base URL rule, the SSE lines, our comments, the stage
lines; and the server's one table from the engine's typed refusals to HTTP answers."""
import json

import pytest

from laneplay import protocol
from laneplay.api_client import EngineError, StreamDecoder, api_base, decode_lines, error_of


@pytest.mark.parametrize("url", ["http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"])
def test_the_base_url_is_the_same_with_or_without_v1(url):
    assert api_base(url) == "http://h:8000"


def test_the_servers_comments_are_what_the_client_reads():
    assert protocol.sse_comment(protocol.QUEUED, 3) == ": laneplay queued 3\n\n"
    assert protocol.sse_comment(protocol.RUNNING) == ": laneplay running\n\n"
    lines = [*protocol.sse_comment(protocol.QUEUED, 2).splitlines(), *protocol.sse_comment(protocol.RUNNING).splitlines(),
             *protocol.sse_comment(protocol.SHARING, 1).splitlines(), ": laneplay newword 0 7", ": keep-alive",
             "data: [DONE]"]
    events = [(e.kind, e.position, e.args) for e in decode_lines(lines, chat=False)]
    assert events == [("queued", 2, ["2"]), ("running", None, []), ("sharing", 1, ["1"]),
                      ("newword", None, ["0", "7"]), ("done", None, [])]


def test_stage_lines_round_trip():
    line = protocol.stage_line(protocol.STAGE_WARMING_UP)
    assert line == "laneplay-engine-stage: warming up"
    assert protocol.parse_stage(line) == "warming up" and protocol.parse_stage("loading weights") is None


def chunk(obj) -> str:
    return "data: " + json.dumps(obj)


def test_a_stream_becomes_deltas_per_choice_then_done_with_the_servers_record():
    timing = {"ttft_ms": 5.0, "per_choice": [{"index": 1, "ttft_ms": 4.0}]}
    lines = [chunk({"choices": [{"index": 0, "delta": {"content": "a"}, "finish_reason": None}]}), "",
             chunk({"choices": [{"index": 1, "delta": {"content": "b"}, "finish_reason": "stop"}],
                    "laneplay": {"per_choice": [{"index": 1, "ttft_ms": 4.0}]}}),
             chunk({"choices": [], "usage": {"completion_tokens": 2}, "laneplay": timing}),
             "data: [DONE]", chunk({"choices": [{"index": 0, "delta": {"content": "after done"}}]})]
    events = list(decode_lines(lines, chat=True))
    assert [(e.kind, e.index, e.text) for e in events] == [("delta", 0, "a"), ("delta", 1, "b"), ("done", 0, "")]
    assert events[1].timing == {"finish_reason": "stop", "server": {"index": 1, "ttft_ms": 4.0}}
    assert events[-1].timing == timing and events[-1].usage == {"completion_tokens": 2}


def test_errors_in_and_before_a_stream_are_one_sentence():
    with pytest.raises(EngineError, match="The engine failed: boom"):
        StreamDecoder(chat=False).feed(chunk({"error": {"message": "boom"}}))
    with pytest.raises(EngineError, match="malformed"):
        StreamDecoder(chat=False).feed("data: {not json")
    e = error_of(400, json.dumps({"error": {"message": "bad top_p"}}), {})
    assert (e.message, e.status, e.kind) == ("bad top_p", 400, "invalid")
    e = error_of(429, "{}", {"Retry-After": "3"})
    assert e.kind == "busy" and e.retry_after == 3.0


def test_the_engines_refusals_map_to_one_table():
    from laneplay.engine.errors import ContextLengthError, KVBudgetError, ParameterError, PromptError
    from laneplay.engine.scheduler import QueueFull
    from laneplay.engine.server import engine_error

    def answer(e, chat=False):
        a = engine_error(e, chat)
        return a.status, a.type, a.code, a.param

    assert answer(ContextLengthError("too long")) == (400, "invalid_request_error", "context_length_exceeded", "prompt")
    assert answer(KVBudgetError("too big"), chat=True) == (400, "invalid_request_error", "invalid_value", "messages")
    assert answer(ParameterError("top_p must be ...", "samples[1].top_p")) == \
        (400, "invalid_request_error", "invalid_value", "samples[1].top_p")
    assert answer(PromptError("prompt is empty")) == (400, "invalid_request_error", "invalid_value", "prompt")
    assert answer(ValueError("The chat template rejected these messages"), chat=True)[3] == "messages"
    assert answer(QueueFull("full")) == (429, "rate_limit_error", "queue_full", None)
    # A message that happens to say "context" is not a context-length error any more.
    assert answer(ParameterError("stop strings cannot mention context", "stop"))[2] == "invalid_value"
