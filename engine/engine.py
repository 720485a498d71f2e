"""The engine's front end: tokenizer, validation, streaming events and metrics over one runner.

A runner produces tokens; the front end turns text into ids and ids into streamed text. Two runners
exist: `engine.runner.LocalRunner` (the model in this process) and `engine.dtp.DTPRunner` (the
model's lanes on N rank processes, each running a LocalRunner). Both provide
`token_steps(ids, params, seeds, eos_ids, should_stop)`, `logits(ids)`, `device`, `world_size` and
`close()`. `engine.loader.load_engine` picks and builds the runner; nothing here knows which it got.
"""
from __future__ import annotations

import functools
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from laneplay.engine.config import ModelConfig
from laneplay.engine.errors import KVBudgetError, ParameterError, PromptError
from laneplay.engine.generate import GenerationEvent, check_context, prompt_ids, stream_events
from laneplay.engine.model import request_kv_bytes
from laneplay.engine.runtime import Runtime
from laneplay.engine.sampling import SamplingParams, sample_seeds
from laneplay.engine.speculative import plan as plan_speculation


class Engine:
    """A loaded model with its tokenizer: `logits`, `generate`, `close`."""

    def __init__(self, cfg: ModelConfig, runner, runtime: Runtime, path: Path, tokenizer=None):
        self.cfg, self.runner, self.runtime, self.path = cfg, runner, runtime, path
        self._tokenizer = tokenizer

    @property
    def tokenizer(self):
        if isinstance(self._tokenizer, Exception):  # a checkpoint without tokenizer files
            raise self._tokenizer
        return self._tokenizer

    @property
    def model_name(self) -> str:
        return self.cfg.name or self.path.name

    @property
    def device(self) -> torch.device:
        return self.runtime.torch_device

    @property
    def dtype(self) -> torch.dtype:
        return self.runtime.torch_dtype

    @property
    def world_size(self) -> int:
        return self.runtime.world_size

    @property
    def model(self):
        """The in-process `LaneModel` (single-process engines; DTP ranks hold theirs in their processes)."""
        model = getattr(self.runner, "model", None)
        if model is None:
            raise AttributeError("this engine's model lives in its DTP rank processes")
        return model

    def logits(self, ids) -> Tensor:
        """Full causal forward without a cache: ids [B, S] -> float32 logits [B, S, V]."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2 or ids.shape[1] == 0:
            raise ValueError(f"ids must be a non-empty [batch, seq] tensor, got shape {list(ids.shape)}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size})")
        if ids.shape[1] > self.cfg.max_position_embeddings:
            raise ValueError(f"{ids.shape[1]} positions exceed the model's context of "
                             f"{self.cfg.max_position_embeddings}")
        return self.runner.logits(ids)

    def prepare(self, prompt, params: SamplingParams | None = None, chat: bool = False):
        """Validate everything before any model work: (prompt ids, params)."""
        params = (params or SamplingParams()).validate()
        ids = prompt_ids(self.tokenizer, prompt, chat)
        if any(not 0 <= t < self.cfg.vocab_size for t in ids):
            raise PromptError(f"prompt token ids must lie in [0, {self.cfg.vocab_size})")
        outside = sorted(t for t in params.logit_bias or {} if t >= self.cfg.vocab_size)
        if outside:
            raise ParameterError(f"logit_bias names token {outside[0]}, outside the vocabulary [0, {self.cfg.vocab_size})",
                                 "logit_bias")
        check_context(len(ids), params, self.cfg.max_position_embeddings)
        self.check_kv_budget(len(ids) + params.max_tokens, params.n)
        return ids, params

    def check_kv_budget(self, positions: int, n: int) -> None:
        """Refuse, before allocating anything, a request whose KV cache would pass the engine's budget."""
        budget = self.runtime.kv_budget_bytes
        need = request_kv_bytes(self.cfg, n, positions, self.runtime.kv_dtype.itemsize)
        if budget and need > budget:
            per_sample = request_kv_bytes(self.cfg, 1, positions, self.runtime.kv_dtype.itemsize)
            fit = max(0, budget // per_sample - 1) if n > 1 else 0
            hint = f"; at this length at most n={fit}" if fit >= 1 else ""
            raise KVBudgetError(f"this request needs {need / 2**30:.2f} GiB of KV cache (n={n} x {positions} positions) "
                                f"but the engine's KV budget is {budget / 2**30:.2f} GiB (--kv-budget-gb); "
                                f"lower n or max_tokens{hint}")

    def generate(self, prompt, params: SamplingParams | None = None, chat: bool = False,
                 should_stop=None, speculative: str = "auto", **overrides) -> Iterator[GenerationEvent]:
        """Stream GenerationEvents (text deltas per sample). Bad input raises before any work.
        speculative: "auto" (prompt-lookup drafts where they pay), "lookup" (always draft), "off"
        (engine/speculative.py); the metrics say what ran and its draft/accepted counts."""
        t_start = time.perf_counter()
        if overrides:
            params = replace(params or SamplingParams(), **overrides)
        ids, params = self.prepare(prompt, params, chat)
        spec = plan_speculation(speculative, self.runner, ids, params)
        seeds = sample_seeds(params)
        if spec.active:
            steps = self.runner.token_steps(ids, params, seeds, self.eos_ids, should_stop, spec=spec)
        else:
            steps = self.runner.token_steps(ids, params, seeds, self.eos_ids, should_stop)
        return stream_events(steps, params, seeds, self.tokenizer, self.eos_ids, len(ids), str(self.device),
                             self.world_size, t_start, spec)

    def request_settings(self, collectives: str | None = None, timeline: bool = False):
        """A context manager around one request's generation on a DTP engine: its collectives
        ("delayed" or "wait_now"; None: the engine's own) and its per-rank timeline, for that request
        only; yields the collectives in use, and `last_timeline` is the request's afterwards."""
        settings = getattr(self.runner, "request_settings", None)
        if settings is None:
            raise ValueError("collectives and timeline apply to DTP engines (world size 2 or more) only")
        return settings(wait_now=None if collectives is None else collectives == "wait_now", timeline=timeline)

    @property
    def last_timeline(self) -> dict | None:
        return getattr(self.runner, "last_timeline", None)

    @functools.cached_property
    def eos_ids(self) -> set[int]:
        """Token ids that end a sample: from config.json and the tokenizer's configs."""
        return set(self.cfg.eos_token_ids) | set(self.tokenizer.eos_ids)

    def close(self) -> None:
        if self.runner is not None:
            self.runner.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
