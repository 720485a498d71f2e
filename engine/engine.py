"""`load_engine`: the one place where device, dtype and runtime are chosen."""
from __future__ import annotations

import functools
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import torch
from torch import Tensor

from engine.checkpoint import GGUFSource, load_weights, open_checkpoint, resolve_checkpoint
from engine.config import ModelConfig
from engine.generate import GenerationEvent, check_context, prompt_ids, stream_events, token_steps
from engine.model import LaneModel
from engine.sampling import SamplingParams, sample, sample_seeds

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of float32, bfloat16, float16")
    return DTYPES[dtype]


def parse_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("device 'cuda' was requested but no CUDA GPU is available; use device='cpu'")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported; use 'cpu' or 'cuda'")
    return dev


class Engine:
    """A loaded model with its tokenizer: `logits`, `generate`, `close`."""

    def __init__(self, cfg: ModelConfig, model: LaneModel, path: Path, device: torch.device, dtype: torch.dtype,
                 tokenizer=None):
        self.cfg, self.model, self.path = cfg, model, path
        self.device, self.dtype = device, dtype
        self.world_size = 1
        self._tokenizer = tokenizer
        self._cache = None

    @property
    def tokenizer(self):
        if isinstance(self._tokenizer, Exception):  # a checkpoint without tokenizer files
            raise self._tokenizer
        return self._tokenizer

    @property
    def model_name(self) -> str:
        return self.cfg.name or self.path.name

    def logits(self, ids) -> Tensor:
        """Full causal forward without a cache: ids [B, S] -> float32 logits [B, S, V]."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2 or ids.shape[1] == 0:
            raise ValueError(f"ids must be a non-empty [batch, seq] tensor, got shape {list(ids.shape)}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size})")
        return self._full_forward(ids)

    @torch.inference_mode()
    def _full_forward(self, ids: Tensor) -> Tensor:
        return self.model(ids.to(self.device), pos=0, cache=None)

    # ---- generation ---------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, ids: Tensor, n: int, max_seq_len: int) -> Tensor:
        """Prompt at batch 1 into a fresh cache, copied to n samples; logits of the last token [n, V]."""
        logits, self._cache = self.model.prefill(ids, n, max_seq_len)
        return logits

    @torch.inference_mode()
    def decode_step(self, tokens: Tensor, pos: int) -> Tensor:
        """One token per sample at position pos: tokens [n, 1] -> logits [n, V]."""
        return self._step(tokens, pos, self._cache)

    def _step(self, tokens: Tensor, pos: int, cache) -> Tensor:
        return self.model(tokens, pos=pos, cache=cache)[:, -1]

    def prepare(self, prompt, params: SamplingParams | None = None, chat: bool = False):
        """Validate everything before any model work: (prompt ids, params)."""
        params = (params or SamplingParams()).validate()
        ids = prompt_ids(self.tokenizer, prompt, chat)
        if any(not 0 <= t < self.cfg.vocab_size for t in ids):
            raise ValueError(f"prompt token ids must lie in [0, {self.cfg.vocab_size})")
        check_context(len(ids), params, self.cfg.max_position_embeddings)
        return ids, params

    def generate(self, prompt, params: SamplingParams | None = None, chat: bool = False,
                 should_stop=None, **overrides) -> Iterator[GenerationEvent]:
        """Stream GenerationEvents (text deltas per sample). Bad input raises before any work."""
        t_start = time.perf_counter()
        if overrides:
            params = replace(params or SamplingParams(), **overrides)
        ids, params = self.prepare(prompt, params, chat)
        return self._generate(ids, params, t_start, should_stop)

    def _generate(self, ids, params, t_start, should_stop):
        seeds = sample_seeds(params)
        steps = self._token_steps(ids, params, seeds, should_stop)
        return stream_events(steps, params, seeds, self.tokenizer, self.eos_ids, len(ids), str(self.device),
                             self.world_size, t_start)

    def _token_steps(self, ids, params, seeds, should_stop):
        try:
            yield from token_steps(self, ids, params, self.eos_ids, seeds, should_stop)
        finally:
            self._cache = None  # a finished or abandoned request frees its KV cache

    def pick(self, logits: Tensor, params: SamplingParams, generators) -> Tensor:
        return sample(logits, params, generators)

    @functools.cached_property
    def eos_ids(self) -> set[int]:
        """Token ids that end a sample: from config.json and the tokenizer's configs."""
        return set(self.cfg.eos_token_ids) | set(self.tokenizer.eos_ids)

    # ---- speed path ----------------------------------------------------------------------------
    def compile(self) -> None:
        """Compile the decode blocks and pay the compile cost now, never inside a request."""
        self.model.compile_blocks()
        self.warm_up()

    @torch.inference_mode()
    def warm_up(self, batches: tuple[int, ...] = (1, 2)) -> None:
        """Run the decode step at each batch size and at two positions (compiles both shape cases)."""
        ids = torch.ones(1, 4, dtype=torch.long, device=self.device)
        for n in batches:
            self.prefill(ids, n, 8)
            for pos in (4, 5, 6):
                self.decode_step(torch.ones(n, 1, dtype=torch.long, device=self.device), pos)
        self._cache = None

    def close(self) -> None:
        self.model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def want_compile(compile, device: torch.device) -> bool:
    """compile=True/False, or "auto": on for CPU (where per-op overhead dominates), LANEPLAY_COMPILE=0/1 overrides."""
    if compile == "auto":
        env = os.environ.get("LANEPLAY_COMPILE")
        return env == "1" if env in ("0", "1") else device.type == "cpu"
    return bool(compile)


def load_engine(model: str | os.PathLike = "smollm2-135m-instruct", device: str | None = "cpu",
                dtype="float32", world_size: int = 1, compile="auto", **options) -> Engine:
    """Load a checkpoint (HF directory, .gguf, Hub id in the local cache, or the embedded default)."""
    dev, dt = parse_device(device), parse_dtype(dtype)
    if world_size > 1:
        from engine.dtp import load_dtp_engine

        return load_dtp_engine(model, device=dev, dtype=dt, world_size=world_size, **options)
    if options:
        raise TypeError(f"unknown load_engine option(s): {', '.join(options)}")
    path = resolve_checkpoint(model)
    cfg, src = open_checkpoint(path)
    try:
        tokenizer = load_checkpoint_tokenizer(path, src)
        weights = load_weights(cfg, src, dtype=dt, device=dev)
    finally:
        src.close()
    engine = Engine(cfg, LaneModel(cfg, weights), path, dev, dt, tokenizer=tokenizer)
    if want_compile(compile, dev):
        engine.compile()
    return engine


def load_checkpoint_tokenizer(path: Path, src):
    """The checkpoint's tokenizer (GGUF: from the already parsed file), or the error saying why not."""
    from engine.tokenizer import load_tokenizer, tokenizer_from_gguf

    try:
        return tokenizer_from_gguf(src.reader) if isinstance(src, GGUFSource) else load_tokenizer(path)
    except FileNotFoundError as e:
        return e  # raised when text is first needed; logits() works without a tokenizer
