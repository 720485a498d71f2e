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

import torch

from laneplay.engine.generate import GenerationEvent, TextSide
from laneplay.engine.model import request_kv_bytes
from laneplay.engine.sampling import SamplingParams, make_generators, sample_seeds


def kv_need(engine, ids: list[int], params: SamplingParams) -> int:
    """The KV cache a request reserves while it runs (its prefill cache and its n-sample copy)."""
    return request_kv_bytes(engine.cfg, params.n, len(ids) + params.max_tokens, engine.dtype.itemsize)


class Sequence:
    """One request's rows: prefill, KV cache and position, generators, text side."""

    def __init__(self, engine, ids: list[int], params: SamplingParams, t_start: float):
        self.runner, self.ids, self.params, self.n = engine.runner, ids, params, params.n
        self.seeds = sample_seeds(params)
        self.generators = make_generators(self.seeds, self.runner.device)
        self.eos_ids = engine.eos_ids
        self.text = TextSide(params, self.seeds, engine.tokenizer, self.eos_ids, len(ids), str(engine.device),
                             engine.world_size, t_start)
        self.kv_bytes = kv_need(engine, ids, params)
        self._prefill = self.runner.prefill_steps(ids, self.n, len(ids) + params.max_tokens)
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
        tokens = self.runner.pick(logits, self.params, self.generators)
        host = tokens.tolist()  # the one host sync per sequence and step; streaming needs the ids anyway
        events = self.text.feed(host, time.perf_counter())
        self.produced += 1
        if not self.params.ignore_eos:
            self._rows_done = [d or t in self.eos_ids for d, t in zip(self._rows_done, host)]
        if all(self._rows_done) or self.produced == self.params.max_tokens or self.text.done:
            self._release()
        else:
            self.tokens = tokens.view(self.n, 1)
        return events

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
    """One token for every row of every (decoding) sequence, in one forward; each sequence's events."""
    tokens = torch.cat([s.tokens for s in seqs]) if len(seqs) > 1 else seqs[0].tokens
    logits = runner.decode_groups(tokens, [(s.pos, s.cache) for s in seqs])
    out, a = [], 0
    for s in seqs:
        s.pos += 1
        out.append(s._take(logits[a:a + s.n]))
        a += s.n
    return out
