"""`load_engine`: the one place where device, dtype and runtime are chosen."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import Tensor

from engine.checkpoint import open_checkpoint, load_weights, resolve_checkpoint
from engine.config import ModelConfig
from engine.model import LaneModel

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

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            from engine.tokenizer import load_tokenizer

            self._tokenizer = load_tokenizer(self.path)
        return self._tokenizer

    @property
    def model_name(self) -> str:
        return self.cfg.name or self.path.name

    @torch.inference_mode()
    def logits(self, ids) -> Tensor:
        """Full causal forward without a cache: ids [B, S] -> float32 logits [B, S, V]."""
        ids = torch.as_tensor(ids, dtype=torch.long)
        if ids.dim() == 1:
            ids = ids[None]
        if ids.dim() != 2 or ids.shape[1] == 0:
            raise ValueError(f"ids must be a non-empty [batch, seq] tensor, got shape {list(ids.shape)}")
        if int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size})")
        return self.model(ids.to(self.device), pos=0, cache=None)

    def close(self) -> None:
        self.model = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def load_engine(model: str | os.PathLike = "smollm2-135m-instruct", device: str | None = "cpu",
                dtype="float32", world_size: int = 1, **options) -> Engine:
    """Load a checkpoint (HF directory, .gguf, Hub id in the local cache, or the embedded default)."""
    dev, dt = parse_device(device), parse_dtype(dtype)
    if world_size > 1:
        from engine.dtp import load_dtp_engine

        return load_dtp_engine(model, device=dev, dtype=dt, world_size=world_size, **options)
    path = resolve_checkpoint(model)
    cfg, src = open_checkpoint(path)
    try:
        weights = load_weights(cfg, src, dtype=dt, device=dev)
    finally:
        src.close()
    return Engine(cfg, LaneModel(cfg, weights), path, dev, dt)
