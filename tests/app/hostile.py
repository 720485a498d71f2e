"""A client of the web app that speaks Gradio's queue protocol as a script would: any cookie (or none),
any page id (`session_hash`, a browser's own or one it copied), any inputs. And a scripted
OpenAI-compatible engine that answers at once, for serving the app without a model."""
from __future__ import annotations

import asyncio
import json
import secrets
import time
from dataclasses import dataclass

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

ENGINE_TEXT = "def answer():\n    return 42\n"


def scripted_engine() -> FastAPI:
    """An OpenAI-compatible server (not ours: no /health) that streams ENGINE_TEXT to every request."""
    app = FastAPI()

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "scripted", "object": "model"}]}

    async def answer(request: Request, chat: bool):
        body = await request.json()
        n = int(body.get("n") or 1)

        async def events():
            for part in ENGINE_TEXT.splitlines(keepends=True):
                for i in range(n):
                    delta = {"delta": {"content": part}} if chat else {"text": part}
                    yield f"data: {json.dumps({'choices': [{'index': i, **delta, 'finish_reason': None}]})}\n\n"
                await asyncio.sleep(0)
            for i in range(n):
                end = {"delta": {}} if chat else {"text": ""}
                yield f"data: {json.dumps({'choices': [{'index': i, **end, 'finish_reason': 'stop'}]})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await answer(request, True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await answer(request, False)

    return app


@dataclass
class Reply:
    """What one event answered: every message of its stream, as text (the concatenated JSON)."""
    messages: list[dict]
    text: str
    completed: bool

    @property
    def outputs(self) -> list:
        done = [m for m in self.messages if m.get("msg") == "process_completed"]
        return ((done[-1].get("output") or {}).get("data") or []) if done else []


class GradioPage:
    """One page of the app as a script drives it: a cookie jar (`cookie`: a value, or None for none) and a
    page id (`session_hash`)."""

    def __init__(self, base: str, config: dict, cookie: str | None, session_hash: str | None = None,
                 cookie_name: str = "laneplay_owner", query: str = "", client: httpx.Client | None = None):
        """`client`: an HTTP client (with its cookies) to share between pages; else one of its own."""
        self.base, self.config, self.query = base, config, query
        self.session_hash = session_hash or secrets.token_hex(6)
        self.own_client = client is None
        self.client = client or httpx.Client(base_url=base, timeout=30.0)
        if cookie is not None:
            self.client.cookies.set(cookie_name, cookie)
        self.components = {c["id"]: c for c in config["components"]}

    def close(self) -> None:
        if self.own_client:
            self.client.close()

    def _payload(self, dep: dict, data: list, event_data) -> dict:
        return {"data": data, "event_data": event_data, "fn_index": dep["id"],
                "trigger_id": (dep.get("targets") or [[None]])[0][0], "session_hash": self.session_hash}

    def call(self, dep: dict, data: list, event_data=None, timeout: float = 30.0) -> Reply:
        """Runs one event (queued or not) with these inputs; returns every message it produced."""
        return self.call_many([(dep, data, event_data)], timeout)[0]

    def call_many(self, calls: list[tuple[dict, list, object]], timeout: float = 60.0) -> list[Reply]:
        """Starts every queued event at once (as a page clicking fast would), then reads the page's stream
        until each has ended; events that skip the queue run one by one. One Reply per call, in order."""
        prefix = self.config.get("api_prefix", "/gradio_api")
        replies: list[Reply | None] = [None] * len(calls)
        waiting: dict[str, int] = {}
        for k, (dep, data, event_data) in enumerate(calls):
            if not dep.get("queue", True):
                r = self.client.post(f"{prefix}/run/predict{self.query}", json=self._payload(dep, data, event_data))
                replies[k] = Reply([{"msg": "process_completed", "output": _json(r)}], r.text, r.status_code == 200)
                continue
            r = self.client.post(f"{prefix}/queue/join{self.query}", json=self._payload(dep, data, event_data))
            if r.status_code != 200:
                replies[k] = Reply([{"msg": "refused", "status": r.status_code}], r.text, False)
            else:
                waiting[r.json()["event_id"]] = k
        got: dict[str, list[dict]] = {e: [] for e in waiting}
        deadline = time.monotonic() + timeout
        if waiting:
            with self.client.stream("GET", f"{prefix}/queue/data", params={"session_hash": self.session_hash}) as s:
                open_ids = set(waiting)
                for line in s.iter_lines():
                    if not line.startswith("data:"):
                        continue
                    msg = json.loads(line[5:])
                    if msg.get("event_id") in got:
                        got[msg["event_id"]].append(msg)
                        if msg.get("msg") == "process_completed":
                            open_ids.discard(msg["event_id"])
                    if not open_ids or msg.get("msg") == "close_stream" or time.monotonic() > deadline:
                        break
        for event_id, k in waiting.items():
            msgs = got[event_id]
            replies[k] = Reply(msgs, json.dumps(msgs), any(m.get("msg") == "process_completed" for m in msgs))
        return replies

    def value_for(self, component_id: int, strings: str, choice: str):
        """An input for a component: `strings` in free text, `choice` where a list of choices is expected,
        the component's own value elsewhere."""
        c = self.components[component_id]
        kind, props = c["type"], c.get("props") or {}
        if kind in ("textbox", "code"):
            return strings
        if kind == "dropdown":
            return [choice] if props.get("multiselect") else choice
        if kind == "state":
            return None
        if kind == "radio":
            choices = props.get("choices") or []
            return choices[0][1] if choices else props.get("value")
        return props.get("value")


def _json(r: httpx.Response):
    try:
        return r.json()
    except ValueError:
        return {"text": r.text}


def backend_dependencies(config: dict) -> list[dict]:
    """Every event of the app that runs server code (a js-only step has no backend)."""
    return [d for d in config["dependencies"] if d.get("backend_fn", True)]


def select_event() -> dict:
    return {"index": [0, 0], "value": "x", "row_value": ["x"], "col_value": ["x"], "selected": True}


def trigger_kind(dep: dict) -> str:
    return (dep.get("targets") or [[None, ""]])[0][1]
