"""The one timing record: produced by the engine, passed unchanged to the API, the UI and storage."""
from __future__ import annotations

from dataclasses import asdict, dataclass, fields


@dataclass
class GenerationMetrics:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ttft_ms: float | None = None  # request start -> first token of this sample
    decode_tokens_per_second: float | None = None  # (tokens - 1) / (t_last - t_first)
    ms_per_token: float | None = None  # 1000 / decode_tokens_per_second
    total_ms: float | None = None
    device: str = "cpu"
    world_size: int = 1
    finish_reason: str | None = None
    seed: int | None = None
    temperature: float | None = None  # this sample's own settings (they may differ within one request)
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    # Speculative decoding (engine/speculative.py): "lookup" when it ran, "off" with the reason when not;
    # draft tokens verified, of them accepted, and the decode steps after the first token (plain + verify).
    speculative: str | None = None
    speculative_reason: str | None = None
    draft_tokens: int = 0
    accepted_tokens: int = 0
    decode_steps: int | None = None
    # of those, the steps beside other requests in which "auto" held its drafts back, and whether it does now
    paused_steps: int = 0
    speculation_paused: bool = False

    # Mapping protocol, so dict(metrics) == asdict(metrics).
    def keys(self):
        return [f.name for f in fields(self)]

    def __getitem__(self, key):
        return getattr(self, key)

    def to_dict(self) -> dict:
        return asdict(self)

    def update_timing(self, t_start: float, t_first: float | None, t_last: float | None) -> None:
        if t_first is None:
            return
        self.ttft_ms = (t_first - t_start) * 1000
        self.total_ms = (t_last - t_start) * 1000
        if self.completion_tokens > 1 and t_last > t_first:
            self.decode_tokens_per_second = (self.completion_tokens - 1) / (t_last - t_first)
            self.ms_per_token = 1000 / self.decode_tokens_per_second
