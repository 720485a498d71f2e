"""The engine's lane-form forward against the independent naive reference (docs/laneformer.md §1-§7)."""
import pytest
import torch

from laneplay.engine import load_engine
from laneplay.engine.checkpoint import random_laneformer_tensors, tiny_laneformer_config, write_checkpoint
from .naive_reference import naive_logits


def build(tmp_path, seed=0, layout="3d", **overrides):
    raw = tiny_laneformer_config(**overrides)
    tensors = random_laneformer_tensors(raw, seed=seed, layout=layout)
    write_checkpoint(tmp_path / "ckpt", raw, tensors)
    return raw, random_laneformer_tensors(raw, seed=seed), load_engine(tmp_path / "ckpt")


def assert_close_to_reference(raw, tensors, eng, batch=1, seq=20, seed=1, rel=1e-4):
    ids = torch.randint(0, raw["vocab_size"], (batch, seq), generator=torch.Generator().manual_seed(seed))
    ref = naive_logits(raw, tensors, ids)
    got = eng.logits(ids)
    assert got.shape == ref.shape
    err = (got - ref).abs().max().item()
    assert err <= rel * ref.abs().max().item(), f"max |Δlogit| {err:.3g} vs logit scale {ref.abs().max():.3g}"
    return ids, got


# Sequences of 20 tokens with sliding_window 8: every SWA layer's window is exceeded.
@pytest.mark.parametrize("delay", [1, 2, 3])
@pytest.mark.parametrize("early_comm", [True, False])
@pytest.mark.parametrize("batch", [1, 3])
def test_broadcast_delays_and_early_comm_match_reference(tmp_path, delay, early_comm, batch):
    raw, tensors, eng = build(tmp_path, broadcast_delay=delay, use_early_comm=early_comm)
    assert_close_to_reference(raw, tensors, eng, batch=batch)


def test_every_layer_present_matches_reference(tmp_path):
    # A delay as long as the model puts every layer in the "early" range: plain tensor parallelism.
    raw, tensors, eng = build(tmp_path, broadcast_delay=5, num_hidden_layers=5, use_early_comm=True)
    assert all(eng.cfg.reduce_mode(i, k) == "present" for i in range(5) for k in ("attention", "mlp"))
    assert_close_to_reference(raw, tensors, eng, batch=3)


@pytest.mark.parametrize("head", ["replicate", "lane", "vocab_parallel", "pre_norm_lane_agg"])
@pytest.mark.parametrize("replicated_norms", [True, False])
def test_head_variants_and_norm_kinds_match_reference(tmp_path, head, replicated_norms):
    extra = {"lm_head_type": "replicate", "pre_norm_lane_agg": True} if head == "pre_norm_lane_agg" else {"lm_head_type": head}
    raw, tensors, eng = build(tmp_path, replicated_rmsn_scale=replicated_norms, **extra)
    assert_close_to_reference(raw, tensors, eng, batch=3)


@pytest.mark.parametrize("swa", [
    {"sliding_window_n_layers": 3},
    {"sliding_window_n_layers": -2},
    {"sliding_window_n_layers": 4, "unclamped_layers": [1]},
    {"sliding_window_n_layers": None, "unclamped_layers": None, "swa_layers": [0, 2, 4]},
    {"sliding_window_n_layers": None, "unclamped_layers": None,
     "layer_types": ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention"]},
])
def test_sliding_window_conventions_match_reference(tmp_path, swa):
    swa = {k: v for k, v in swa.items() if v is not None}
    raw = tiny_laneformer_config(**swa)
    for k in ("sliding_window_n_layers", "unclamped_layers"):
        if k not in swa and ("swa_layers" in swa or "layer_types" in swa):
            raw.pop(k)
    tensors = random_laneformer_tensors(raw, seed=3)
    write_checkpoint(tmp_path / "c", raw, tensors)
    assert_close_to_reference(raw, tensors, load_engine(tmp_path / "c"), batch=1, seq=24)


@pytest.mark.parametrize("overrides", [
    {"use_comm": False},
    {"use_comm": False, "use_early_comm": False},
    {"use_attention_comm": False, "use_mlp_comm": True},
    {"early_layers_broadcast": False},
    {"early_layers_broadcast": False, "use_early_comm": False},
    {"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                      "original_max_position_embeddings": 16}, "rope_theta": 500.0},
    {"num_lanes": 8, "num_attention_heads": 16, "num_key_value_heads": 8, "hidden_size": 64},
    {"num_lanes": 1},
])
def test_comm_flags_rope_scaling_and_lane_counts_match_reference(tmp_path, overrides):
    raw, tensors, eng = build(tmp_path, **overrides)
    assert_close_to_reference(raw, tensors, eng, batch=2)


def test_flattened_2d_layout_loads_the_same_model(tmp_path):
    raw, tensors, eng = build(tmp_path, layout="2d", lm_head_type="vocab_parallel")
    assert_close_to_reference(raw, tensors, eng, batch=1)


def test_sharded_checkpoint_loads_the_same_model(tmp_path):
    raw = tiny_laneformer_config()
    tensors = random_laneformer_tensors(raw, seed=5)
    write_checkpoint(tmp_path / "sharded", raw, tensors, max_shard_bytes=200_000)
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 1
    assert_close_to_reference(raw, tensors, load_engine(tmp_path / "sharded"))


@pytest.mark.parametrize("dtype,rel", [("bfloat16", 0.05), ("float16", 0.01)])
def test_half_precision_stays_close_to_float32(tmp_path, dtype, rel):
    raw = tiny_laneformer_config()
    write_checkpoint(tmp_path / "c", raw, random_laneformer_tensors(raw, seed=2), dtype=torch.bfloat16)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    ref = load_engine(tmp_path / "c", dtype="float32").logits(ids)
    got = load_engine(tmp_path / "c", dtype=dtype).logits(ids)
    assert got.dtype == torch.float32
    assert (got - ref).abs().max() <= rel * ref.abs().max()


# ---- incremental decoding through the static cache ------------------------------------------

@pytest.mark.parametrize("overrides", [{}, {"broadcast_delay": 1, "use_early_comm": False},
                                       {"lm_head_type": "lane", "replicated_rmsn_scale": False}])
@pytest.mark.parametrize("prefill", [1, 5, 12])
def test_prefill_then_one_token_steps_match_full_forward(tmp_path, overrides, prefill):
    raw, _, eng = build(tmp_path, **overrides)
    ids = torch.randint(0, 256, (2, 30), generator=torch.Generator().manual_seed(7))  # window 8: rings wrap
    full = eng.logits(ids)
    cache = eng.model.new_cache(batch=2, max_seq_len=40)
    steps = [eng.model(ids[:, :prefill], pos=0, cache=cache)]
    steps += [eng.model(ids[:, p:p + 1], pos=p, cache=cache) for p in range(prefill, 30)]
    assert (torch.cat(steps, dim=1) - full).abs().max() <= 1e-4 * full.abs().max()


def test_chunked_prefill_continues_from_the_cache(tmp_path):
    raw, _, eng = build(tmp_path)
    ids = torch.randint(0, 256, (1, 30), generator=torch.Generator().manual_seed(8))
    full = eng.logits(ids)
    cache = eng.model.new_cache(batch=1, max_seq_len=30)
    chunks = [(0, 6), (6, 17), (17, 18), (18, 30)]  # chunks longer than the window, after a wrap
    got = torch.cat([eng.model(ids[:, a:b], pos=a, cache=cache) for a, b in chunks], dim=1)
    assert (got - full).abs().max() <= 1e-4 * full.abs().max()


def test_sliding_window_cache_does_not_grow_with_context(tmp_path):
    raw, _, eng = build(tmp_path)
    small, large = eng.model.new_cache(1, 32), eng.model.new_cache(1, 128)
    swa = set(eng.cfg.swa_layers)
    for i in range(eng.cfg.num_layers):
        if i in swa:
            assert small.k[i].shape == large.k[i].shape and small.k[i].shape[2] == raw["sliding_window"]
        else:
            assert large.k[i].shape[2] == 4 * small.k[i].shape[2]


def test_shared_prefill_expands_to_independent_samples(tmp_path):
    raw, _, eng = build(tmp_path)
    prompt = torch.randint(0, 256, (1, 10), generator=torch.Generator().manual_seed(9))
    cache = eng.model.new_cache(1, 32)
    eng.model(prompt, pos=0, cache=cache)
    many = cache.expand_batch(3)
    nxt = torch.tensor([[5], [6], [7]])
    got = eng.model(nxt, pos=10, cache=many)
    for b in range(3):
        ref = eng.logits(torch.cat([prompt, nxt[b:b + 1]], dim=1))[:, -1]
        assert (got[b, -1] - ref[0]).abs().max() <= 1e-4 * ref.abs().max()


@pytest.mark.slow
def test_compiled_decode_step_matches_eager_and_compiles_only_at_load(tmp_path):
    """Loading compiles each block twice (one row, more rows: the warm-up runs batch 1 and 2); decoding
    after it, at other batch sizes, cache lengths and positions (rings filling and wrapping), and
    several requests in one step, compiles nothing more, and matches the eager model."""
    from torch._dynamo.utils import counters

    def graphs():
        return counters["stats"]["unique_graphs"]

    raw, _, eager = build(tmp_path)
    before = graphs()
    compiled = load_engine(tmp_path / "ckpt", compile=True)  # compiles and warms up at load
    assert graphs() - before == 4  # (attention, MLP) x (one row, more rows)
    before = graphs()
    ids = torch.randint(0, 256, (5, 20), generator=torch.Generator().manual_seed(4))

    def prefilled(batch, length, n):
        caches = [e.model.new_cache(batch, length) for e in (eager, compiled)]
        with torch.inference_mode():  # as the engine runs a prefill
            for e, c in zip((eager, compiled), caches):
                e.model(ids[:batch, :n], pos=0, cache=c)
        return caches

    for batch, length in ((3, 24), (5, 20), (1, 30)):
        caches = prefilled(batch, length, 6)
        for p in range(6, 20):  # crosses the sliding window (8) so the ring buffers wrap
            a = eager.model.decode(ids[:batch, p:p + 1], p, caches[0])
            b = compiled.model.decode(ids[:batch, p:p + 1], p, caches[1])
            assert (a - b).abs().max() <= 1e-4 * a.abs().max()
    # separate requests in one step, each at its own position (the scheduler's batches)
    first, second = prefilled(2, 24, 5), prefilled(1, 16, 9)
    for step in range(4):
        rows = ids[:3, 10 + step:11 + step]
        a, b = (e.model.decode_groups(rows, [(5 + step, c1), (9 + step, c2)])
                for e, c1, c2 in zip((eager, compiled), first, second))
        assert (a - b).abs().max() <= 1e-4 * a.abs().max()
    # the engine's own path: a prompt prefilled once, its cache copied for 3 samples
    steps = []
    for e in (eager, compiled):
        e.runner.prefill(ids[:1, :7], 3, 16)
        steps.append([e.runner.decode_step(ids[:3, p:p + 1], p) for p in range(7, 12)])
    for a, b in zip(*steps):
        assert (a - b).abs().max() <= 1e-4 * a.abs().max()
    assert graphs() == before, "decoding after the warm-up compiled again"


def test_per_layer_broadcast_flags_of_the_newer_revision(tmp_path):
    # "layers < d do not broadcast to the future" written as per-layer flags (newer config style)
    # is the same function as early_layers_broadcast=False (checked against the reference).
    n, d = 5, 2
    flags = [i >= d and i + d < n for i in range(n)]
    raw = tiny_laneformer_config(broadcast_delay=d, broadcast_attention_to_future=flags, broadcast_mlp_to_future=flags)
    tensors = random_laneformer_tensors(raw, seed=6)
    write_checkpoint(tmp_path / "c", raw, tensors)
    reference_cfg = {k: v for k, v in raw.items() if not k.startswith("broadcast_") or k == "broadcast_delay"}
    reference_cfg["early_layers_broadcast"] = False
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    ref = naive_logits(reference_cfg, tensors, ids)
    got = load_engine(tmp_path / "c").logits(ids)
    assert (got - ref).abs().max() <= 1e-4 * ref.abs().max()
