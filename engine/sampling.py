"""Sampling parameters and the one sampling function (greedy, temperature, top-k, top-p, min-p).

Each sample of a request owns a `torch.Generator` seeded from (request seed, sample index), so a
sample is reproducible on its own and independent of the others in its batch, and the DTP runtime
(which samples on rank 0 from gathered logits) draws exactly the same tokens.
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, field

import torch
from torch import Tensor

MAX_N = 16
MAX_STOP_STRINGS = 8
MAX_STOP_LENGTH = 256
MAX_SEED = 2**63 - 1
# Temperatures below this are greedy: dividing by them would overflow float32 (1e-38 is inf), and the
# distribution they describe is already the argmax to within float precision.
GREEDY_TEMPERATURE = 1e-5


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

    def validate(self) -> "SamplingParams":
        """Raise ValueError with a clear sentence for any out-of-range value; returns self."""
        def need(cond, msg):
            if not cond:
                raise ValueError(msg)

        def is_int(v):
            return isinstance(v, int) and not isinstance(v, bool)

        def is_num(v):
            return isinstance(v, (int, float)) and not isinstance(v, bool) and v == v  # not NaN

        need(is_int(self.max_tokens) and self.max_tokens >= 1, f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        need(is_num(self.temperature) and 0 <= self.temperature <= 100, f"temperature must be in [0, 100], got {self.temperature!r}")
        need(is_num(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}")
        need(is_int(self.top_k) and self.top_k >= 0, f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        need(is_num(self.min_p) and 0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p!r}")
        need(self.seed is None or (is_int(self.seed) and 0 <= self.seed <= MAX_SEED),
             f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        need(is_int(self.n) and 1 <= self.n <= MAX_N, f"n must be an integer in [1, {MAX_N}], got {self.n!r}")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        need(isinstance(self.stop, (list, tuple)) and len(self.stop) <= MAX_STOP_STRINGS,
             f"stop must be a list of at most {MAX_STOP_STRINGS} strings")
        need(all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_LENGTH for s in self.stop),
             f"each stop string must be a non-empty string of at most {MAX_STOP_LENGTH} characters")
        self.stop = list(self.stop)
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1


def sample_seeds(params: SamplingParams) -> list[int]:
    """One seed per sample: sample i of a request with seed s always uses seed s + i."""
    base = params.seed if params.seed is not None else secrets.randbelow(2**62)
    return [(base + i) % (MAX_SEED + 1) for i in range(params.n)]


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
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens ranked above it already hold top_p of the mass (keep >= 1).
        drop_sorted = (probs.cumsum(-1) - probs) >= params.top_p
        drop_sorted[..., 0] = False  # the most likely token always stays (top_p may round to 0 in float32)
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    if params.min_p > 0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < params.min_p * probs.max(-1, keepdim=True).values, float("-inf"))
    return logits


def sample(logits: Tensor, params: SamplingParams, generators: list[torch.Generator]) -> Tensor:
    """Next token per row. logits [B, V] -> [B] (greedy when temperature is 0)."""
    if params.greedy:
        return logits.argmax(-1)
    probs = process_logits(logits.float(), params).softmax(-1)
    return torch.cat([torch.multinomial(probs[b], 1, generator=generators[b]) for b in range(probs.shape[0])])
