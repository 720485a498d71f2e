"""The engine HTTP server: OpenAI-compatible completions and chat completions, models, health, metrics.

`create_app(engine)` builds the FastAPI app around an already loaded engine (`laneplay engine` serves
it with uvicorn; tests pass their own engine). A request is validated completely -- field types,
sampling ranges, and its length in real tokens against the context -- before it is queued, so a
queued request can only fail inside the engine. Generation runs in the scheduler's worker thread
(engine/scheduler.py); this file turns its events into OpenAI-shaped JSON and SSE chunks.

Every response also carries a top-level "laneplay" object with the server-side timing (standard
clients ignore unknown fields): ttft_ms, decode_tokens_per_second, ms_per_token, total_ms, device,
world_size, queue_ms, request_seq (arrival order), start_seq (order the engine started requests),
priority, rows_per_step (rows in its decode steps, on average), shared_with (other requests in its last step),
per_choice (each choice's timing, seed and sampling settings). When streaming, the chunk that finishes a choice carries that choice's timing, and the
last chunk before [DONE] (the usage chunk when stream_options.include_usage is set) carries it all.

A request may carry a "laneplay" object of its own: {"priority": "interactive" | "batch"} says how the
scheduler admits it (engine/scheduler.py: batch work fills what interactive requests leave);
{"speculative": "auto" | "lookup" | "off"} its prompt-lookup speculation (engine/speculative.py; "auto"
by default), reported in the final "laneplay" object (speculative, speculative_reason, draft_tokens,
accepted_tokens, decode_steps, paused_steps, accepted_per_step, acceptance) and in usage (draft_tokens,
accepted_tokens); and for DTP
engines (world size 2 or more):
{"collectives": "delayed" | "wait_now", "timeline": true | false}. The engine runs that request, and
only it, with those collectives (the A/B of the delay is two requests), and with "timeline" the final
"laneplay" object adds "timeline": every rank's decode steps (compute, collectives issued, delayed
waits, "wait now" waits, blocking collectives; totals and the last 64 steps, see
engine.dtp.summarize_timeline). The response says which collectives ran ("collectives"). At world
size 1 either setting is a 400 (there are no collectives); an empty object or "timeline": false is
accepted and changes nothing.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import math
import os
import secrets
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from laneplay.engine.errors import ContextLengthError, KVBudgetError, ParameterError, PromptError
from laneplay.engine.sampling import SAMPLE_KEYS, SamplingParams
from laneplay.protocol import QUEUED, RUNNING, SHARING, SPECULATIVE, sse_comment
from laneplay.limits import MAX_TOP_LOGPROBS
from laneplay.engine.scheduler import MAX_ROWS, PRIORITIES, STARTED, Job, Queued, QueueFull, Scheduler
from laneplay.engine.speculative import MODES as SPECULATIVE_MODES

DEFAULT_MAX_TOKENS = 256  # when the request names none (capped by what the context has left)
MAX_BODY_BYTES = 4 << 20
ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics")


class APIError(Exception):
    """An error answered in the OpenAI format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", headers: dict | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


# ---- request parsing ------------------------------------------------------------------------------
# JSON type checks (bool is not accepted where a number is meant, although Python says it is an int).
_INT, _NUM, _BOOL = ((int,), "an integer"), ((int, float), "a number"), ((bool,), "a boolean")
_STR, _OBJ = ((str,), "a string"), ((dict,), "an object")
_JSON_TYPES = {str: "a string", bool: "a boolean", int: "an integer", float: "a number", list: "an array",
               dict: "an object"}
_SAMPLE_KINDS = {"temperature": _NUM, "top_p": _NUM, "top_k": _INT, "min_p": _NUM, "seed": _INT,
                 "frequency_penalty": _NUM, "presence_penalty": _NUM, "repetition_penalty": _NUM}

# Every field of OpenAI's chat and completions requests (the openai package's completion_create_params), and
# ours, by what this server does with it (README, "The API's fields", has the table and the tests). A field
# that is not listed here is a 400 naming it: nothing a client sends is dropped without a word.
_COMMON = {"model", "stream", "stream_options", "max_tokens", "temperature", "top_p", "n", "stop", "seed",
           "frequency_penalty", "presence_penalty", "logit_bias", "logprobs", "user"}
_EXTENSIONS = {"top_k", "min_p", "repetition_penalty", "ignore_eos", "samples", "laneplay"}
CHAT_FIELDS = _COMMON | _EXTENSIONS | {"messages", "max_completion_tokens", "top_logprobs", "metadata", "store",
                                       "service_tier", "safety_identifier", "prompt_cache_key", "prompt_cache_options",
                                       "prompt_cache_retention", "parallel_tool_calls", "tools", "tool_choice",
                                       "functions", "function_call", "response_format", "audio", "modalities",
                                       "prediction", "web_search_options", "reasoning_effort", "verbosity",
                                       "moderation"}
COMPLETION_FIELDS = _COMMON | _EXTENSIONS | {"prompt", "echo", "suffix", "best_of"}


def _off(value) -> bool:
    return value is None or value == [] or value == {} or value is False


# Fields that would change the output in a way this server does not do: a 400 naming the field, unless the value
# asks for nothing (`accepts`). The others of OpenAI's lists either change the output and are honoured, or only
# describe the caller or OpenAI's service (user, metadata, store, service_tier, safety_identifier, prompt_cache_*)
# and are accepted as they are; parallel_tool_calls only matters with tools, which are refused.
REFUSED = {
    "tools": (_off, "tool calling"),
    "functions": (_off, "function calling"),
    "tool_choice": (lambda v: v in (None, "none", "auto"), "tool calling"),
    "function_call": (lambda v: v in (None, "none", "auto"), "function calling"),
    "response_format": (lambda v: v is None or v == {"type": "text"}, "structured output (only {\"type\": \"text\"})"),
    "audio": (lambda v: v is None, "audio output"),
    "modalities": (lambda v: v is None or v == ["text"], "output modalities other than text"),
    "prediction": (lambda v: v is None, "predicted outputs"),
    "web_search_options": (lambda v: v is None, "web search"),
    "reasoning_effort": (lambda v: v is None, "reasoning settings (the model does not reason separately)"),
    "verbosity": (lambda v: v is None, "verbosity settings"),
    "moderation": (lambda v: v is None, "moderation"),
    "suffix": (lambda v: v is None or v == "", "a suffix (insertion)"),
}


def check_fields(body: dict, chat: bool) -> None:
    """Refuse a request field this server does not know, or knows and does not do (see REFUSED)."""
    known = CHAT_FIELDS if chat else COMPLETION_FIELDS
    for name in body:
        if name not in known:
            other = "completions" if chat else "chat completions"
            hint = f" (it belongs to {other})" if name in (COMPLETION_FIELDS if chat else CHAT_FIELDS) else ""
            raise APIError(400, f"'{name}' is not a field this server knows{hint}; it was refused rather than "
                                "ignored.", name, "unknown_parameter")
        if name in REFUSED and not REFUSED[name][0](body[name]):
            raise APIError(400, f"'{name}' is not supported by this server: it does not do "
                                f"{REFUSED[name][1]}.", name, "unsupported_parameter")
    best_of, n = body.get("best_of"), body.get("n")
    if best_of is not None and best_of != (1 if n is None else n):
        raise APIError(400, "'best_of' is not supported by this server: it returns every sample it makes "
                            "(ask for n choices instead).", "best_of", "unsupported_parameter")


def _field(body: dict, name: str, kind, default=None, param: str | None = None):
    value = body.get(name)
    if value is None:
        return default
    types, what = kind
    if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
        got = _JSON_TYPES.get(type(value), "something else")
        raise APIError(400, f"'{param or name}' must be {what}, got {got}.", param or name, "invalid_type")
    return value


@dataclass
class ParsedRequest:
    prompt: object  # str | list[int] (completions) or list of {"role", "content"} (chat)
    params: SamplingParams
    max_tokens_given: bool
    stream: bool
    include_usage: bool
    dtp: dict | None = None  # the "laneplay" extension: {"collectives": str | None, "timeline": bool}
    priority: str = "interactive"  # the "laneplay" extension's "priority": "interactive" | "batch"
    echo: bool = False  # completions: the prompt comes back in front of each choice's text
    speculative: str = "auto"  # the "laneplay" extension's "speculative": "auto" | "lookup" | "off"


def parse_request(body, chat: bool) -> ParsedRequest:
    """Types and shapes of an OpenAI request; ranges are checked by engine.prepare. A field that is not
    known, or not done, is a 400 naming it (`check_fields`)."""
    if not isinstance(body, dict):
        raise APIError(400, "The request body must be a JSON object.")
    check_fields(body, chat)
    logprobs = _logprobs(body, chat)
    echo = False if chat else _field(body, "echo", _BOOL, False)
    if echo and logprobs is not None:
        raise APIError(400, "'echo' with 'logprobs' is not supported by this server: the prompt's log-probabilities "
                            "would take a second pass over the prompt; ask for one of them.", "echo",
                       "unsupported_parameter")
    max_tokens = _field(body, "max_completion_tokens", _INT) if chat else None
    if max_tokens is None:
        max_tokens = _field(body, "max_tokens", _INT)
    stop = body.get("stop")
    if stop is not None and not isinstance(stop, (str, list)):
        raise APIError(400, "'stop' must be a string or an array of strings.", "stop", "invalid_type")
    n, samples = _field(body, "n", _INT), _samples(body)
    if samples is not None and n is not None and n != len(samples):
        raise APIError(400, f"'n' ({n}) must equal the number of 'samples' ({len(samples)}); leave 'n' out when "
                            "giving 'samples'.", "n", "invalid_value")
    params = SamplingParams(
        max_tokens=1 if max_tokens is None else max_tokens,
        temperature=_field(body, "temperature", _NUM, 1.0),  # OpenAI's defaults: temperature 1, top_p 1
        top_p=_field(body, "top_p", _NUM, 1.0),
        top_k=_field(body, "top_k", _INT, 0),
        min_p=_field(body, "min_p", _NUM, 0.0),
        seed=_field(body, "seed", _INT),
        stop=[stop] if isinstance(stop, str) else list(stop or []),
        n=n if n is not None else len(samples) if samples else 1,
        ignore_eos=_field(body, "ignore_eos", _BOOL, False),
        frequency_penalty=_field(body, "frequency_penalty", _NUM, 0.0),
        presence_penalty=_field(body, "presence_penalty", _NUM, 0.0),
        repetition_penalty=_field(body, "repetition_penalty", _NUM, 1.0),
        logit_bias=_logit_bias(body),
        logprobs=logprobs,
        samples=samples,
    )
    options = _field(body, "stream_options", _OBJ, {})
    return ParsedRequest(
        prompt=_messages(body) if chat else _prompt(body),
        params=params,
        max_tokens_given=max_tokens is not None,
        stream=_field(body, "stream", _BOOL, False),
        include_usage=_field(options, "include_usage", _BOOL, False, param="stream_options.include_usage"),
        dtp=_dtp_settings(body),
        priority=_priority(body),
        echo=echo,
        speculative=_speculative(body),
    )


def _logprobs(body: dict, chat: bool) -> int | None:
    """How many alternatives each token reports (None: no logprobs). Chat: `logprobs` (a boolean) and
    `top_logprobs` (0 to 20, which needs logprobs true); completions: `logprobs` (0 to 20) itself."""
    if not chat:
        return _field(body, "logprobs", _INT)  # the range: SamplingParams.validate
    wanted = _field(body, "logprobs", _BOOL, False)
    top = _field(body, "top_logprobs", _INT)
    if top is not None and not wanted:
        raise APIError(400, "'top_logprobs' needs 'logprobs': true.", "top_logprobs", "invalid_value")
    if top is not None and not 0 <= top <= MAX_TOP_LOGPROBS:
        raise APIError(400, f"'top_logprobs' must be an integer in [0, {MAX_TOP_LOGPROBS}], got {top}.",
                       "top_logprobs", "invalid_value")
    return (top or 0) if wanted else None


def _logit_bias(body: dict) -> dict[int, float] | None:
    """{"token id": bias} (JSON keys are strings) -> {id: bias}; the ranges: SamplingParams.validate."""
    bias = _field(body, "logit_bias", _OBJ)
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit()):
            raise APIError(400, f"'logit_bias' keys must be token ids (decimal integers), got {json.dumps(key)}.",
                           "logit_bias", "invalid_value")
        out[int(key)] = _field(bias, key, _NUM, param=f"logit_bias.{key}")
    return out


COLLECTIVES = ("delayed", "wait_now")
_DTP_KEYS = ("collectives", "timeline")
_EXT_KEYS = (*_DTP_KEYS, "priority", "speculative")


def _ext_choice(body: dict, key: str, default: str, choices: tuple[str, ...]) -> str:
    """One string choice of the "laneplay" extension: `default` when absent, a 400 naming
    'laneplay.<key>' and its choices (in the order given) when not one of them."""
    param = f"laneplay.{key}"
    value = _field(_field(body, "laneplay", _OBJ) or {}, key, _STR, default, param=param)
    if value not in choices:
        quoted = [f'"{c}"' for c in choices]
        allowed = " or ".join(quoted) if len(quoted) < 3 else f"{', '.join(quoted[:-1])} or {quoted[-1]}"
        raise APIError(400, f"'{param}' must be {allowed}, got {json.dumps(value)}.", param, "invalid_value")
    return value


# "interactive" (the default) or "batch" (joins the engine's batch only where interactive requests leave
# room: pass@N jobs, evals); prompt-lookup speculation (engine/speculative.py): "auto" (the default: drafts
# where they pay), "lookup" (always draft) or "off".
def _priority(body: dict) -> str:
    return _ext_choice(body, "priority", "interactive", PRIORITIES)


def _speculative(body: dict) -> str:
    return _ext_choice(body, "speculative", "auto", tuple(sorted(SPECULATIVE_MODES)))


def step_tokens(metrics) -> int:
    """The tokens decode steps gave: all but each sample's first (the prefill gives that one)."""
    return sum(max(0, m.completion_tokens - 1) for m in metrics)


def speculation_record(finals: dict) -> dict:
    """What speculation did for a request (all its choices): the mode that ran ("lookup", or "off" with
    the reason), draft tokens verified, of them accepted, decode steps after the first token, of them the
    steps beside other requests in which "auto" held its drafts back (paused_steps), tokens per decode
    step, and the acceptance rate."""
    ms = [m for _, m in sorted(finals.items())]
    drafts, accepted = sum(m.draft_tokens for m in ms), sum(m.accepted_tokens for m in ms)
    steps = sum(m.decode_steps or 0 for m in ms)
    tokens = step_tokens(ms)
    ran = next((m.speculative for m in ms if m.speculative), None)
    return {"speculative": ran, "speculative_reason": next((m.speculative_reason for m in ms if m.speculative_reason), None),
            "draft_tokens": drafts, "accepted_tokens": accepted, "decode_steps": steps,
            "paused_steps": sum(m.paused_steps for m in ms),
            "accepted_per_step": _ms(tokens / steps) if steps else None,
            "acceptance": _ms(accepted / drafts) if drafts else None}


def _dtp_settings(body: dict) -> dict | None:
    """The "laneplay" extension: one request's DTP collectives and timeline (None: not asked for)."""
    ext = _field(body, "laneplay", _OBJ)
    if ext is None:
        return None
    unknown = sorted(set(ext) - set(_EXT_KEYS))
    if unknown:
        raise APIError(400, f"'laneplay.{unknown[0]}' is not a setting of the 'laneplay' object; allowed: "
                            f"{', '.join(_EXT_KEYS)}.", f"laneplay.{unknown[0]}", "unknown_parameter")
    collectives = _field(ext, "collectives", _STR, param="laneplay.collectives")
    if collectives is not None and collectives not in COLLECTIVES:
        raise APIError(400, f"'laneplay.collectives' must be \"delayed\" or \"wait_now\", got "
                            f"{json.dumps(collectives)}.", "laneplay.collectives", "invalid_value")
    timeline = _field(ext, "timeline", _BOOL, False, param="laneplay.timeline")
    return {"collectives": collectives, "timeline": timeline} if collectives is not None or timeline else None


def check_dtp_settings(dtp: dict | None, world_size: int) -> None:
    """DTP settings need a DTP engine: at world size 1 there are no collectives to change or record."""
    if dtp is None or world_size > 1:
        return
    name = "laneplay.collectives" if dtp["collectives"] is not None else "laneplay.timeline"
    raise APIError(400, f"'{name}' needs a DTP engine, and this one runs at world size 1 (no collectives); "
                        "start it with --world-size 2 or more.", name, "unsupported_parameter")


def _samples(body: dict) -> list[dict] | None:
    """The "samples" extension: one object of sampling settings per choice, every key optional
    (ranges, and the count, are checked by engine.prepare)."""
    samples = _field(body, "samples", ((list,), "an array of objects"))
    for i, s in enumerate(samples or []):
        where = f"samples[{i}]"
        if not isinstance(s, dict):
            got = _JSON_TYPES.get(type(s), "something else")
            raise APIError(400, f"'{where}' must be an object, got {got}.", where, "invalid_type")
        unknown = sorted(set(s) - set(SAMPLE_KEYS))
        if unknown:
            raise APIError(400, f"'{where}' has unknown key(s) {', '.join(map(repr, unknown))}; allowed: "
                                f"{', '.join(SAMPLE_KEYS)}.", where, "unknown_parameter")
        for key in s:
            _field(s, key, _SAMPLE_KINDS[key], param=f"{where}.{key}")
    return samples


def _prompt(body: dict):
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return prompt
    raise APIError(400, "'prompt' must be a string or an array of token ids (one prompt per request).", "prompt")


def _messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise APIError(400, "'messages' must be a non-empty array of {role, content} objects.", "messages")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict):
            raise APIError(400, f"messages[{i}] must be an object with 'role' and 'content'.", "messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text, joined
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise APIError(400, f"messages[{i}].content: only text parts ({{\"type\": \"text\", \"text\": ...}}) "
                                    "are supported.", "messages")
            content = "\n".join(p["text"] for p in content)
        role = "system" if m.get("role") == "developer" else m.get("role")
        out.append({"role": role, "content": content})  # roles and content types: checked by the chat template
    return out


# ---- the engine's refusals -> HTTP ----------------------------------------------------------------
# How each kind of refusal is answered: (HTTP status, OpenAI error type, code). The first class of an
# error's MRO that is listed decides; a plain ValueError is the chat template's or the tokenizer's.
ENGINE_ERRORS: dict[type, tuple[int, str, str]] = {
    ContextLengthError: (400, "invalid_request_error", "context_length_exceeded"),
    KVBudgetError: (400, "invalid_request_error", "invalid_value"),
    ParameterError: (400, "invalid_request_error", "invalid_value"),
    PromptError: (400, "invalid_request_error", "invalid_value"),
    ValueError: (400, "invalid_request_error", "invalid_value"),
    QueueFull: (429, "rate_limit_error", "queue_full"),
}


def engine_error(e: Exception, chat: bool, headers: dict | None = None) -> APIError:
    """The answer to an engine's refusal (`ENGINE_ERRORS`); a refusal that names no field is about the prompt."""
    status, kind, code = next(ENGINE_ERRORS[c] for c in type(e).__mro__ if c in ENGINE_ERRORS)
    param = getattr(e, "param", None)
    if param is None and isinstance(e, ValueError):
        param = "messages" if chat else "prompt"
    return APIError(status, str(e), param, code, kind, headers)


# ---- responses -----------------------------------------------------------------------------------
def _api_reason(reason: str | None) -> str | None:
    # "cancelled" reaches a client only when the server stopped the request (time limit, shutdown).
    return "length" if reason == "cancelled" else reason


def _ms(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def engine_dtype(engine) -> str | None:
    """Which weight path runs (float32, float16, bfloat16, int8, int4): the meter shows it."""
    return getattr(getattr(engine, "runtime", None), "dtype", None)


def choice_timing(index: int, m) -> dict:
    return {"index": index, "ttft_ms": _ms(m.ttft_ms), "decode_tokens_per_second": _ms(m.decode_tokens_per_second),
            "ms_per_token": _ms(m.ms_per_token), "total_ms": _ms(m.total_ms), "completion_tokens": m.completion_tokens,
            "finish_reason": _api_reason(m.finish_reason), "seed": m.seed, "temperature": m.temperature,
            "top_p": m.top_p, "top_k": m.top_k, "min_p": m.min_p, "speculative": m.speculative, "draft_tokens": m.draft_tokens,
            "accepted_tokens": m.accepted_tokens, "decode_steps": m.decode_steps, "paused_steps": m.paused_steps}


def request_timing(job: Job) -> dict:
    """Timing of the whole request. For n samples decoding as one batch: ttft of the first token,
    tokens/s over all samples, and ms_per_token = time per decode step (one token for every sample)."""
    timed = [m for m in job.finals.values() if m.ttft_ms is not None]
    ttft = tps = step_ms = total = None
    if timed:
        ttft, total = min(m.ttft_ms for m in timed), max(m.total_ms for m in timed)
        steps = max(m.completion_tokens for m in timed) - 1
        if total > ttft and steps > 0:
            tps = sum(m.completion_tokens - 1 for m in timed) / ((total - ttft) / 1000)
            step_ms = (total - ttft) / steps
    return {"ttft_ms": _ms(ttft), "decode_tokens_per_second": _ms(tps), "ms_per_token": _ms(step_ms),
            "total_ms": _ms(total), "queue_ms": _ms(job.queue_ms), "request_seq": job.seq, "start_seq": job.start_seq,
            "priority": job.priority, "rows_per_step": _ms(job.rows_per_step), "shared_with": job.sharing}


LOGPROB_FLOOR = -9999.0  # OpenAI's figure for a token the model gives no chance (JSON has no -inf)


def _lp(x: float) -> float:
    return x if math.isfinite(x) else LOGPROB_FLOOR


def chat_logprobs(tokens: list) -> dict:
    """Chat's `choice.logprobs` for some tokens (engine.generate.TokenLogprob)."""
    return {"content": [{"token": t.text, "logprob": _lp(t.logprob), "bytes": t.bytes,
                         "top_logprobs": [{"token": s, "logprob": _lp(lp), "bytes": b} for _, s, lp, b in t.top]}
                        for t in tokens], "refusal": None}


def completion_logprobs(tokens: list, offset: int) -> dict:
    """Completions' `choice.logprobs` for some tokens, the first of them at character `offset` of the choice's text."""
    offsets = []
    for t in tokens:
        offsets.append(offset)
        offset += len(t.text)
    return {"tokens": [t.text for t in tokens], "token_logprobs": [_lp(t.logprob) for t in tokens],
            "top_logprobs": [{s: _lp(lp) for _, s, lp, _ in t.top} for t in tokens], "text_offset": offsets}


class Reply:
    """The OpenAI-shaped pieces of one response: completion or chat, whole or streamed. `echo`: the text in
    front of each completion choice (the prompt, when the request echoes it)."""

    def __init__(self, chat: bool, model: str, job: Job, engine, echo: str = ""):
        self.chat, self.model, self.job, self.engine, self.echo = chat, model, job, engine, echo
        self.id = ("chatcmpl-" if chat else "cmpl-") + secrets.token_hex(12)
        self.created = int(time.time())
        self.chunk_object = "chat.completion.chunk" if chat else "text_completion"
        self.offsets: dict[int, int] = {}  # streamed completions: where each choice's next token starts

    def _logprobs(self, index: int, tokens: list | None):
        if tokens is None:
            return None
        if self.chat:
            return chat_logprobs(tokens)
        start = self.offsets.get(index, len(self.echo))
        self.offsets[index] = start + sum(len(t.text) for t in tokens)
        return completion_logprobs(tokens, start)

    def _envelope(self, obj: str, choices: list) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def usage(self) -> dict:
        prompt = len(self.job.ids)
        completion = sum(m.completion_tokens for m in self.job.finals.values())
        spec = speculation_record(self.job.finals)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": self.job.cached_tokens},
                "draft_tokens": spec["draft_tokens"], "accepted_tokens": spec["accepted_tokens"]}

    def timing(self) -> dict:
        per_choice = [choice_timing(i, m) for i, m in sorted(self.job.finals.items())]
        out = {**request_timing(self.job), "device": str(self.engine.device), "dtype": engine_dtype(self.engine),
               "world_size": getattr(self.engine, "world_size", 1), **speculation_record(self.job.finals),
               "per_choice": per_choice}
        if self.job.dtp is not None:  # the request's own DTP settings: what ran, and its timeline
            out["collectives"] = self.job.collectives
            if self.job.dtp["timeline"]:
                out["timeline"] = self.job.timeline
        return out

    def chunk(self, index: int, text: str, reason: str | None, first: bool, tokens: list | None = None) -> dict:
        """One streamed delta; `tokens`: its logprobs (engine.generate.TokenLogprob), when asked for."""
        logprobs = self._logprobs(index, tokens)
        if self.chat:
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        else:
            text = self.echo + text if first else text
            choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}
        return self._envelope(self.chunk_object, [choice])

    def whole(self, texts: list[str], reasons: list[str | None], tokens: list[list | None] | None = None) -> dict:
        tokens = tokens or [None] * len(texts)
        logprobs = [self._logprobs(i, t) for i, t in enumerate(tokens)]
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": t}, "logprobs": lp,
                        "finish_reason": r} for i, (t, r, lp) in enumerate(zip(texts, reasons, logprobs))]
        else:
            choices = [{"index": i, "text": self.echo + t, "logprobs": lp, "finish_reason": r}
                       for i, (t, r, lp) in enumerate(zip(texts, reasons, logprobs))]
        out = self._envelope("chat.completion" if self.chat else "text_completion", choices)
        out["usage"] = self.usage()
        out["laneplay"] = self.timing()
        return out


def _sse(obj) -> str:
    return f"data: {json.dumps(obj, separators=(',', ':'))}\n\n"


async def stream_reply(reply: Reply, n: int, include_usage: bool, scheduler: Scheduler | None = None):
    """SSE chunks of one streamed request. Before the first chunk, SSE comments (which OpenAI clients
    skip) say where the request is: `: laneplay queued <position>` while it waits for the engine, then
    `: laneplay running <queue_ms>` when the engine takes it (how long it waited, ms). While a choice
    speculates, a comment before its chunk carries its counts whenever they change: `: laneplay speculative
    <index> <draft_tokens> <accepted_tokens> <decode_steps> <completion_tokens> <paused_steps> <paused>`
    (tokens per step = (completion_tokens - 1) / decode_steps, acceptance = accepted_tokens / draft_tokens;
    paused 1 while "auto" holds its drafts back beside other requests, paused_steps the steps it did)."""
    started, finished, error, sharing = set(), 0, None, 0
    spec_counts: dict[int, tuple] = {}
    position = scheduler.position(reply.job) if scheduler is not None else None
    if position is not None:
        yield sse_comment(QUEUED, position)
    try:
        async for ev in reply.job.stream():
            if ev is STARTED:
                yield sse_comment(RUNNING, f"{reply.job.queue_ms or 0.0:.1f}")
                continue
            if isinstance(ev, Queued):  # its place in line moved
                yield sse_comment(QUEUED, ev.position)
                continue
            if reply.job.sharing != sharing:  # how many other requests share the engine's steps now
                sharing = reply.job.sharing
                yield sse_comment(SHARING, sharing)
            m = ev.metrics
            counts = (m.draft_tokens, m.accepted_tokens, m.decode_steps, m.completion_tokens, m.paused_steps,
                      int(m.speculation_paused))
            if m.speculative == "lookup" and spec_counts.get(ev.sample_index) != counts:  # the meter's live numbers
                spec_counts[ev.sample_index] = counts
                yield sse_comment(SPECULATIVE, ev.sample_index, *counts)
            reason = _api_reason(ev.finish_reason)
            chunk = reply.chunk(ev.sample_index, ev.text, reason, first=ev.sample_index not in started,
                                tokens=ev.logprobs)
            started.add(ev.sample_index)
            if include_usage:
                chunk["usage"] = None
            if reason:
                finished += 1
                if finished == n and not include_usage:  # the last chunk with choices: all the timing
                    chunk["laneplay"] = reply.timing()
                else:
                    chunk["laneplay"] = {"per_choice": [choice_timing(ev.sample_index, ev.metrics)]}
            yield _sse(chunk)
    except Exception as e:  # the engine failed mid-stream: the client gets an error event, never a hang
        error = APIError(500, f"Generation failed: {e}", type="server_error")
    if reply.job.outcome == "dropped":
        error = APIError(503, "The server is shutting down; the request did not run.", type="server_error")
    if error is not None:
        yield _sse(error.body())
    elif include_usage:
        final = reply._envelope(reply.chunk_object, [])
        final["usage"] = reply.usage()
        final["laneplay"] = reply.timing()
        yield _sse(final)
    yield "data: [DONE]\n\n"


class JobStream(StreamingResponse):
    """An SSE response that cancels its job however the response ends (done, client gone, error)."""

    def __init__(self, content, scheduler: Scheduler, job: Job):
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.scheduler, self.job = scheduler, job

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.scheduler.cancel(self.job)  # no-op when the job has finished


async def collect_reply(reply: Reply, n: int, request: Request, scheduler: Scheduler) -> dict:
    """A whole (non-streamed) response; a client that disconnects while waiting cancels its job."""
    async def watch_disconnect():
        while (await request.receive())["type"] != "http.disconnect":
            pass
        scheduler.cancel(reply.job)

    watcher = asyncio.create_task(watch_disconnect())
    texts, reasons = [[] for _ in range(n)], [None] * n
    tokens = [[] if reply.job.params.logprobs is not None else None for _ in range(n)]
    try:
        async for ev in reply.job.stream():
            if ev is STARTED or isinstance(ev, Queued):
                continue
            texts[ev.sample_index].append(ev.text)
            reasons[ev.sample_index] = _api_reason(ev.finish_reason)
            if ev.logprobs is not None:
                tokens[ev.sample_index] += ev.logprobs
    except Exception as e:
        raise APIError(500, f"Generation failed: {e}", type="server_error") from e
    finally:
        watcher.cancel()
        scheduler.cancel(reply.job)
    if reply.job.outcome == "dropped":
        raise APIError(503, "The server is shutting down; the request did not run.", type="server_error")
    return reply.whole(["".join(t) for t in texts], reasons, tokens)


# ---- metrics -------------------------------------------------------------------------------------
class ServerMetrics:
    """Prometheus metrics in a registry of this app's own (several apps can live in one process)."""

    def __init__(self, scheduler: Scheduler):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("laneplay_requests", "HTTP requests by endpoint and status code",
                                ["endpoint", "status"], registry=r)
        self.outcomes = Counter("laneplay_generations", "Generation requests by outcome "
                                "(completed, cancelled, timeout, dropped, error)", ["outcome"], registry=r)
        self.prompt_tokens = Counter("laneplay_prompt_tokens", "Prompt tokens processed", registry=r)
        self.tokens = Counter("laneplay_generated_tokens", "Completion tokens generated (all samples)", registry=r)
        # speculation, by the mode requests asked for ("auto", "lookup", "off"): acceptance = accepted / draft
        # tokens, tokens per decode step = step tokens / decode steps (the tokens after each sample's first,
        # which the prefill gives)
        spec = ("speculative",)
        self.draft_tokens = Counter("laneplay_draft_tokens", "Draft tokens verified (prompt lookup)", spec, registry=r)
        self.accepted_tokens = Counter("laneplay_accepted_tokens", "Draft tokens the model kept", spec, registry=r)
        self.decode_steps = Counter("laneplay_decode_steps", "Decode steps of finished requests (after the first "
                                    "token)", spec, registry=r)
        self.step_tokens = Counter("laneplay_step_tokens", "Tokens those decode steps gave (all but each sample's "
                                   "first)", spec, registry=r)
        self.ttft = Histogram("laneplay_time_to_first_token_seconds", "Engine start to first token", registry=r,
                              buckets=(.01, .025, .05, .1, .25, .5, 1, 2.5, 5, 10, 30, 60))
        self.tpot = Histogram("laneplay_time_per_output_token_seconds", "Time per decode step", registry=r,
                              buckets=(.001, .0025, .005, .01, .02, .04, .08, .16, .32, .64, 1.28))
        self.queue_wait = Histogram("laneplay_queue_wait_seconds", "Arrival to engine start", registry=r,
                                    buckets=(.001, .01, .1, .5, 1, 2.5, 5, 10, 30, 60, 120, 300))
        depth = Gauge("laneplay_queue_depth", "Requests waiting for the engine", registry=r)
        depth.set_function(lambda: scheduler.depth)
        busy = Gauge("laneplay_busy", "1 while a request is generating", registry=r)
        busy.set_function(lambda: int(scheduler.busy))
        running = Gauge("laneplay_running_requests", "Requests in the engine's batch", registry=r)
        running.set_function(lambda: len(scheduler.running))
        self.step_rows = Histogram("laneplay_rows_per_step", "Rows (samples of all requests) in each decode step",
                                   registry=r, buckets=(1, 2, 3, 4, 6, 8, 12, 16))
        self.step_time = Histogram("laneplay_time_between_tokens_seconds", "Duration of each decode step: the "
                                   "time between two tokens of every row in it", registry=r,
                                   buckets=(.001, .0025, .005, .01, .02, .04, .08, .16, .32, .64, 1.28))
        scheduler.on_step = self.observe_step

    def observe_step(self, rows: int, seconds: float) -> None:
        """Called by the worker after each shared decode step."""
        self.step_rows.observe(rows)
        self.step_time.observe(seconds)

    def observe(self, job: Job) -> None:
        """Called once per job (from the worker thread, or the event loop for dropped jobs)."""
        self.outcomes.labels(job.outcome).inc()
        if job.t_start is None:
            return
        self.queue_wait.observe(job.queue_ms / 1000)
        self.prompt_tokens.inc(len(job.ids))
        self.tokens.inc(sum(m.completion_tokens for m in job.finals.values()))
        if job.finals:
            rec, asked = speculation_record(job.finals), job.speculative
            self.draft_tokens.labels(asked).inc(rec["draft_tokens"])
            self.accepted_tokens.labels(asked).inc(rec["accepted_tokens"])
            self.decode_steps.labels(asked).inc(rec["decode_steps"])
            self.step_tokens.labels(asked).inc(step_tokens(job.finals.values()))
        timing = request_timing(job)
        if timing["ttft_ms"] is not None:
            self.ttft.observe(timing["ttft_ms"] / 1000)
        if timing["ms_per_token"] is not None:
            self.tpot.observe(timing["ms_per_token"] / 1000)


class AccessLayer:
    """ASGI middleware: the API key check (every route but /health) and request counting."""

    def __init__(self, app, api_key: str | None, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        endpoint = path if path in ENDPOINTS else "/v1/models/{model}" if path.startswith("/v1/models/") else "other"
        status = None

        async def counted_send(message):
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                self.metrics.requests.labels(endpoint, str(status)).inc()
            await send(message)

        if self.expected is not None and path != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                error = APIError(401, "Missing or incorrect API key; send 'Authorization: Bearer <key>'.",
                                 code="invalid_api_key")
                return await error.response()(scope, receive, counted_send)
        try:
            await self.app(scope, receive, counted_send)
        except Exception:
            if status is None:
                self.metrics.requests.labels(endpoint, "500").inc()
            raise


# ---- the app -------------------------------------------------------------------------------------
async def _read_json(request: Request):
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise APIError(413, f"The request body is larger than {MAX_BODY_BYTES >> 20} MiB.")
    try:
        return json.loads(body)
    except ValueError as e:  # includes UnicodeDecodeError
        raise APIError(400, f"The request body is not valid JSON ({e}).", code="invalid_json") from None


def create_app(engine, *, api_key: str | None = None, max_queue: int = 32, request_timeout_s: float = 600.0,
               model_name: str | None = None, max_rows: int = MAX_ROWS) -> FastAPI:
    """The HTTP app around a loaded engine. The caller owns the engine (the app never closes it).
    max_rows: rows per shared decode step (1: requests run one at a time)."""
    served = model_name or engine.model_name
    names = {served, engine.model_name}  # the request's "model" may be either, or omitted
    context = engine.cfg.max_position_embeddings
    scheduler = Scheduler(engine, max_queue=max_queue, request_timeout_s=request_timeout_s, max_rows=max_rows)
    metrics = ServerMetrics(scheduler)
    scheduler.on_finish = metrics.observe
    started = int(time.time())
    to_dict = getattr(engine.cfg, "to_dict", None)  # the served model's shapes (the app's performance model)
    model_config = to_dict() if to_dict else None

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        scheduler.close()

    app = FastAPI(title="Laneplay engine", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.scheduler, app.state.metrics = scheduler, metrics
    app.add_middleware(AccessLayer, api_key=api_key, metrics=metrics)

    @app.exception_handler(APIError)
    async def api_error(request, e: APIError):
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, e: RequestValidationError):
        err = e.errors()[0] if e.errors() else {}
        param = ".".join(str(p) for p in err.get("loc", ())[1:]) or None
        return APIError(422, f"{param or 'request'}: {err.get('msg', 'invalid value')}.", param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request, e: StarletteHTTPException):
        code = "not_found" if e.status_code == 404 else None
        return APIError(e.status_code, str(e.detail), code=code).response()

    @app.exception_handler(Exception)
    async def server_error(request, e: Exception):
        return APIError(500, f"Internal server error: {type(e).__name__}.", type="server_error").response()

    def check_model(name) -> None:
        if name is not None and name not in names:
            raise APIError(404, f"The model '{name}' does not exist; this server serves '{served}'.", "model",
                           "model_not_found")

    def model_card() -> dict:
        return {"id": served, "object": "model", "created": started, "owned_by": "laneplay", "max_model_len": context}

    async def generate(request: Request, chat: bool):
        body = await _read_json(request)
        if isinstance(body, dict):
            check_model(_field(body, "model", _STR))
        req = parse_request(body, chat)
        check_dtp_settings(req.dtp, getattr(engine, "world_size", 1))
        try:  # tokenizing a long prompt takes a moment: off the event loop
            ids, params = await run_in_threadpool(engine.prepare, req.prompt, req.params, chat)
        except ValueError as e:
            raise engine_error(e, chat) from None
        if not req.max_tokens_given:
            params.max_tokens = min(DEFAULT_MAX_TOKENS, context - len(ids))
        try:
            job = scheduler.submit(ids, params, dtp=req.dtp, priority=req.priority, speculative=req.speculative)
        except QueueFull as e:
            retry = str(max(1, math.ceil(scheduler.mean_job_s)))
            raise engine_error(e, chat, headers={"Retry-After": retry}) from None
        echo = "" if not req.echo else req.prompt if isinstance(req.prompt, str) else engine.tokenizer.decode(ids)
        reply = Reply(chat, served, job, engine, echo)
        if req.stream:
            return JobStream(stream_reply(reply, params.n, req.include_usage, scheduler), scheduler, job)
        return JSONResponse(await collect_reply(reply, params.n, request, scheduler))

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def get_model(name: str):
        check_model(name)
        return model_card()

    @app.get("/health")
    async def health():
        return {"status": "ok", "model": served, "pid": os.getpid(), "queue_depth": scheduler.depth, "busy": scheduler.busy,
                "running": len(scheduler.running), "max_rows": scheduler.max_rows, "max_queue": scheduler.max_queue, "device": str(engine.device), "dtype": engine_dtype(engine),
                "world_size": getattr(engine, "world_size", 1), "context_length": context,
                "model_config": model_config}

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


class EngineServer(uvicorn.Server):
    """uvicorn, except that shutting down first ends the running request (finish_reason "length") and
    drops waiting ones, so open streams end with [DONE] instead of being cut at the graceful timeout."""

    async def shutdown(self, sockets=None):
        self.config.app.state.scheduler.close(timeout=0)
        await super().shutdown(sockets=sockets)


def serve(app: FastAPI, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    EngineServer(uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)).run()
