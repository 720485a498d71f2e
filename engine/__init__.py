"""Laneplay's inference engine: Laneformer lane form, checkpoints, KV cache, sampling, DTP runtime."""
from engine.config import ConfigError, ModelConfig
from engine.checkpoint import CheckpointError, DEFAULT_MODEL
from engine.engine import Engine, load_engine

__all__ = ["load_engine", "Engine", "ModelConfig", "ConfigError", "CheckpointError", "DEFAULT_MODEL"]
from engine.generate import GenerationEvent  # noqa: E402
from engine.metrics import GenerationMetrics  # noqa: E402
from engine.sampling import SamplingParams  # noqa: E402

__all__ += ["SamplingParams", "GenerationEvent", "GenerationMetrics"]
