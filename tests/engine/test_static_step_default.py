"""The static decode step (the CUDA path's step) on the embedded default model, run eagerly on CPU."""
import torch

from laneplay.engine.static_step import StaticDecoder


def test_default_model_static_step_matches_decode(default_engine):
    model = default_engine.model
    ids = torch.tensor([[1, 504, 3458, 314, 216, 1050]])
    _, cache = model.prefill(ids[:, :4], 1, 6)
    dec = StaticDecoder(model, capacity=32, graphs=False)
    dec.load(cache, 4)
    for p in (4, 5):
        ref = model.decode(ids[:, p:p + 1], p, cache)
        got = dec.step(ids[:, p:p + 1], p)
        assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()
