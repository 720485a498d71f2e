"""The DTP runtime on CPU with gloo: same function at every world size, delayed or "wait now"."""
import asyncio
import os
import signal
import time

import pytest
import torch

from laneplay.engine import SamplingParams, load_engine
from laneplay.engine.checkpoint import random_laneformer_tensors, tiny_laneformer_config, write_checkpoint
from laneplay.engine.dtp import DTPError
from laneplay.engine.loader import reload

pytestmark = pytest.mark.slow

LANES8 = dict(num_lanes=8, num_attention_heads=16, num_key_value_heads=8, hidden_size=64, intermediate_size=128)
CONFIGS = {
    "d1-early": dict(broadcast_delay=1, use_early_comm=True),
    "d1-late": dict(broadcast_delay=1, use_early_comm=False),
    "d2-early": dict(broadcast_delay=2, use_early_comm=True),
    "d2-late": dict(broadcast_delay=2, use_early_comm=False),
    "vocab-parallel": dict(broadcast_delay=2, lm_head_type="vocab_parallel"),
    "lane-head-lane-norms": dict(broadcast_delay=2, lm_head_type="lane", replicated_rmsn_scale=False),
    "pre-norm-agg": dict(broadcast_delay=1, pre_norm_lane_agg=True, early_layers_broadcast=False),
}
IDS = torch.randint(0, 256, (2, 20), generator=torch.Generator().manual_seed(0))  # window 8 < 20
PROMPT = [3, 14, 15, 92, 65]


def collect(eng, **params):
    texts, tokens = {}, {}
    for ev in eng.generate(PROMPT, SamplingParams(**params)):
        texts[ev.sample_index] = texts.get(ev.sample_index, "") + ev.text
        tokens.setdefault(ev.sample_index, []).extend(ev.token_ids)
    return texts, tokens


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """name -> (path, reference logits, greedy tokens, sampled texts) from the single-process engine."""
    out = {}
    for name, overrides in CONFIGS.items():
        raw = tiny_laneformer_config(**LANES8, **overrides)
        path = write_checkpoint(tmp_path_factory.mktemp(name), raw, random_laneformer_tensors(raw, seed=len(out)))
        single = load_engine(path, compile=False)
        out[name] = (path, single.logits(IDS), collect(single, max_tokens=8)[1],
                     collect(single, max_tokens=8, temperature=1.0, top_p=0.9, seed=7, n=2)[0])
    return out


@pytest.fixture(scope="module", params=[2, 4, 8])
def cluster(request, checkpoints):
    eng = load_engine(next(iter(checkpoints.values()))[0], world_size=request.param, timeout_s=60)
    yield eng
    eng.close()


# At world size 8 (one lane per rank, the spec's layout) the delay-1 and delay-2 schedules and the vocab-
# parallel head; at 2 and 4 every configuration (eight ranks share the two cores: each case costs seconds).
WORLD8 = ("d1-early", "d2-late", "vocab-parallel")


# (tests/engine/conftest.py deselects the other cases at world size 8)
@pytest.mark.parametrize("name", list(CONFIGS))
def test_every_world_size_computes_the_single_process_function(cluster, checkpoints, name):
    path, ref_logits, ref_greedy, ref_sampled = checkpoints[name]
    eng = reload(cluster, path)
    for wait_now in (False, True):
        eng.runner.configure(wait_now=wait_now)
        assert (eng.logits(IDS) - ref_logits).abs().max() <= 1e-5
        assert collect(eng, max_tokens=8)[1] == ref_greedy
    eng.runner.configure(wait_now=False)
    assert collect(eng, max_tokens=8, temperature=1.0, top_p=0.9, seed=7, n=2)[0] == ref_sampled


def test_each_rank_holds_its_share_of_the_layer_weights(cluster, checkpoints):
    path = checkpoints["d2-early"][0]
    reload(cluster, path)
    single = load_engine(path, compile=False)
    nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
    total = sum(nbytes(t) for lw in single.model.layers for t in vars(lw).values())
    norms = sum(nbytes(lw.attn_norm) + nbytes(lw.ffn_norm) for lw in single.model.layers)  # replicated [D]
    per_rank = [info["layer_bytes"] for info in cluster.runner.rank_info]
    print(f"world {cluster.world_size}: layer bytes per rank {per_rank} of {total} "
          f"({', '.join(f'{b / total:.3f}' for b in per_rank)})")
    assert per_rank == [(total - norms) // cluster.world_size + norms] * cluster.world_size


def test_llama_checkpoint_runs_as_standard_tensor_parallelism(tmp_path):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
                                   num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=128)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "llama")
    from laneplay.engine.checkpoint import write_byte_tokenizer
    write_byte_tokenizer(tmp_path / "llama", 300)
    single = load_engine(tmp_path / "llama", compile=False)
    ref, ref_tokens = single.logits(IDS), collect(single, max_tokens=6)[1]
    for ws in (4,):  # one KV head per rank
        eng = load_engine(tmp_path / "llama", world_size=ws)
        try:
            assert eng.cfg.num_lanes == ws
            assert (eng.logits(IDS) - ref).abs().max() <= 1e-5
            assert collect(eng, max_tokens=6)[1] == ref_tokens
        finally:
            eng.close()


def test_world_size_must_divide_the_lanes(checkpoints):
    with pytest.raises(ValueError, match="must divide the model's 8 lanes"):
        load_engine(checkpoints["d2-early"][0], world_size=3)


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().split()[2] != "Z"


def test_a_killed_rank_ends_generation_with_a_clear_error_and_no_process_left(checkpoints):
    eng = load_engine(checkpoints["d2-early"][0], world_size=2, timeout_s=20)
    pids = eng.runner.pids
    events = eng.generate(PROMPT, SamplingParams(max_tokens=120, ignore_eos=True))
    next(events)
    t0 = time.monotonic()
    os.kill(pids[1], signal.SIGKILL)
    with pytest.raises(DTPError, match=r"rank 1 died"):
        for _ in events:
            pass
    assert time.monotonic() - t0 < 20 + 10
    time.sleep(0.5)
    assert not any(_alive(p) for p in pids)
    with pytest.raises(DTPError):
        eng.logits(IDS)


def test_close_leaves_no_process_behind(checkpoints):
    eng = load_engine(checkpoints["d1-late"][0], world_size=4)
    pids = eng.runner.pids
    eng.close()
    assert not any(_alive(p) for p in pids)


def test_stop_string_cancels_all_ranks_and_the_engine_stays_usable(cluster, checkpoints):
    path, _, ref_greedy, _ = checkpoints["d2-late"]
    eng = reload(cluster, path)
    events = eng.generate(PROMPT, SamplingParams(max_tokens=50, ignore_eos=True))
    next(events)
    with pytest.raises(DTPError, match="between requests"):  # rank 0's pipe carries the request's tokens now
        eng.logits(IDS)
    events.close()  # the consumer walks away mid-request
    assert collect(eng, max_tokens=8)[1] == ref_greedy


def _run(eng, prompt, params, speculative):
    tokens, final = [], None
    for ev in eng.generate(prompt, params, speculative=speculative):
        tokens += ev.token_ids
        final = ev.metrics if ev.finish_reason else final
    return tokens, final


@pytest.mark.parametrize("name", ["d1-late", "d2-early"])  # at world sizes 2 and 4 (neither is in WORLD8)
def test_ranks_speculate_alike_and_keep_the_single_process_tokens(cluster, checkpoints, name):
    """Prompt lookup across ranks: every rank drafts, verifies (the verify's logits gathered whole on every
    rank), keeps the same tokens and rolls back the same positions; the front's metrics carry rank 0's
    counts. (These random models repeat themselves a little: 48 greedy tokens keep a few drafts.)"""
    path = checkpoints[name][0]
    eng = reload(cluster, path)
    single = load_engine(path, compile=False)
    prompt = PROMPT * 4
    greedy = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    want, _ = _run(single, prompt, greedy, "off")
    got, m = _run(eng, prompt, greedy, "lookup")
    assert got == want
    assert m.speculative == "lookup" and m.accepted_tokens > 0 and m.draft_tokens > m.accepted_tokens  # kept, rolled back
    assert m.decode_steps + m.accepted_tokens == len(got) - 1
    sampled = SamplingParams(max_tokens=16, temperature=0.8, seed=5, ignore_eos=True)
    got, m = _run(eng, prompt, sampled, "lookup")
    assert got == _run(single, prompt, sampled, "lookup")[0] and m.draft_tokens > 0  # the ranks draw alike


async def _together(eng, requests, cancel_after=None, steps=None):
    """Requests submitted at once to the engine's scheduler: [(tokens per sample, job, when it ended)].
    cancel_after: (index, tokens): that request is cancelled once it has streamed so many tokens.
    steps: a list that gets the rows of every shared decode step (the server's metrics hook)."""
    from laneplay.engine.scheduler import STARTED, Queued, Scheduler

    sched = Scheduler(eng)
    if steps is not None:
        sched.on_step = lambda rows, seconds: steps.append(rows)
    sched.start()

    async def collect(i, job):
        out, n = {}, 0
        async for ev in job.stream():
            if ev is STARTED or isinstance(ev, Queued):
                continue
            out.setdefault(ev.sample_index, []).extend(ev.token_ids)
            n += len(ev.token_ids)
            if cancel_after and cancel_after[0] == i and n >= cancel_after[1]:
                sched.cancel(job)
        return out, job, time.perf_counter()

    try:
        jobs = [sched.submit(*eng.prepare(prompt, params), speculative=spec) for prompt, params, spec in requests]
        return await asyncio.gather(*(collect(i, j) for i, j in enumerate(jobs)))
    finally:
        sched.close()


def _alone(eng, prompt, params, spec):
    out = {}
    for ev in eng.generate(prompt, params, speculative=spec):
        out.setdefault(ev.sample_index, []).extend(ev.token_ids)
    return out


@pytest.mark.parametrize("name", ["d1-late"])  # at world sizes 2 and 4
def test_requests_at_once_share_the_ranks_steps_and_keep_their_tokens(cluster, checkpoints, name):
    """Separate requests at once on a DTP engine run as rows of the ranks' shared steps (prompt chunks and
    decode steps interleaved, `Rank.serve`): all start before any ends, each hears it shared the engine's steps,
    and each gets the tokens the single-process engine gives it alone (greedy, seeded samples, several
    samples, prompt-lookup speculation). A cancelled one leaves at a step boundary; the others go on."""
    path = checkpoints[name][0]
    eng = reload(cluster, path)
    single = load_engine(path, compile=False)
    assert eng.runner.batches_itself
    requests = [
        (PROMPT * 3, SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True), "off"),
        ([7, 1, 7, 1, 9], SamplingParams(max_tokens=16, temperature=0.9, top_p=0.95, seed=11, n=2, ignore_eos=True), "auto"),
        (PROMPT * 4, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), "lookup"),
        ([2] * 30, SamplingParams(max_tokens=20, temperature=0.7, top_k=20, seed=5, ignore_eos=True), "off"),
    ]
    steps = []
    got = asyncio.run(_together(eng, requests, steps=steps))
    first_end = min(end for _, _, end in got)
    assert max(steps) == 5  # all four requests' rows (one has two samples) in one step of the ranks
    for (prompt, params, spec), (tokens, job, _) in zip(requests, got):
        assert job.outcome == "completed" and job.t_start < first_end  # none waited for another to finish
        assert params.n < job.rows_per_step <= 5  # its steps carried the others' rows too
        assert tokens == _alone(single, prompt, params, spec), (prompt, params)
    # one request cancelled mid-stream leaves the batch; the other keeps its tokens; the engine goes on
    keep = requests[0]
    drop = (PROMPT, SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True), "off")
    (t_keep, j_keep, _), (t_drop, j_drop, _) = asyncio.run(_together(eng, [keep, drop], cancel_after=(1, 3)))
    assert j_drop.outcome == "cancelled" and len(t_drop[0]) < 60
    assert j_keep.outcome == "completed" and t_keep == _alone(single, *keep)
    assert _alone(eng, *requests[3]) == _alone(single, *requests[3])
