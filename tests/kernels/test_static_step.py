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
    dec.load(cache, prompt)
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
        dec.load(cache, 3)
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


def _shared_case(eng, impl, plan, capacity=48):
    """Separate requests through `StaticDecoder.groups` against each request's own `LaneModel.decode`.
    plan: per step, the requests in it; a request is (name, prompt length, samples), prefilled when it
    first appears; one absent from a later step sits it out (or, when it never comes back, ends: its
    cache is dropped and its rows freed)."""
    import gc

    model, worst = eng.model, 0.0
    dec = StaticDecoder(model, capacity=capacity, graphs=False, impl=impl)
    gen = torch.Generator().manual_seed(7)
    own, ref, pos = {}, {}, {}
    last = {name: max(i for i, step in enumerate(plan) if any(r[0] == name for r in step))
            for step in plan for name, _, _ in step}
    for i, step in enumerate(plan):
        for name, prompt, n in step:
            if name not in own:
                ids = torch.randint(0, eng.cfg.vocab_size, (1, prompt), generator=gen)
                own[name] = model.prefill(ids, n, 40)[1]
                ref[name], pos[name] = KV_copy(own[name]), prompt
        tokens = torch.randint(0, eng.cfg.vocab_size, (sum(n for _, _, n in step), 1), generator=gen)
        got = dec.groups(tokens, [(pos[name], own[name]) for name, _, _ in step])
        a = 0
        for name, _, n in step:
            want = model.decode(tokens[a:a + n], pos[name], ref[name])
            worst = max(worst, ((got[a:a + n] - want).abs().max() / want.abs().max()).item())
            a, pos[name] = a + n, pos[name] + 1
        for name in [k for k in own if last[k] == i]:  # its request ended: the cache goes, its rows free
            del own[name]
        gc.collect()
    return worst, dec


def test_separate_requests_share_the_static_step_torch(tmp_path):
    """Requests join (prefilled, copied into the shared cache), sit steps out, end (their rows freed, the
    rows above them moved down) and new ones take the room, at positions on both sides of the window (8:
    rings wrap); every request's logits are those of its own decode steps. (The Triton kernels' rows at
    their own positions in a bucket of the shared cache: tests/kernels/test_kernels.py.)"""
    eng = engine_for(tmp_path, CONFIGS["delay 2, early comm"])
    A, B, C, D = ("a", 5, 1), ("b", 9, 2), ("c", 3, 1), ("d", 12, 1)
    plan = [[A], [A, B], [A, B, C], [B, C], [A, C], [A, B, C], [C, D], [D, C], [D]]
    worst, dec = _shared_case(eng, "torch", plan)
    assert worst <= 1e-4, f"max relative |Δlogit| {worst:.3g}"
    assert set(dec.buckets) == {1, 2, 4} and dec.rows_held == 0  # padded to buckets; every request ended


def test_a_static_engine_batches_separate_requests_and_keeps_their_tokens(tmp_path):
    import asyncio

    from laneplay.engine.sampling import SamplingParams
    from laneplay.engine.scheduler import STARTED, Queued, Scheduler

    raw = tiny_laneformer_config()
    write_checkpoint(tmp_path / "ckpt", raw, random_laneformer_tensors(raw, seed=6))
    plain, static = load_engine(tmp_path / "ckpt"), load_engine(tmp_path / "ckpt", graphs=True)
    requests = [("abc", SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True)),
                ("hello there", SamplingParams(max_tokens=9, temperature=0.9, n=2, seed=4, ignore_eos=True)),
                ("x", SamplingParams(max_tokens=20, temperature=0.7, top_k=5, seed=1, ignore_eos=True))]

    def alone(prompt, params):
        out = {}
        for ev in plain.generate(prompt, params):
            out.setdefault(ev.sample_index, []).extend(ev.token_ids)
        return out

    async def together():
        sched = Scheduler(static)
        assert sched.batched
        sched.start()

        async def collect(job):
            out = {}
            async for ev in job.stream():
                if ev is not STARTED and not isinstance(ev, Queued):
                    out.setdefault(ev.sample_index, []).extend(ev.token_ids)
            return out, job
        try:
            return await asyncio.gather(*(collect(sched.submit(*static.prepare(p, s))) for p, s in requests))
        finally:
            sched.close()

    for (prompt, params), (tokens, job) in zip(requests, asyncio.run(together())):
        assert tokens == alone(prompt, params) and job.outcome == "completed"
        assert job.rows_per_step > params.n  # it shared steps
    assert static.runner.static.buckets and static.runner.static.rows_held == 0  # through the shared cache; all left


# ---- speculative verification in the static step ------------------------------------------------------

def _verify_rounds(eng, impl, prompt, rounds, capacity=64):
    """A request loaded into the static step verifies S positions and keeps k of them, round after round,
    with a plain step between rounds; the reference decodes exactly the kept tokens one step at a time on
    its own cache. Every verify row's logits and every step's against the reference's."""
    model, gen = eng.model, torch.Generator().manual_seed(prompt)
    V = eng.cfg.vocab_size
    ids = torch.randint(0, V, (1, prompt), generator=gen)
    _, cache = model.prefill(ids, 1, capacity)
    ref = KV_copy(cache)
    dec = StaticDecoder(model, capacity=capacity, graphs=False, impl=impl)
    dec.load(cache, prompt)
    pos, worst = prompt, 0.0

    def rel(got, want):
        return ((got - want).abs().max() / want.abs().max()).item()
    for S, keep in rounds:
        tokens = torch.randint(0, V, (1, S), generator=gen)
        got, kept = dec.verify(tokens, pos)
        probe = ref
        for j in range(S):  # what each position's decode step gives after the tokens before it
            if j == keep:
                probe = KV_copy(ref)  # past the kept ones: on a copy, as if never written
            worst = max(worst, rel(got[0, j], model.decode(tokens[:, j:j + 1], pos + j, probe)[0]))
        kept.keep(keep)
        pos += keep
        tok = torch.randint(0, V, (1, 1), generator=gen)
        worst = max(worst, rel(dec.step(tok, pos), model.decode(tok, pos, ref)))
        pos += 1
    return worst, dec


@pytest.mark.parametrize("name", ["delay 2, early comm", "delay 1, vocab-parallel head, GQA 3"])
def test_a_verify_in_the_static_step_is_consecutive_decode_steps(tmp_path, name):
    """The prompt (11) is longer than the window (8): the ring arrives wrapped and moves into the static
    ring of 8 + K_MAX slots. Rounds keep none, some and all of their positions, the longest verify (16)
    included, and the steps after them see only what was kept. (The Triton kernels' rows sharing one
    cache row: tests/kernels/test_kernels.py.)"""
    eng = engine_for(tmp_path, CONFIGS[name])
    worst, dec = _verify_rounds(eng, "torch", 11, [(4, 2), (6, 0), (16, 16), (3, 3), (9, 5)])
    assert worst <= 1e-4, f"max relative |Δlogit| {worst:.3g}"
    assert {n for _, n in dec.verifies} == {4, 8, 16}  # padded up to buckets
    with pytest.raises(ValueError, match="1 to 16 positions"):
        dec.verify(torch.zeros(1, 17, dtype=torch.long), 40)


def test_a_resident_request_verifies_in_the_shared_cache(tmp_path):
    """Two requests share the static cache; one verifies while the other sits out, both step on together,
    and each one's logits are its own decode steps' (the other's rows untouched). A request whose first
    step is a verify moves into the shared cache for it."""
    import gc

    eng = engine_for(tmp_path, CONFIGS["delay 2, early comm"])
    model, gen, V = eng.model, torch.Generator().manual_seed(3), eng.cfg.vocab_size
    dec = StaticDecoder(model, capacity=64, graphs=False, impl="torch")
    own, ref, pos = {}, {}, {"a": 10, "b": 4}
    worst = 0.0

    def rel(got, want):
        return ((got - want).abs().max() / want.abs().max()).item()
    for name, p in pos.items():
        own[name] = model.prefill(torch.randint(0, V, (1, p), generator=gen), 1, 60)[1]
        ref[name] = KV_copy(own[name])

    def both():
        nonlocal worst
        tokens = torch.randint(0, V, (2, 1), generator=gen)
        got = dec.groups(tokens, [(pos["a"], own["a"]), (pos["b"], own["b"])])
        for i, name in enumerate(("a", "b")):
            worst = max(worst, rel(got[i], model.decode(tokens[i:i + 1], pos[name], ref[name])[0]))
            pos[name] += 1
    c = model.prefill(torch.randint(0, V, (1, 6), generator=gen), 1, 40)[1]  # a third request verifies first
    ref_c = KV_copy(c)
    tokens = torch.randint(0, V, (1, 4), generator=gen)
    assert dec.can_verify(c, 6) and dec.rows_held == 1  # it moved into the shared cache to verify there
    got, _ = dec.verify(tokens, 6, c)
    worst = max(rel(got[0, j], model.decode(tokens[:, j:j + 1], 6 + j, ref_c)[0]) for j in range(4))
    del c
    gc.collect()
    both()
    assert dec.can_verify(own["a"]) and dec.rows_held == 2 and not dec.can_verify(object())
    for S, keep in ((5, 2), (12, 12), (2, 0)):
        tokens = torch.randint(0, V, (1, S), generator=gen)
        got, kept = dec.verify(tokens, pos["a"], own["a"])
        for j in range(keep):
            worst = max(worst, rel(got[0, j], model.decode(tokens[:, j:j + 1], pos["a"] + j, ref["a"])[0]))
        kept.keep(keep)
        pos["a"] += keep
        both()
    with pytest.raises(ValueError, match="asked to verify"):
        dec.verify(torch.zeros(1, 2, dtype=torch.long), pos["a"] + 1, own["a"])
    assert worst <= 1e-4, f"max relative |Δlogit| {worst:.3g}"
    del own["b"]
    gc.collect()
    both_gone = dec.groups(torch.zeros(1, 1, dtype=torch.long), [(pos["a"], own["a"])])
    assert both_gone.shape[0] == 1 and dec.rows_held == 1


def test_a_static_engine_speculates_and_keeps_the_greedy_tokens(tmp_path):
    """Greedy requests with prompt lookup through the static step (alone: the batch-1 cache; through the
    scheduler: the shared cache) give the tokens of the plain engine without speculation."""
    import asyncio

    from laneplay.engine.sampling import SamplingParams
    from laneplay.engine.scheduler import STARTED, Queued, Scheduler

    raw = tiny_laneformer_config()
    write_checkpoint(tmp_path / "ckpt", raw, random_laneformer_tensors(raw, seed=6))
    plain, static = load_engine(tmp_path / "ckpt"), load_engine(tmp_path / "ckpt", graphs=True)
    base = list(range(40, 52))
    prompt = base * 3 + base[:4]  # repeats: the lookup has something to find
    params = SamplingParams(max_tokens=30, temperature=0.0, ignore_eos=True)

    def run(eng, mode):
        toks, final = [], None
        for ev in eng.generate(prompt, params, speculative=mode):
            toks += ev.token_ids
            final = ev.metrics if ev.finish_reason else final
        return toks, final

    want, _ = run(plain, "off")
    got, m = run(static, "lookup")
    assert got == want and m.speculative == "lookup" and m.draft_tokens > 0
    assert m.decode_steps + m.accepted_tokens == 29

    async def two():
        sched = Scheduler(static)
        sched.start()

        async def collect(job):
            out = []
            async for ev in job.stream():
                if ev is not STARTED and not isinstance(ev, Queued):
                    out += ev.token_ids
            return out, job
        try:
            jobs = [sched.submit(*static.prepare(prompt, params), speculative="lookup") for _ in range(2)]
            return await asyncio.gather(*(collect(j) for j in jobs))
        finally:
            sched.close()

    for tokens, job in asyncio.run(two()):
        assert tokens == want and job.outcome == "completed"
    assert ("shared", 2) in static.runner.static.verifies or ("shared", 4) in static.runner.static.verifies
