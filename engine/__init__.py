"""Laneplay's inference engine: Laneformer lane form, checkpoints, KV cache, sampling, DTP runtime."""
from laneplay.engine.checkpoint import DEFAULT_MODEL, CheckpointError
from laneplay.engine.config import ConfigError, ModelConfig
from laneplay.engine.engine import Engine
from laneplay.engine.generate import GenerationEvent
from laneplay.engine.loader import load_engine
from laneplay.engine.metrics import GenerationMetrics
from laneplay.engine.runtime import Runtime
from laneplay.engine.sampling import SampleSettings, SamplingParams

__all__ = ["load_engine", "Engine", "SamplingParams", "SampleSettings", "GenerationEvent", "GenerationMetrics",
           "Runtime", "ModelConfig", "ConfigError", "CheckpointError", "DEFAULT_MODEL"]
