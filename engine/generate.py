"""The generation loop: one shared prefill, n samples decoded as one batch, streamed as text deltas.

Prefill runs once at batch 1 and its KV cache is copied to the n samples. Each decode step runs the
one-token forward for the whole batch (a compiled step where available), samples on device, and
does one host transfer of the n new token ids, which streaming needs anyway. Timing is taken here,
where tokens are produced: TTFT from the start of the request, decode speed over first..last token.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterator

import torch

from laneplay.engine.errors import ContextLengthError, PromptError
from laneplay.engine.metrics import GenerationMetrics
from laneplay.engine.sampling import RowSampler, SamplingParams
from laneplay.engine.speculative import note as note_speculation


@dataclass
class TokenLogprob:
    """One token of a sample's text with its log-probability (see `engine.sampling`: the model's log-softmax
    over the whole vocabulary) and the most likely tokens at its position. `text` is the part of the
    sample's text this token wrote: the texts of a sample's tokens concatenate to its text (a token inside
    a multi-byte character writes "" and the one completing it the character; a stop string cuts the token
    it falls in and drops the ones after). `bytes` are the token's own bytes (the UTF-8 of `text` where a
    stop string or the start of the text cut the token). `top`: [(id, text, logprob, bytes)], best first; a token's text there is
    its piece alone (invalid UTF-8 shown as U+FFFD)."""
    token_id: int
    text: str
    logprob: float
    bytes: list[int]
    top: list[tuple[int, str, float, list[int]]]


@dataclass
class GenerationEvent:
    sample_index: int
    text: str  # new text since the previous event of this sample
    token_ids: list[int]  # new token ids since the previous event of this sample
    finish_reason: str | None  # None while running; "stop" (EOS or stop string) or "length" at the end
    metrics: GenerationMetrics
    # with params.logprobs: the tokens whose text this event (and the ones before) released, in order;
    # over a whole sample they concatenate to its text (an EOS token writes no text and is not listed)
    logprobs: list[TokenLogprob] | None = None


class StopMatcher:
    """Finds stop strings across token boundaries; holds back text that may be a stop's beginning."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.text = ""  # everything decoded so far
        self.emitted = 0  # how much of it was released

    def feed(self, delta: str) -> tuple[str, bool]:
        """Add decoded text; returns (text safe to release, whether a stop string was hit)."""
        search_from = max(0, self.emitted - max((len(s) for s in self.stops), default=0))
        self.text += delta
        hits = [i for i in (self.text.find(s, search_from) for s in self.stops) if i >= 0]
        if hits:
            out, self.emitted = self.text[self.emitted:min(hits)], len(self.text)
            return out, True
        hold = 0
        for s in self.stops:  # the longest text suffix that is a proper prefix of a stop string
            for k in range(min(len(s) - 1, len(self.text)), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        end = max(self.emitted, len(self.text) - hold)
        out, self.emitted = self.text[self.emitted:end], end
        return out, False

    def flush(self) -> str:
        out, self.emitted = self.text[self.emitted:], len(self.text)
        return out


@dataclass
class _Sample:
    index: int
    seed: int
    decoder: object
    stop: StopMatcher
    metrics: GenerationMetrics
    t_first: float | None = None
    t_last: float | None = None
    finish_reason: str | None = None
    pending_ids: list[int] = field(default_factory=list)
    ledger: list[TokenLogprob] = field(default_factory=list)  # tokens whose text is not released yet
    unassigned: int = 0  # released characters not yet given to a token of the ledger


def prompt_ids(tokenizer, prompt, chat: bool) -> list[int]:
    """Token ids for a text prompt, a chat (str or list of messages), or ready-made ids."""
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    if isinstance(prompt, (list, tuple)) and prompt and all(isinstance(m, dict) for m in prompt):
        return tokenizer.encode_chat(list(prompt))
    if not isinstance(prompt, str):
        raise PromptError("prompt must be a string, a list of token ids or a list of chat messages")
    if not prompt.strip():
        raise PromptError("prompt is empty")
    if chat:
        return tokenizer.encode_chat([{"role": "user", "content": prompt}])
    return tokenizer.encode(prompt)


def check_context(n_prompt: int, params: SamplingParams, context: int) -> None:
    if n_prompt == 0:
        raise PromptError("prompt is empty")
    if n_prompt + params.max_tokens > context:
        raise ContextLengthError(f"prompt ({n_prompt} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                                 f"model's context of {context} tokens; shorten the prompt or lower max_tokens")


Step = tuple[list[int], float, list | None]  # one token per sample, when, their logprobs (RowSampler.host_logprobs)


def token_steps(runner, ids: list[int], params: SamplingParams, eos_ids: set[int], seeds: list[int],
                should_stop: Callable[[], bool] | None = None, spec=None) -> Iterator[Step]:
    """The token side of a request: yields (one new token per sample, time it was produced, their logprobs
    when the request asks for them).

    `runner` provides `prefill(ids [1, S], n, max_seq_len, should_stop) -> X | None` (None: stopped
    between prefill chunks), `decode_step(tokens [n, 1], pos) -> X` and `pick(X, sampler) -> tokens [n]`
    (X: logits, or per-rank shards under DTP; `sampler`: the request's `RowSampler`, row i sampled with
    sample i's settings).
    Stops when every sample hit EOS, at max_tokens, or when `should_stop()` says so (checked between
    prefill chunks and after every token).

    spec: an active `engine.speculative.Speculation` (one sample): steps with drafts run
    `runner.verify(tokens [1, S], pos) -> (logits [1, S, V], rewind)` instead of `decode_step` and yield
    every token they keep, one at a time, with the same time.
    """
    n = params.n
    sampler = RowSampler(params, seeds, ids, runner.device)
    x = runner.prefill(torch.tensor([ids], dtype=torch.long, device=runner.device), n, len(ids) + params.max_tokens,
                       should_stop)
    if x is None:
        return
    if spec is not None and spec.active:
        yield from _speculative_steps(runner, ids, params, eos_ids, sampler, should_stop, spec, x)
        return
    done = [False] * n
    for step in range(params.max_tokens):
        tokens = runner.pick(x, sampler)  # [n], on device
        host = tokens.tolist()  # the one host sync per step; streaming needs the ids anyway
        yield host, time.perf_counter(), sampler.host_logprobs()
        if not params.ignore_eos:
            done = [d or t in eos_ids for d, t in zip(done, host)]
        if all(done) or step == params.max_tokens - 1 or (should_stop is not None and should_stop()):
            return
        x = runner.decode_step(tokens.view(n, 1), len(ids) + step)


def _speculative_steps(runner, ids, params, eos_ids, sampler, should_stop, spec, x):
    """token_steps for one sample with prompt-lookup drafts (see `engine.speculative`; speculation is off
    for requests whose sampler keeps a penalties' history; logprobs come per kept position from the verify)."""
    from laneplay.engine.speculative import room

    generators = sampler.generators
    tok = int(runner.pick(x, sampler)[0])
    produced = 1
    yield [tok], time.perf_counter(), sampler.host_logprobs()
    spec.produced([tok])
    while True:
        if (tok in eos_ids and not params.ignore_eos) or produced == params.max_tokens or (
                should_stop is not None and should_stop()):
            return
        pos = len(ids) + produced - 1  # where tok goes
        drafts = spec.drafts(room(spec, produced, params.max_tokens, runner.cache))
        if drafts:
            logits, rewind = runner.verify(torch.tensor([[tok, *drafts]], device=runner.device), pos)
            out = spec.accept(logits[0], drafts, generators[0], () if params.ignore_eos else eos_ids)
            lps = sampler.position_logprobs(logits[0], out)
            rewind.keep(len(out))  # tok and the kept drafts; the new token goes in at the next step
        else:
            out = [int(runner.pick(runner.decode_step(torch.tensor([[tok]], device=runner.device), pos), sampler)[0])]
            lps = [sampler.host_logprobs()]
        spec.steps += 1
        now = time.perf_counter()
        for t, lp in zip(out, lps or [None] * len(out)):
            produced += 1
            yield [t], now, lp
            if t in eos_ids and not params.ignore_eos:
                return
            if should_stop is not None and should_stop():
                return
        spec.produced(out)
        tok = out[-1]


class TextSide:
    """The text side of one request, fed one step at a time: incremental detokenization, stop strings,
    finish reasons and timing per sample (each sample's metrics also say its seed and sampling
    settings). `feed` takes a step's tokens (one per sample) and, when the request asks for logprobs, theirs;
    it returns the events they make; `close` ends what is still open as "cancelled"."""

    def __init__(self, params: SamplingParams, seeds: list[int], tokenizer, eos_ids: set[int], prompt_tokens: int,
                 device: str, world_size: int, t_start: float, spec=None):
        self.params, self.eos_ids, self.t_start, self.step = params, eos_ids, t_start, 0
        self.tokenizer = tokenizer
        self.spec = spec  # the request's `engine.speculative.Speculation`, whose counts the metrics carry
        self.samples = [
            _Sample(i, s, tokenizer.stream(), StopMatcher(params.stop),
                    GenerationMetrics(prompt_tokens=prompt_tokens, device=device, world_size=world_size, seed=s,
                                      temperature=t, top_p=p, top_k=k, min_p=m))
            for i, (s, (t, p, k, m)) in enumerate(zip(seeds, params.settings()))
        ]

    @property
    def done(self) -> bool:
        return all(s.finish_reason for s in self.samples)

    def feed(self, host: list[int], now: float, logprobs: list | None = None) -> list[GenerationEvent]:
        params, out = self.params, []
        last_step = self.step == params.max_tokens - 1
        self.step += 1
        for s in self.samples:
            if s.finish_reason is not None:
                continue
            tok = host[s.index]
            s.t_first = now if s.t_first is None else s.t_first
            s.t_last = now
            s.metrics.completion_tokens += 1
            note_speculation(s.metrics, self.spec)
            s.pending_ids.append(tok)
            if tok in self.eos_ids and not params.ignore_eos:
                tail = s.decoder.flush()  # text still held belongs to the tokens before EOS, which writes none
                self._write(s, tail)
                text, s.finish_reason = s.stop.feed(tail)[0] + s.stop.flush(), "stop"
            else:
                piece = s.decoder.push(tok)
                if logprobs is not None:
                    s.ledger.append(self._token(tok, piece, *logprobs[s.index]))
                text, hit = s.stop.feed(piece)
                if hit:
                    s.finish_reason = "stop"
                elif last_step:
                    tail = s.decoder.flush()
                    self._write(s, tail)
                    text += s.stop.feed(tail)[0] + s.stop.flush()
                    s.finish_reason = "length"
            if text or s.finish_reason:
                s.metrics.finish_reason = s.finish_reason
                s.metrics.update_timing(self.t_start, s.t_first, s.t_last)
                released = self._release(s, len(text)) if logprobs is not None else None
                out.append(GenerationEvent(s.index, text, s.pending_ids, s.finish_reason, replace(s.metrics),
                                           released))
                s.pending_ids = []
        return out

    # -- logprobs: which token wrote which text --
    def _token(self, tok: int, piece: str, logprob: float, top: list) -> TokenLogprob:
        alternatives = [(i, *self._piece(i), lp) for i, lp in top]
        return TokenLogprob(tok, piece, logprob, [], [(i, text, lp, raw) for i, text, raw, lp in alternatives])

    def _piece(self, tok: int) -> tuple[str, list[int]]:
        raw = self.tokenizer.token_bytes(tok)
        return raw.decode("utf-8", "replace"), list(raw)

    @staticmethod
    def _write(s: _Sample, tail: str) -> None:
        """Text the decoder released only at the end belongs to the last token that has not written yet."""
        if tail and s.ledger:
            s.ledger[-1].text += tail

    def _release(self, s: _Sample, chars: int) -> list[TokenLogprob]:
        """The ledger's tokens whose text the released `chars` (and what came before) cover. A token that
        wrote nothing yet (inside a character) waits for the next one while the sample runs; at the end, a
        stop string cuts the token it falls in and drops the rest."""
        s.unassigned += chars
        out = []
        while s.ledger and len(s.ledger[0].text) <= s.unassigned and (
                s.ledger[0].text or len(s.ledger) > 1 or s.finish_reason):
            s.unassigned -= len(s.ledger[0].text)
            out.append(s.ledger.pop(0))
        if s.finish_reason:
            if s.ledger and s.unassigned:
                cut = s.ledger[0]
                cut.text, s.unassigned = cut.text[:s.unassigned], 0
                out.append(cut)
            s.ledger.clear()
        for t in out:
            t.bytes = self._bytes(t)
        return out

    def _bytes(self, t: TokenLogprob) -> list[int]:
        raw = self.tokenizer.token_bytes(t.token_id)
        try:
            whole = raw.decode("utf-8")
        except UnicodeDecodeError:  # part of a character: its bytes complete the ones around it
            return list(raw)
        # its text may begin with what earlier tokens left unfinished; a cut (stop string, the leading space a
        # sentencepiece decode drops) makes the token's bytes those of its text
        return list(raw) if t.text.endswith(whole) else list(t.text.encode())

    def close(self) -> list[GenerationEvent]:
        """The token side ended early (cancelled, timed out): close what is open."""
        out = []
        for s in self.samples:
            if s.finish_reason is None:
                s.finish_reason = s.metrics.finish_reason = "cancelled"
                out.append(GenerationEvent(s.index, "", s.pending_ids, "cancelled", replace(s.metrics)))
        return out


def stream_events(steps: Iterator[Step], params: SamplingParams, seeds: list[int], tokenizer,
                  eos_ids: set[int], prompt_tokens: int, device: str, world_size: int,
                  t_start: float, spec=None) -> Iterator[GenerationEvent]:
    """The text side over a whole token stream (see `TextSide`)."""
    text = TextSide(params, seeds, tokenizer, eos_ids, prompt_tokens, device, world_size, t_start, spec)
    try:
        for host, now, logprobs in steps:
            yield from text.feed(host, now, logprobs)
            if text.done:
                return
        yield from text.close()
    finally:
        close = getattr(steps, "close", None)
        if close is not None:
            close()
