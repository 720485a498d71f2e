"""Shared, expensive fixtures for engine tests: the embedded default model, ours and transformers'."""
import pytest
import torch


@pytest.fixture(scope="session")
def default_engine():
    from laneplay.engine import load_engine

    return load_engine("smollm2-135m-instruct", compile=False)


@pytest.fixture(scope="session")
def hf_default_model():
    transformers = pytest.importorskip("transformers")
    from laneplay.engine.checkpoint import resolve_checkpoint

    path = resolve_checkpoint("smollm2-135m-instruct")
    return transformers.AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                             dtype=torch.float32).eval()
