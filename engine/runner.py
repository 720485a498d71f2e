"""The local runner: one `LaneModel` (all lanes, or a DTP rank's slice of them) and its KV cache.

It speaks the runner protocol of `engine.generate.token_steps` (`prefill`, `decode_step`, `pick`),
and is used unchanged by the single-process engine and by every DTP rank; the only difference is
the model's `comm` (local sums here, collectives on a rank), which also owns how a step's logits are
turned into tokens (`comm.pick`: a plain sample locally, a gather of vocab shards on a rank).
"""
from __future__ import annotations

import itertools
import time
from typing import Callable, Iterator

import torch
from torch import Tensor

from laneplay.engine.generate import token_steps
from laneplay.engine.model import KVPrefix, LaneModel
from laneplay.engine.runtime import Runtime
from laneplay.engine.sampling import RowSampler, SamplingParams


class LocalRunner:
    """`prefill` / `decode_step` / `pick` over one model in this process, plus whole-request helpers."""

    def __init__(self, model: LaneModel, runtime: Runtime):
        self.model, self.runtime = model, runtime
        self.cfg, self.comm = model.cfg, model.comm
        self.device = model.device
        self.world_size = runtime.world_size
        self.cache = None
        self.static = None  # the static (CUDA-graph) decode step, when the runtime asks for it
        self._static_now = False  # whether the current request decodes through it
        if runtime.graphs:
            from laneplay.engine.static_step import StaticDecoder

            self.static = StaticDecoder(model, graphs=model.device.type == "cuda" and runtime.world_size == 1,
                                        kv_budget_bytes=runtime.kv_budget_bytes)
            if self.static.graphs:
                self.static.tune()  # which attention split and GEMV this GPU runs fastest
        if runtime.compile:
            self.compile()
        elif self.static is not None:
            self.warm_up()  # captures the batch-1 and batch-2 graphs now, never inside a request

    # -- the runner protocol of token_steps --
    @torch.inference_mode()
    def prefill(self, ids: Tensor, n: int, max_seq_len: int, should_stop=None) -> Tensor | None:
        """Prompt at batch 1 into a fresh cache, copied to n samples; last-token logits [n, V] (a shard on a
        rank), or None when `should_stop()` ended it between chunks."""
        logits, self.cache = self.model.prefill(ids, n, max_seq_len, should_stop, chunk=self.runtime.prefill_chunk)
        self._static_now = self.cache is not None and self.static is not None and self.static.fits(n, max_seq_len)
        if self._static_now:
            self.static.load(self.cache, ids.shape[1])
            self.cache = None
        return logits

    @torch.inference_mode()
    def decode_step(self, tokens: Tensor, pos: int) -> Tensor:
        """One token per sample at position pos: tokens [n, 1] -> logits [n, V] (a shard on a rank)."""
        t0 = time.perf_counter()
        if self._static_now:
            out = self.static.step(tokens, pos)
        else:
            out = self.model.decode(tokens, pos, self.cache)
        self.comm.note_step(t0, time.perf_counter())
        return out

    def verify(self, tokens: Tensor, pos: int, cache=None):
        """Speculative verification: tokens [1, S] at positions pos.. over this request's cache (or `cache`)
        -> (logits [1, S, V], a rewind: `keep(k)` with the positions kept). Through the static step
        (`StaticDecoder.verify`, a graph per bucket on CUDA) where the request's KV lives there, else
        `LaneModel.verify`."""
        t0 = time.perf_counter()
        if self.static is not None and (self._static_now if cache is None else self.static.can_verify(cache, pos)):
            logits, rewind = self.static.verify(tokens, pos, cache)
        else:
            logits, rewind = self.model.verify(tokens, pos, self.cache if cache is None else cache)
        self.comm.note_step(t0, time.perf_counter())
        return self.comm.verify_logits(logits), rewind  # on a DTP rank: every rank's shards, gathered

    @torch.inference_mode()
    def pick(self, logits: Tensor, sampler: RowSampler) -> Tensor:
        return self.comm.pick(logits, sampler)

    # -- several requests at once (the scheduler's iteration-level batches) --
    @property
    def batchable(self) -> bool:
        """Whether separate requests may share decode steps here: one process (with the static step, their
        rows share its cache and a graph per bucket: `StaticDecoder.groups`)."""
        return self.world_size == 1 and self.model is not None

    def prefill_steps(self, ids: list[int], n: int, max_seq_len: int, prefixes=None, piece: int | None = None):
        """One request's prefill, a chunk (or piece) per step (see `LaneModel.prefill_steps`): (the steps, how
        many prompt tokens came from `prefixes`, an `engine.batch.PrefixCache`, which also keeps this
        prompt's whole chunks for later requests)."""
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        start, keep, reused = None, None, 0
        if prefixes is not None:
            cache = self.model.new_cache(1, max_seq_len)  # the prefill's own cache, reused prefix or not
            hit = prefixes.lookup(ids, cache.slots)
            built = KVPrefix(len(cache.slots))
            if hit is not None:
                prefix, reused = hit
                prefix.load(cache, reused)
                built = prefix.truncated(reused)
            start = (cache, reused)

            def keep(cache, a, b, last):
                built.add_chunk(cache, a, b)
                if last:
                    prefixes.store(ids[:b], built)

        steps = self.model.prefill_steps(x, n, max_seq_len, chunk=self.runtime.prefill_chunk, start=start, keep=keep,
                                         piece=piece)
        return steps, reused

    def verify_joins(self, pos: int, S: int, cache) -> bool:
        """Whether a verify of S positions from pos may run as S one-token groups of a `decode_groups` step,
        beside other requests' rows, with each row's logits those of a decode step
        (`LaneModel.verifies_as_groups`). Not with the static step: its shared step takes one row per
        request, and a verify there is a step of its own (`StaticDecoder.verify`)."""
        return self.static is None and self.model.verifies_as_groups(pos, S, cache)

    @torch.inference_mode()
    def decode_groups(self, tokens: Tensor, groups: list) -> Tensor:
        """One decode step for several requests: groups [(pos, cache)] -> logits [B, V]."""
        t0 = time.perf_counter()
        inside = self.static.inside(groups) if self.static is not None else [False] * len(groups)
        if all(inside):
            out = self.static.groups(tokens, groups)
        elif not any(inside):
            out = self.model.decode_groups(tokens, groups)
        else:  # some in the static step's shared cache, the others on their own caches
            edges = [0, *itertools.accumulate(c.batch for _, c in groups)]
            part = {flag: [i for i, f in enumerate(inside) if f == flag] for flag in (True, False)}
            logits = {}
            for flag, run in ((True, self.static.groups), (False, self.model.decode_groups)):
                rows = torch.cat([tokens[edges[i]:edges[i + 1]] for i in part[flag]])
                for i, x in zip(part[flag], run(rows, [groups[i] for i in part[flag]]).split(
                        [groups[i][1].batch for i in part[flag]])):
                    logits[i] = x
            out = torch.cat([logits[i] for i in range(len(groups))])
        self.comm.note_step(t0, time.perf_counter())
        return out

    # -- whole requests --
    def token_steps(self, ids: list[int], params: SamplingParams, seeds: list[int], eos_ids: set[int],
                    should_stop: Callable[[], bool] | None = None, spec=None) -> Iterator[tuple[list[int], float]]:
        """(one new token per sample, time, logprobs or None) per step; the KV cache is freed when the request
        ends. spec: the request's speculation (`engine.speculative`), or None."""
        try:
            yield from token_steps(self, ids, params, eos_ids, seeds, should_stop, spec)
        finally:
            self.cache = None

    @torch.inference_mode()
    def logits(self, ids: Tensor) -> Tensor:
        """Full causal forward without a cache: ids [B, S] -> float32 logits [B, S, V] (whole vocabulary)."""
        local = self.model(ids.to(self.device), pos=0, cache=None)
        return self.comm.gather_logits(local)[0]

    # -- speed path --
    def compile(self) -> None:
        """Compile the decode blocks and pay the compile cost now, never inside a request."""
        self.model.compile_blocks()
        self.warm_up()

    @torch.inference_mode()
    def warm_up(self, batches: tuple[int, ...] = (1, 2)) -> None:
        """Prefill and run decode steps at each batch size: compiles the blocks' one-row and many-row
        graphs (`LaneModel.compile_blocks`; every later batch size, position and cache length reuses
        them), or captures the static step's graphs (and those of its buckets of separate requests)."""
        ids = torch.ones(1, 4, dtype=torch.long, device=self.device)
        for n in batches:
            self.prefill(ids, n, 8)
            for pos in (4, 5, 6):
                self.decode_step(torch.ones(n, 1, dtype=torch.long, device=self.device), pos)
        self.cache = None
        if self.static is not None:
            self.static.warm_buckets()  # separate requests' shared steps
            self.static.warm_verifies()  # speculative verifies, alone and in the shared cache

    def close(self) -> None:
        self.model = self.cache = self.static = None
