"""Sampling parameters and the one sampling function (penalties and bias, then greedy, temperature, top-k,
top-p, min-p), and the log-probabilities a request may ask for.

Each sample of a request owns a `torch.Generator` seeded from (request seed, sample index), so a
sample is reproducible on its own and independent of the others in its batch, and the DTP runtime
(which samples on rank 0 from gathered logits) draws exactly the same tokens. A request may also give
each sample its own temperature, top-p, top-k, min-p and seed (`SamplingParams.samples`); rows with the
same settings are still sampled as one batch.

Before any of that, each row's logits are adjusted, in this order (vLLM's): `logit_bias` is added (token id ->
bias); `repetition_penalty` r (transformers' / llama.cpp's / vLLM's multiplicative form) divides the positive
logits and multiplies the negative ones of every token in the prompt or the output so far; then
`frequency_penalty` f and `presence_penalty` p (OpenAI's definitions) subtract `f * count + p * (count > 0)`,
count being how often the token occurs in this row's output so far. Greedy rows take the argmax of the
adjusted logits. The history the penalties read lives in a `TokenHistory` per request (the runner keeps it
beside the generators, in `RowSampler`), so a row's tokens do not depend on its batch.

Log-probabilities (`logprobs`) are OpenAI's: the model's log-softmax over the whole vocabulary of the raw
logits, before bias, penalties, temperature and truncation -- what the model thinks of each token, not the
distribution the token was drawn from.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field, replace

import torch
from torch import Tensor

from laneplay.engine.errors import ParameterError
from laneplay.kernels import lowbit
from laneplay.limits import (MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_TOKENS, MAX_N, MAX_PENALTY, MAX_REPETITION_PENALTY,
                             MAX_SEED, MAX_STOP_LENGTH, MAX_STOP_STRINGS, MAX_TEMPERATURE, MAX_TOP_LOGPROBS,
                             MIN_PENALTY, MIN_TEMPERATURE)

# Temperatures below this are greedy: dividing by them would overflow float32 (1e-38 is inf), and the
# distribution they describe is already the argmax to within float precision.
GREEDY_TEMPERATURE = 1e-5
# what one sample of a batch may set
SAMPLE_KEYS = ("temperature", "top_p", "top_k", "min_p", "seed", "frequency_penalty", "presence_penalty",
               "repetition_penalty")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_num(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # not NaN


# (name, accepts, what an accepted value is): shared by a request's and each sample's settings.
_RULES = (
    ("temperature", lambda v: _is_num(v) and MIN_TEMPERATURE <= v <= MAX_TEMPERATURE,
     f"must be in [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]"),
    ("top_p", lambda v: _is_num(v) and 0 < v <= 1, "must be in (0, 1]"),
    ("top_k", lambda v: _is_int(v) and v >= 0, "must be an integer >= 0 (0 = off)"),
    ("min_p", lambda v: _is_num(v) and 0 <= v <= 1, "must be in [0, 1]"),
    ("seed", lambda v: v is None or (_is_int(v) and 0 <= v <= MAX_SEED), "must be an integer in [0, 2^63)"),
    ("frequency_penalty", lambda v: _is_num(v) and MIN_PENALTY <= v <= MAX_PENALTY,
     f"must be in [{MIN_PENALTY:g}, {MAX_PENALTY:g}]"),
    ("presence_penalty", lambda v: _is_num(v) and MIN_PENALTY <= v <= MAX_PENALTY,
     f"must be in [{MIN_PENALTY:g}, {MAX_PENALTY:g}]"),
    ("repetition_penalty", lambda v: _is_num(v) and 0 < v <= MAX_REPETITION_PENALTY,
     f"must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = off)"),
)


def is_greedy(temperature: float, top_k: int) -> bool:
    return temperature < GREEDY_TEMPERATURE or top_k == 1


@dataclass
class SampleSettings:
    """One sample's own settings in a batch; None inherits the request's value (a seed: request seed + index)."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None  # 0 = off
    min_p: float | None = None  # 0 = off
    seed: int | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    repetition_penalty: float | None = None


@dataclass
class SamplingParams:
    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0  # 0 = off
    seed: int | None = None  # None: a fresh random seed, reported in the metrics
    stop: list[str] = field(default_factory=list)
    n: int = 1
    ignore_eos: bool = False
    frequency_penalty: float = 0.0  # OpenAI's: minus f x (times the token occurs in the output so far)
    presence_penalty: float = 0.0  # OpenAI's: minus p once the token occurs in the output
    repetition_penalty: float = 1.0  # multiplicative, over prompt + output (1 = off)
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit (request-wide)
    logprobs: int | None = None  # None: none; k >= 0: each token's log-probability and its k most likely alternatives
    # Per-sample settings (sample i is samples[i]); n is then len(samples). max_tokens, stop, ignore_eos stay shared.
    samples: list[SampleSettings] | None = None

    def __post_init__(self):
        # Plain dicts (JSON, or `asdict` on the way to the DTP ranks) become SampleSettings again; anything
        # else is left for validate() to name. n follows the list unless it was set.
        if isinstance(self.samples, (list, tuple)):
            self.samples = [SampleSettings(**s) if isinstance(s, dict) and set(s) <= set(SAMPLE_KEYS) else s
                            for s in self.samples]
            if self.n == 1 and self.samples:
                self.n = len(self.samples)

    def validate(self) -> "SamplingParams":
        """Raise ParameterError (a ValueError) with a clear sentence for any out-of-range value; returns self."""
        def need(cond, msg, param):
            if not cond:
                raise ParameterError(msg, param)

        need(_is_int(self.max_tokens) and self.max_tokens >= 1, f"max_tokens must be an integer >= 1, got {self.max_tokens!r}", "max_tokens")
        for name, ok, what in _RULES:
            value = getattr(self, name)
            need(ok(value), f"{name} {what}, got {value!r}", name)
        if self.samples is not None:
            got = f"{len(self.samples)} of them" if isinstance(self.samples, list) else repr(self.samples)
            need(isinstance(self.samples, list) and 1 <= len(self.samples) <= MAX_N,
                 f"samples must be a list of 1 to {MAX_N} sample settings, got {got}", "samples")
        need(_is_int(self.n) and 1 <= self.n <= MAX_N, f"n must be an integer in [1, {MAX_N}], got {self.n!r}", "n")
        for i, s in enumerate(self.samples or []):
            if isinstance(s, dict):  # __post_init__ kept it: a key that is not a sample setting
                unknown = sorted(map(str, set(s) - set(SAMPLE_KEYS)))
                need(False, f"samples[{i}] has unknown key(s) {unknown}; allowed: {', '.join(SAMPLE_KEYS)}", f"samples[{i}]")
            need(isinstance(s, SampleSettings), f"samples[{i}] must be an object of sample settings, got {s!r}", f"samples[{i}]")
            for name, ok, what in _RULES:
                value = getattr(s, name)
                need(value is None or ok(value), f"samples[{i}].{name} {what}, got {value!r}", f"samples[{i}].{name}")
        need(self.samples is None or self.n == len(self.samples),
             f"n ({self.n}) must equal the number of samples ({len(self.samples or [])}); leave n out when giving samples", "n")
        if self.logit_bias is not None:
            bias = self.logit_bias
            need(isinstance(bias, dict) and len(bias) <= MAX_LOGIT_BIAS_TOKENS,
                 f"logit_bias must be an object of at most {MAX_LOGIT_BIAS_TOKENS} token id -> bias entries", "logit_bias")
            for tok, b in bias.items():
                need(_is_int(tok) and tok >= 0, f"logit_bias keys must be token ids (integers >= 0), got {tok!r}", "logit_bias")
                need(_is_num(b) and -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS,
                     f"logit_bias values must be in [{-MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], got {b!r} for token {tok}", "logit_bias")
        need(self.logprobs is None or (_is_int(self.logprobs) and 0 <= self.logprobs <= MAX_TOP_LOGPROBS),
             f"logprobs must be an integer in [0, {MAX_TOP_LOGPROBS}], got {self.logprobs!r}", "logprobs")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        need(isinstance(self.stop, (list, tuple)) and len(self.stop) <= MAX_STOP_STRINGS,
             f"stop must be a list of at most {MAX_STOP_STRINGS} strings", "stop")
        need(all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_LENGTH for s in self.stop),
             f"each stop string must be a non-empty string of at most {MAX_STOP_LENGTH} characters", "stop")
        self.stop = list(self.stop)
        return self

    def settings(self) -> list[tuple[float, float, int, float]]:
        """(temperature, top_p, top_k, min_p) of each of the n samples; unset per-sample values are the request's."""
        own = (self.temperature, self.top_p, self.top_k, self.min_p)
        if not self.samples:
            return [own] * self.n
        return [tuple(mine if mine is not None else req for mine, req in
                      zip((s.temperature, s.top_p, s.top_k, s.min_p), own)) for s in self.samples]

    def penalties(self) -> list[tuple[float, float, float]]:
        """(frequency_penalty, presence_penalty, repetition_penalty) of each of the n samples."""
        own = (self.frequency_penalty, self.presence_penalty, self.repetition_penalty)
        if not self.samples:
            return [own] * self.n
        return [tuple(mine if mine is not None else req for mine, req in
                      zip((s.frequency_penalty, s.presence_penalty, s.repetition_penalty), own)) for s in self.samples]

    @property
    def adjusts_logits(self) -> bool:
        """Some row's logits are changed before sampling (bias or a penalty)."""
        return bool(self.logit_bias) or any(f or p or r != 1 for f, p, r in self.penalties())

    def for_sample(self, i: int) -> "SamplingParams":
        """Sample i's settings as the params of a request of its own (n=1, no per-sample list, request seed)."""
        if not self.samples:
            return replace(self, n=1)
        t, p, k, m = self.settings()[i]
        f, pr, r = self.penalties()[i]
        return replace(self, temperature=t, top_p=p, top_k=k, min_p=m, frequency_penalty=f, presence_penalty=pr,
                       repetition_penalty=r, n=1, samples=None)

    @property
    def greedy(self) -> bool:
        """Every sample decodes greedily (temperature below GREEDY_TEMPERATURE, or top_k 1)."""
        if not self.samples:
            return is_greedy(self.temperature, self.top_k)
        return all(is_greedy(t, k) for t, _, k, _ in self.settings())


def sample_seeds(params: SamplingParams) -> list[int]:
    """One seed per sample: sample i of a request with seed s uses seed s + i, unless it names its own."""
    base = params.seed if params.seed is not None else secrets.randbelow(2**62)
    own = [s.seed for s in params.samples] if params.samples else [None] * params.n
    return [seed if seed is not None else (base + i) % (MAX_SEED + 1) for i, seed in enumerate(own)]


def make_generators(seeds: list[int], device) -> list[torch.Generator]:
    return [torch.Generator(device=device).manual_seed(s) for s in seeds]


def process_logits(logits: Tensor, params: SamplingParams) -> Tensor:
    """Temperature, then top-k, top-p and min-p as -inf masks. logits [B, V] float32.

    Every row keeps at least its largest logit finite, so the softmax of the result is a distribution
    for any accepted parameters and any logits (huge, -inf, ties; NaN counts as -inf, +inf as the
    largest finite float): the row's maximum is subtracted before dividing by the temperature.
    """
    big = torch.finfo(logits.dtype).max
    logits = torch.nan_to_num(logits, nan=float("-inf"), posinf=big, neginf=float("-inf"))
    top = logits.max(-1, keepdim=True).values
    dead = ~torch.isfinite(top)  # a row of only -inf: every token equally likely
    logits = torch.where(dead, torch.zeros_like(logits), logits)
    top = torch.where(dead, torch.zeros_like(top), top)
    logits = (logits - top) / params.temperature  # <= 0, and 0 at the maximum: nothing overflows upwards
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        logits = logits.masked_fill(_top_p_drop(logits, params.top_p), float("-inf"))
    if params.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits


# Candidates ranked first for top-p: the nucleus almost always lies within them, so the whole vocabulary
# (49k tokens for the default model) is not sorted for every token; when it does not, 8x more.
TOP_P_CANDIDATES = 256


def _top_p_drop(logits: Tensor, top_p: float) -> Tensor:
    """Where top-p drops a token: when the tokens ranked above it already hold top_p of the mass (the
    most likely token always stays, since top_p may round to 0 in float32). On the CPU ranks only the
    first TOP_P_CANDIDATES tokens (8x more, up to the whole row, until the cut lies within them for
    every row): everything ranked below a dropped token is dropped too."""
    V = logits.shape[-1]
    probs = logits.softmax(-1)
    # On a GPU the whole sort is cheap, and testing whether the candidates suffice would cost a host sync.
    k = min(V, TOP_P_CANDIDATES) if logits.device.type == "cpu" else V
    while True:
        ranked, order = torch.topk(probs, k, dim=-1)  # descending
        drop_ranked = (ranked.cumsum(-1) - ranked) >= top_p
        drop_ranked[..., 0] = False
        if k == V or bool(drop_ranked[..., -1].all()):
            break
        k = min(V, 8 * k)
    return torch.ones_like(logits, dtype=torch.bool).scatter(-1, order, drop_ranked)


class TokenHistory:
    """What the penalties read, per row of one request: the tokens seen in prompt + output (repetition_penalty)
    and how often each occurs in the output (frequency_penalty, presence_penalty). Only what the request's
    penalties need is kept; the tensors ([rows, vocab]) are made at the first step, where the logits' width
    and device are known, and updated on device (no host sync)."""

    def __init__(self, params: SamplingParams, prompt_ids: list[int]):
        pens = params.penalties()
        self.prompt = list(prompt_ids)
        self.wants_seen = any(r != 1 for _, _, r in pens)
        self.wants_counts = any(f or p for f, p, _ in pens)
        self.seen: Tensor | None = None  # bool [n, V]
        self.counts: Tensor | None = None  # float32 [n, V]

    def ready(self, logits: Tensor) -> "TokenHistory":
        n, V = logits.shape
        if self.wants_seen and self.seen is None:
            self.seen = torch.zeros(n, V, dtype=torch.bool, device=logits.device)
            ids = torch.tensor([t for t in self.prompt if 0 <= t < V], dtype=torch.long, device=logits.device)
            self.seen[:, ids] = True
        if self.wants_counts and self.counts is None:
            self.counts = torch.zeros(n, V, dtype=torch.float32, device=logits.device)
        return self

    def add(self, tokens: Tensor) -> None:
        """One new token per row (tokens [n])."""
        rows = torch.arange(tokens.shape[0], device=tokens.device)
        if self.seen is not None:
            self.seen[rows, tokens] = True
        if self.counts is not None:
            self.counts[rows, tokens] += 1


def adjust_logits(logits: Tensor, params: SamplingParams, history: TokenHistory | None) -> Tensor:
    """logit_bias, then repetition, frequency and presence penalties, row by row (row b is sample b of
    `params`). logits [n, V] -> float32 [n, V] (a new tensor)."""
    logits = logits.float().clone()
    V = logits.shape[-1]
    if params.logit_bias:
        items = [(t, b) for t, b in params.logit_bias.items() if t < V]
        ids = torch.tensor([t for t, _ in items], dtype=torch.long, device=logits.device)
        logits[:, ids] += torch.tensor([float(b) for _, b in items], dtype=torch.float32, device=logits.device)
    if history is None:
        return logits
    history.ready(logits)
    pens = params.penalties()
    column = lambda values: torch.tensor(values, dtype=torch.float32, device=logits.device).unsqueeze(-1)  # noqa: E731
    if history.seen is not None:
        r = column([r for _, _, r in pens])
        logits = torch.where(history.seen, torch.where(logits > 0, logits / r, logits * r), logits)
    if history.counts is not None:
        counts = history.counts
        logits = logits - column([f for f, _, _ in pens]) * counts - column([p for _, p, _ in pens]) * (counts > 0)
    return logits


def sample(logits: Tensor, params: SamplingParams, generators: list[torch.Generator],
           history: TokenHistory | None = None) -> Tensor:
    """Next token per row. logits [B, V] -> [B] (greedy when temperature is 0).

    Bias and penalties first (`adjust_logits`; the penalties read `history`, which the caller updates with
    the tokens). With per-sample settings (B == len(params.samples)), rows that share settings are
    processed as one batch and greedy rows take the argmax; each row draws with its own generator, so a
    row's token is the one it would get alone.
    """
    if params.adjusts_logits:
        logits = adjust_logits(logits, params, history)
    if not params.samples:
        return _sample_rows(logits, params, generators)
    groups: dict[tuple, list[int]] = {}
    for b, (t, p, k, m) in enumerate(params.settings()):
        groups.setdefault(("greedy",) if is_greedy(t, k) else (t, p, k, m), []).append(b)
    if len(groups) == 1:
        return _sample_rows(logits, params.for_sample(0), generators)
    out = torch.empty(logits.shape[0], dtype=torch.long, device=logits.device)
    for rows in groups.values():
        idx = torch.tensor(rows, device=logits.device)
        out[idx] = _sample_rows(logits[idx], params.for_sample(rows[0]), [generators[b] for b in rows])
    return out


def token_logprobs(logits: Tensor, tokens: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor]:
    """The log-probability of each row's token and the row's k most likely tokens with theirs: the model's
    log-softmax over the whole vocabulary of the raw logits [n, V]. -> (chosen [n], top ids [n, k], top [n, k])."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    chosen = lp.gather(-1, tokens.view(-1, 1)).squeeze(-1)
    top, ids = torch.topk(lp, min(k, lp.shape[-1]), dim=-1)
    return chosen, ids, top


class RowSampler:
    """One request's sampling across its steps: its params, each row's seeded generator, the token history
    the penalties read, and (when the request asks for logprobs) the last step's log-probabilities.
    Calling it with a step's whole-vocabulary logits [n, V] gives that step's tokens [n]."""

    def __init__(self, params: SamplingParams, seeds: list[int], prompt_ids: list[int], device):
        self.params = params
        self.generators = make_generators(seeds, device)
        self.history = TokenHistory(params, prompt_ids)
        if not (self.history.wants_seen or self.history.wants_counts):
            self.history = None
        self.last: tuple[Tensor, Tensor, Tensor] | None = None

    @property
    def needs_logits(self) -> bool:
        """Whether a step needs the whole-vocabulary logits even where every row is greedy (DTP ranks can
        otherwise agree on an argmax from per-shard maxima)."""
        return self.params.adjusts_logits or self.params.logprobs is not None

    def __call__(self, logits: Tensor) -> Tensor:
        tokens = sample(logits, self.params, self.generators, self.history)
        if self.history is not None:
            self.history.add(tokens)
        if self.params.logprobs is not None:
            self.last = token_logprobs(logits, tokens, self.params.logprobs)
        return tokens

    def position_logprobs(self, logits: Tensor, tokens: list[int]) -> list | None:
        """A speculating request's (one row) log-probabilities for the tokens a verify kept: per position,
        what `host_logprobs` gives for a step. logits [S, V] from the verify, S >= len(tokens)."""
        if self.params.logprobs is None:
            return None
        self.last = token_logprobs(logits[:len(tokens)], torch.tensor(tokens, device=logits.device),
                                   self.params.logprobs)
        return [[row] for row in self.host_logprobs()]

    def host_logprobs(self) -> list[tuple[float, list[tuple[int, float]]]] | None:
        """The last step's log-probabilities on the host, per row: (the token's, [(id, logprob)] of the
        most likely tokens, best first); None when the request did not ask for them."""
        if self.last is None:
            return None
        chosen, ids, top = self.last
        k = ids.shape[-1]
        rows = torch.cat([chosen.double().unsqueeze(-1), ids.double(), top.double()], -1).tolist()  # one transfer
        return [(r[0], [(int(i), t) for i, t in zip(r[1:1 + k], r[1 + k:])]) for r in rows]


def _top2_in_c(logits: Tensor) -> bool:
    """float32 CPU rows [n, V] go through one C pass (`lowbit.top2`): torch's argmax and topk take ~0.2-0.4 ms
    over the default model's 49,152 entries."""
    return logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 2 and lowbit.available()


def top_two_rows(logits: Tensor):
    """Row by row, as the caller reads them: (the most likely token, its logit, the second logit) of each
    row of logits [n, V]; ties go to the lower id, as argmax takes them. On the host one C pass per row,
    so rows the caller never reads cost nothing; elsewhere all rows at once (one sync)."""
    if _top2_in_c(logits):
        for j in range(logits.shape[0]):
            ids, top = lowbit.top2(logits[j:j + 1])
            yield int(ids[0, 0]), *top[0].tolist()
    else:
        top = logits.topk(2, dim=-1)
        yield from zip(top.indices[:, 0].tolist(), *top.values.T.tolist())


def greedy_tokens(logits: Tensor) -> Tensor:
    """The argmax of each row of logits [n, V] (the first maximum)."""
    return lowbit.top2(logits)[0][:, 0] if _top2_in_c(logits) else logits.argmax(-1)


def _sample_rows(logits: Tensor, params: SamplingParams, generators: list[torch.Generator]) -> Tensor:
    """Rows that share `params`' own settings (its per-sample list is not read)."""
    if is_greedy(params.temperature, params.top_k):
        return greedy_tokens(logits)
    return _draw(process_logits(logits.float(), params).softmax(-1), generators)


def _draw(probs: Tensor, generators: list[torch.Generator]) -> Tensor:
    """One token per row of probs [B, V], row b by inverting its cumulative distribution at one uniform
    number from generators[b] (one random draw per token, where torch.multinomial draws one per
    vocabulary entry). A token of probability 0 is never drawn."""
    V = probs.shape[-1]
    cdf = probs.double().cumsum(-1)
    u = torch.cat([torch.rand(1, generator=g, dtype=torch.float64, device=probs.device) for g in generators])
    tok = torch.searchsorted(cdf, (u * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    # u * total can round up to the total itself: then the last token that has any probability
    last = V - 1 - (probs > 0).flip(-1).int().argmax(-1)
    return torch.where(tok >= V, last, tok)
