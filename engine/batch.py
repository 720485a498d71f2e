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
from laneplay.engine.speculative import SOLO_DRAFTS, SOLO_KEEP, SOLO_ROWS, room
from laneplay.engine.speculative import plan as plan_speculation

# The most rows a shared step takes (each request's rows, a verify's drafts among them). Any number keeps
# every row's logits a decode step's (the low-bit step has 16-bit activations at any size); more would
# stretch every row's time between tokens (16 rows already cost 5.5-6.8x one on the 2-core machines).
STEP_ROWS = 16


def kv_need(engine, ids: list[int], params: SamplingParams) -> int:
    """The KV cache a request reserves while it runs (its prefill cache and its n-sample copy)."""
    return request_kv_bytes(engine.cfg, params.n, len(ids) + params.max_tokens, engine.runtime.kv_dtype.itemsize)


class Sequence:
    """One request's rows: prefill, KV cache and position, sampler (generators, penalties' history), text side."""

    def __init__(self, engine, ids: list[int], params: SamplingParams, t_start: float, prefixes=None,
                 speculative: str = "auto", seeds: list[int] | None = None, text: bool = True,
                 piece: int | None = None):
        """seeds: the samples' seeds (default: drawn as a request alone draws them); text: turn tokens into
        text events (`TextSide`), or else hand back each position's raw (tokens, time, logprobs) step, as a
        DTP rank does (its front end has the text side); piece: the most prompt positions one prefill step
        runs where a chunk runs on the fused step (`LaneModel.prefill_steps`; None: whole chunks)."""
        self.runner, self.ids, self.params, self.n = engine.runner, ids, params, params.n
        self.seeds = sample_seeds(params) if seeds is None else list(seeds)
        self.sampler = RowSampler(params, self.seeds, ids, self.runner.device)
        self.eos_ids = engine.eos_ids
        self.spec = plan_speculation(speculative, self.runner, ids, params)
        self.text = TextSide(params, self.seeds, engine.tokenizer, self.eos_ids, len(ids), str(engine.device),
                             engine.world_size, t_start, self.spec) if text else _RawSteps()
        self.kv_bytes = kv_need(engine, ids, params)
        self._prefill, self.reused = self.runner.prefill_steps(ids, self.n, len(ids) + params.max_tokens, prefixes,
                                                               piece)
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
        """This step's prompt-lookup drafts (empty: it takes a plain row). shared: other requests decode in
        this step; then "auto" drafts only while the request keeps most of its drafts
        (`Speculation.drafts`). Greedy tokens are the same either way."""
        return self.spec.drafts(room(self.spec, self.produced, self.params.max_tokens, self.cache), shared)

    def joins(self, drafts: list[int]) -> bool:
        """Whether the verify of these drafts may run as rows of a shared step."""
        return bool(drafts) and self.runner.verify_joins(self.pos, 1 + len(drafts), self.cache)

    def verify_tokens(self, drafts: list[int]):
        """The verify's rows: its last token, then the drafts ([1 + k, 1] on the runner's device)."""
        return torch.cat([self.tokens.view(1), torch.tensor(drafts, device=self.runner.device)]).view(-1, 1)

    def verify(self, drafts: list[int], logits=None) -> list[GenerationEvent]:
        """The speculating step: keeps the drafts the model agrees with (engine/speculative.py). logits: the
        verify's rows [1 + k, V] when it ran inside a shared step (`joins`: nothing was overwritten, so
        nothing rolls back); else its last token and drafts run as one forward of its own, which rolls back
        what it does not keep."""
        rewind = None
        if logits is None:
            logits, rewind = self.runner.verify(self.verify_tokens(drafts).view(1, -1), self.pos, self.cache)
            logits = logits[0]
        out = self.spec.accept(logits, drafts, self.sampler.generators[0],
                              () if self.params.ignore_eos else self.eos_ids)
        if rewind is not None:
            rewind.keep(len(out))
        self.pos += len(out)
        self.spec.steps += 1
        return self._feed([[t] for t in out], self.sampler.position_logprobs(logits, out))

    def cancel(self) -> list[GenerationEvent]:
        """Stopped from outside (client gone, Stop, time limit): close the open samples as "cancelled"."""
        self._release()
        return self.text.close()

    def _release(self) -> None:
        self.finished = True
        if self._prefill is not None:
            self._prefill.close()
        self._prefill = self.cache = self.tokens = None


def prompt_turns(items, budget: int, chunk: int):
    """The (key, sequence) pairs of `items` whose prompt runs its next chunk in this step, in order: every
    prefilling sequence while the step's prompt-token budget lasts (each counts one chunk, or its whole
    prompt when that is shorter)."""
    for key, seq in items:
        if seq.prefilling and budget > 0:
            budget -= min(len(seq.ids), chunk)
            yield key, seq


class _RawSteps:
    """A text side that keeps no text: each position's step as `token_steps` yields it."""

    done = False

    def feed(self, host: list[int], now: float, logprobs=None) -> list[tuple]:
        return [(host, now, logprobs)]

    def close(self) -> list:
        return []


def decode_step(runner, seqs: list[Sequence]) -> list[list[GenerationEvent]]:
    """One step for every (decoding) sequence; each sequence's events. Every plain row gets one token and
    every verify that can join (`Sequence.joins`) checks its drafts, in one shared forward
    (`decode_groups`: a verify of k drafts is k + 1 one-token groups at consecutive positions of its
    cache); a verify that cannot join runs as a forward of its own. Either way a sequence's tokens are
    the ones it gets alone. A shared step takes at most STEP_ROWS rows: the drafts share what the
    requests' own rows leave, the first draft of each request before anyone's second (`share_rows`).
    "auto" drafts freely beside other requests only in a step where every one of them drafts (where all
    draft, all gain: engine.speculative.SHARED_KEEP). Where one does not, it waits for every row of the
    step, so its time pays for the others' drafts: there an "auto" request drafts at most SOLO_DRAFTS,
    and only while it keeps nearly all of its drafts (SOLO_KEEP) in a step of SOLO_ROWS requests' rows;
    otherwise it holds them back. Four separate prompts at once, two of them repetitive: with every draft
    held back all four finished together (eight drafting freely: 6% later); with the few kept drafts the
    two finished in 0.64-0.78x that time and the others in the same."""
    shared = len(seqs) > 1
    drafts = [s.drafts(shared) for s in seqs]
    joined = [s.joins(d) for s, d in zip(seqs, drafts)]
    if shared:
        own = sum(s.n for s in seqs)
        wants = [len(d) if j else 0 for d, j in zip(drafts, joined)]
        if not all(wants):  # beside a request that does not draft, "auto" drafts a little or not at all
            for i, (s, w) in enumerate(zip(seqs, wants)):
                if w and s.spec.control.auto:
                    if SOLO_ROWS[0] <= own <= SOLO_ROWS[1] and s.spec.control.kept_share >= SOLO_KEEP:
                        wants[i] = min(w, SOLO_DRAFTS)
                    else:
                        s.spec.hold(drafts[i][0])
                        wants[i] = 0
        for i, k in enumerate(share_rows(wants, STEP_ROWS - own)):
            if joined[i]:
                drafts[i] = drafts[i][:k]
                joined[i] = k > 0
    events: list = [None] * len(seqs)
    step = [i for i, (d, j) in enumerate(zip(drafts, joined)) if j or not d]
    if step:
        parts, groups = [], []
        for i in step:
            s = seqs[i]
            if joined[i]:
                parts.append(s.verify_tokens(drafts[i]))
                groups += [(s.pos + j, s.cache) for j in range(1 + len(drafts[i]))]
            else:
                parts.append(s.tokens)
                groups.append((s.pos, s.cache))
        logits = runner.decode_groups(torch.cat(parts) if len(parts) > 1 else parts[0], groups)
        a = 0
        for i, part in zip(step, parts):
            s, rows = seqs[i], part.shape[0]
            if joined[i]:
                events[i] = s.verify(drafts[i], logits[a:a + rows])
            else:
                s.pos += 1
                events[i] = s._take(logits[a:a + rows])
            a += rows
    for i, s in enumerate(seqs):
        if events[i] is None:
            events[i] = s.verify(drafts[i])
    return events


def share_rows(wants: list[int], free: int) -> list[int]:
    """Rows for each request's drafts out of `free`: one draft each in turn (a first draft is the likeliest
    to be kept), until every request has what it wants or nothing is left."""
    got = [0] * len(wants)
    while free > 0 and any(g < w for g, w in zip(got, wants)):
        for i, w in enumerate(wants):
            if got[i] < w and free > 0:
                got[i] += 1
                free -= 1
    return got


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
