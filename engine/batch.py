"""Requests as rows of one batch: what the scheduler needs to run several requests in the same steps.

A `Sequence` is one request's rows (its n samples) inside an iteration-level batch: its prompt is
prefilled a chunk at a time (`prefill_chunk`), then each `decode_step` runs one token for every
decoding sequence in one forward (`LaneModel.decode_groups`: the products over all rows, attention per
sequence on its own KV cache at its own position). Each sequence samples its rows with its own
parameters and seeded generators and feeds its own text side, so it finishes on its own (EOS, stop
string, max_tokens) and its tokens are the ones it produces alone.
"""
from __future__ import annotations

import time
from collections import OrderedDict

import torch

from laneplay.engine.generate import GenerationEvent, TextSide
from laneplay.engine.model import request_kv_bytes
from laneplay.engine.sampling import RowSampler, SamplingParams, sample_seeds
from laneplay.engine.speculative import plan as plan_speculation
from laneplay.engine.speculative import room


def kv_need(engine, ids: list[int], params: SamplingParams) -> int:
    """The KV cache a request reserves while it runs (its prefill cache and its n-sample copy)."""
    return request_kv_bytes(engine.cfg, params.n, len(ids) + params.max_tokens, engine.dtype.itemsize)


class Sequence:
    """One request's rows: prefill, KV cache and position, sampler (generators, penalties' history), text side."""

    def __init__(self, engine, ids: list[int], params: SamplingParams, t_start: float, prefixes=None,
                 speculative: str = "auto"):
        self.runner, self.ids, self.params, self.n = engine.runner, ids, params, params.n
        self.seeds = sample_seeds(params)
        self.sampler = RowSampler(params, self.seeds, ids, self.runner.device)
        self.eos_ids = engine.eos_ids
        self.spec = plan_speculation(speculative, self.runner, ids, params)
        self.text = TextSide(params, self.seeds, engine.tokenizer, self.eos_ids, len(ids), str(engine.device),
                             engine.world_size, t_start, self.spec)
        self.kv_bytes = kv_need(engine, ids, params)
        self._prefill, self.reused = self.runner.prefill_steps(ids, self.n, len(ids) + params.max_tokens, prefixes)
        self.cache = self.tokens = None
        self.pos = len(ids)  # where the next decode step writes
        self.chunks = 0  # prompt chunks run so far
        self.produced = 0  # tokens per row so far
        self.finished = False
        self._rows_done = [False] * self.n

    @property
    def prefilling(self) -> bool:
        return self._prefill is not None

    def prefill_chunk(self) -> list[GenerationEvent]:
        """Run the next chunk of the prompt; after the last one, the first tokens' events."""
        out = next(self._prefill)
        self.chunks += 1
        if out is None:
            return []
        self._prefill = None
        logits, self.cache = out
        return self._take(logits)

    def _take(self, logits) -> list[GenerationEvent]:
        """Sample this sequence's rows from their logits [n, V] and turn the tokens into events."""
        tokens = self.runner.pick(logits, self.sampler)
        if self.produced:
            self.spec.steps += 1
        # the one host sync per sequence and step; streaming needs the ids anyway
        return self._feed([tokens.tolist()], [self.sampler.host_logprobs()], last=tokens)

    def _feed(self, steps: list[list[int]], logprobs: list | None = None, last=None) -> list[GenerationEvent]:
        """Tokens of this step (one list of n per token position, in order) -> events. logprobs: per
        position, its log-probabilities when the request asks for them (`RowSampler`). last: the step's
        tokens already on the device, when the caller has them (no copy back)."""
        events, now = [], time.perf_counter()
        for j, host in enumerate(steps):
            events += self.text.feed(host, now, logprobs[j] if logprobs else None)
            self.produced += 1
            self.spec.produced(host)
            if not self.params.ignore_eos:
                self._rows_done = [d or t in self.eos_ids for d, t in zip(self._rows_done, host)]
            if all(self._rows_done) or self.produced == self.params.max_tokens or self.text.done:
                self._release()
                return events
        if last is None:
            last = torch.tensor(steps[-1], device=self.runner.device)
        self.tokens = last.view(self.n, 1)
        return events

    def drafts(self, shared: bool = False) -> list[int]:
        """This step's prompt-lookup drafts (empty: it takes a plain row of the shared step). shared: other
        requests decode in this step; then "auto" takes a plain row, since a verify runs as a forward of
        its own (~2-5 steps' cost) while a row of the shared step costs a fraction of one ("lookup"
        always drafts). Greedy tokens are the same either way."""
        if shared and self.spec.mode == "auto":
            return []
        return self.spec.drafts(room(self.spec, self.produced, self.params.max_tokens, self.cache))

    def verify(self, drafts: list[int]) -> list[GenerationEvent]:
        """The speculating step: its last token and drafts in one forward of its own; keeps what the model
        agrees with (engine/speculative.py) and rolls back the rest of the cache."""
        logits, rewind = self.runner.verify(torch.cat([self.tokens.view(1, 1), torch.tensor(
            [drafts], device=self.runner.device)], dim=1), self.pos, self.cache)
        out = self.spec.accept(logits[0], drafts, self.sampler.generators[0],
                              () if self.params.ignore_eos else self.eos_ids)
        rewind.keep(len(out))
        self.pos += len(out)
        self.spec.steps += 1
        return self._feed([[t] for t in out], self.sampler.position_logprobs(logits[0], out))

    def cancel(self) -> list[GenerationEvent]:
        """Stopped from outside (client gone, Stop, time limit): close the open samples as "cancelled"."""
        self._release()
        return self.text.close()

    def _release(self) -> None:
        self.finished = True
        if self._prefill is not None:
            self._prefill.close()
        self._prefill = self.cache = self.tokens = None


def decode_step(runner, seqs: list[Sequence]) -> list[list[GenerationEvent]]:
    """One step for every (decoding) sequence; each sequence's events. A sequence with prompt-lookup
    drafts this step runs its verify as its own forward (its drafts, its position); every other row gets
    one token in one shared forward. Either way a sequence's tokens are the ones it gets alone. While
    several requests decode, "auto" requests take plain rows (`Sequence.drafts`)."""
    drafts = {id(s): s.drafts(shared=len(seqs) > 1) for s in seqs}
    plain = [s for s in seqs if not drafts[id(s)]]
    events: dict[int, list[GenerationEvent]] = {}
    if plain:
        tokens = torch.cat([s.tokens for s in plain]) if len(plain) > 1 else plain[0].tokens
        logits = runner.decode_groups(tokens, [(s.pos, s.cache) for s in plain])
        a = 0
        for s in plain:
            s.pos += 1
            events[id(s)] = s._take(logits[a:a + s.n])
            a += s.n
    for s in seqs:
        if drafts[id(s)]:
            events[id(s)] = s.verify(drafts[id(s)])
    return [events[id(s)] for s in seqs]


class PrefixCache:
    """The KV of recently prefilled prompts, by their tokens, as llama-server's slots and vLLM's prefix
    cache keep them: a prompt that begins like one served recently (the same editor content with a new
    instruction, Generate again, pass@N's samples after its greedy call) starts its prefill after the
    longest run of whole prefill chunks it shares with one of them, and gets exactly the cache (and
    tokens) a cold prefill gives, since the chunks it still runs are the ones a cold prefill runs.

    Entries are whole chunks of prompts (never generated tokens), evicted least recently used to stay
    within `max_bytes`; the scheduler also shrinks it when running requests need the memory. One cache
    belongs to one engine (one model, one dtype).
    """

    def __init__(self, chunk: int, max_bytes: int):
        self.chunk, self.max_bytes = chunk, max_bytes
        self._entries: OrderedDict[tuple[int, ...], object] = OrderedDict()
        self.bytes = 0
        self.hits = 0
        self.reused_tokens = 0

    def __len__(self) -> int:
        return len(self._entries)

    def lookup(self, ids: list[int], slots: list[int]):
        """(prefix, end): the longest whole-chunk prefix of `ids` held here, short of the prompt's last
        token (its logits must be computed), that a cache with these slots can start from; or None."""
        best = None
        for key, prefix in self._entries.items():
            shared = _common_length(key, ids)
            end = min(shared, len(ids) - 1) // self.chunk * self.chunk
            while end > 0 and not prefix.covers(end, slots):
                end -= self.chunk
            if end > 0 and (best is None or end > best[2]):
                best = (key, prefix, end)
        if best is None:
            return None
        self._entries.move_to_end(best[0])
        self.hits += 1
        self.reused_tokens += best[2]
        return best[1], best[2]

    def store(self, ids: list[int], prefix) -> None:
        key = tuple(ids)
        if key in self._entries:
            self._entries.move_to_end(key)
            return
        if prefix.nbytes > self.max_bytes:
            return
        for other in [k for k in self._entries if len(k) < len(key) and key[:len(k)] == k]:
            self._remove(other)  # a shorter prompt this one begins with: this entry restarts at its chunks too
        self._entries[key] = prefix
        self.bytes += prefix.nbytes
        self.shrink(self.max_bytes)

    def shrink(self, to_bytes: int) -> None:
        """Drop the least recently used entries until at most `to_bytes` are held."""
        while self._entries and self.bytes > max(0, to_bytes):
            self._remove(next(iter(self._entries)))

    def _remove(self, key) -> None:
        self.bytes -= self._entries.pop(key).nbytes


def _common_length(a, b) -> int:
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if list(a[:mid]) == list(b[:mid]):
            lo = mid
        else:
            hi = mid
    return lo
