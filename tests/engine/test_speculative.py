"""Speculative decoding by prompt lookup (engine/speculative.py, LaneModel.verify, model.Rewind).

The verify forward is checked against the naive reference (float) and against one-token decode steps
bit for bit (the fused low-bit step); the rewind against a cache that never saw the rejected tokens;
greedy generation with speculation against generation without, token for token; and the sampling
acceptance rule by the distribution of what it emits.
"""
import random

import pytest
import torch

from laneplay.engine import SamplingParams, load_engine
from laneplay.engine.checkpoint import (load_weights, open_checkpoint, random_laneformer_tensors,
                                        tiny_laneformer_config, write_checkpoint)
from laneplay.engine.model import LaneModel
from laneplay.engine.sampling import process_logits
from laneplay.engine.speculative import (AUTO_LONG, AUTO_MAX, K_MAX, LONG_MATCH, MATCH_MAX, NGRAMS, ONE_KEEP,
                                         SHARE_DECAY, SHARED_KEEP, Controller,
                                         Lookup, Speculation, check_mode, draw, plan, trusted)
from tests.engine.naive_reference import naive_logits


# ---- drafting ------------------------------------------------------------------------------------

def naive_draft(tokens: list[int], k: int, ngrams=NGRAMS) -> tuple[list[int], int]:
    """Scan backwards for the most recent earlier occurrence of the last n tokens, longest n first; then
    count how far back it agrees with the sequence's end."""
    for n in ngrams:
        if len(tokens) < n:
            continue
        tail = tokens[-n:]
        for start in range(len(tokens) - n - 1, -1, -1):
            if tokens[start:start + n] == tail:
                m = n
                while m < MATCH_MAX and start - (m - n) - 1 >= 0 and \
                        tokens[start - (m - n) - 1] == tokens[len(tokens) - m - 1]:
                    m += 1
                return tokens[start + n:start + n + k], m
    return [], 0


@pytest.mark.parametrize("vocab", [3, 6, 40])
def test_lookup_drafts_what_followed_the_most_recent_longest_match(vocab):
    rng = random.Random(vocab)
    for trial in range(60):
        seq = [rng.randrange(vocab) for _ in range(rng.randrange(1, 80))]
        cut = rng.randrange(0, len(seq) + 1)
        lookup = Lookup(seq[:cut])
        lookup.extend(seq[cut:])  # built in two parts, as prompt then output
        for k in (1, 4, 8):
            assert lookup.draft(k) == naive_draft(seq, k), (seq, k)


def test_lookup_on_code_proposes_the_rest_of_a_copied_line_and_says_how_long_the_match_is():
    assert Lookup([10, 11, 12, 13, 14, 15, 16, 99, 10, 11]).draft(4) == ([12, 13, 14, 15], 2)
    assert Lookup([7, 10, 11, 12, 13, 14, 15, 16, 99, 7, 10, 11]).draft(2) == ([12, 13], 3)
    line = list(range(100, 140))
    assert Lookup(line + [5] + line[:30]).draft(3) == ([130, 131, 132], MATCH_MAX)
    assert Lookup([1, 2, 3]).draft(4) == ([], 0)  # nothing repeats


def test_auto_drafts_what_the_match_is_worth_and_follows_the_acceptance():
    assert [trusted(m) for m in range(6)] == [0, 1, 2, 6, 7, 7] and trusted(LONG_MATCH - 1) == AUTO_MAX
    assert trusted(LONG_MATCH) == trusted(MATCH_MAX) == AUTO_LONG < K_MAX
    assert Controller("auto", one_token=False).want(1) == 0  # where a verify row is dear: not on one token
    one = Speculation("auto", [5, 6, 7, 8, 6], SamplingParams(temperature=0.0))  # 6 again: a one-token match
    assert one.lookup.draft(3) == ([7, 8, 6], 1) and one.drafts(room=16) == [7]
    assert one.drafts(room=16, shared=True) == [] and one.paused_steps == 0  # beside others: none, no pause
    ctl = Controller("auto")
    assert ctl.want(0) == 0 and ctl.want(1) == 1  # a one-token match: one draft, while drafts are kept
    assert ctl.want(2) == 2 and ctl.want(3) == 6 and ctl.want(MATCH_MAX) == AUTO_LONG  # the start: the match's worth
    ctl.record(K_MAX, 3)  # three kept: half of k is more than kept + 1
    assert ctl.k == K_MAX // 2
    ks = []
    for _ in range(3):  # nothing kept: halving, down to one
        ctl.record(ctl.k, 0)
        ks.append(ctl.k)
    assert ks == [K_MAX // 4, 1, 1]
    for _ in range(4):  # a run of kept drafts grows k back to K_MAX ("auto" takes what the match is worth)
        ctl.record(ctl.k, ctl.k)
    assert ctl.k == K_MAX and ctl.want(MATCH_MAX) == AUTO_LONG and ctl.want(4) == trusted(4)
    # "lookup" drafts on every match, even one token long
    always = Controller("lookup")
    assert always.want(1) == K_MAX and always.want(0) == 0


def test_beside_others_auto_drafts_while_its_drafts_are_kept_and_resumes_where_the_text_repeats():
    """A shared step: "auto" drafts while it keeps SHARED_KEEP of its drafts lately; below that it takes plain
    rows, still checking its first draft against each token that comes, and drafts again once those are kept.
    Alone, and in "lookup", it always drafts what the match is worth."""
    line = list(range(100, 140))
    params = SamplingParams(temperature=0.0)
    spec = Speculation("auto", line + [7] + line, params)  # the line again: a long match
    lookup = Speculation("lookup", line + [7] + line, params)
    d = spec.drafts(room=16, shared=True)
    assert spec.control.kept_share == 1.0 and d  # trusted until a verify is seen
    after = [7] + line  # what followed the line's earlier occurrence
    assert d == after[:AUTO_LONG] and lookup.drafts(room=16, shared=True) == after[:K_MAX]  # "lookup": up to K_MAX
    spec.produced(spec.accept(_logits_for([999] * (len(d) + 1)), d, torch.Generator()))  # every draft rejected
    assert spec.control.kept_share < SHARED_KEEP and not spec.paused and spec.paused_steps == 0
    # the text repeats again: plain rows beside others while the shadowed first drafts are kept
    rounds = 0
    for t in line:
        would = spec.lookup.draft(1)[1] >= 2  # alone it would draft here
        d = spec.drafts(room=16, shared=True)
        if d:
            break
        rounds += would
        assert spec.paused == (rounds > 0)  # the meter says so: speculation paused while sharing the engine
        spec.produced([t])
    assert d == line[line.index(t):][:len(d)] and 1 <= rounds <= 8 and spec.control.kept_share >= SHARED_KEEP
    assert spec.paused_steps == rounds and spec.paused  # every step in which it held drafts back
    assert spec.drafts(room=16) == d and not spec.paused  # alone: what the match is worth, never paused
    spec.paused = True  # as it was beside others: a verify ends the pause
    spec.produced(spec.accept(_logits_for(d + [1]), d, torch.Generator()))
    assert not spec.paused and spec.counts()["paused_steps"] == rounds
    # what it weighs: kept over drafted, each earlier verify weighing SHARE_DECAY of the next
    ctl = Controller("auto")
    ctl.record(4, 0)
    ctl.record(2, 2)
    assert ctl.kept_share == pytest.approx((SHARE_DECAY ** 2 + 2) / (SHARE_DECAY ** 2 + 4 * SHARE_DECAY + 2))


def _logits_for(tokens: list[int], vocab: int = 1000) -> torch.Tensor:
    """Logits [len, vocab] whose argmax at row j is tokens[j]."""
    logits = torch.zeros(len(tokens), vocab)
    for j, t in enumerate(tokens):
        logits[j, t] = 5.0
    return logits


def test_text_without_repeated_phrases_never_drafts_in_auto_but_does_in_lookup():
    # random tokens over 2,000 ids: single tokens recur often, two in a row almost never
    rng = random.Random(5)
    ids = [rng.randrange(2_000) for _ in range(400)]
    auto = Speculation("auto", ids[:100], SamplingParams(temperature=0.0))
    always = Speculation("lookup", ids[:100], SamplingParams(temperature=0.0))
    one_token_matches = lookup_drafts = 0
    for t in ids[100:]:
        one_token_matches += always.lookup.draft(1)[1] == 1
        lookup_drafts += bool(always.drafts(room=16))
        always.produced([t])
    assert one_token_matches > 20 and lookup_drafts >= one_token_matches
    # "auto" drafts one token on a one-token match only while its drafts are kept: here a few times, then never
    pos, drafted_at = 100, []
    while pos < len(ids) - 1:
        d = auto.drafts(room=min(16, len(ids) - pos - 1))
        if d:
            drafted_at.append(pos)
            out = auto.accept(_logits_for(ids[pos:pos + len(d) + 1], vocab=2_000), d, torch.Generator())
        else:
            out = [ids[pos]]
        auto.produced(out)
        pos += len(out)
    assert 1 <= len(drafted_at) <= 4 and auto.control.kept_share < ONE_KEEP


def test_modes_are_checked_and_off_says_why():
    with pytest.raises(ValueError, match="speculative must be one of auto, off, lookup"):
        check_mode("fast")

    class NoVerify:
        world_size = 1

    class Ranks:  # a DTP front: the ranks verify
        world_size, speculates = 2, True

    class Static:
        world_size, static, verify = 1, object(), None

    assert plan("auto", NoVerify(), [1, 2], SamplingParams()).reason == "this runner has no verify step"
    assert plan("auto", Ranks(), [1, 2], SamplingParams(temperature=0.0)).active
    assert plan("auto", Static(), [1, 2], SamplingParams(temperature=0.0)).active  # StaticDecoder.verify
    assert not plan("off", Ranks(), [1, 2], SamplingParams()).active
    assert "n > 1" in Speculation("lookup", [1, 2], SamplingParams(n=2, temperature=1.0)).reason


# ---- the verify forward and its rewind -------------------------------------------------------------

@pytest.fixture(scope="module")
def float_ckpt(tmp_path_factory):
    """Several lanes, delayed reduces and sliding-window layers (ring of 8 slots)."""
    raw = tiny_laneformer_config(sliding_window=8)
    tensors = random_laneformer_tensors(raw, seed=7)
    return raw, tensors, write_checkpoint(tmp_path_factory.mktemp("spec"), raw, tensors)


@pytest.mark.parametrize("prompt_len,S", [(5, 3), (12, 6), (21, 8)])  # before and after the rings wrap
def test_verify_matches_the_naive_reference_and_rewinds_to_an_untouched_cache(float_ckpt, prompt_len, S):
    raw, tensors, path = float_ckpt
    model = load_engine(path).model
    gen = torch.Generator().manual_seed(prompt_len)
    ids = torch.randint(0, 256, (1, prompt_len + S), generator=gen)
    _, cache = model.prefill(ids[:, :prompt_len], 1, 48)
    logits, rewind = model.verify(ids[:, prompt_len:], prompt_len, cache)
    ref = naive_logits(raw, tensors, ids)[:, prompt_len:]
    assert (logits - ref).abs().max() <= 1e-4 * ref.abs().max()
    for keep in (0, 1, S - 1):
        _, cache = model.prefill(ids[:, :prompt_len], 1, 48)
        _, rewind = model.verify(ids[:, prompt_len:], prompt_len, cache)
        rewind.keep(keep)
        # the next token after the kept ones, decoded from this cache, is what a cache that never saw
        # the rejected tokens gives (a fresh prefill of everything kept)
        nxt = torch.tensor([[17]])
        got = model.decode(nxt, prompt_len + keep, cache)
        want = naive_logits(raw, tensors, torch.cat([ids[:, :prompt_len + keep], nxt], dim=1))[:, -1]
        assert (got - want).abs().max() <= 1e-4 * want.abs().max(), keep


def _one_lane_int4(tmp_path, window=5, positions=96):
    from laneplay.kernels import lowbit

    if not lowbit.available():
        pytest.skip("the low-bit kernels are not built")
    raw = tiny_laneformer_config(num_lanes=1, sliding_window=window, max_position_embeddings=positions)
    path = write_checkpoint(tmp_path / "one", raw, random_laneformer_tensors(raw, seed=4))
    cfg, src = open_checkpoint(path)
    model = LaneModel(cfg, lowbit.pack_weights(load_weights(cfg, src), "int4"))
    src.close()
    assert model.fused_step is not None
    return model, path


@torch.inference_mode()
def test_low_bit_verify_is_bit_for_bit_the_decode_steps(tmp_path):
    """One lane, int4: the verify is one fused step with a group per position, so each position's
    logits and K/V equal those of one-token decode steps exactly (ring of 8 slots; past the point
    where the ring wraps it runs as a prefill chunk, within rounding)."""
    model, _ = _one_lane_int4(tmp_path, window=8)
    gen = torch.Generator().manual_seed(1)
    for prompt_len, S in [(2, 5), (3, 6), (10, 4)]:
        ids = torch.randint(0, 256, (1, prompt_len + S), generator=gen)
        _, c_steps = model.prefill(ids[:, :prompt_len], 1, 40)
        _, c_verify = model.prefill(ids[:, :prompt_len], 1, 40)
        steps = torch.stack([model.decode(ids[:, prompt_len + j:prompt_len + j + 1], prompt_len + j, c_steps)[0]
                             for j in range(S)])
        logits, rewind = model.verify(ids[:, prompt_len:], prompt_len, c_verify)
        if prompt_len + S <= 8:  # no ring wraps: the fused path
            assert torch.equal(logits[0], steps)
            for a, b in zip(c_steps.k + c_steps.v, c_verify.k + c_verify.v):
                assert torch.equal(a, b)
        else:
            assert (logits[0] - steps).abs().max() <= 1e-3 * steps.abs().max()
        rewind.keep(S)


def test_the_longest_low_bit_verify_is_bit_for_bit_the_decode_steps(tmp_path):
    """K_MAX drafts and the last token: still one fused step whose products keep 16-bit activations."""
    from laneplay.kernels import lowbit

    assert K_MAX + 1 < lowbit.gemm_min_rows()  # its products stay on the integer kernels (no float GEMM)
    model, _ = _one_lane_int4(tmp_path, window=64)
    S = K_MAX + 1
    ids = torch.randint(0, 256, (1, 3 + S), generator=torch.Generator().manual_seed(2))
    _, c_steps = model.prefill(ids[:, :3], 1, 40)
    _, c_verify = model.prefill(ids[:, :3], 1, 40)
    steps = torch.stack([model.decode(ids[:, 3 + j:4 + j], 3 + j, c_steps)[0] for j in range(S)])
    logits, _ = model.verify(ids[:, 3:], 3, c_verify)
    assert torch.equal(logits[0], steps)


@torch.inference_mode()
def test_a_long_low_bit_verify_is_bit_for_bit_the_decode_steps(tmp_path):
    """Past 300 positions the attention takes keys in 64-key blocks for both query heads of a KV head,
    in two stretches per head, its scores 8 keys at a time, and the verify's positions (one cache) take
    each stretch together: each position's logits and K/V are still exactly a decode step's."""
    model, _ = _one_lane_int4(tmp_path, window=400, positions=512)
    assert model.cfg.heads_per_lane > model.cfg.kv_heads_per_lane and model.cfg.head_dim % 8 == 0
    ids = torch.randint(0, 256, (1, 309), generator=torch.Generator().manual_seed(5))
    _, c_steps = model.prefill(ids[:, :300], 1, 320)
    _, c_verify = model.prefill(ids[:, :300], 1, 320)
    steps = torch.stack([model.decode(ids[:, 300 + j:301 + j], 300 + j, c_steps)[0] for j in range(9)])
    assert model.verifies_as_groups(300, 9, c_verify)
    logits, _ = model.verify(ids[:, 300:], 300, c_verify)
    assert torch.equal(logits[0], steps)
    for a, b in zip(c_steps.k + c_steps.v, c_verify.k + c_verify.v):
        assert torch.equal(a, b)


# ---- whole requests: greedy equality, sampling, the scheduler --------------------------------------

def run(engine, prompt, params, mode):
    toks, final = [], None
    for ev in engine.generate(prompt, params, speculative=mode):
        toks += ev.token_ids
        if ev.finish_reason:
            final = ev.metrics
    return toks, final


def greedy_differences(engine, prompt, a: list[int], b: list[int]) -> list[float]:
    """Where two greedy runs part: the top-2 logit gap there of run a's own path (a near-tie explains it).
    Run a is the one without speculation; its logits are replayed as the engine made them: the prompt's
    prefill (in the runtime's chunks), then one decode step per token."""
    n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
    if n is None:
        return []
    ids = engine.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
    runner = engine.runner
    logits = runner.prefill(torch.tensor([ids]), 1, len(ids) + n + 1)
    for j, tok in enumerate(a[:n]):
        logits = runner.decode_step(torch.tensor([[tok]]), len(ids) + j)
    top2 = logits.reshape(-1).float().topk(2)
    assert int(top2.indices[0]) == a[n]  # the replay is the run
    return [float(top2.values[0] - top2.values[1])]


@pytest.mark.parametrize("dtype", ["float32", "int4"])
def test_greedy_with_speculation_is_greedy_without(float_ckpt, tmp_path, dtype):
    if dtype == "int4":
        _, path = _one_lane_int4(tmp_path)
    else:
        path = float_ckpt[2]
    eng = load_engine(path, dtype=dtype)
    gen = torch.Generator().manual_seed(3)
    drafted = accepted = 0
    for trial in range(6):
        base = torch.randint(3, 256, (12,), generator=gen).tolist()
        prompt = base * 3 + base[:5]  # text that repeats: the lookup has something to find
        params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
        off, m_off = run(eng, prompt, params, "off")
        on, m_on = run(eng, prompt, params, "lookup")
        if on != off:  # only a near-tie of a verify that ran as a prefill chunk (float rounding) may decide otherwise
            gap = greedy_differences(eng, prompt, off, on)
            # int4: a chunk's rounding can move a row's 16-bit activation codes by one step, float32 only its sums
            assert gap[0] <= {"float32": 1e-4, "int4": 1e-3}[dtype], (trial, gap)
        assert m_off.speculative == "off" and m_off.draft_tokens == 0 and m_off.decode_steps == 39
        assert m_on.speculative == "lookup" and m_on.completion_tokens == 40
        assert m_on.decode_steps < 39 or m_on.accepted_tokens == 0
        assert m_on.decode_steps + m_on.accepted_tokens == 39  # every step gives one token plus what it kept
        drafted += m_on.draft_tokens
        accepted += m_on.accepted_tokens
    assert drafted > 0 and accepted > 0


def test_speculative_sampling_keeps_the_distribution():
    """The acceptance rule on fixed logits, 20,000 times: the first token follows p_0, and the second
    (after a kept first draft) follows p_1, each within 4.5 standard errors."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, 0.0, float("-inf")],
                           [0.1, 1.5, -0.5, 2.0, 0.0, 0.3],
                           [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]])
    params = SamplingParams(temperature=0.9, top_k=5).validate()
    p = process_logits(logits, params).softmax(-1).double()
    drafts = [1, 3]
    spec = Speculation("lookup", [0, 1, 2], params)
    gen = torch.Generator().manual_seed(5)
    first, second = torch.zeros(6, dtype=torch.float64), torch.zeros(6, dtype=torch.float64)
    N = 20000
    for _ in range(N):
        out = spec.accept(logits, drafts, gen)
        first[out[0]] += 1
        if out[0] == drafts[0]:
            second[out[1]] += 1
    for freq, want, n in ((first / N, p[0], N), (second / second.sum(), p[1], int(second.sum()))):
        se = (want * (1 - want) / n).sqrt()
        assert ((freq - want).abs() <= 4.5 * se + 1e-12).all(), (freq, want)
        assert (freq[want == 0] == 0).all()
    # p_0(1) = 0.20, p_1(3) = 0.51: (0.20 + 0.20 * 0.51) / 2 of the drafts are kept
    assert 0.12 < spec.accepted_tokens / spec.draft_tokens < 0.17


def test_draw_never_takes_a_token_without_probability():
    gen = torch.Generator().manual_seed(0)
    probs = torch.tensor([0.0, 0.3, 0.0, 0.7, 0.0])
    got = {draw(probs, gen) for _ in range(300)}
    assert got == {1, 3}


@pytest.fixture(scope="module")
def int4_default():
    from laneplay.kernels import lowbit

    if not lowbit.available():
        pytest.skip("the low-bit kernels are not built")
    return load_engine("smollm2-135m-instruct", dtype="int4")


EDIT = ("def total(prices, tax):\n    result = 0\n    for p in prices:\n        result += p * (1 + tax)\n"
        "    return result\n\n# The same function with the variable `result` renamed to `acc`:\n")


def test_default_model_greedy_edit_is_exact_and_speculates(int4_default):
    eng = int4_default
    params = SamplingParams(max_tokens=48, temperature=0.0)
    off, m_off = run(eng, EDIT, params, "off")
    for mode in ("lookup", "auto"):
        on, m_on = run(eng, EDIT, params, mode)
        assert on == off, mode
        assert m_on.decode_steps + m_on.accepted_tokens == m_off.decode_steps == 47, mode
    assert m_on.accepted_tokens > 0
    lookup = run(eng, EDIT, params, "lookup")[1]
    assert lookup.accepted_tokens >= 10 and lookup.decode_steps < m_off.decode_steps


def test_seeded_sampling_with_speculation_is_reproducible(int4_default):
    params = SamplingParams(max_tokens=32, temperature=0.8, seed=21)
    a, ma = run(int4_default, EDIT, params, "lookup")
    b, mb = run(int4_default, EDIT, params, "lookup")
    assert a == b and ma.draft_tokens == mb.draft_tokens > 0


def test_speculating_rows_in_a_batch_get_the_tokens_they_get_alone(int4_default):
    eng = int4_default
    reqs = [(EDIT, SamplingParams(max_tokens=40, temperature=0.0)),
            (EDIT + "def total(prices, tax):\n", SamplingParams(max_tokens=30, temperature=0.7, seed=3)),
            ("def fib(n):\n", SamplingParams(max_tokens=20, temperature=0.9, seed=2, n=2)),
            (EDIT, SamplingParams(max_tokens=20, temperature=0.0))]
    modes = ["lookup", "auto", "auto", "off"]

    import asyncio

    from laneplay.engine.scheduler import Scheduler
    from tests.engine.test_batching import _collect

    async def main():
        sched = Scheduler(eng)
        sched.start()
        try:
            jobs = []
            for (prompt, params), mode in zip(reqs, modes):
                ids, params = eng.prepare(prompt, params)
                jobs.append(sched.submit(ids, params, speculative=mode))
            return jobs, await asyncio.gather(*(_collect(j) for j in jobs))
        finally:
            sched.close()

    jobs, results = asyncio.run(main())
    for (prompt, params), mode, job, (toks, _) in zip(reqs, modes, jobs, results):
        assert job.outcome == "completed"
        want = {}
        for ev in eng.generate(prompt, params, speculative=mode):
            want.setdefault(ev.sample_index, []).extend(ev.token_ids)
        assert toks == want, mode
    assert jobs[0].finals[0].accepted_tokens > 0 and jobs[0].rows_per_step > 1  # it speculated, beside others
    assert jobs[2].finals[0].speculative == "off" and jobs[3].finals[0].draft_tokens == 0


def test_verifies_join_the_shared_step_and_auto_drafts_beside_others_while_they_are_kept(int4_default, monkeypatch):
    """On the fused low-bit path a verify's rows join the other requests' rows in one forward (at most
    STEP_ROWS in all) and give the tokens they give alone; where a verify cannot join it runs as a forward
    of its own. Beside other requests "auto" drafts while it keeps most of its drafts, "lookup" always."""
    import asyncio

    from laneplay.engine.batch import STEP_ROWS, share_rows
    from laneplay.engine.speculative import SOLO_DRAFTS, SOLO_ROWS
    from laneplay.engine.scheduler import Scheduler
    from tests.engine.test_batching import _collect

    eng = int4_default
    runner = eng.runner
    params = SamplingParams(max_tokens=40, temperature=0.0)
    alone = run(eng, EDIT, params, "auto")
    assert alone[1].draft_tokens > 0

    calls = {"groups": [], "verify": 0}
    decode_groups, verify = runner.decode_groups, runner.verify

    def counted_groups(tokens, groups):
        calls["groups"].append((tokens.shape[0], len({id(c) for _, c in groups})))
        return decode_groups(tokens, groups)

    def counted_verify(*a, **k):
        calls["verify"] += 1
        return verify(*a, **k)

    monkeypatch.setattr(runner, "decode_groups", counted_groups)
    monkeypatch.setattr(runner, "verify", counted_verify)

    async def main(modes):
        sched = Scheduler(eng)
        sched.start()
        try:
            ids, p = eng.prepare(EDIT, params)
            jobs = [sched.submit(ids, p, speculative=m) for m in modes]
            return jobs, await asyncio.gather(*(_collect(j) for j in jobs))
        finally:
            sched.close()

    jobs, results = asyncio.run(main(["lookup", "lookup", "lookup"]))
    assert all(toks == {0: alone[0]} for toks, _ in results)
    assert all(j.finals[0].accepted_tokens > 0 and j.rows_per_step > 1 for j in jobs)  # drafted, beside others
    assert calls["verify"] == 0 and all(rows <= STEP_ROWS for rows, _ in calls["groups"])
    assert any(rows > caches > 1 for rows, caches in calls["groups"])  # verify rows and others in one forward

    calls["groups"].clear()
    jobs, results = asyncio.run(main(["auto", "auto", "auto"]))
    assert all(toks == {0: alone[0]} for toks, _ in results)
    assert all(j.finals[0].accepted_tokens > 0 for j in jobs)  # the edit copies its code: kept drafts, beside others
    assert any(rows > caches > 1 for rows, caches in calls["groups"])

    # beside requests that do not draft, "auto" drafts a little while it keeps nearly all of its drafts (at
    # most SOLO_DRAFTS a step, in steps of SOLO_ROWS requests), and otherwise holds them back (and says so)
    assert SOLO_ROWS == (3, 4)
    calls["groups"].clear()
    jobs, results = asyncio.run(main(["auto", "off", "off"]))
    assert all(toks == {0: alone[0]} for toks, _ in results)
    solo, off = jobs[0].finals[0], jobs[1].finals[0]
    assert solo.accepted_tokens > 0 and off.draft_tokens == off.paused_steps == 0
    three = [rows for rows, caches in calls["groups"] if caches == 3]
    assert three and max(three) == 3 + SOLO_DRAFTS  # the others' rows, its own and its few drafts
    calls["groups"].clear()
    jobs, results = asyncio.run(main(["auto", "off"]))
    assert all(toks == {0: alone[0]} for toks, _ in results)
    assert jobs[0].finals[0].paused_steps > 0  # beside one other it holds its drafts back
    assert all(rows == 2 for rows, caches in calls["groups"] if caches == 2)

    monkeypatch.setattr(runner, "verify_joins", lambda pos, S, cache: False)
    jobs, results = asyncio.run(main(["lookup", "auto"]))
    assert all(toks == {0: alone[0]} for toks, _ in results)
    assert jobs[0].finals[0].draft_tokens > 0 and calls["verify"] > 0  # a verify of its own

    assert share_rows([5, 0, 2, 9], 6) == [2, 0, 2, 2] and share_rows([1, 1], 0) == [0, 0]
    assert share_rows([3, 1], 10) == [3, 1]


def test_a_kept_draft_that_ends_the_request_ends_the_verify_and_the_counts_add_up():
    spec = Speculation("lookup", [1, 2, 3], SamplingParams(temperature=0.0))
    drafts = [5, 2, 7]  # 2 is end-of-sequence
    logits = torch.full((4, 10), -5.0)
    for j, t in enumerate(drafts + [9]):
        logits[j, t] = 5.0  # the model agrees with every draft
    out = spec.accept(logits, drafts, torch.Generator(), eos={2})
    assert out == [5, 2] and spec.draft_tokens == 3 and spec.accepted_tokens == 1
    spec2 = Speculation("lookup", [1, 2, 3], SamplingParams(temperature=0.0))
    assert spec2.accept(logits, drafts, torch.Generator()) == [5, 2, 7, 9] and spec2.accepted_tokens == 3


@pytest.mark.parametrize("per_row", [True, False], ids=["row-by-row", "all-rows"])
def test_greedy_acceptance_reads_rows_up_to_the_first_rejection_and_counts_near_ties(monkeypatch, per_row):
    """On the host the top two come a row at a time and stop at the first rejected draft; elsewhere all
    rows at once. Both keep the same drafts, take the same correction and count the same near ties (top
    two within rounding) over the rows read."""
    import laneplay.engine.sampling as sampling

    if per_row and not sampling._top2_in_c(torch.zeros(1, 2)):
        pytest.skip("the low-bit kernels are not built here: the rows come from torch, all at once")
    monkeypatch.setattr(sampling, "_top2_in_c", lambda logits: per_row)
    gen = torch.Generator().manual_seed(4)
    for trial in range(40):
        k = 1 + trial % 6
        logits = torch.randn(k + 1, 300, generator=gen)
        best = logits.argmax(-1).tolist()
        cut = trial % (k + 1)  # drafts agree up to here
        drafts = [best[j] if j < cut else (best[j] + 1) % 300 for j in range(k)]
        tie = trial % 3 == 0  # a near tie in a row that is read
        if tie:
            logits[0, (best[0] + 7) % 300] = logits[0, best[0]] - 1e-7 * abs(float(logits[0, best[0]]))
        spec = Speculation("lookup", [1, 2, 3], SamplingParams(temperature=0.0))
        out = spec.accept(logits, drafts, torch.Generator())
        assert out == drafts[:cut] + [best[cut]]
        assert spec.accepted_tokens == cut and spec.draft_tokens == k
        assert spec.near_ties == int(tie)


def test_auto_drafts_on_a_one_token_match_only_where_a_verify_row_is_cheap(int4_default, default_engine, kernel):
    """On the AMX tiles a verify row costs ~0.15-0.2 of a decode step and a one-token match's draft (kept about
    a quarter of the time) pays; with the VNNI and AVX2 kernels a row costs 0.37 or more, and "auto" takes
    none there. The float path reads its weights once for all rows."""
    params = SamplingParams(temperature=0.0)
    assert plan("auto", int4_default.runner, [1, 2, 3], params).control.one_token == (kernel == "amx")
    assert plan("auto", default_engine.runner, [1, 2, 3], params).control.one_token
    assert plan("lookup", int4_default.runner, [1, 2, 3], params).control.want(1) == K_MAX
