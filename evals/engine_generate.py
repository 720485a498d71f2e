"""The model behind `laneplay eval`: the local engine or an engine server, as a runner `Generate`.

Both return the texts the runner wants and keep, for every call, what it cost (`Batch`): the call's
wall time and each sample's tokens and latency, from the engine's own metrics. pass@N asks whether
sampling N times is worth the latency, so these timings are stored next to the outcomes.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from laneplay.evals.prompting import STOP_SEQUENCES

REMOTE_STOP_LIMIT = 4  # OpenAI-compatible servers commonly accept at most 4 stop strings


@dataclass
class SampleTiming:
    completion_tokens: int | None = None
    generation_ms: float | None = None  # request start -> this sample's last token
    decode_tokens_per_second: float | None = None
    finish_reason: str | None = None


@dataclass
class Batch:
    """One generate() call: n samples of one prompt (one shared prefill on the local engine)."""
    n: int
    temperature: float
    seconds: float  # wall time of the whole call
    samples: list[SampleTiming] = field(default_factory=list)

    @property
    def tokens(self) -> int:
        return sum(s.completion_tokens or 0 for s in self.samples)


def _is_chat(prompt) -> bool:
    return isinstance(prompt, list)


def request_body(prompt, n: int, temperature: float, seed: int | None, max_tokens: int, top_p: float = 1.0,
                 model: str | None = None) -> tuple[dict, bool]:
    """The request to an engine server for n samples of one prompt (a text or chat messages), as `laneplay
    eval` and the app's pass@N send it: (body, chat?). Greedy requests ignore top_p."""
    chat = _is_chat(prompt)
    body = {"n": n, "temperature": temperature, "top_p": top_p if temperature > 0 else 1.0,
            "max_tokens": max_tokens, "seed": seed}
    if model:
        body["model"] = model
    if chat:
        body["messages"] = prompt
    else:
        body["prompt"] = prompt
        body["stop"] = list(STOP_SEQUENCES[:REMOTE_STOP_LIMIT])  # the rest are cut by the extraction
    return body, chat


class LocalGenerate:
    """Generates with an engine loaded in this process (`engine.load_engine`)."""

    def __init__(self, engine, top_p: float = 1.0):
        self.engine, self.top_p = engine, top_p
        self.batches: list[Batch] = []
        self.model = engine.model_name
        self.device = str(engine.device)

    def __call__(self, prompt, n: int, temperature: float, seed: int | None, max_tokens: int) -> list[str]:
        from laneplay.engine import SamplingParams

        # Base mode stops at the end of the function body: the extraction would cut there anyway.
        stop = [] if _is_chat(prompt) else list(STOP_SEQUENCES)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature,
                                top_p=self.top_p if temperature > 0 else 1.0, seed=seed, stop=stop, n=n)
        parts: list[list[str]] = [[] for _ in range(n)]
        timings = [SampleTiming() for _ in range(n)]
        start = time.perf_counter()
        for ev in self.engine.generate(prompt, params, chat=_is_chat(prompt)):
            parts[ev.sample_index].append(ev.text)
            if ev.finish_reason:
                m = ev.metrics
                timings[ev.sample_index] = SampleTiming(m.completion_tokens, m.total_ms,
                                                        m.decode_tokens_per_second, m.finish_reason)
        self.batches.append(Batch(n, temperature, time.perf_counter() - start, timings))
        return ["".join(p) for p in parts]

    def close(self) -> None:
        self.engine.close()


class RemoteGenerate:
    """Generates through an engine server's OpenAI-compatible API (non-streaming requests)."""

    def __init__(self, url: str, model: str | None = None, top_p: float = 1.0, timeout_s: float = 3600.0):
        from laneplay.api_client import EngineError, SyncEngineClient

        key = os.environ.get("LANEPLAY_API_KEY")  # the server's --api-key, if it has one
        self.client = SyncEngineClient(url, api_key=key, timeout_s=timeout_s, connect_s=timeout_s)
        self.url, self.model, self.top_p = url, model, top_p
        self.device = "remote"
        self.batches: list[Batch] = []
        try:  # reachable? and which model it serves (a server without /v1/models is fine too)
            models = self.client.models()
        except EngineError as e:
            if e.status is None:
                raise OSError(f"the engine server at {url} did not answer ({e.cause}: {e.message})") from None
            models = None
        if not self.model and models:
            self.model = models[0].get("id")
        # A Laneplay engine runs an evaluation as batch work: interactive users of the same engine go first.
        self.ours = bool(models) and models[0].get("owned_by") == "laneplay"

    def __call__(self, prompt, n: int, temperature: float, seed: int | None, max_tokens: int) -> list[str]:
        from laneplay.api_client import EngineError, endpoint

        body, chat = request_body(prompt, n, temperature, seed, max_tokens, self.top_p, self.model)
        if self.ours:
            body["laneplay"] = {"priority": "batch"}
        start = time.perf_counter()
        try:
            reply = self.client.complete(body, chat)
        except EngineError as e:
            if e.status is None:
                raise RuntimeError(f"the engine server at {self.url} did not answer ({e.message})") from None
            raise RuntimeError(f"the engine server at {self.url} answered {e.status} on {endpoint(chat)}: "
                               f"{e.message}") from None
        seconds = time.perf_counter() - start
        self.model = self.model or reply.get("model")
        choices = sorted(reply.get("choices") or [], key=lambda c: c.get("index", 0))
        if len(choices) != n:
            raise RuntimeError(f"the engine server returned {len(choices)} choice(s) for n={n}")
        texts = [((c.get("message") or {}).get("content") if chat else c.get("text")) or "" for c in choices]
        usage_tokens = (reply.get("usage") or {}).get("completion_tokens")
        timings = []
        for i, c in enumerate(choices):
            m = _server_metrics(reply, c.get("index", i))
            tokens = m.get("completion_tokens", usage_tokens // n if isinstance(usage_tokens, int) else None)
            timings.append(SampleTiming(tokens, m.get("total_ms", seconds * 1000),
                                        m.get("decode_tokens_per_second"), c.get("finish_reason")))
        self.batches.append(Batch(n, temperature, seconds, timings))
        return texts

    def close(self) -> None:
        self.client.close()


def _server_metrics(reply: dict, index: int) -> dict:
    """Choice `index`'s timing from the Laneplay server's `laneplay.per_choice` ({} from other servers)."""
    extra = reply.get("laneplay")
    per_choice = extra.get("per_choice") if isinstance(extra, dict) else None
    return next((m for m in per_choice or [] if isinstance(m, dict) and m.get("index") == index), {})
