"""Shared, expensive fixtures for engine tests: the embedded default model, ours and transformers'."""
import pytest


def pytest_collection_modifyitems(config, items):
    """A module may name the configurations it runs at the largest world size (`WORLD8` in test_dtp.py:
    eight ranks share the two cores, so each case there costs several seconds); the rest are deselected."""
    drop = []
    for item in items:
        only = getattr(item.module, "WORLD8", None)
        params = getattr(getattr(item, "callspec", None), "params", {})
        if only is not None and params.get("cluster") == 8 and "name" in params and params["name"] not in only:
            drop.append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = [i for i in items if i not in drop]


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
