"""Shared, expensive fixtures for engine tests: the embedded default model, ours and transformers'."""
import pytest


@pytest.fixture(scope="session")
def default_engine():
    from laneplay.engine import load_engine

    return load_engine("smollm2-135m-instruct", compile=False)


@pytest.fixture(scope="session")
def hf_default_model():
    pytest.importorskip("transformers")
    from laneplay.bench.common import hf_from_gguf
    from laneplay.engine.checkpoint import resolve_checkpoint

    return hf_from_gguf(resolve_checkpoint("smollm2-135m-instruct"))  # transformers' own GGUF loader
