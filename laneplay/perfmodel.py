"""Performance model of batch-1 decode on a multi-GPU node: standard tensor parallelism vs DTP.

A paper model, not a measurement: for one decode step it adds up, per device,

    time/token = bytes read / (HBM bandwidth x achievable fraction)      (memory time)
               + kernels x launch overhead per kernel                     (launch time)
               + communication that is not covered by compute             (exposed communication)

The bytes are the weights each device reads per token (its lanes' q/k/v/o and MLP slices, norms, one
embedding row, its vocabulary shard of the head) plus its KV cache read at the stated context position
(sliding-window layers read at most `sliding_window` positions). The sub-blocks (attention, MLP) of every
layer are walked in order on one device's clock, with the schedule of the DTP engine
(docs/laneformer.md §9):

* standard TP: every sub-block ends with a blocking all-reduce (2 per layer); the residual stream is the
  same on every device, so the end needs only the gather of the vocabulary shards' argmax.
* DTP (delay d = `broadcast_delay`): layers < d all-reduce now if `use_early_comm` (else add sqrt(L) x own
  and issue); a layer >= d waits, after computing the sub-block, for the collective issued by the same
  sub-block type of layer i - d, then issues its own only if layer i + d reads it (the last d layers
  issue nothing); the final aggregation (an all-reduce of the normed states for the `replicate` head,
  then a small gather for the argmax) blocks. A collective issued at layer i therefore hides behind the
  compute of the d layers in between; only what is left is exposed. Collectives run one at a time on a
  communication stream (`comm_streams`, 0 = unlimited) and each costs
  latency + payload x 2(G-1)/G / bus bandwidth.

With one device there is no communication at all (the lane exchange is local).

It lives beside the packages, not in `laneplay.bench`: the benchmarks' `laneplay perfmodel` command
(bench/perfmodel.py) and the app's DTP tab both use it, and the app takes the served model's shapes
from the engine's /health JSON (`engine_config`), never from an engine object. The model's schedule
rules are the engine's own (`laneplay.engine.config.ModelConfig`, imported when a config is read).

    from laneplay.perfmodel import predict, node_preset
    p = predict(engine.cfg, node_preset("8xH200"))      # or predict(engine, ...), a ModelConfig,
    p.tokens_per_s_dtp, p.hidden_share                   # a config.json dict or path, or None (Laneformer 2B)

`predict(config, node, position=1024) -> Prediction`; `node_preset(name, **overrides) -> Node`;
`Node` is a frozen dataclass (use `dataclasses.replace` to vary a parameter).

Calibration: the `cpu` preset takes its bandwidth and achieved share from bench/results/decode-cpu.json
and its collective latency from bench/results/dtp-cpu.json. A GPU run (bench/results/gpu-*.json with a
`device` name and any of `hbm_gbps`, `bw_efficiency`, `collective_us`, `launch_us`) calibrates the presets
whose device it names. Every parameter says whether it is calibrated or assumed, and from where.
"""
from __future__ import annotations

import importlib.util
import json
import math
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path



def _results_folder() -> Path:
    """bench/results, where the benchmarks write the runs that calibrate the presets (found by the
    package's location; nothing of `laneplay.bench` is imported)."""
    spec = importlib.util.find_spec("laneplay.bench")
    places = list(spec.submodule_search_locations or []) if spec else []
    return Path(places[0]) / "results" if places else Path("bench") / "results"


RESULTS = _results_folder()
SUB_BLOCKS = ("attention", "mlp")
DTYPE_BYTES = {"fp32": 4, "float32": 4, "fp16": 2, "float16": 2, "bf16": 2, "bfloat16": 2, "fp8": 1}

# Laneformer 2B as docs/laneformer.md §10 gives it (2,320,069,632 parameters).
LANEFORMER_2B = {
    "model_type": "laneformer_tp", "vocab_size": 32000, "hidden_size": 3072, "intermediate_size": 12288,
    "num_hidden_layers": 15, "num_attention_heads": 32, "num_key_value_heads": 16, "num_lanes": 8,
    "broadcast_delay": 2, "use_comm": True, "use_early_comm": True, "sliding_window": 2048,
    "sliding_window_n_layers": 10, "unclamped_layers": [], "rope_theta": 10000.0, "norm_eps": 1e-5,
    "replicated_rmsn_scale": True, "lm_head_type": "replicate", "pre_norm_lane_agg": False,
    "tie_word_embeddings": False, "max_position_embeddings": 4096, "bos_token_id": 1, "eos_token_id": 2,
}

# Kog's published batch-1 decode speeds (FP16, no speculation), tokens/s.
KOG_TPS = {"8xH200": 2100.0, "8xMI300X": 3000.0}


class PerfModelError(ValueError):
    """A node or model the performance model cannot describe; the message says which parameter."""


@dataclass(frozen=True)
class Node:
    name: str
    gpus: int  # devices = world size; each hosts num_lanes / gpus lanes
    hbm_gbps: float  # memory bandwidth per device, GB/s
    bw_efficiency: float  # achievable fraction of it for batch-1 GEMVs
    collective_us: float  # latency of one small all-reduce (or gather), launch included
    collective_gbps: float  # bus bandwidth of the collective (inf: no bandwidth term)
    launch_graph_us: float  # per-kernel overhead when the step is replayed as one CUDA/HIP graph
    launch_eager_us: float  # per-kernel overhead when kernels are launched one by one from Python
    kernels_per_layer: float = 8.0  # kernel boundaries per layer (half attention, half MLP)
    tail_kernels: float = 5.0  # embedding, final norm, head, sampling
    dtype_bytes: int = 2
    cuda_graph: bool = True
    comm_streams: int = 1  # collectives in flight at once (0 = unlimited)
    shared_bandwidth: bool = False  # devices share one memory bus (CPU ranks): per-device BW = hbm_gbps / gpus
    sources: dict = field(default_factory=dict, compare=False)  # parameter -> where its value comes from

    @property
    def launch_us(self) -> float:
        return self.launch_graph_us if self.cuda_graph else self.launch_eager_us

    @property
    def device_gbps(self) -> float:
        bw = self.hbm_gbps * self.bw_efficiency
        return bw / self.gpus if self.shared_bandwidth else bw

    def collective_time_us(self, payload_bytes: float) -> float:
        if self.gpus <= 1:
            return 0.0
        wire = 0.0 if math.isinf(self.collective_gbps) else (
            payload_bytes * 2 * (self.gpus - 1) / self.gpus / (self.collective_gbps * 1e3))
        return self.collective_us + wire

    def validate(self) -> "Node":
        def need(cond, msg):
            if not cond:
                raise PerfModelError(f"node {self.name}: {msg}")

        need(isinstance(self.gpus, int) and self.gpus >= 1, f"gpus must be an integer >= 1, got {self.gpus!r}")
        for k in ("hbm_gbps", "collective_gbps"):
            need(getattr(self, k) > 0, f"{k} must be > 0, got {getattr(self, k)}")
        need(0 < self.bw_efficiency <= 1, f"bw_efficiency must be in (0, 1], got {self.bw_efficiency}")
        for k in ("collective_us", "launch_graph_us", "launch_eager_us", "kernels_per_layer", "tail_kernels"):
            v = getattr(self, k)
            need(v >= 0 and math.isfinite(v), f"{k} must be a finite number >= 0, got {v}")
        need(self.dtype_bytes in (1, 2, 4), f"dtype_bytes must be 1, 2 or 4, got {self.dtype_bytes}")
        need(self.comm_streams >= 0, f"comm_streams must be >= 0, got {self.comm_streams}")
        return self


# ---- presets ------------------------------------------------------------------------------------------

_H200 = dict(
    hbm_gbps=(4800.0, "H200 SXM HBM3e, 4.8 TB/s (NVIDIA specification)"),
    bw_efficiency=(0.60, "small per-device GEMVs at ~60% of HBM peak (planning value; single-GPU batch-1 "
                         "engines reach 64-78% on large matrices)"),
    collective_us=(6.0, "one-shot custom all-reduce at 8 ranks, ~6 us for a few KB (SGLang/TensorRT-LLM "
                        "style: 5.7-7.8 us on H100; plain NCCL from PyTorch is ~20-25 us)"),
    collective_gbps=(480.0, "NVLS all-reduce bus bandwidth at 8 GPUs, ~480 GB/s (nccl-tests report)"),
    launch_graph_us=(1.3, "~1.3 us idle per kernel boundary under CUDA graphs (Hazy Research, H100)"),
    launch_eager_us=(10.0, "~9-12 us per Triton kernel dispatched from Python (vLLM/tritonbench reports)"),
    kernels_per_layer=(8.0, "~125 kernels per token after fusion = 8 per layer x 15 + 5 "
                            "(CUDA-graph Llama-1B baseline has ~100)"),
    tail_kernels=(5.0, "embedding, final norm, head, sampling"),
    dtype_bytes=(2, "FP16, as in Kog's published numbers"),
)
_MI300X = {
    **_H200,
    "hbm_gbps": (5300.0, "MI300X HBM3, 5.3 TB/s (AMD ROCm documentation)"),
    "collective_us": (5.0, "~5 us fused wait + reduce on 8x MI300X (muiLLM); vLLM ROCm one-stage AR 6.3 us"),
    "collective_gbps": (448.0, "7 Infinity Fabric links x ~64 GB/s per direction, one per peer"),
    "launch_graph_us": (1.3, "assumed equal to the CUDA-graph figure (no HIP-graph measurement found)"),
}
_PRESETS = {
    "8xH200": (8, _H200), "8xMI300X": (8, _MI300X), "1xH200": (1, _H200),
}
PRESETS = ("8xH200", "8xMI300X", "1xH200", "cpu")


def _read_json(path: Path) -> dict | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _rel(path: Path, data: dict | None = None) -> str:
    noisy = " (a run flagged noisy)" if data and data.get("noisy") else ""
    return f"bench/results/{path.name}{noisy}"


def cpu_calibration(results: Path = RESULTS) -> dict:
    """{param: (value, source)} measured on this machine's CPU, from the decode and DTP benchmarks."""
    out: dict = {}
    dec = _read_json(results / "decode-cpu.json")
    if dec:
        bw = dec.get("bandwidth") or {}
        reads = [x.get("read_gbps") for x in (bw, bw.get("before"), bw.get("after")) if isinstance(x, dict)]
        reads = [r for r in reads if isinstance(r, (int, float)) and r > 0]
        ours = [r for r in dec.get("rows", []) if str(r.get("engine", "")).startswith("ours") and r.get("gbps")]
        # the plain float32 row (compiled if there is one), at the shortest prompt
        ours.sort(key=lambda r: ("float16" in r["engine"], "compiled" not in r["engine"],
                                 r.get("prompt") not in (None, "short")))
        if reads:
            read = sum(reads) / len(reads)
            out["hbm_gbps"] = (read, f"measured DRAM read bandwidth, {_rel(results / 'decode-cpu.json', dec)}")
            if ours:
                row = ours[0]
                out["bw_efficiency"] = (min(1.0, row["gbps"] / read),
                                        f"achieved {row['gbps']:.1f} of {read:.1f} GB/s by '{row['engine']}' decode "
                                        f"(framework overhead folded in), {_rel(results / 'decode-cpu.json', dec)}")
    dtp = _read_json(results / "dtp-cpu.json")
    if dtp and isinstance(dtp.get("config"), dict):
        try:
            from laneplay.engine.config import config_from_hf

            cfg = config_from_hf(dtp["config"])
            now = next(r for r in dtp.get("rows", []) if r.get("mode", "").startswith("wait now"))
            n = sum(cfg.broadcasts_to_future(i, k) for i in range(cfg.num_layers) for k in SUB_BLOCKS)
            if n and now.get("exposed_ms"):
                out["collective_us"] = (now["exposed_ms"] * 1000 / n,
                                        f"gloo, {dtp.get('world_size')} ranks: 'wait now' exposed "
                                        f"{now['exposed_ms']:.1f} ms/token / {n} collectives, "
                                        f"{_rel(results / 'dtp-cpu.json', dtp)}")
                out["gpus"] = (int(dtp.get("world_size") or 2), f"world size of {_rel(results / 'dtp-cpu.json', dtp)}")
        except (StopIteration, ValueError, KeyError, TypeError):
            pass
    return out


def gpu_calibration(device: str, results: Path = RESULTS) -> dict:
    """{param: (value, source)} from bench/results/gpu-*.json files whose `device` names this GPU."""
    out: dict = {}
    for path in sorted(results.glob("gpu-*.json")):
        data = _read_json(path)
        if not data or device.lower() not in str(data.get("device", "")).lower():
            continue
        for key in ("hbm_gbps", "bw_efficiency", "collective_us", "launch_us"):
            v = data.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
                note = f" ({data['calibration_note']})" if data.get("calibration_note") else ""
                out["launch_graph_us" if key == "launch_us" else key] = (float(v), f"measured, {_rel(path)}{note}")
    return out


def node_preset(name: str, results: Path = RESULTS, **overrides) -> Node:
    """A node by preset name (8xH200, 8xMI300X, 1xH200, cpu), calibrated where measured runs exist."""
    if name == "cpu":
        base = {
            "hbm_gbps": (20.0, "assumed: 2-core VM DRAM, 10-20 GB/s (no decode-cpu.json)"),
            "bw_efficiency": (0.5, "assumed (no decode-cpu.json)"),
            "collective_us": (1000.0, "assumed: gloo over shared cores, ~1 ms (no dtp-cpu.json)"),
            "collective_gbps": (10.0, "assumed: gloo over shared memory"),
            "launch_graph_us": (0.0, "folded into bw_efficiency (calibrated on whole decode steps)"),
            "launch_eager_us": (0.0, "folded into bw_efficiency (calibrated on whole decode steps)"),
            "kernels_per_layer": (0.0, "folded into bw_efficiency"),
            "tail_kernels": (0.0, "folded into bw_efficiency"),
            "dtype_bytes": (4, "float32, the dtype the CPU decode benchmark runs"),
            "gpus": (2, "assumed: 2 gloo ranks, as the DTP benchmark runs on CPU"),
        }
        calibrated = cpu_calibration(results)
        extra = {"shared_bandwidth": True}
    elif name in _PRESETS:
        gpus, spec = _PRESETS[name]
        base = {**spec, "gpus": (gpus, "preset")}
        device = "H200" if "H200" in name else "MI300X"
        calibrated = gpu_calibration(device, results)
        extra = {}
    else:
        raise PerfModelError(f"unknown node preset {name!r} (expected one of {', '.join(PRESETS)})")
    values = {k: v for k, (v, _) in base.items()}
    sources = {k: f"assumed: {s}" if not s.startswith(("assumed", "preset", "folded")) else s
               for k, (_, s) in base.items()}
    for k, (v, s) in calibrated.items():
        values[k] = v
        sources[k] = f"calibrated: {s}"
    if name != "cpu" and not calibrated:
        sources["calibration"] = "not calibrated: no GPU run yet"
    for k, v in overrides.items():
        if v is None:
            continue
        if k not in {f.name for f in fields(Node)}:
            raise PerfModelError(f"unknown node parameter {k!r}")
        values[k] = v
        sources[k] = "set on the command line"
    return Node(name=name, sources=sources, **extra, **values).validate()


# ---- the model ----------------------------------------------------------------------------------------

def resolve_config(config=None):
    """A ModelConfig from None (Laneformer 2B), a ModelConfig, an engine (anything with `.cfg`),
    a parsed config.json dict, or a path to a config.json / checkpoint directory."""
    from laneplay.engine.config import ModelConfig, config_from_hf, load_config

    if config is None:
        return config_from_hf(LANEFORMER_2B, name="laneformer-2b (published shapes)")
    if isinstance(config, ModelConfig):
        return config
    if isinstance(getattr(config, "cfg", None), ModelConfig):
        return config.cfg
    if isinstance(config, dict):
        return config_from_hf(config, name=str(config.get("name", "")))
    if isinstance(config, (str, Path)):
        return load_config(config)
    raise PerfModelError(f"cannot read a model config from {type(config).__name__}")


def engine_config(raw: dict | None):
    """The engine's /health `model_config` (its ModelConfig as a dict) as a config for this model, re-split
    as standard TP for Llama models (the engine's split is not the node's); None when absent or unreadable
    (an engine of another version)."""
    if not isinstance(raw, dict):
        return None
    from laneplay.engine.config import ModelConfig, RopeScaling

    names = {f.name for f in fields(ModelConfig)}
    vals = {k: tuple(v) if isinstance(v, list) else v for k, v in raw.items() if k in names}
    try:
        if isinstance(vals.get("rope_scaling"), dict):
            vals["rope_scaling"] = RopeScaling(**vals["rope_scaling"])
        cfg = ModelConfig(**vals)
    except (TypeError, ValueError):
        return None
    return replace(cfg, num_lanes=1) if cfg.arch == "llama" else cfg


def param_count(cfg) -> int:
    """Parameters of a lane-form / Llama model from its shapes (embedding, layers, final norm, head)."""
    D, hd, L = cfg.hidden_size, cfg.head_dim, cfg.num_lanes
    norm = L * D if cfg.lane_norms else D
    layer = D * cfg.num_heads * hd * 2 + D * cfg.num_kv_heads * hd * 2 + 3 * D * cfg.intermediate_size + 2 * norm
    head = 0 if cfg.tie_word_embeddings else cfg.vocab_size * D * (L if cfg.lm_head_type == "lane" else 1)
    final = L * D if cfg.final_lane_norm else D
    return cfg.vocab_size * D + cfg.num_layers * layer + final + head


@dataclass
class DeviceBytes:
    """Bytes one device reads per decode step, by part (the model is symmetric across devices)."""

    attention: list  # per layer: its slice of wq, wk, wv, wo + the attention norm + its KV cache read
    mlp: list  # per layer: its slice of w1, w3, w2 + the MLP norm
    kv: float  # the KV-cache part of `attention`, summed over layers
    tail: float  # one embedding row, the final norm, its share of the head

    @property
    def total(self) -> float:
        return sum(self.attention) + sum(self.mlp) + self.tail


def _check_split(cfg, gpus: int) -> None:
    if cfg.num_lanes > 1:
        if gpus > cfg.num_lanes or cfg.num_lanes % gpus:
            raise PerfModelError(f"gpus ({gpus}) must divide num_lanes ({cfg.num_lanes}); more devices than lanes "
                                 "would need ordinary tensor parallelism inside a lane")
    elif cfg.num_kv_heads % gpus or cfg.intermediate_size % gpus:
        raise PerfModelError(f"gpus ({gpus}) must divide num_key_value_heads ({cfg.num_kv_heads}) and "
                             f"intermediate_size ({cfg.intermediate_size}) to shard this model")


def device_bytes(cfg, gpus: int, dtype_bytes: int, position: int) -> DeviceBytes:
    """Weights + KV one device reads to decode the token at `position` (0-based) with `gpus` devices."""
    _check_split(cfg, gpus)
    D, hd, b = cfg.hidden_size, cfg.head_dim, dtype_bytes
    lanes_here = max(1, cfg.num_lanes // gpus)
    norm = (lanes_here * D if cfg.lane_norms else D) * b
    attn_w = (2 * D * cfg.num_heads * hd + 2 * D * cfg.num_kv_heads * hd) * b / gpus
    mlp_w = 3 * D * cfg.intermediate_size * b / gpus
    kv_per_pos = 2 * cfg.num_kv_heads * hd * b / gpus
    attention, mlp, kv = [], [], 0.0
    for i in range(cfg.num_layers):
        w = cfg.window(i)
        keys = position + 1 if w is None else min(position + 1, w)
        kv += keys * kv_per_pos
        attention.append(attn_w + norm + keys * kv_per_pos)
        mlp.append(mlp_w + norm)
    head_cols = D * (cfg.num_lanes if cfg.lm_head_type == "lane" else 1)
    final_norm = (lanes_here * D if cfg.final_lane_norm else D) * b
    tail = D * b + final_norm + cfg.vocab_size * head_cols * b / gpus
    return DeviceBytes(attention=attention, mlp=mlp, kv=kv, tail=tail)


def final_collectives(cfg, dtype_bytes: int, standard_tp: bool = False) -> list[tuple[str, float]]:
    """Blocking collectives after the last layer (docs/laneformer.md §9.4): (what, payload bytes)."""
    D, argmax = cfg.hidden_size, ("argmax gather (max logit, index)", 8.0)
    if cfg.num_lanes == 1 or standard_tp:  # identical streams on every device, vocab-sharded head
        return [argmax]
    if cfg.lm_head_type == "lane":
        return [("all-reduce of the logits", cfg.vocab_size * 4.0)]
    if cfg.lm_head_type == "vocab_parallel":
        return [argmax]
    what = "all-reduce of the lane sum" if cfg.pre_norm_lane_agg else "all-reduce of the normed lane states"
    return [(what, D * dtype_bytes), argmax]


@dataclass
class Schedule:
    ms: float  # time per token
    memory_ms: float
    launch_ms: float
    exposed_comm_ms: float
    comm_ms: float  # all collective time, hidden or not
    blocking: int  # collectives waited for at once
    delayed: int  # collectives issued now and consumed d layers later


def simulate(cfg, node: Node, nbytes: DeviceBytes, delayed: bool) -> Schedule:
    """Walk one decode step on one device's clock (µs): compute, issue, wait; see the module docstring."""
    bw = node.device_gbps * 1e3  # bytes per µs
    k_sub = node.kernels_per_layer / 2
    c = node.collective_time_us(cfg.hidden_size * node.dtype_bytes)
    streams: list[float] = []  # when each busy communication stream frees up
    ready: dict = {}  # (layer, kind) -> when the collective issued there completes
    t = exposed = comm = 0.0
    blocking = n_delayed = 0

    def start(at: float, dur: float) -> float:
        nonlocal comm
        comm += dur
        if node.comm_streams == 0:
            return at + dur
        if len(streams) < node.comm_streams:
            streams.append(0.0)
        j = min(range(len(streams)), key=streams.__getitem__)
        streams[j] = max(at, streams[j]) + dur
        return streams[j]

    def block(dur: float) -> None:
        nonlocal t, exposed, blocking
        end = start(t, dur)
        exposed += end - t
        t, blocking = end, blocking + 1

    t += (nbytes.tail / bw) + node.tail_kernels * node.launch_us  # embedding row, final norm, head
    for i in range(cfg.num_layers):
        for kind in SUB_BLOCKS:
            part = nbytes.attention[i] if kind == "attention" else nbytes.mlp[i]
            t += part / bw + k_sub * node.launch_us
            if node.gpus == 1:
                continue
            if not delayed or cfg.num_lanes == 1 or cfg.reduce_mode(i, kind) == "present":
                block(c)  # standard TP, or DTP's early layers with use_early_comm
                continue
            if cfg.reduce_mode(i, kind) == "past" and cfg.consumes_past(i, kind):
                done = ready.pop((i - cfg.broadcast_delay, kind), 0.0)  # 0: a blocking sum is at hand
                exposed += max(0.0, done - t)
                t = max(t, done)
            if cfg.broadcasts_to_future(i, kind):
                ready[(i, kind)] = start(t, c)
                n_delayed += 1
    if node.gpus > 1:
        for _, payload in final_collectives(cfg, node.dtype_bytes, standard_tp=not delayed):
            block(node.collective_time_us(payload))
    kernels = node.tail_kernels + node.kernels_per_layer * cfg.num_layers
    return Schedule(ms=t / 1e3, memory_ms=nbytes.total / bw / 1e3, launch_ms=kernels * node.launch_us / 1e3,
                    exposed_comm_ms=exposed / 1e3, comm_ms=comm / 1e3, blocking=blocking, delayed=n_delayed)


@dataclass
class Prediction:
    model: str
    node: str
    gpus: int
    position: int
    broadcast_delay: int
    param_count: int
    bytes_per_token: float  # read by all devices together
    bytes_per_device: float
    kv_bytes_per_device: float
    weight_bytes: float  # every parameter once (param_count x dtype)
    memory_ms: float
    launch_ms: float
    ms_per_token_tp: float
    ms_per_token_dtp: float
    tokens_per_s_tp: float
    tokens_per_s_dtp: float
    exposed_comm_ms_tp: float
    exposed_comm_ms_dtp: float
    comm_ms_tp: float
    comm_ms_dtp: float
    hidden_share: float  # of DTP's collective time, the part covered by compute
    collectives_tp: int
    collectives_dtp_blocking: int
    collectives_dtp_delayed: int

    def as_dict(self) -> dict:
        return asdict(self)


def predict(config=None, node: Node | str = "8xH200", position: int = 1024) -> Prediction:
    """Batch-1 decode time per token for `config` (see resolve_config) on `node` (a Node or preset name)."""
    cfg = resolve_config(config)
    node = node_preset(node) if isinstance(node, str) else node.validate()
    if not isinstance(position, int) or position < 0:
        raise PerfModelError(f"position must be an integer >= 0, got {position!r}")
    nb = device_bytes(cfg, node.gpus, node.dtype_bytes, position)
    tp, dtp = simulate(cfg, node, nb, delayed=False), simulate(cfg, node, nb, delayed=True)
    n = param_count(cfg)
    return Prediction(
        model=cfg.name or cfg.arch, node=node.name, gpus=node.gpus, position=position,
        broadcast_delay=cfg.broadcast_delay, param_count=n, bytes_per_token=nb.total * node.gpus,
        bytes_per_device=nb.total, kv_bytes_per_device=nb.kv, weight_bytes=float(n * node.dtype_bytes),
        memory_ms=tp.memory_ms, launch_ms=tp.launch_ms,
        ms_per_token_tp=tp.ms, ms_per_token_dtp=dtp.ms, tokens_per_s_tp=1e3 / tp.ms, tokens_per_s_dtp=1e3 / dtp.ms,
        exposed_comm_ms_tp=tp.exposed_comm_ms, exposed_comm_ms_dtp=dtp.exposed_comm_ms,
        comm_ms_tp=tp.comm_ms, comm_ms_dtp=dtp.comm_ms,
        hidden_share=max(0.0, 1 - dtp.exposed_comm_ms / dtp.comm_ms) if dtp.comm_ms > 0 else 0.0,
        collectives_tp=tp.blocking, collectives_dtp_blocking=dtp.blocking, collectives_dtp_delayed=dtp.delayed)


def _solve(f, lo: float, hi: float, target_ms: float, increasing: bool) -> float | None:
    """The parameter value where f (ms/token, monotone in it) meets target_ms; None if out of [lo, hi]."""
    def ok(v: float) -> bool:
        return f(v) <= target_ms

    good, bad = (lo, hi) if increasing else (hi, lo)
    if not ok(good):
        return None
    if ok(bad):
        return bad
    for _ in range(60):
        mid = (good + bad) / 2
        good, bad = (mid, bad) if ok(mid) else (good, mid)
    return good


def implied(cfg, node: Node, position: int, tps: float) -> dict:
    """What single parameter would make DTP (and standard TP) decode at `tps` tokens/s, others as assumed."""
    target = 1e3 / tps

    def ms(mode: str, **kw) -> float:
        n = replace(node, **kw)
        return simulate(cfg, n, device_bytes(cfg, n.gpus, n.dtype_bytes, position), delayed=mode == "dtp").ms

    launch_key = "launch_graph_us" if node.cuda_graph else "launch_eager_us"
    out = {}
    for mode in ("dtp", "tp"):
        out[mode] = {
            "collective_us": _solve(lambda v: ms(mode, collective_us=v), 0.0, 1e4, target, True),
            "bw_efficiency": _solve(lambda v: ms(mode, bw_efficiency=v), 1e-4, 1.0, target, False),
            "launch_us": _solve(lambda v: ms(mode, **{launch_key: v}), 0.0, 1e3, target, True),
        }
    return out
