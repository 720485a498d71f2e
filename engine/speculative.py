"""Speculative decoding by prompt lookup: drafts from the text already there, verified in one step.

Code edits ("add type hints", "rename this variable", "fix the bug on line 3") mostly copy text that
is already in the prompt. `Lookup` finds the most recent earlier occurrence of the sequence's last n
tokens (prompt and output so far, n = 4, 3, 2, then 1), measures how far back that match goes (its
length m, up to MATCH_MAX), and proposes the tokens that followed it. The last token and up to k
drafts go through one multi-token forward over the KV cache (`LaneModel.verify`); the longest prefix
the model agrees with is kept, plus the model's own next token, and the rejected positions' K/V are
rolled back (`model.Rewind`).

How many drafts: a verify row costs ROW_COST of a decode step, so a draft pays where its chance of
being kept is above that. The match length predicts it well: over the HumanEval edit corpus of
`laneplay bench spec` on the embedded default, a one-token match's first draft was kept 25% of the
time, a two-token match's 46%, and from three tokens on the first draft was kept 80-95% of the time
and the eighth 33-68%. So "auto" drafts one token on a one-token match (while it keeps ONE_KEEP of its
drafts lately), 2 tokens on a match of two, 2m (up to AUTO_MAX) on a longer one, and AUTO_LONG from
LONG_MATCH tokens on ("lookup" drafts up to K_MAX on every match), and `Controller` caps that
by the request's recent acceptance: K_MAX at first and while every draft is kept, falling to what was
kept plus one (or half, if more) when one is not, doubling again on a verify that keeps all. Plain
completion then seldom drafts and never pays much for it. Replayed over the corpus's greedy tokens with
verify costs measured on the 2-core host, these counts beat the earlier ones (2 drafts on a match of
three and up to K_MAX on longer ones) by 8% on edits with the AMX tiles' costs and 1.5% with the VNNI
kernel's, and are within 1% on plain completions (AUTO_MAX).

Exactness: greedy keeps a draft token only where it is the argmax, so the tokens are the plain
greedy ones wherever the verify's logits equal a decode step's (bit for bit on the one-lane low-bit
path, within float rounding elsewhere). Sampling uses the speculative-sampling rule for a point-mass
draft: keep draft x with probability p(x), else draw from p with x removed and renormalised; the
token kept is then distributed exactly as p, so the output distribution is the plain one.

Nothing here reads a clock: a request's tokens depend only on its own history, so it gets the same
tokens alone and in a batch, and a seeded request is reproducible.
"""
from __future__ import annotations

import torch
from torch import Tensor

from laneplay.engine.sampling import SamplingParams, is_greedy, process_logits, top_two_rows

MODES = ("auto", "off", "lookup")
NGRAMS = (4, 3, 2, 1)  # n-gram lengths looked up, longest first
MATCH_MAX = 16  # how far back a match's length is measured
# Drafts per verify: where a request starts, and the most. A verify of K_MAX + 1 = 16 rows fits one shared
# step (engine.batch.STEP_ROWS) and stays far below the rows from which a product is a float GEMM
# (kernels.lowbit.gemm_min_rows), so every verify row's logits stay bit for bit a decode step's.
K_START = K_MAX = 15
# What a verify of S rows costs in one-token decode steps is about 1 + ROW_COST * (S - 1): measured on the
# embedded default, CPU int4, 2 cores with AVX-512 VNNI (1 row 6.2 ms, 4 rows 12.1 ms, 9 rows 25.4 ms, 16
# rows 46 ms: the integer products are arithmetic-bound). On the AMX tiles a row costs ~0.12-0.2 up to 8 rows
# and a second tile chunk from the 9th (1.42-1.54, 2.12-2.35 and 3.65-3.95 steps at S = 4, 8, 16 on Sapphire
# Rapids, 2 cores); replayed over the edit corpus, a rule that picks the draft count from such costs and
# per-match-length acceptance drafted no better than the match-length rule here (1.64x against 1.63x), so
# the rule does not depend on the kernel.
ROW_COST = 0.37
# Beside other requests every draft row makes the step dearer for all of them, so "auto" drafts there only
# while the request keeps at least SHARED_KEEP of its drafts (kept_share, each verify weighing SHARE_DECAY
# of the next), and freely only in a step where every request drafts (engine.batch.decode_step). Measured on the
# embedded default (int4, 2 cores, 128 greedy tokens each, all at once, against plain rows beside others):
# four copies of a prompt that keeps 97% of its drafts finished in 0.69-0.71x the time, four of one keeping
# 88% in 0.81-0.83x, eight of it in 0.93-0.97x; four and eight separate prompts in 0.92-0.96x and 0.99-1.06x.
SHARED_KEEP, SHARE_DECAY = 0.7, 0.75
# A one-token match's draft is kept about a quarter of the time in code (a verify of 2 rows costs ~1.16
# decode steps on the default model's AMX tiles), so "auto" drafts one there while it keeps at least
# ONE_KEEP of its drafts lately, where verify rows are cheap (Controller.want, dear_rows), and alone (beside
# other requests every row costs them too, and such drafts would pull kept_share down): interleaved on
# the bench's corpora, against no draft there, edits 1.03-1.04x and plain completions 1.06-1.07x (median
# per prompt, Sapphire Rapids, 2 cores).
ONE_KEEP = 0.3
# In a step where some request does not draft, an "auto" request that keeps at least SOLO_KEEP of its drafts
# lately still drafts, at most SOLO_DRAFTS, while the step holds SOLO_ROWS requests' rows (from, to): its few
# draft rows are nearly all kept, so the others' steps carry hardly any row that gives no token, and it
# finishes sooner, which makes the others' later steps a row cheaper; the others hold theirs back
# (engine.batch.decode_step). Against holding every draft back (interleaved runs, int4, 2 cores): four separate
# prompts at once (two keep 86-97% of their drafts alone), those two finished in 0.62-0.78x the time, the
# other two in 0.96-0.99x; three, the repetitive one in 0.66x, the others 0.97-0.98x. Beside 8 requests the
# others took 1.07-1.10x, and beside one 1.05-1.08x (a 2-row step's extra rows are its dearest, and the one
# that finishes sooner leaves one row to save), hence SOLO_ROWS.
SOLO_KEEP, SOLO_DRAFTS, SOLO_ROWS = 0.9, 2, (3, 4)


# The most drafts "auto" verifies: a verify of AUTO_MAX + 1 = 8 rows is one chunk on the AMX tiles (8 rows with
# their rests in 16 tile rows), and the 9th starts a second one (measured on the embedded default, 2 cores:
# 8 rows 2.1-2.4 decode steps, 9 rows 2.7-3.1), while the eighth draft of a match of 3-5 tokens is kept only
# 33-68% of the time; from a match of LONG_MATCH tokens on, where drafts are kept 90-97% of the time, a
# second chunk pays: AUTO_LONG drafts. Replayed over the edit corpus with the costs of nine bench runs on
# the tiles (mean over the runs): a cap of 7 on every match 1.78x, of 11 1.71x, of 15 1.67x (the rule
# before, 2 drafts on a three-token match and up to 15: 1.68x); 11 from a 12-token match on 1.81x (from 16
# tokens 1.80x, 15 drafts from 12 1.78x). With the VNNI kernel's costs 1.35x against the rule before's
# 1.33x; plain completions within 1% everywhere.
AUTO_MAX, AUTO_LONG, LONG_MATCH = 7, 11, 12


def trusted(m: int) -> int:
    """How many drafts a match of m tokens is worth in "auto" (see the module's docstring)."""
    if m >= LONG_MATCH:
        return AUTO_LONG
    return 0 if m < 1 else 1 if m == 1 else 2 if m == 2 else min(AUTO_MAX, 2 * m)


def check_mode(mode) -> str:
    if mode not in MODES:
        raise ValueError(f"speculative must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


class Lookup:
    """The n-gram index of one sequence: for each n in NGRAMS, every n-gram that has a continuation,
    mapped to where its most recent continuation starts."""

    def __init__(self, ids: list[int], ngrams: tuple[int, ...] = NGRAMS):
        self.ngrams = ngrams
        self.tokens: list[int] = []
        self.index: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in ngrams}
        self.extend(ids)

    def extend(self, ids: list[int]) -> None:
        toks = self.tokens
        for t in ids:
            j = len(toks)  # t starts at j: it continues the n-grams that end just before it
            for n in self.ngrams:
                if j >= n:
                    self.index[n][tuple(toks[j - n:j])] = j
            toks.append(t)

    def draft(self, k: int) -> tuple[list[int], int]:
        """(up to k tokens that followed the most recent occurrence of the sequence's last n tokens, n the
        longest that occurs before; the match's length m: how many tokens before that occurrence's
        continuation equal the sequence's last m, at most MATCH_MAX). ([], 0) when nothing repeats."""
        toks = self.tokens
        for n in self.ngrams:
            if len(toks) < n:
                continue
            start = self.index[n].get(tuple(toks[-n:]))
            if start is not None:
                m = n
                while m < MATCH_MAX and start - 1 - m >= 0 and toks[start - 1 - m] == toks[-1 - m]:
                    m += 1
                return toks[start:start + k], m
        return [], 0


class Controller:
    """How many drafts to verify next, from what the recent verifies kept: doubling while every draft
    is kept, falling to what was kept plus one (or half, if more) when one is not. It also keeps the
    share of drafts kept lately (`kept_share`: kept over drafted, each verify weighing SHARE_DECAY of
    the one after it), which decides whether "auto" drafts beside other requests."""

    def __init__(self, mode: str, one_token: bool = True):
        self.auto = mode == "auto"
        self.one_token = one_token  # "auto" may draft on a one-token match (where a verify row is cheap)
        self.k = K_START
        self._kept = self._drafted = 1.0  # no verify yet: drafts are trusted until one is seen

    @property
    def kept_share(self) -> float:
        return self._kept / self._drafted

    def want(self, m: int) -> int:
        """Drafts for a match of m tokens (0: a plain step). "auto" drafts on a one-token match only while
        it keeps at least ONE_KEEP of its drafts lately: in text that does not repeat itself such a draft
        is seldom kept, and it stops there."""
        if m < 1:
            return 0
        if not self.auto:
            return self.k
        if m == 1 and (not self.one_token or self.kept_share < ONE_KEEP):
            return 0
        return min(self.k, trusted(m))

    def record(self, drafted: int, kept: int) -> None:
        self.k = min(K_MAX, 2 * self.k) if kept == drafted else max(1, kept + 1, self.k // 2)
        self.observe(drafted, kept)

    def observe(self, drafted: int, kept: int) -> None:
        """Drafts checked against the tokens that came (verified, or only looked at beside a plain step)."""
        self._kept = SHARE_DECAY * self._kept + kept
        self._drafted = SHARE_DECAY * self._drafted + drafted


class Speculation:
    """One request's speculation: its lookup, controller, and counts. `reason` says why it is off."""

    def __init__(self, mode: str, ids: list[int], params: SamplingParams, reason: str | None = None,
                 one_token: bool = True):
        self.mode = check_mode(mode)
        if reason is None and mode == "off":
            reason = "off by request"
        if reason is None and params.n != 1:
            reason = "n > 1: the samples of one request share a position"
        if reason is None and params.adjusts_logits:
            # penalties and bias change each position's distribution by the tokens before it: these
            # requests take one token per step (logprobs come from the verify's logits per position)
            reason = "penalties and logit_bias take one token per step"
        one = params.for_sample(0) if params.n == 1 else params
        self.greedy = is_greedy(one.temperature, one.top_k)
        if reason is None and mode == "auto" and not self.greedy:
            # sampling stays exact in distribution, but a seed then draws other tokens than it does in a
            # request of n samples; "auto" keeps a seeded sample the same at any n, "lookup" trades that away
            reason = "auto speculates greedy requests only (a seeded sample keeps its tokens at any n)"
        self.reason = reason
        self.active = reason is None
        self.params = one
        self.lookup = Lookup(ids) if self.active else None
        self.control = Controller(mode, one_token)
        self._shadow = None  # the first draft a shared step left out, checked against the token that came
        self.draft_tokens = self.accepted_tokens = 0
        self.verify_steps = 0
        self.steps = 0  # decode steps after the first token: plain steps and verifies
        self.near_ties = 0  # greedy tokens a verify decided where its top two logits were within rounding
        # Shared steps in which the sharing rule held this request's drafts back ("auto" beside other
        # requests: it keeps too few lately, or another request in the step does not draft), and whether
        # the last step that could have drafted was one: the meter says speculation is paused meanwhile.
        self.paused_steps = 0
        self.paused = False

    @property
    def label(self) -> str:
        return "lookup" if self.active else "off"

    COUNTS = ("active", "reason", "draft_tokens", "accepted_tokens", "verify_steps", "steps", "near_ties",
              "paused_steps", "paused")

    def counts(self) -> dict:
        """Whether it ran (and why not) and its counts: what a DTP rank 0 sends the front with each step."""
        return {k: getattr(self, k) for k in self.COUNTS}

    def take_counts(self, counts: dict | None) -> None:
        """The front's copy of the speculation the ranks ran (`counts`)."""
        for k, v in (counts or {}).items():
            if k in self.COUNTS:
                setattr(self, k, v)

    def drafts(self, room: int, shared: bool = False) -> list[int]:
        """Drafts for the next step (empty: a plain step). room: how many more tokens the request may
        produce after the next one, and how many drafts the KV cache's rings can take back. shared: other
        requests' rows are in the step; then "auto" drafts only while it keeps SHARED_KEEP of its drafts,
        and otherwise notes whether its first draft would have been kept (so drafting resumes where the
        text repeats again)."""
        self._shadow = None
        if not shared:
            self.paused = False
        if not self.active or room < 1:
            return []
        drafts, m = self.lookup.draft(K_MAX)
        if shared and m == 1 and self.control.auto:
            return []  # a one-token match's draft pays alone only: beside others every row costs them too
        drafts = drafts[:min(self.control.want(m), room)]
        if shared and self.control.auto and drafts and self.control.kept_share < SHARED_KEEP:
            self.hold(drafts[0])
            return []
        return drafts

    def hold(self, shadow: int | None = None) -> None:
        """This shared step runs the request's row plain although it had drafts (the sharing rule); shadow:
        the first of them, checked against the token that comes (`produced`), so the share of drafts kept
        lately follows the text while the request does not draft."""
        self.paused_steps += 1
        self.paused = True
        if shadow is not None:
            self._shadow = shadow

    def produced(self, tokens: list[int]) -> None:
        """Tokens the request produced (plain steps and verifies), in order."""
        if self.active:
            if self._shadow is not None:
                self.control.observe(1, int(tokens[0] == self._shadow))
                self._shadow = None
            self.lookup.extend(tokens)

    def accept(self, logits: Tensor, drafts: list[int], generator: torch.Generator, eos=()) -> list[int]:
        """The verify's logits [k + 1, V] for the drafts [k]: the kept drafts, then one token of the model's
        own (a correction, or after k kept drafts the next token), cut after the first of `eos` (the request
        ends there; a kept draft that ends it counts as that step's own token, so decode steps plus accepted
        tokens stay the tokens after the first). Updates the counts and the controller."""
        k = len(drafts)
        if self.greedy:
            # the rows up to the first whose argmax is not its draft; on the host the rows after it are
            # never read (~0.05 ms a row on the default model's 49,152 logits)
            kept = 0
            for best, v0, v1 in top_two_rows(logits.float()):
                self.near_ties += int(abs(v0 - v1) <= 1e-5 * max(abs(v0), 1.0))
                if kept == k or best != drafts[kept]:
                    break
                kept += 1
            out = drafts[:kept] + [best]
        else:
            probs = process_logits(logits.float(), self.params).softmax(-1)
            out = []
            for j, x in enumerate(drafts):
                p = probs[j]
                u = torch.rand(1, generator=generator, dtype=torch.float64, device=p.device)
                if float(u) < float(p[x]):  # kept with probability p(x)
                    out.append(x)
                    continue
                rest = p.clone()
                rest[x] = 0.0  # the residual max(p - q, 0) of a point-mass draft q at x, renormalised by the draw
                out.append(draw(rest, generator))
                break
            else:
                out.append(draw(probs[k], generator))
            kept = len(out) - 1
        self.control.record(k, kept)
        end = next((j for j, t in enumerate(out) if t in eos), None)
        if end is not None:
            out = out[:end + 1]
        self.draft_tokens += k
        self.accepted_tokens += len(out) - 1
        self.verify_steps += 1
        self.paused = False
        return out


def draw(probs: Tensor, generator: torch.Generator) -> int:
    """One token from the (unnormalised) distribution probs [V], by inverting its cumulative sum at one
    uniform number; a token of probability 0 is never drawn."""
    cdf = probs.double().cumsum(-1)
    u = torch.rand(1, generator=generator, dtype=torch.float64, device=probs.device)
    tok = int(torch.searchsorted(cdf, u * cdf[-1], right=True))
    if tok >= probs.shape[-1]:  # u * total rounded up to the total: the last token with any probability
        tok = int(torch.nonzero(probs > 0).max())
    return tok


def note(metrics, spec: Speculation | None) -> None:
    """Copy a request's speculation into its sample's metrics (what the API and the meter report)."""
    if spec is None:
        return
    metrics.speculative, metrics.speculative_reason = spec.label, spec.reason
    metrics.draft_tokens, metrics.accepted_tokens = spec.draft_tokens, spec.accepted_tokens
    metrics.decode_steps = spec.steps if spec.active else max(0, metrics.completion_tokens - 1)
    metrics.paused_steps, metrics.speculation_paused = spec.paused_steps, spec.paused


def plan(mode: str, runner, ids: list[int], params: SamplingParams) -> Speculation:
    """The speculation a request gets on this runner: on, or off with the reason."""
    mode = check_mode(mode)
    reason = None
    if mode != "off" and not (hasattr(runner, "verify") or getattr(runner, "speculates", False)):
        reason = "this runner has no verify step"
    return Speculation(mode, ids, params, reason, one_token=not dear_rows(runner))


def dear_rows(runner) -> bool:
    """Whether a verify row costs much of a decode step on this runner: the low-bit CPU kernels without AMX
    tiles (a row ~0.37 of a step with VNNI, more with AVX2, against 0.15-0.2 on the tiles; the float and
    CUDA paths read the weights once for all rows). There a one-token match's draft, kept about a quarter of
    the time, does not pay, and "auto" takes none."""
    if not getattr(getattr(runner, "model", None), "lowbit", False):
        return False
    from laneplay.kernels import lowbit

    return lowbit.kernel_name() != "amx"


def room(spec: Speculation, produced: int, max_tokens: int, cache) -> int:
    """How many drafts the next verify may carry: the tokens still allowed after the next one, and no
    more positions than the smallest ring holds (the rewind writes each slot once). cache None: the
    request's KV is in the static step's cache, whose rings hold K_MAX slots beyond the window."""
    return min(max_tokens - produced - 1, min(cache.slots) - 1 if cache is not None else K_MAX, K_MAX)
