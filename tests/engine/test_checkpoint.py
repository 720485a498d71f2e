"""Checkpoint formats: Llama keys vs transformers, GGUF, Hub ids, and clear errors for bad checkpoints."""
import json

import pytest
import torch

from laneplay.engine import CheckpointError, load_engine
from laneplay.engine.checkpoint import (open_checkpoint, load_weights, random_laneformer_tensors, resolve_checkpoint,
                               tiny_laneformer_config, write_checkpoint)
from laneplay.engine.model import LaneModel

transformers = pytest.importorskip("transformers")


def tiny_llama(tmp_path, tie=False, seed=0, **overrides):
    torch.manual_seed(seed)
    kw = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=8,
              num_key_value_heads=4, max_position_embeddings=128, rope_theta=10000.0, rms_norm_eps=1e-6,
              tie_word_embeddings=tie)
    kw.update(overrides)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    with torch.no_grad():  # non-trivial norms so a mix-up of norm weights shows
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    model.save_pretrained(tmp_path / "llama")
    return model, tmp_path / "llama"


@pytest.mark.parametrize("tie", [False, True])
def test_llama_checkpoint_matches_transformers(tmp_path, tie):
    model, path = tiny_llama(tmp_path, tie=tie)
    ids = torch.randint(0, 300, (2, 17), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = model(ids).logits
    got = load_engine(path).logits(ids)
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.parametrize("lanes", [2, 4])
def test_llama_split_into_lanes_is_the_same_function(tmp_path, lanes):
    model, path = tiny_llama(tmp_path)
    ids = torch.randint(0, 300, (1, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
    cfg, src = open_checkpoint(path)
    cfg = cfg.with_lanes(lanes)
    got = LaneModel(cfg, load_weights(cfg, src))(ids)
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.slow
def test_embedded_gguf_matches_transformers_gguf_loader(default_engine, hf_default_model):
    ids = torch.tensor([[1, 504, 3458, 282, 4649, 314, 216, 33, 34, 35, 2]])
    with torch.no_grad():
        ref = hf_default_model(ids).logits
    got = default_engine.logits(ids)
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


# ---- errors that name the problem -----------------------------------------------------------

def write_tiny(tmp_path, **overrides):
    raw = tiny_laneformer_config(**overrides)
    tensors = random_laneformer_tensors(raw, seed=0)
    return raw, tensors, tmp_path / "bad"


def test_missing_tensor_is_named(tmp_path):
    raw, tensors, path = write_tiny(tmp_path)
    del tensors["model.layers.2.feed_forward.w3.weight"]
    write_checkpoint(path, raw, tensors)
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.feed_forward\.w3\.weight.*missing"):
        load_engine(path)


def test_wrong_shape_is_named(tmp_path):
    raw, tensors, path = write_tiny(tmp_path)
    tensors["model.layers.1.attention.wk.weight"] = torch.zeros(4, 7, 64)
    write_checkpoint(path, raw, tensors)
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.attention\.wk\.weight.*shape \[4, 7, 64\]"):
        load_engine(path)


def test_extra_tensor_is_named(tmp_path):
    raw, tensors, path = write_tiny(tmp_path)
    tensors["model.layers.0.attention.wq.bias"] = torch.zeros(4, 16)
    write_checkpoint(path, raw, tensors)
    with pytest.raises(CheckpointError, match=r"unexpected tensor 'model\.layers\.0\.attention\.wq\.bias'"):
        load_engine(path)


def test_unknown_head_type_is_named(tmp_path):
    raw, tensors, path = write_tiny(tmp_path)
    write_checkpoint(path, dict(raw, lm_head_type="tied_lanes"), tensors)
    with pytest.raises(CheckpointError, match=r"unknown lm_head_type 'tied_lanes'"):
        load_engine(path)


@pytest.mark.parametrize("overrides,pattern", [
    ({"num_attention_heads": 6, "num_key_value_heads": 2, "hidden_size": 48}, "not divisible by num_lanes"),
    ({"sliding_window": 0}, "sliding_window must be a positive integer"),
    ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
    ({"lm_head_type": "lane", "pre_norm_lane_agg": True}, "pre_norm_lane_agg"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4}}, "rope scaling type 'yarn'"),
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
])
def test_inconsistent_configs_are_clear_errors(tmp_path, overrides, pattern):
    raw, tensors, path = write_tiny(tmp_path)
    path.mkdir()
    (path / "config.json").write_text(json.dumps(dict(raw, **overrides)))
    with pytest.raises(CheckpointError, match=pattern):
        load_engine(path)


def test_truncated_safetensors_is_a_clear_error(tmp_path):
    raw, tensors, path = write_tiny(tmp_path)
    write_checkpoint(path, raw, tensors)
    f = path / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match=r"model\.safetensors is truncated"):
        load_engine(path)


def test_garbage_safetensors_is_a_clear_error(tmp_path):
    raw, tensors, path = write_tiny(tmp_path)
    write_checkpoint(path, raw, tensors)
    (path / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all")
    with pytest.raises(CheckpointError, match=r"model\.safetensors is not a readable safetensors file"):
        load_engine(path)


def test_missing_shard_is_a_clear_error(tmp_path):
    raw, tensors, path = write_tiny(tmp_path)
    write_checkpoint(path, raw, tensors, max_shard_bytes=200_000)
    next(path.glob("model-00002-*.safetensors")).unlink()
    with pytest.raises(CheckpointError, match=r"model-00002-.*missing"):
        load_engine(path)


def test_directory_without_config_is_a_clear_error(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_engine(tmp_path / "empty")


def test_uncached_hub_id_prints_the_download_command(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(CheckpointError, match=r"hf download kogai/laneformer-2b-it"):
        load_engine("kogai/laneformer-2b-it")


def test_hub_id_resolves_from_the_local_cache(tmp_path, monkeypatch):
    raw, tensors, _ = write_tiny(tmp_path)
    snap = tmp_path / "hub" / "models--kogai--laneformer-2b-it" / "snapshots" / "abc123"
    write_checkpoint(snap, raw, tensors)
    (snap.parents[1] / "refs").mkdir()
    (snap.parents[1] / "refs" / "main").write_text("abc123")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    assert resolve_checkpoint("kogai/laneformer-2b-it") == snap
    assert load_engine("kogai/laneformer-2b-it").cfg.num_lanes == raw["num_lanes"]


def test_nonexistent_path_is_a_clear_error(tmp_path):
    with pytest.raises(CheckpointError, match=r"no checkpoint at"):
        load_engine(str(tmp_path / "nope"))
