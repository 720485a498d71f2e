"""Model configuration: one dataclass for Laneformer and Llama-family checkpoints.

Read from a Hugging Face `config.json` with the field names of docs/laneformer.md §10; the per-layer
rules it answers are docs/laneformer.md §4-§6.
A Llama checkpoint is the special case "every layer reduces PRESENT" (standard tensor parallelism),
which we encode as `broadcast_delay = 0`: with no delay, PAST at layer i consumes layer i itself,
`x + (Σx - x) = Σx`, i.e. exactly PRESENT.
"""
from __future__ import annotations

import json
import logging
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

LM_HEAD_TYPES = ("replicate", "lane", "vocab_parallel")

# Reduce modes of docs/laneformer.md §4.
NO_REDUCE, PRESENT, PAST = "no_reduce", "present", "past"
SUB_BLOCKS = ("attention", "mlp")


class ConfigError(ValueError):
    """A config.json that the engine cannot run; the message names the field."""


@dataclass(frozen=True)
class RopeScaling:
    """Llama-3.1-style frequency scaling (docs/laneformer.md §6)."""

    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int


@dataclass(frozen=True)
class ModelConfig:
    arch: str  # "laneformer" | "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    num_lanes: int = 1
    broadcast_delay: int = 0  # 0 = every layer PRESENT (standard TP)
    use_attention_comm: bool = True
    use_mlp_comm: bool = True
    use_early_comm: bool = True
    # Old code: layers d..2d-1 re-add the other lanes' outputs of layers 0..d-1 (docs/laneformer.md §4).
    # False = the newer revision, where layers < d broadcast nothing to the future.
    early_layers_broadcast: bool = True
    # Newer revision: per-layer "does layer i send its output to layer i + d" (None: derived as above).
    attention_to_future: tuple[bool, ...] | None = None
    mlp_to_future: tuple[bool, ...] | None = None
    sliding_window: int | None = None
    swa_layers: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    norm_eps: float = 1e-5
    lane_norms: bool = False  # LaneRMSNorm scales [L, D] instead of one replicated weight [D]
    lm_head_type: str = "replicate"
    pre_norm_lane_agg: bool = False
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    pad_token_id: int | None = None
    name: str = ""
    extra: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self):
        self.validate()

    # ---- derived sizes -------------------------------------------------------------------
    @property
    def heads_per_lane(self) -> int:
        return self.num_heads // self.num_lanes

    @property
    def kv_heads_per_lane(self) -> int:
        return self.num_kv_heads // self.num_lanes

    @property
    def ffn_per_lane(self) -> int:
        return self.intermediate_size // self.num_lanes

    @property
    def final_lane_norm(self) -> bool:
        """The final norm is per lane unless norms are replicated or lanes are summed before it."""
        return self.lane_norms and not self.pre_norm_lane_agg

    @property
    def vocab_per_lane(self) -> int:
        return self.vocab_size // self.num_lanes

    # ---- the per-layer schedule ------------------------------------------------------------
    def is_sliding(self, layer: int) -> bool:
        return self.sliding_window is not None and layer in self.swa_layers

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.is_sliding(layer) else None

    def uses_comm(self, kind: str) -> bool:
        return self.use_attention_comm if kind == "attention" else self.use_mlp_comm

    def reduce_mode(self, layer: int, kind: str) -> str:
        """NO_REDUCE / PRESENT / PAST for sub-block `kind` of `layer` (docs/laneformer.md §4)."""
        if self.num_lanes == 1 or self.broadcast_delay == 0:
            return PRESENT
        if layer < self.broadcast_delay:
            return PRESENT if self.use_early_comm else NO_REDUCE
        return PAST if self.uses_comm(kind) else NO_REDUCE

    def consumes_past(self, layer: int, kind: str) -> bool:
        """Whether PAST at `layer` adds the other lanes' outputs of layer - d (False: past is zero)."""
        d = self.broadcast_delay
        if self.reduce_mode(layer, kind) != PAST:
            return False
        flags = self.attention_to_future if kind == "attention" else self.mlp_to_future
        if flags is not None:
            return flags[layer - d]
        return layer - d >= d or self.early_layers_broadcast

    def broadcasts_to_future(self, layer: int, kind: str) -> bool:
        """Whether layer's unreduced output is read by layer + d (so a collective must be issued)."""
        d = self.broadcast_delay
        return d > 0 and layer + d < self.num_layers and self.consumes_past(layer + d, kind)

    # ---- checks ------------------------------------------------------------------------------
    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ConfigError(f"config.json: {msg}")

        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "num_lanes", "max_position_embeddings"):
            v = getattr(self, name)
            need(isinstance(v, int) and v > 0, f"{name} must be a positive integer, got {v!r}")
        need(self.broadcast_delay >= 0, f"broadcast_delay must be >= 0, got {self.broadcast_delay}")
        need(self.num_heads % self.num_kv_heads == 0,
             f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})")
        for name, v in (("num_attention_heads", self.num_heads), ("num_key_value_heads", self.num_kv_heads),
                        ("intermediate_size", self.intermediate_size)):
            need(v % self.num_lanes == 0, f"{name} ({v}) is not divisible by num_lanes ({self.num_lanes})")
        need(self.head_dim % 2 == 0, f"head_dim ({self.head_dim}) must be even for RoPE")
        need(self.lm_head_type in LM_HEAD_TYPES,
             f"unknown lm_head_type {self.lm_head_type!r} (expected one of {', '.join(LM_HEAD_TYPES)})")
        if self.lm_head_type == "vocab_parallel":
            need(self.vocab_size % self.num_lanes == 0,
                 f"vocab_size ({self.vocab_size}) is not divisible by num_lanes ({self.num_lanes}) for the vocab_parallel head")
        need(not (self.pre_norm_lane_agg and self.lm_head_type != "replicate"),
             "pre_norm_lane_agg is only allowed with lm_head_type 'replicate'")
        need(not (self.tie_word_embeddings and self.lm_head_type != "replicate"),
             "tie_word_embeddings needs lm_head_type 'replicate'")
        if self.sliding_window is not None:
            need(isinstance(self.sliding_window, int) and self.sliding_window > 0,
                 f"sliding_window must be a positive integer, got {self.sliding_window!r}")
        for name in ("attention_to_future", "mlp_to_future"):
            flags = getattr(self, name)
            need(flags is None or len(flags) == self.num_layers,
                 f"broadcast_{name} must have one entry per layer ({self.num_layers})")
        need(all(0 <= i < self.num_layers for i in self.swa_layers),
             f"sliding-window layer indices {list(self.swa_layers)} out of range for {self.num_layers} layers")
        need(self.norm_eps > 0 and math.isfinite(self.norm_eps), f"norm_eps must be > 0, got {self.norm_eps}")
        need(self.rope_theta > 0, f"rope_theta must be > 0, got {self.rope_theta}")
        if self.rope_scaling is not None:
            s = self.rope_scaling
            need(s.factor > 0 and s.high_freq_factor > s.low_freq_factor > 0 and s.original_max_position_embeddings > 0,
                 f"inconsistent rope_scaling {asdict(s)}")

    def with_lanes(self, num_lanes: int) -> "ModelConfig":
        """A Llama config re-split into `num_lanes` lanes (standard TP: same function)."""
        if self.arch != "llama":
            raise ConfigError("only Llama-family configs can be re-split into another number of lanes")
        return replace(self, num_lanes=num_lanes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("extra")
        return d


# ------------------------------------------------------------------------------------------------
# Reading a Hugging Face config.json

_LANEFORMER_TYPES = {"laneformer_tp", "laneformer"}
_LLAMA_TYPES = {"llama"}

# Keys that carry no meaning for inference (bookkeeping) or that we read elsewhere.
_IGNORED_KEYS = {
    "architectures", "auto_map", "transformers_version", "torch_dtype", "dtype", "model_type",
    "initializer_range", "use_cache", "attention_dropout", "_name_or_path", "output_attentions",
    "output_hidden_states", "return_dict", "pretraining_tp", "mlp_bias", "attention_bias", "hidden_act",
    "rope_dim", "head_dim", "bos_token_id", "eos_token_id", "pad_token_id", "tie_word_embeddings",
    "max_position_embeddings", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "rope_theta", "rope_scaling", "rope_scaling_args",
    "rope_parameters", "norm_eps", "rms_norm_eps", "num_lanes", "broadcast_delay", "use_comm",
    "use_early_comm", "use_attention_comm", "use_mlp_comm", "early_layers_broadcast", "sliding_window",
    "broadcast_attention_to_future", "broadcast_mlp_to_future",
    "sliding_window_n_layers", "unclamped_layers", "swa_layers", "layer_types", "replicated_rmsn_scale",
    "lm_head_type", "pre_norm_lane_agg", "use_sliding_window", "max_window_layers", "name",
    "generation_config", "chat_template", "quantization_config",
}


def _ids(v) -> tuple[int, ...]:
    if v is None:
        return ()
    if isinstance(v, int):
        return (v,)
    return tuple(int(x) for x in v)


def _rope(raw: dict) -> tuple[float, RopeScaling | None]:
    theta = raw.get("rope_theta")
    params = raw.get("rope_parameters") or {}
    if theta is None:
        theta = params.get("rope_theta", 10000.0)
    scaling = raw.get("rope_scaling") or raw.get("rope_scaling_args")
    if scaling is None and params.get("rope_type", "default") not in (None, "default"):
        scaling = params
    if not scaling:
        return float(theta), None
    kind = scaling.get("rope_type", scaling.get("type", "llama3"))
    if kind == "default":
        return float(theta), None
    if kind != "llama3":
        raise ConfigError(f"config.json: rope scaling type {kind!r} is not supported (only 'llama3' frequency scaling)")
    try:
        return float(theta), RopeScaling(
            factor=float(scaling["factor"]),
            low_freq_factor=float(scaling.get("low_freq_factor", 1.0)),
            high_freq_factor=float(scaling.get("high_freq_factor", 4.0)),
            original_max_position_embeddings=int(scaling.get("original_max_position_embeddings", 8192)),
        )
    except KeyError as e:
        raise ConfigError(f"config.json: rope scaling is missing field {e.args[0]!r}") from None


def _swa_layers(raw: dict, n_layers: int) -> tuple[int, ...]:
    """Which layers use the sliding window, under any of the three conventions (docs/laneformer.md §5)."""
    if raw.get("sliding_window") is None:
        return ()
    if raw.get("layer_types") is not None:
        types = list(raw["layer_types"])
        if len(types) != n_layers:
            raise ConfigError(f"config.json: layer_types has {len(types)} entries for {n_layers} layers")
        bad = [t for t in types if t not in ("sliding_attention", "full_attention")]
        if bad:
            raise ConfigError(f"config.json: unknown layer_types entry {bad[0]!r}")
        return tuple(i for i, t in enumerate(types) if t == "sliding_attention")
    if raw.get("swa_layers") is not None:
        return tuple(sorted(int(i) for i in raw["swa_layers"]))
    if "sliding_window_n_layers" in raw or "unclamped_layers" in raw:
        n = int(raw.get("sliding_window_n_layers") or 0)
        unclamped = {int(i) for i in raw.get("unclamped_layers") or ()}
        return tuple(i for i in range(n_layers) if i not in unclamped and (i < n or i >= n_layers + n))
    if raw.get("use_sliding_window") is False:  # Qwen/Mistral-style switch
        return ()
    return tuple(range(n_layers))  # a bare `sliding_window` means every layer


def _layer_flags(raw: dict, key: str, n_layers: int) -> tuple[bool, ...] | None:
    """A per-layer bool list (or one bool for all layers), e.g. broadcast_mlp_to_future."""
    v = raw.get(key)
    if v is None:
        return None
    if isinstance(v, bool):
        return (v,) * n_layers
    if not isinstance(v, list) or len(v) != n_layers or not all(isinstance(x, bool) for x in v):
        raise ConfigError(f"config.json: {key} must be a bool or a list of {n_layers} bools, got {v!r}")
    return tuple(v)


def config_from_hf(raw: dict, name: str = "") -> ModelConfig:
    """Build a ModelConfig from a parsed config.json dict; unknown keys warn, bad values raise."""
    mtype = raw.get("model_type")
    if mtype in _LANEFORMER_TYPES or (mtype is None and "num_lanes" in raw):
        arch = "laneformer"
    elif mtype in _LLAMA_TYPES:
        arch = "llama"
    else:
        raise ConfigError(f"config.json: model_type {mtype!r} is not supported (expected laneformer_tp or llama)")

    unknown = sorted(set(raw) - _IGNORED_KEYS)
    if unknown:
        log.warning("config.json: ignoring unknown keys %s", ", ".join(unknown))
    for key, ok in (("attention_bias", False), ("mlp_bias", False)):
        if raw.get(key, ok) != ok:
            raise ConfigError(f"config.json: {key}={raw[key]!r} is not supported (no biases)")
    if raw.get("hidden_act", "silu") != "silu":
        raise ConfigError(f"config.json: hidden_act {raw['hidden_act']!r} is not supported (SwiGLU with silu only)")
    if int(raw.get("pretraining_tp", 1)) != 1:
        raise ConfigError("config.json: pretraining_tp != 1 is not supported")

    def req(key: str):
        if key not in raw:
            raise ConfigError(f"config.json: missing required field {key!r}")
        return raw[key]

    d, hq = int(req("hidden_size")), int(req("num_attention_heads"))
    n_layers = int(req("num_hidden_layers"))
    head_dim = raw.get("head_dim") or d // hq
    if raw.get("rope_dim") not in (None, head_dim):
        raise ConfigError(f"config.json: rope_dim {raw['rope_dim']} != head_dim {head_dim} (partial rotary) is not supported")
    theta, scaling = _rope(raw)
    use_comm = bool(raw.get("use_comm", True))
    window = raw.get("sliding_window")
    lanes = int(raw.get("num_lanes", 1)) if arch == "laneformer" else 1
    common = dict(
        arch=arch, vocab_size=int(req("vocab_size")), hidden_size=d,
        intermediate_size=int(req("intermediate_size")), num_layers=n_layers, num_heads=hq,
        num_kv_heads=int(raw.get("num_key_value_heads") or hq), head_dim=int(head_dim),
        sliding_window=None if window is None else int(window), swa_layers=_swa_layers(raw, n_layers),
        rope_theta=theta, rope_scaling=scaling,
        norm_eps=float(raw.get("norm_eps", raw.get("rms_norm_eps", 1e-5))),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        bos_token_id=raw.get("bos_token_id"), eos_token_ids=_ids(raw.get("eos_token_id")),
        pad_token_id=raw.get("pad_token_id"), name=name, extra=dict(raw),
    )
    if arch == "llama":
        return ModelConfig(**common)
    return ModelConfig(
        **common,
        num_lanes=lanes,
        broadcast_delay=int(raw.get("broadcast_delay", 2)),
        use_attention_comm=bool(raw.get("use_attention_comm", use_comm)),
        use_mlp_comm=bool(raw.get("use_mlp_comm", use_comm)),
        use_early_comm=bool(raw.get("use_early_comm", True)),
        early_layers_broadcast=bool(raw.get("early_layers_broadcast", True)),
        attention_to_future=_layer_flags(raw, "broadcast_attention_to_future", n_layers),
        mlp_to_future=_layer_flags(raw, "broadcast_mlp_to_future", n_layers),
        lane_norms=not bool(raw.get("replicated_rmsn_scale", True)),
        lm_head_type=str(raw.get("lm_head_type", "replicate")),
        pre_norm_lane_agg=bool(raw.get("pre_norm_lane_agg", False)),
    )


def load_config(path: str | Path) -> ModelConfig:
    """Read `<dir>/config.json` (or a config.json path)."""
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    if not p.is_file():
        raise ConfigError(f"no config.json in {p.parent}: a Hugging Face checkpoint directory needs one")
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p} is not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p} must hold a JSON object")
    return config_from_hf(raw, name=p.parent.name)
