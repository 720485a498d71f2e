"""Naive, deliberately literal reference of the Laneformer forward pass (test oracle).

Written from the description in docs/laneformer.md §1-§8 and shares no code with ``engine/``: it
must never import anything from the engine, so the engine can be checked against it.

Everything is computed in float32 with explicit Python loops over layers, lanes and heads; the
whole causal sequence is recomputed (no KV cache).  Speed is irrelevant: tests use tiny models.

Public helpers:

- ``naive_logits(config, tensors, ids) -> [B, S, V]``
- ``naive_hidden_states(config, tensors, ids) -> [B, S, L, D]`` (after the last layer, before the
  final norm / lane aggregation / head)
- ``naive_trace(config, tensors, ids) -> dict`` per-layer intermediates (for bisecting a mismatch)
- ``swa_layer_set(config) -> set[int]`` the layers that use sliding-window attention (docs/laneformer.md §5)
- ``reduce_modes(config) -> list[(attn_mode, mlp_mode)]`` the docs/laneformer.md §4 mode of every layer
- ``rope_frequencies(config, head_dim) -> [hd/2]`` f_t with optional llama3 scaling (docs/laneformer.md §6)
- ``random_laneformer(config, seed) -> state dict`` random weights in the docs/laneformer.md §8 3-D HF layout
- ``tiny_config(**overrides) -> config dict`` a small, valid config
"""
from __future__ import annotations

import math

import torch

NO_REDUCE = "NO_REDUCE"
PRESENT = "PRESENT"
PAST = "PAST"

_NEG_INF = float("-inf")


# --------------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------------


def _get(config: dict, key: str, default):
    """config[key], or default when the key is absent or null."""
    value = config.get(key)
    return default if value is None else value


class _Cfg:
    """The handful of numbers the forward needs, read from an HF-style config dict."""

    def __init__(self, config: dict):
        self.V = int(config["vocab_size"])
        self.D = int(config["hidden_size"])
        self.F = int(config["intermediate_size"])
        self.N = int(config["num_hidden_layers"])
        self.Hq = int(config["num_attention_heads"])
        self.Hkv = int(_get(config, "num_key_value_heads", self.Hq))
        self.L = int(config["num_lanes"])
        self.d = int(config["broadcast_delay"])
        if "head_dim" in config and config["head_dim"] is not None:
            self.hd = int(config["head_dim"])
        else:
            if self.D % self.Hq != 0:
                raise ValueError(f"hidden_size {self.D} not divisible by num_attention_heads {self.Hq}")
            self.hd = self.D // self.Hq
        if self.hd % 2 != 0:
            raise ValueError(f"head_dim {self.hd} must be even for pair-wise RoPE")
        if self.L < 1:
            raise ValueError("num_lanes must be >= 1")
        if self.d < 1:
            # docs/laneformer.md §4 only defines delays of at least one layer: with d = 0 "the output of
            # layer i - 0" would be the layer's own, not yet produced, output.
            raise ValueError(f"broadcast_delay must be >= 1, got {self.d}")
        for name, value in (("num_attention_heads", self.Hq), ("num_key_value_heads", self.Hkv),
                            ("intermediate_size", self.F)):
            if value % self.L != 0:
                raise ValueError(f"{name}={value} is not divisible by num_lanes={self.L}")
        if self.Hq % self.Hkv != 0:
            raise ValueError("num_attention_heads must be a multiple of num_key_value_heads")

        self.use_comm = bool(_get(config, "use_comm", True))
        self.use_early_comm = bool(_get(config, "use_early_comm", True))
        # Optional newer-revision per-sub-block flags override use_comm for their type only.
        self.use_attention_comm = bool(_get(config, "use_attention_comm", self.use_comm))
        self.use_mlp_comm = bool(_get(config, "use_mlp_comm", self.use_comm))
        self.early_layers_broadcast = bool(_get(config, "early_layers_broadcast", True))

        self.sliding_window = config.get("sliding_window")
        if self.sliding_window is not None:
            self.sliding_window = int(self.sliding_window)
            if self.sliding_window < 1:
                raise ValueError("sliding_window must be >= 1 (or null)")

        if "norm_eps" in config and config["norm_eps"] is not None:
            self.eps = float(config["norm_eps"])
        else:
            self.eps = float(_get(config, "rms_norm_eps", 1e-5))

        self.replicated_rmsn_scale = bool(_get(config, "replicated_rmsn_scale", True))
        self.lm_head_type = str(_get(config, "lm_head_type", "replicate"))
        if self.lm_head_type not in ("replicate", "lane", "vocab_parallel"):
            raise ValueError(f"unknown lm_head_type {self.lm_head_type!r}")
        self.pre_norm_lane_agg = bool(_get(config, "pre_norm_lane_agg", False))
        if self.pre_norm_lane_agg and self.lm_head_type != "replicate":
            raise ValueError("pre_norm_lane_agg is only allowed with lm_head_type='replicate' (docs/laneformer.md §7)")
        if self.lm_head_type == "vocab_parallel" and self.V % self.L != 0:
            raise ValueError("vocab_parallel head needs vocab_size divisible by num_lanes")

        # Things this reference does not implement: refuse loudly rather than silently differ.
        if config.get("rope_scaling_args") is not None:
            raise NotImplementedError("rope_scaling_args: pass the llama3 block as rope_scaling")
        if config.get("rope_dim") is not None and int(config["rope_dim"]) != self.hd:
            raise NotImplementedError("partial rotary (rope_dim != head_dim) is not in docs/laneformer.md")


# --------------------------------------------------------------------------------------------
# docs/laneformer.md §5: which layers are sliding-window
# --------------------------------------------------------------------------------------------


def swa_layer_set(config: dict) -> set[int]:
    """Indices of the layers that use sliding-window attention (docs/laneformer.md §5).

    ``sliding_window`` null -> no SWA anywhere.  Otherwise, in order of precedence:
    ``layer_types`` (one "sliding_attention"/"full_attention" per layer), then ``swa_layers``
    (explicit list), then the old convention with ``sliding_window_n_layers`` (n) and
    ``unclamped_layers``.
    """
    n_layers = int(config["num_hidden_layers"])
    if config.get("sliding_window") is None:
        return set()

    layer_types = config.get("layer_types")
    if layer_types is not None:
        if len(layer_types) != n_layers:
            raise ValueError(f"layer_types has {len(layer_types)} entries for {n_layers} layers")
        result = set()
        for i, kind in enumerate(layer_types):
            if kind == "sliding_attention":
                result.add(i)
            elif kind != "full_attention":
                raise ValueError(f"unknown layer type {kind!r} for layer {i}")
        return result

    swa_layers = config.get("swa_layers")
    if swa_layers is not None:
        result = set()
        for i in swa_layers:
            i = int(i)
            if not 0 <= i < n_layers:
                raise ValueError(f"swa_layers entry {i} out of range for {n_layers} layers")
            result.add(i)
        return result

    n = int(_get(config, "sliding_window_n_layers", 0))
    unclamped = [int(i) for i in _get(config, "unclamped_layers", [])]
    result = set()
    for i in range(n_layers):
        if i in unclamped:  # rule 1: full causal
            continue
        if i < n or i >= n_layers + n:  # rule 2: SWA
            result.add(i)
        # rule 3: full causal otherwise
    return result


# --------------------------------------------------------------------------------------------
# docs/laneformer.md §4: reduce modes
# --------------------------------------------------------------------------------------------


def reduce_modes(config: dict) -> list[tuple[str, str]]:
    """(attention mode, MLP mode) of every layer, per docs/laneformer.md §4 (the older code's assignment)."""
    c = _Cfg(config)
    modes = []
    for i in range(c.N):
        pair = []
        for comm in (c.use_attention_comm, c.use_mlp_comm):
            if i < c.d:
                pair.append(PRESENT if c.use_early_comm else NO_REDUCE)
            else:
                pair.append(PAST if comm else NO_REDUCE)
        modes.append((pair[0], pair[1]))
    return modes


def _reduce(mode: str, x: list, past: list | None, n_lanes: int) -> list:
    """Reduce(x, past) of docs/laneformer.md §4 on per-lane lists of [B,S,D] tensors; returns one tensor per lane."""
    out = []
    if mode == NO_REDUCE:
        for lane in range(n_lanes):
            out.append(x[lane] * math.sqrt(n_lanes))
    elif mode == PRESENT:
        total = x[0]
        for lane in range(1, n_lanes):
            total = total + x[lane]
        for lane in range(n_lanes):
            out.append(total)
    elif mode == PAST:
        if past is None:
            # newer revision, early_layers_broadcast=False: nothing was broadcast from layers < d,
            # past is zero, so x + (sum(0) - 0) = x.
            for lane in range(n_lanes):
                out.append(x[lane])
        else:
            past_total = past[0]
            for lane in range(1, n_lanes):
                past_total = past_total + past[lane]
            for lane in range(n_lanes):
                out.append(x[lane] + (past_total - past[lane]))
    else:
        raise ValueError(mode)
    return out


# --------------------------------------------------------------------------------------------
# docs/laneformer.md §6: RoPE
# --------------------------------------------------------------------------------------------


def rope_frequencies(config: dict, head_dim: int) -> torch.Tensor:
    """f_t = theta^(-2t/hd), t = 0..hd/2-1, with optional llama3 scaling; float64 [hd/2]."""
    theta = float(_get(config, "rope_theta", 10000.0))
    freqs = []
    for t in range(head_dim // 2):
        freqs.append(theta ** (-2.0 * t / head_dim))

    scaling = config.get("rope_scaling")
    if scaling is not None:
        rope_type = scaling.get("rope_type", scaling.get("type"))
        if rope_type in (None, "default"):
            pass
        elif rope_type == "llama3":
            factor = float(scaling["factor"])
            low = float(scaling["low_freq_factor"])
            high = float(scaling["high_freq_factor"])
            orig = float(scaling["original_max_position_embeddings"])
            scaled = []
            for f in freqs:
                wavelen = 2.0 * math.pi / f
                if wavelen > orig / low:
                    scaled.append(f / factor)
                elif wavelen < orig / high:
                    scaled.append(f)
                else:
                    s = (orig / wavelen - low) / (high - low)
                    scaled.append((1.0 - s) * f / factor + s * f)
            freqs = scaled
        else:
            raise NotImplementedError(f"rope_scaling type {rope_type!r} is not in docs/laneformer.md")
    return torch.tensor(freqs, dtype=torch.float64)


def _rope_cos_sin(config: dict, head_dim: int, seq_len: int):
    """cos/sin tables [S, hd/2] (angles in float64, then cast to float32)."""
    freqs = rope_frequencies(config, head_dim)
    cos = torch.zeros(seq_len, head_dim // 2, dtype=torch.float64)
    sin = torch.zeros(seq_len, head_dim // 2, dtype=torch.float64)
    for pos in range(seq_len):
        angle = pos * freqs
        cos[pos] = torch.cos(angle)
        sin[pos] = torch.sin(angle)
    return cos.float(), sin.float()


def apply_rope_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B,S,hd]; pair (2t, 2t+1) rotated by angle pos*f_t (complex multiply by e^{i angle})."""
    out = torch.empty_like(x)
    half = x.shape[-1] // 2
    for t in range(half):
        a = x[..., 2 * t]
        b = x[..., 2 * t + 1]
        c = cos[:, t]  # [S], broadcasts against [B,S]
        s = sin[:, t]
        out[..., 2 * t] = a * c - b * s
        out[..., 2 * t + 1] = a * s + b * c
    return out


# --------------------------------------------------------------------------------------------
# Building blocks
# --------------------------------------------------------------------------------------------


def _rms(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt((x * x).mean(dim=-1, keepdim=True) + eps)


def _norm_lane(x: torch.Tensor, weight: torch.Tensor, lane: int, eps: float) -> torch.Tensor:
    """RMSNorm of one lane's stream x [B,S,D]; weight [D] (replicated) or [L, D] (lane scale)."""
    if weight.dim() == 1:
        return _rms(x, eps) * weight
    return _rms(x, eps) * weight[lane]


def _mask(seq_len: int, window: int | None) -> torch.Tensor:
    """Additive [S,S] mask: query p sees key j iff j <= p (and p - W < j when windowed)."""
    mask = torch.full((seq_len, seq_len), _NEG_INF, dtype=torch.float32)
    for p in range(seq_len):
        for j in range(seq_len):
            allowed = j <= p
            if window is not None:
                allowed = allowed and (p - window < j)
            if allowed:
                mask[p, j] = 0.0
    return mask


def _attention(c: _Cfg, x_lanes: list, wq, wk, wv, wo, cos, sin, mask) -> list:
    """Attention (docs/laneformer.md §3) on per-lane normed inputs; returns the per-lane (unreduced) outputs [B,S,D]."""
    hq_lane = c.Hq // c.L
    hkv_lane = c.Hkv // c.L
    n_rep = c.Hq // c.Hkv
    hd = c.hd

    # Projections, per lane on the lane's own stream; then the lane-major global head numbering.
    q_heads, k_heads, v_heads = {}, {}, {}
    for lane in range(c.L):
        q = x_lanes[lane] @ wq[lane].T  # [B,S,Hq/L*hd]
        k = x_lanes[lane] @ wk[lane].T  # [B,S,Hkv/L*hd]
        v = x_lanes[lane] @ wv[lane].T
        for j in range(hq_lane):
            q_heads[hq_lane * lane + j] = q[..., j * hd:(j + 1) * hd]
        for j in range(hkv_lane):
            k_heads[hkv_lane * lane + j] = k[..., j * hd:(j + 1) * hd]
            v_heads[hkv_lane * lane + j] = v[..., j * hd:(j + 1) * hd]

    for h in range(c.Hq):
        q_heads[h] = apply_rope_interleaved(q_heads[h], cos, sin)
    for g in range(c.Hkv):
        k_heads[g] = apply_rope_interleaved(k_heads[g], cos, sin)

    scale = hd ** -0.5
    out_heads = {}
    for h in range(c.Hq):
        g = h // n_rep  # GQA
        scores = (q_heads[h] @ k_heads[g].transpose(-1, -2)) * scale  # [B,S,S]
        scores = scores + mask
        probs = torch.softmax(scores, dim=-1)
        out_heads[h] = probs @ v_heads[g]  # [B,S,hd]

    outputs = []
    for lane in range(c.L):
        o = torch.cat([out_heads[hq_lane * lane + j] for j in range(hq_lane)], dim=-1)
        outputs.append(o @ wo[lane].T)  # [B,S,D], a partial sum
    return outputs


def _mlp(c: _Cfg, x_lanes: list, w1, w3, w2) -> list:
    outputs = []
    for lane in range(c.L):
        gate = x_lanes[lane] @ w1[lane].T
        up = x_lanes[lane] @ w3[lane].T
        hidden = torch.nn.functional.silu(gate) * up
        outputs.append(hidden @ w2[lane].T)
    return outputs


# --------------------------------------------------------------------------------------------
# Weights
# --------------------------------------------------------------------------------------------


def _tensor(tensors: dict, key: str, shape: tuple) -> torch.Tensor:
    if key not in tensors:
        raise KeyError(f"missing tensor {key!r}")
    t = tensors[key]
    if tuple(t.shape) != tuple(shape):
        raise ValueError(f"{key}: expected shape {tuple(shape)}, got {tuple(t.shape)}")
    return t.detach().to(torch.float32)


def _norm_weight(c: _Cfg, tensors: dict, prefix: str, replicated: bool) -> torch.Tensor:
    if replicated:
        return _tensor(tensors, prefix + ".weight", (c.D,))
    return _tensor(tensors, prefix + ".scale", (c.L, c.D))


# --------------------------------------------------------------------------------------------
# Forward
# --------------------------------------------------------------------------------------------


def _forward(config: dict, tensors: dict, ids: torch.Tensor, trace: dict | None):
    c = _Cfg(config)
    if ids.dim() != 2:
        raise ValueError(f"ids must be [B, S], got shape {tuple(ids.shape)}")
    ids = ids.long()
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= c.V):
        raise ValueError("token id out of range")
    seq_len = ids.shape[1]

    # docs/laneformer.md §1: embedding and lane expansion: identical copies of the embedding in every lane.
    emb = _tensor(tensors, "model.tok_embeddings.weight", (c.V, c.D))
    e = emb[ids]  # [B,S,D]
    h = [e.clone() for _ in range(c.L)]

    swa = swa_layer_set(config)
    modes = reduce_modes(config)
    cos, sin = _rope_cos_sin(config, c.hd, seq_len)
    full_mask = _mask(seq_len, None)
    swa_mask = _mask(seq_len, c.sliding_window) if c.sliding_window is not None else None

    future_attention = {}
    future_mlp = {}
    for i in range(c.N):
        p = f"model.layers.{i}."
        attn_norm = _norm_weight(c, tensors, p + "attention_norm", c.replicated_rmsn_scale)
        ffn_norm = _norm_weight(c, tensors, p + "ffn_norm", c.replicated_rmsn_scale)
        wq = _tensor(tensors, p + "attention.wq.weight", (c.L, c.Hq * c.hd // c.L, c.D))
        wk = _tensor(tensors, p + "attention.wk.weight", (c.L, c.Hkv * c.hd // c.L, c.D))
        wv = _tensor(tensors, p + "attention.wv.weight", (c.L, c.Hkv * c.hd // c.L, c.D))
        wo = _tensor(tensors, p + "attention.wo.weight", (c.L, c.D, c.Hq * c.hd // c.L))
        w1 = _tensor(tensors, p + "feed_forward.w1.weight", (c.L, c.F // c.L, c.D))
        w3 = _tensor(tensors, p + "feed_forward.w3.weight", (c.L, c.F // c.L, c.D))
        w2 = _tensor(tensors, p + "feed_forward.w2.weight", (c.L, c.D, c.F // c.L))
        attn_mode, mlp_mode = modes[i]
        mask = swa_mask if i in swa else full_mask

        # Which saved partials of layer i - d are visible to layer i.
        past_a = past_m = None
        if i >= c.d:
            src = i - c.d
            if src >= c.d or c.early_layers_broadcast:
                past_a = future_attention[src]
                past_m = future_mlp[src]

        h_in = h
        # attention sub-block
        r = h
        x = [_norm_lane(h[lane], attn_norm, lane, c.eps) for lane in range(c.L)]
        a = _attention(c, x, wq, wk, wv, wo, cos, sin, mask)
        red = _reduce(attn_mode, a, past_a if attn_mode == PAST else None, c.L)
        h = [r[lane] + red[lane] for lane in range(c.L)]
        future_attention[i] = a  # saved BEFORE reduction
        h_mid = h

        # MLP sub-block
        r = h
        x = [_norm_lane(h[lane], ffn_norm, lane, c.eps) for lane in range(c.L)]
        m = _mlp(c, x, w1, w3, w2)
        red = _reduce(mlp_mode, m, past_m if mlp_mode == PAST else None, c.L)
        h = [r[lane] + red[lane] for lane in range(c.L)]
        future_mlp[i] = m

        if trace is not None:
            stack = lambda xs: torch.stack(xs, dim=2)  # noqa: E731  list of [B,S,D] -> [B,S,L,D]
            trace["h_in"].append(stack(h_in))
            trace["attn_out"].append(stack(a))
            trace["h_mid"].append(stack(h_mid))
            trace["mlp_out"].append(stack(m))
            trace["h_out"].append(stack(h))
            trace["modes"].append((attn_mode, mlp_mode))
            trace["swa"].append(i in swa)
            trace["has_past"].append(past_a is not None)

    hidden = torch.stack(h, dim=2)  # [B,S,L,D]
    logits = _head(c, tensors, h)
    return hidden, logits


def _head(c: _Cfg, tensors: dict, h: list) -> torch.Tensor:
    """docs/laneformer.md §7: final norm, lane aggregation and LM head."""
    if c.pre_norm_lane_agg:
        norm_w = _tensor(tensors, "model.norm.weight", (c.D,))
        w = _tensor(tensors, "lm_head.weight", (c.V, c.D))
        total = h[0]
        for lane in range(1, c.L):
            total = total + h[lane]
        y = _rms(total, c.eps) * norm_w  # a SUM over lanes, then the norm
        return y @ w.T

    norm_w = _norm_weight(c, tensors, "model.norm", c.replicated_rmsn_scale)
    normed = [_norm_lane(h[lane], norm_w, lane, c.eps) for lane in range(c.L)]

    if c.lm_head_type == "replicate":
        w = _tensor(tensors, "lm_head.weight", (c.V, c.D))
        total = normed[0]
        for lane in range(1, c.L):
            total = total + normed[lane]
        y = total / c.L  # mean over lanes of the normed streams
        return y @ w.T

    if c.lm_head_type == "lane":
        w = _tensor(tensors, "lm_head.linear.weight", (c.V, c.L * c.D))
        logits = None
        for lane in range(c.L):
            w_lane = w[:, lane * c.D:(lane + 1) * c.D]  # lane-major column blocks
            part = normed[lane] @ w_lane.T
            logits = part if logits is None else logits + part
        return logits

    # vocab_parallel
    w = _tensor(tensors, "lm_head.weight", (c.L, c.V // c.L, c.D))
    slices = [normed[lane] @ w[lane].T for lane in range(c.L)]
    return torch.cat(slices, dim=-1)


def naive_logits(config: dict, tensors: dict, ids: torch.Tensor) -> torch.Tensor:
    """ids [B, S] -> logits [B, S, V] (float32 computation; full causal recompute, no KV cache)."""
    with torch.no_grad():
        return _forward(config, tensors, ids, None)[1]


def naive_hidden_states(config: dict, tensors: dict, ids: torch.Tensor) -> torch.Tensor:
    """ids [B, S] -> per-lane residual streams after the last layer, [B, S, L, D] (pre final norm)."""
    with torch.no_grad():
        return _forward(config, tensors, ids, None)[0]


def naive_trace(config: dict, tensors: dict, ids: torch.Tensor) -> dict:
    """Per-layer intermediates, each a list over layers of [B,S,L,D] tensors.

    Keys: h_in, attn_out (unreduced partials), h_mid (after the attention residual add), mlp_out,
    h_out, plus modes / swa / has_past per layer, hidden [B,S,L,D] and logits [B,S,V].
    """
    trace = {k: [] for k in ("h_in", "attn_out", "h_mid", "mlp_out", "h_out", "modes", "swa",
                             "has_past")}
    with torch.no_grad():
        hidden, logits = _forward(config, tensors, ids, trace)
    trace["hidden"] = hidden
    trace["logits"] = logits
    return trace


# --------------------------------------------------------------------------------------------
# Test helpers: configs and random weights
# --------------------------------------------------------------------------------------------


def tiny_config(**overrides) -> dict:
    """A small valid Laneformer config (HF field names); keyword arguments override fields."""
    config = {
        "model_type": "laneformer_tp",
        "vocab_size": 64,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "num_lanes": 4,
        "broadcast_delay": 1,
        "use_comm": True,
        "use_early_comm": True,
        "sliding_window": None,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "norm_eps": 1e-5,
        "replicated_rmsn_scale": True,
        "lm_head_type": "replicate",
        "pre_norm_lane_agg": False,
        "max_position_embeddings": 256,
        "tie_word_embeddings": False,
    }
    config.update(overrides)
    return config


def random_laneformer(config: dict, seed: int) -> dict:
    """Random float32 state dict in the docs/laneformer.md §8 3-D HF layout for ``config``.

    Linear weights ~ N(0, 1/fan_in), embedding ~ N(0, 1), norm weights/scales ~ 1 + N(0, 0.1²)
    (so that they matter), which keeps activations and logits O(1).
    """
    c = _Cfg(config)
    gen = torch.Generator().manual_seed(int(seed))

    def normal(shape, std):
        return torch.randn(*shape, generator=gen, dtype=torch.float32) * std

    def norm(shape):
        return 1.0 + normal(shape, 0.1)

    def norm_entry(sd, prefix, replicated):
        if replicated:
            sd[prefix + ".weight"] = norm((c.D,))
        else:
            sd[prefix + ".scale"] = norm((c.L, c.D))

    q_lane = c.Hq * c.hd // c.L
    kv_lane = c.Hkv * c.hd // c.L
    f_lane = c.F // c.L
    sd = {"model.tok_embeddings.weight": normal((c.V, c.D), 1.0)}
    for i in range(c.N):
        p = f"model.layers.{i}."
        norm_entry(sd, p + "attention_norm", c.replicated_rmsn_scale)
        sd[p + "attention.wq.weight"] = normal((c.L, q_lane, c.D), c.D ** -0.5)
        sd[p + "attention.wk.weight"] = normal((c.L, kv_lane, c.D), c.D ** -0.5)
        sd[p + "attention.wv.weight"] = normal((c.L, kv_lane, c.D), c.D ** -0.5)
        sd[p + "attention.wo.weight"] = normal((c.L, c.D, q_lane), q_lane ** -0.5)
        norm_entry(sd, p + "ffn_norm", c.replicated_rmsn_scale)
        sd[p + "feed_forward.w1.weight"] = normal((c.L, f_lane, c.D), c.D ** -0.5)
        sd[p + "feed_forward.w3.weight"] = normal((c.L, f_lane, c.D), c.D ** -0.5)
        sd[p + "feed_forward.w2.weight"] = normal((c.L, c.D, f_lane), f_lane ** -0.5)
    norm_entry(sd, "model.norm", c.replicated_rmsn_scale or c.pre_norm_lane_agg)
    if c.lm_head_type == "replicate":
        sd["lm_head.weight"] = normal((c.V, c.D), c.D ** -0.5)
    elif c.lm_head_type == "lane":
        sd["lm_head.linear.weight"] = normal((c.V, c.L * c.D), (c.L * c.D) ** -0.5)
    else:
        sd["lm_head.weight"] = normal((c.L, c.V // c.L, c.D), c.D ** -0.5)
    return sd
