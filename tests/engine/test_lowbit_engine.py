"""The low-bit CPU path (dtype int4 / int8) end to end: the packed model against the same packed
weights unpacked to float in plain torch (so only the kernels' activation quantization differs), on
random Laneformer checkpoints (every head and reduce variant, sliding-window rings that wrap, batch 2),
under DTP ranks at world size 2, and on the embedded default model, whose GGUF blocks it keeps exactly."""
import pytest
import torch

from laneplay.engine import SamplingParams, load_engine
from laneplay.engine.checkpoint import (load_weights, open_checkpoint, random_laneformer_tensors, resolve_checkpoint,
                                        tiny_laneformer_config, write_checkpoint)
from laneplay.engine.lowbit_step import DecodeStep
from laneplay.engine.model import LaneModel
from laneplay.engine.runtime import make_runtime
from laneplay.kernels import lowbit

pytestmark = pytest.mark.skipif(not lowbit.available(), reason="the low-bit C kernels are not built")

# Bounds, as a fraction of the largest |logit| of the reference: what int8 activation blocks cost.
LOGIT_BOUND = 0.03
# One lane holds the whole width, so a block's activation scale covers more spread: measured up to
# 0.034 on these random one-lane checkpoints (with or without the fused step).
ONE_LANE_BOUND = 0.05
CONFIGS = {
    "d2-early": dict(broadcast_delay=2, use_early_comm=True),
    "d1-late": dict(broadcast_delay=1, use_early_comm=False),
    "vocab-parallel": dict(broadcast_delay=2, lm_head_type="vocab_parallel"),
    "lane-head-lane-norms": dict(broadcast_delay=2, lm_head_type="lane", replicated_rmsn_scale=False),
    "pre-norm-agg": dict(broadcast_delay=1, pre_norm_lane_agg=True, early_layers_broadcast=False),
}


def random_model(name, seed=0):
    raw = tiny_laneformer_config(**CONFIGS[name])
    return raw, random_laneformer_tensors(raw, seed=seed)


def models(tmp_path, name, fmt):
    raw, tensors = random_model(name)
    path = write_checkpoint(tmp_path / name, raw, tensors)
    cfg, src = open_checkpoint(path)
    weights = load_weights(cfg, src)
    src.close()
    packed = lowbit.pack_weights(weights, fmt)
    return path, LaneModel(cfg, packed), LaneModel(cfg, lowbit.unpack_weights(packed))


def close(a, b, scale, bound=LOGIT_BOUND):
    return float((a - b).abs().max()) <= bound * float(scale)


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("name", list(CONFIGS))
@torch.inference_mode()
def test_packed_model_matches_its_unpacked_weights(tmp_path, name, fmt):
    _, low, ref = models(tmp_path, name, fmt)
    ids = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(1))
    want = ref(ids)
    assert low.lowbit and not ref.lowbit
    assert close(low(ids), want, want.abs().max())  # prefill path: every projection packed, S > 1
    # decode: two samples, past the sliding window of 8 (the rings wrap)
    lr, cr = ref.prefill(ids[:1, :4], 2, 40)
    ll, cl = low.prefill(ids[:1, :4], 2, 40)
    assert close(ll, lr, lr.abs().max())
    agree = total = 0
    for pos in range(4, 30):
        tok = torch.tensor([[pos % 256], [(7 * pos) % 256]])
        a, b = ref.decode(tok, pos, cr), low.decode(tok, pos, cl)
        assert close(b, a, a.abs().max()), pos
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += 2
    assert agree >= 0.9 * total


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("overrides", [dict(), dict(lm_head_type="lane", replicated_rmsn_scale=False, sliding_window=5,
                                                    num_key_value_heads=8)],
                         ids=["replicate", "lane-head-mha"])
@torch.inference_mode()
def test_one_lane_models_decode_in_one_fused_step(tmp_path, fmt, overrides):
    """One lane in one process: `LaneModel.decode` runs the whole step in one C call. It gives the
    per-block path's logits and cache (the same kernels; only the final norm is computed in C rather
    than torch), and the unpacked reference's within the bound, at batch 1 and 3, rings wrapping."""
    raw = tiny_laneformer_config(num_lanes=1, **overrides)
    cfg, src = open_checkpoint(write_checkpoint(tmp_path / "one", raw, random_laneformer_tensors(raw, seed=3)))
    packed = lowbit.pack_weights(load_weights(cfg, src), fmt)
    src.close()
    fused, blocks, ref = LaneModel(cfg, packed), LaneModel(cfg, packed), LaneModel(cfg, lowbit.unpack_weights(packed))
    blocks.fused_step = None
    assert isinstance(fused.fused_step, DecodeStep)
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(2))
    for n in (1, 3):
        # both packed models start from the per-block path's prompt cache (the fused model's own prefill runs
        # as decode steps: test_a_fused_prefill_is_decode_steps_bit_for_bit)
        caches = [m.prefill(ids, n, 40)[1] for m in (blocks, blocks, ref)]
        for pos in range(6, 30):
            tok = torch.tensor([[(5 * pos + 11 * i) % 256] for i in range(n)])
            a, b, r = (m.decode(tok, pos, c) for m, c in zip((fused, blocks, ref), caches))
            assert a.shape == (n, 256)
            assert float((a - b).abs().max()) <= 1e-4 * float(b.abs().max()), pos
            assert close(a, r, r.abs().max(), ONE_LANE_BOUND), pos
        for x, y in zip(caches[0].k + caches[0].v, caches[1].k + caches[1].v):
            assert torch.allclose(x, y, atol=1e-6)
    with pytest.raises(ValueError, match="sequences"):
        fused.decode(torch.zeros(2, 1, dtype=torch.long), 6, fused.prefill(ids, 1, 40)[1])


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("sliding_window", [None, 6])
@torch.inference_mode()
def test_a_fused_prefill_is_decode_steps_bit_for_bit(tmp_path, fmt, sliding_window, monkeypatch, kernel):
    """On the fused one-lane path a prompt's chunks run as one-token groups of the C step: the prompt's cache
    and last logits are bit for bit those of one decode step per token, on every kernel. Chunks that would
    wrap a ring, or end past GROUPS_PREFILL_END, go through the per-layer path (within rounding of the same)."""
    from laneplay.engine import model as model_mod

    raw = tiny_laneformer_config(num_lanes=1, sliding_window=sliding_window)
    cfg, src = open_checkpoint(write_checkpoint(tmp_path / "one", raw, random_laneformer_tensors(raw, seed=4)))
    packed = lowbit.pack_weights(load_weights(cfg, src), fmt)
    src.close()
    m = LaneModel(cfg, packed)
    ids = torch.randint(0, 256, (1, 11), generator=torch.Generator().manual_seed(5))
    steps = m.new_cache(1, 40)
    for p in range(11):
        last = m.decode(ids[:, p:p + 1], p, steps)
    calls = []
    groups = m.fused_step.groups
    monkeypatch.setattr(m.fused_step, "groups", lambda *a, **k: calls.append(len(a[1])) or groups(*a, **k))
    logits, cache = next(s for s in m.prefill_steps(ids, 1, 40, chunk=4) if s is not None)
    if sliding_window is None:  # chunks of 4, 4, 3 positions, each one C call
        assert calls == [4, 4, 3]
        assert torch.equal(logits, last)
        assert all(torch.equal(x, y) for x, y in zip(cache.k + cache.v, steps.k + steps.v))
        calls.clear()  # in pieces of 3 (a batch request's prompt): a step each, the same numbers
        pieces = list(m.prefill_steps(ids, 1, 40, chunk=4, piece=3))
        assert calls == [3, 1, 3, 1, 3] and pieces[:-1] == [None] * 4
        logits, cache = pieces[-1]
        assert torch.equal(logits, last)
        assert all(torch.equal(x, y) for x, y in zip(cache.k + cache.v, steps.k + steps.v))
    else:  # the window's ring (6 slots and spares) wraps: the chunks that reach it take the per-layer path
        assert calls and all(n == 4 for n in calls) and len(calls) < 3
        assert close(logits, last, last.abs().max())
    calls.clear()
    monkeypatch.setattr(model_mod, "GROUPS_PREFILL_END", 4)
    logits, _ = next(s for s in m.prefill_steps(ids, 1, 40, chunk=4) if s is not None)
    assert calls == [4] and close(logits, last, last.abs().max())


@torch.inference_mode()
def test_fused_step_gives_the_same_logits_on_any_thread_count_and_thread(tmp_path):
    """The fused step runs in one team of threads whose size it picks itself (`step_threads`): any
    count, adaptive or pinned, and a step run from another Python thread (as the server's scheduler
    does) give the same logits and cache, bit for bit."""
    import threading

    # one KV head and a long context: the attention over the full layers is cut into stretches
    raw = tiny_laneformer_config(num_lanes=1, sliding_window=5, num_key_value_heads=1, max_position_embeddings=256)
    cfg, src = open_checkpoint(write_checkpoint(tmp_path / "one", raw, random_laneformer_tensors(raw, seed=4)))
    model = LaneModel(cfg, lowbit.pack_weights(load_weights(cfg, src), "int4"))
    src.close()
    start = 110  # a prefilled prompt past the ring of 5; the decode crosses 128 visible keys (two stretches)
    ids = torch.randint(0, 256, (1, start), generator=torch.Generator().manual_seed(5))

    def run(n_seq=1):
        _, cache = model.prefill(ids, n_seq, 200)
        out = [model.decode(torch.tensor([[(3 * pos + i) % 256] for i in range(n_seq)]), pos, cache)
               for pos in range(start, 200)]  # and past several probes of the ladder
        return torch.stack(out), torch.cat([t.flatten() for t in cache.k + cache.v])

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(3)  # more threads than this machine may have cores: the team must still agree
        lowbit.step_threads(1)
        want_logits, want_cache = run()
        for n in (2, 3, 0):
            assert lowbit.step_threads(n) == (n or lowbit.step_threads())
            logits, kv = run()
            assert torch.equal(logits, want_logits) and torch.equal(kv, want_cache), n
        got = {}
        worker = threading.Thread(target=lambda: got.update(zip(("logits", "kv"), run())))
        worker.start()
        worker.join()
        assert torch.equal(got["logits"], want_logits) and torch.equal(got["kv"], want_cache)
        assert lowbit.step_threads() >= 1
    finally:
        lowbit.step_threads(0)
        torch.set_num_threads(threads)
    with pytest.raises(ValueError, match="thread count"):
        lowbit.step_threads(-3)


def test_lane_models_keep_the_per_block_path(tmp_path):
    """Cross-lane sums between blocks: no fused step for several lanes (or under DTP ranks)."""
    _, low, _ = models(tmp_path, "d2-early", "int4")
    assert low.fused_step is None


def test_unpacked_reference_is_not_the_float_model(tmp_path):
    """The check above can fail: the float weights themselves differ from the packed ones by more."""
    _, low, ref = models(tmp_path, "d2-early", "int4")
    raw, tensors = random_model("d2-early")
    cfg, src = open_checkpoint(write_checkpoint(tmp_path / "f", raw, tensors))
    exact = LaneModel(cfg, load_weights(cfg, src))
    src.close()
    assert float((exact.layers[0].wqkv - ref.layers[0].wqkv).abs().max()) > 0


@pytest.mark.slow
def test_dtp_ranks_pack_their_own_slices(tmp_path):
    raw, tensors = random_model("d2-early", seed=3)
    path = write_checkpoint(tmp_path / "ckpt", raw, tensors)
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(2))
    one = load_engine(path, dtype="int4")
    want, greedy = one.logits(ids), [t for ev in one.generate([5, 6, 7], SamplingParams(max_tokens=6))
                                    for t in ev.token_ids]
    two = load_engine(path, dtype="int4", world_size=2, timeout_s=60)
    try:
        assert two.runtime.dtype == "int4"
        got = two.logits(ids)
        assert close(got, want, want.abs().max())
        tokens = [t for ev in two.generate([5, 6, 7], SamplingParams(max_tokens=6)) for t in ev.token_ids]
        assert len(tokens) == len(greedy)
        assert sum(a == b for a, b in zip(tokens, greedy)) >= len(greedy) - 1
    finally:
        two.close()


@pytest.fixture(scope="module")
def default_weights():
    from laneplay.engine.tokenizer import tokenizer_from_gguf

    cfg, src = open_checkpoint(resolve_checkpoint("smollm2-135m-instruct"))
    try:
        return cfg, load_weights(cfg, src), tokenizer_from_gguf(src.reader)
    finally:
        src.close()


@pytest.mark.slow
def test_default_model_int4_keeps_the_gguf_blocks_exactly(default_weights):
    """The embedded GGUF is Q4_1 blocks with a Q8_0 head: int4 packs them back bit for bit."""
    cfg, weights, _ = default_weights
    packed = lowbit.pack_weights(weights, "int4")
    for name, w in weights.items():
        if isinstance(packed[name], lowbit.PackedWeight):
            assert torch.equal(packed[name].dequantize(), w), name
    assert packed["layers.0.w13"].nbytes <= weights["layers.0.w13"].nbytes / 5
    assert DecodeStep.fits(LaneModel(cfg, packed))  # the default model decodes in one C call per token


@pytest.mark.slow
@torch.inference_mode()
def test_default_model_int4_decodes_like_its_float_weights(default_weights):
    """Teacher-forced over a piece of code: the same next-token choice almost everywhere."""
    cfg, weights, tokenizer = default_weights
    low, ref = LaneModel(cfg, lowbit.pack_weights(weights, "int4")), LaneModel(cfg, weights)
    text = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
            "    for _ in range(n):\n        a, b = b, a + b\n    return a\n\n\nprint(fibonacci(10))\n")
    ids = torch.tensor([tokenizer.encode(text)])
    n = ids.shape[1]
    full = ref.forward(ids)[0]  # the float weights' logits at every position, in one pass
    ll, cl = low.prefill(ids[:, :4], 1, n + 1)
    agree, worst = int(full[3].argmax() == ll.argmax()), float((full[3] - ll).abs().max())
    for pos in range(4, n):  # the int4 model decodes token by token
        a, b = full[pos], low.decode(ids[:, pos:pos + 1], pos, cl)
        worst = max(worst, float((a - b).abs().max()))
        agree += int(a.argmax() == b.argmax())
    assert agree >= 0.9 * (n - 3) and worst < 2.0, (agree, n - 3, worst)


def test_runtime_resolves_the_low_bit_dtypes():
    rt = make_runtime("cpu", "int4", compile=True)
    assert (rt.dtype, rt.weight_format, rt.torch_dtype, rt.compile) == ("int4", "int4", torch.float32, False)
    assert make_runtime("cpu", "auto").dtype == "int4"
    assert make_runtime("cpu", "float32").weight_format is None
    with pytest.raises(ValueError, match="static decode step"):
        make_runtime("cpu", "int8", graphs=True)
    with pytest.raises(ValueError, match="not supported"):
        make_runtime("cpu", "int3")


@pytest.mark.parametrize("fmt", ["int4", "int8"])
@pytest.mark.parametrize("name", ["d2-early", "lane-head-lane-norms"])
@torch.inference_mode()
def test_long_prompt_chunks_run_as_float_gemms_on_the_unpacked_weights(tmp_path, name, fmt):
    """From gemm_min_rows rows on, a product is one float GEMM on the unpacked weight: a prompt then
    prefills like the unpacked reference up to float rounding, with no activation quantization at all
    (its K/V are the same bits with 8- or 16-bit codes, which only the last row's head product takes),
    and the decode after it still runs the integer kernels within their bound. The packed model keeps
    float16 K/V, so the prompt's logits are compared with the reference's over a float16 cache too."""
    _, low, ref = models(tmp_path, name, fmt)
    ids = torch.randint(0, 256, (1, 24), generator=torch.Generator().manual_seed(3))
    assert low.kv_dtype == lowbit.KV_DTYPE == torch.float16 and ref.kv_dtype == torch.float32

    def kv_with(bits: int):
        lowbit.activation_bits(bits)
        cache = low.prefill(ids, 1, 40)[1]
        return [t.clone() for t in (*cache.k, *cache.v)]

    before, bits = lowbit.gemm_min_rows(12), lowbit.activation_bits()
    try:
        ref.kv_dtype = low.kv_dtype  # the prompt's keys and values rounded as the packed model's cache holds them
        lr, _ = ref.prefill(ids, 1, 40)
        ref.kv_dtype = torch.float32
        ll, cl = low.prefill(ids, 1, 40)
        assert torch.allclose(ll, lr, rtol=1e-4, atol=1e-4 * float(lr.abs().max()))
        cr = ref.prefill(ids, 1, 40)[1]
        a, b = ref.decode(ids[:, -1:], 24, cr), low.decode(ids[:, -1:], 24, cl)
        assert close(b, a, a.abs().max())
        assert all(torch.equal(x, y) for x, y in zip(kv_with(8), kv_with(16)))
        lowbit.gemm_min_rows(10 ** 9)  # the same prompt on the integer kernels: within their bound,
        li, _ = low.prefill(ids, 1, 40)
        assert close(li, lr, lr.abs().max())
        assert not all(torch.equal(x, y) for x, y in zip(kv_with(8), kv_with(16)))  # and its codes show
    finally:
        lowbit.gemm_min_rows(before)
        lowbit.activation_bits(bits)
