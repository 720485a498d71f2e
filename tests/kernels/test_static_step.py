"""The static decode step (the CUDA path's step, run eagerly here) against `LaneModel.decode`.

Same prefill, same token sequence; every step's logits compared. Runs with the torch references and
with the Triton kernels under the interpreter, across the reduce schedules, head kinds and a sliding
window that wraps."""
import pytest
import torch

from laneplay.engine import load_engine
from laneplay.engine.checkpoint import random_laneformer_tensors, tiny_laneformer_config, write_checkpoint
from laneplay.engine.static_step import StaticDecoder

CONFIGS = {
    "delay 2, early comm": {},
    "delay 2, no early comm, lane norms, lane head": {"use_early_comm": False, "replicated_rmsn_scale": False,
                                                      "lm_head_type": "lane"},
    "delay 1, vocab-parallel head, GQA 3": {"broadcast_delay": 1, "lm_head_type": "vocab_parallel",
                                            "num_attention_heads": 12, "num_key_value_heads": 4, "hidden_size": 48},
    "standard TP (delay 0)": {"broadcast_delay": 0},
}


def engine_for(tmp_path, overrides, dtype="float32"):
    raw = tiny_laneformer_config(**overrides)
    write_checkpoint(tmp_path / "ckpt", raw, random_laneformer_tensors(raw, seed=5))
    return load_engine(tmp_path / "ckpt", dtype=dtype)


def compare(eng, impl, n, prompt, steps, capacity=48, rel=1e-4, fused_rope=False):
    model = eng.model
    ids = torch.randint(0, eng.cfg.vocab_size, (1, prompt + steps), generator=torch.Generator().manual_seed(n))
    _, cache = model.prefill(ids[:, :prompt], n, prompt + steps)
    ref_cache = KV_copy(cache)
    dec = StaticDecoder(model, capacity=capacity, graphs=False, impl=impl)
    dec.fused_rope = fused_rope
    dec.load(cache)
    worst = 0.0
    for p in range(prompt, prompt + steps):
        tok = (ids[:, p:p + 1] + torch.arange(n)[:, None]) % eng.cfg.vocab_size  # samples differ
        ref = model.decode(tok, p, ref_cache)
        got = dec.step(tok, p)
        worst = max(worst, ((got - ref).abs().max() / ref.abs().max()).item())
    assert worst <= rel, f"max relative |Δlogit| {worst:.3g}"


def KV_copy(cache):
    out = object.__new__(type(cache))
    out.batch, out.max_seq_len, out.slots = cache.batch, cache.max_seq_len, list(cache.slots)
    out.k, out.v = [t.clone() for t in cache.k], [t.clone() for t in cache.v]
    return out


@pytest.mark.parametrize("name", list(CONFIGS))
def test_static_step_matches_decode_torch(tmp_path, name):
    eng = engine_for(tmp_path, CONFIGS[name])
    compare(eng, "torch", n=2, prompt=5, steps=12)  # window 8: rings wrap


# The interpreter takes ~2 s per step of this tiny model: few steps, placed across the window's edge.
def test_static_step_matches_decode_triton_interpreted(tmp_path):
    eng = engine_for(tmp_path, CONFIGS["delay 2, early comm"])
    compare(eng, "triton", n=1, prompt=7, steps=2)  # positions 7 and 8: the ring of 8 fills, then wraps


def test_static_step_half_precision_gqa3_triton_interpreted(tmp_path):
    eng = engine_for(tmp_path, CONFIGS["delay 1, vocab-parallel head, GQA 3"], dtype="float16")
    compare(eng, "triton", n=2, prompt=9, steps=1, rel=2e-2, fused_rope=True)  # a wrapped ring, two samples


def test_static_step_refuses_what_it_cannot_hold(tmp_path):
    eng = engine_for(tmp_path, {})
    dec = StaticDecoder(eng.model, capacity=16, graphs=False)
    _, cache = eng.model.prefill(torch.tensor([[1, 2, 3]]), 1, 20)
    with pytest.raises(ValueError, match="exceeds the static cache"):
        dec.load(cache)
    with pytest.raises(RuntimeError, match="load"):
        dec.step(torch.tensor([[1]]), 3)
    with pytest.raises(ValueError, match="CUDA"):
        StaticDecoder(eng.model, graphs=True)


def test_engine_with_the_static_step_generates_the_same_text(tmp_path):
    from laneplay.engine.sampling import SamplingParams

    raw = tiny_laneformer_config()
    write_checkpoint(tmp_path / "ckpt", raw, random_laneformer_tensors(raw, seed=6))
    plain = load_engine(tmp_path / "ckpt")
    static = load_engine(tmp_path / "ckpt", graphs=True)
    assert static.runtime.graphs and static.runner.static is not None and not plain.runtime.graphs

    def tokens(eng, **kw):
        params = SamplingParams(max_tokens=14, **kw)
        ids, params = eng.prepare("abc", params)
        return [t for t, _, _ in eng.runner.token_steps(ids, params, [11, 12, 13], eng.eos_ids)]

    for kw in ({"temperature": 0.0}, {"temperature": 0.9, "n": 3, "seed": 4}):
        assert tokens(static, **kw) == tokens(plain, **kw)
    assert static.runner.static.batches  # it really decoded through the static step


def test_a_choice_that_cannot_be_measured_keeps_the_default(tmp_path, caplog):
    eng = engine_for(tmp_path, {})
    dec = StaticDecoder(eng.model, capacity=16, graphs=False)
    assert dec.tune() == {}  # no CUDA here: both measurements fail, and say so
    assert dec.attention_config is None and not dec.fused_rope and not dec.gemv
    assert "keeping the default" in caplog.text


@pytest.mark.slow
def test_dtp_ranks_decode_through_the_static_step(tmp_path):
    """World size 2 (gloo): each rank runs the static step on its lanes, the sums through its collectives."""
    from laneplay.engine.sampling import SamplingParams

    raw = tiny_laneformer_config()
    write_checkpoint(tmp_path / "ckpt", raw, random_laneformer_tensors(raw, seed=7))
    single = load_engine(tmp_path / "ckpt")
    with load_engine(tmp_path / "ckpt", world_size=2, graphs=True) as dtp:
        assert dtp.runtime.graphs
        for kw in ({"temperature": 0.0}, {"temperature": 0.8, "n": 3, "seed": 2}):
            params = SamplingParams(max_tokens=12, **kw)  # prompt 3 + 12 tokens: the ring of 8 wraps
            ids, params = single.prepare("xyz", params)
            want = [t for t, _, _ in single.runner.token_steps(ids, params, [5, 6, 7], single.eos_ids)]
            got = [t for t, _, _ in dtp.runner.token_steps(ids, params, [5, 6, 7], dtp.eos_ids)]
            assert got == want, kw
