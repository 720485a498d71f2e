"""Laneformer in lane form (docs/laneformer.md §1-§7): embedding -> lanes -> layers (attention, MLP, reduce) -> aggregate -> head.

The hidden state carries an explicit lane axis. We keep it lane-major, `h: [L, B, S, D]` (`[B, S, L, D]`
with the lane axis first), so that every lane-local matmul is one slice of a `bmm`
and a rank of the DTP runtime holds a contiguous block of lanes. A model instance may host only a
slice of the lanes (`lanes = range(l0, l1)`); all cross-lane traffic goes through `self.comm`
(`LocalLanes` here, collectives in `engine.dtp`), so the math is written once.

A Llama checkpoint is the same model with every layer reducing PRESENT (standard tensor parallelism).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from laneplay.engine.config import NO_REDUCE, PRESENT, ModelConfig
from laneplay.engine.runtime import PREFILL_CHUNK
from laneplay.engine.sampling import RowSampler

# Prompt chunks ending by this position run as one-token groups of the fused low-bit step
# (`LaneModel.prefills_as_groups`); later ones through the per-layer path, whose attention is faster there.
GROUPS_PREFILL_END = 1024



# ---- RoPE (docs/laneformer.md §6) ----------------------------------------------------------------

def rope_frequencies(cfg: ModelConfig) -> Tensor:
    """f_t = theta^(-2t/hd), t = 0..hd/2-1, with optional Llama-3.1 scaling; float64 for exactness."""
    t = torch.arange(0, cfg.head_dim, 2, dtype=torch.float64)
    freqs = cfg.rope_theta ** (-t / cfg.head_dim)
    s = cfg.rope_scaling
    if s is None:
        return freqs
    wavelen = 2 * math.pi / freqs
    low_wavelen = s.original_max_position_embeddings / s.low_freq_factor
    high_wavelen = s.original_max_position_embeddings / s.high_freq_factor
    smooth = (s.original_max_position_embeddings / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    blended = (1 - smooth) * freqs / s.factor + smooth * freqs
    return torch.where(wavelen > low_wavelen, freqs / s.factor, torch.where(wavelen < high_wavelen, freqs, blended))


def rope_tables(cfg: ModelConfig, max_positions: int, device=None) -> tuple[Tensor, Tensor]:
    """cos, sin: [max_positions, hd/2] float32."""
    angles = torch.outer(torch.arange(max_positions, dtype=torch.float64), rope_frequencies(cfg))
    return angles.cos().float().to(device), angles.sin().float().to(device)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Interleaved pairs (2t, 2t+1) rotated by pos*f_t. x: [..., S, H, hd]; cos/sin: [S, hd/2]."""
    xf = x.float().unflatten(-1, (-1, 2))  # [..., S, H, hd/2, 2]
    x0, x1 = xf[..., 0], xf[..., 1]
    c, s = cos[:, None, :], sin[:, None, :]  # broadcast over heads
    out = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1)
    return out.flatten(-2).to(x.dtype)


# ---- building blocks -------------------------------------------------------------------------

def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """RMSNorm over the last dim, in float32; weight is [D] (replicated) or [L, 1, 1, D] (per lane)."""
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y.to(x.dtype) * weight


def lane_linear(x: Tensor, w) -> Tensor:
    """y[l] = x[l] @ w[l].T. x: [L, B, S, I], w: [L, O, I] -> [L, B, S, O] (docs/laneformer.md §2).

    w may also be a packed low-bit weight (`kernels.lowbit.PackedWeight`, the CPU low-bit path)."""
    if not isinstance(w, Tensor):
        return w.linear(x)
    L, B, S, I = x.shape
    return torch.bmm(x.reshape(L, B * S, I), w.transpose(1, 2)).view(L, B, S, -1)


def linear(x: Tensor, w) -> Tensor:
    """x [..., I] @ w[O, I].T (w a tensor or a packed low-bit weight)."""
    return x @ w.T if isinstance(w, Tensor) else w.linear(x)


def decode_attention(q: Tensor, k: Tensor, v: Tensor) -> Tensor:
    """One query token over all visible keys; the GQA group of a KV head shares one matmul.

    q [N, Hq, 1, hd], k/v [N, Hkv, T, hd] -> [N, Hq, 1, hd]. Scores softmax in float32.
    (Small matmuls beat the fused CPU attention kernel at one query.)
    """
    return flat_decode_attention(q, k.flatten(0, 1), v.flatten(0, 1), k.shape[1])


def flat_decode_attention(q: Tensor, k: Tensor, v: Tensor, hkv: int) -> Tensor:
    """`decode_attention` with the row and KV-head axes of k/v flattened: k/v [N*Hkv, T, hd].

    The compiled decode block passes `kc.flatten(0, 1)[:, :n]`: the visible slots of the flattened
    cache are a view whatever n is, where reshaping the [N, Hkv, n, hd] slice depends on whether n
    is the whole cache (and the compiled block would guard on it)."""
    N, hq, _, hd = q.shape
    qg = q.reshape(N * hkv, hq // hkv, hd)  # query head j uses KV head j // (hq / hkv)
    scores = torch.bmm(qg, k.transpose(1, 2)).float() * hd ** -0.5  # [N*Hkv, rep, T]
    probs = scores.softmax(-1).to(v.dtype)
    return torch.bmm(probs, v).reshape(N, hq, 1, hd)


def chunk_attention(q: Tensor, k: Tensor, v: Tensor, past: tuple[Tensor, Tensor] | None) -> Tensor:
    """A prompt chunk's attention on CPU: causal among its own S tokens, and over all of `past` (the
    cached keys/values of the positions before it). q [N, Hq, S, hd]; k, v [N, Hkv, S, hd].

    Two flash-attention calls merged by their log-sum-exps, so no mask is built and no masked-out score
    is computed. For the past, each KV head's query heads are folded into one longer query sequence
    (GQA without copying the cache), which is also why this beats one masked call.
    """
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    N, hq, S, hd = q.shape
    hkv = k.shape[1]
    rep = hq // hkv
    own_k = k.repeat_interleave(rep, 1) if rep > 1 else k
    own_v = v.repeat_interleave(rep, 1) if rep > 1 else v
    o_own, lse_own = flash(q, own_k, own_v, is_causal=True)[:2]
    if past is None or past[0].shape[2] == 0:
        return o_own
    o_past, lse_past = flash(q.reshape(N, hkv, rep * S, hd), past[0], past[1])[:2]
    o_past, lse_past = o_past.reshape(N, hq, S, hd), lse_past.reshape(N, hq, S)
    top = torch.maximum(lse_own, lse_past)
    w_own, w_past = (lse_own - top).exp().unsqueeze(-1), (lse_past - top).exp().unsqueeze(-1)
    out = (o_own.float() * w_own + o_past.float() * w_past) / (w_own + w_past)
    return out.to(q.dtype)


def project_qkv(x: Tensor, wqkv: Tensor, cos: Tensor, sin: Tensor, cfg: ModelConfig):
    """Normed x [L, B, S, D] -> q [L*B, Hq_l, S, hd], k, v [L*B, Hkv_l, S, hd]; RoPE on q and k."""
    L, B, S, _ = x.shape
    hq, hkv, hd = cfg.heads_per_lane, cfg.kv_heads_per_lane, cfg.head_dim
    q, k, v = lane_linear(x, wqkv).split([hq * hd, hkv * hd, hkv * hd], dim=-1)
    q = apply_rope(q.reshape(L * B, S, hq, hd), cos, sin).transpose(1, 2)
    k = apply_rope(k.reshape(L * B, S, hkv, hd), cos, sin).transpose(1, 2)
    return q, k, v.reshape(L * B, S, hkv, hd).transpose(1, 2)


def decode_blocks(cfg: ModelConfig):
    """The two per-layer functions of one decode step, pure in their tensor arguments."""
    eps = cfg.norm_eps

    def attention_block(h, norm_w, wqkv, wo, kc, vc, cos, sin, slot: Tensor, n: int | Tensor) -> Tensor:
        """h [L, B, 1, D] -> attention partial [L, B, 1, D]; writes this token's K/V into slot and
        attends over slots [0, n). n is an int, or a 0-d tensor holding it (the compiled block)."""
        L, B = h.shape[:2]
        if isinstance(n, Tensor):  # see _compiled_blocks
            n = n.item()
            torch._check(n >= 1)
            torch._check(n <= kc.shape[2])
        q, k, v = project_qkv(rms_norm(h, norm_w, eps), wqkv, cos, sin, cfg)
        kc.index_copy_(2, slot, k)
        vc.index_copy_(2, slot, v)
        o = flat_decode_attention(q, kc.flatten(0, 1)[:, :n], vc.flatten(0, 1)[:, :n], kc.shape[1])
        return lane_linear(o.transpose(1, 2).reshape(L, B, 1, -1), wo)

    def mlp_block(h, norm_w, w13, w2) -> Tensor:
        """SwiGLU of the normed stream: h [L, B, S, D] -> MLP partial [L, B, S, D]."""
        gate, up = lane_linear(rms_norm(h, norm_w, eps), w13).chunk(2, dim=-1)
        return lane_linear(F.silu(gate) * up, w2)

    return attention_block, mlp_block


def _standard_strides(x: Tensor) -> Tensor:
    """x itself when it has the contiguous strides of its shape (size-1 dims included), else a copy that
    has them. A compiled block guards on its arguments' strides: a lane axis expanded from one stream
    has stride 0, and a one-row slice of a stream keeps its parent's strides in its size-1 dims."""
    stride, expect = x.stride(), 1
    for d in range(x.dim() - 1, -1, -1):
        if stride[d] != expect:
            return x.clone(memory_format=torch.contiguous_format)
        expect *= x.shape[d]
    return x


def _compiled_blocks(attention_block, mlp_block):
    """`decode_blocks`' functions compiled so that each compiles twice: for one row, and for any
    number of rows >= 2 at any position, cache length and window.

    Every size is static (the weights, the heads, cos/sin [1, hd/2]) except the ones marked dynamic
    here: the stream's rows and the K/V cache's rows and slots. `maybe_mark_dynamic` lets a size of 1
    specialise (the one-row graph) and makes symbols that are never duck-sized, i.e. never tied to
    another size because the two happened to be equal at the first compile. The visible slot count n
    goes in as a 0-d tensor read inside the graph (`fullgraph` keeps the read in it): as a plain
    dynamic int the graph would also guard on n < slots (whether the visible slice of the cache is
    contiguous: it is once a ring is full, or at a cache's last position) and on n <= 4096 (how
    inductor sums a float reduction that long). The stream goes in with its contiguous strides
    (`_standard_strides`); cos/sin must be tensors of their own, not views at the position's offset;
    the caches must not be views (`KVCache`). The MLP acts row by row, so the stream [L, B, S, D] goes
    in as [L, B*S, 1, D]: decode steps and prefill chunks share its two graphs.

    `dynamic=False` turns off automatic dynamic shapes (a size that changes recompiles with it made
    symbolic, and that state is kept per function, so another model in the process would make the
    first one's sizes symbolic); `isolate_recompiles` gives each model its own compiled graphs and
    recompile limit (the functions' code is shared by every model).
    """
    attention = torch.compile(attention_block, fullgraph=True, dynamic=False, isolate_recompiles=True)
    mlp = torch.compile(mlp_block, fullgraph=True, dynamic=False, isolate_recompiles=True)
    mark = torch._dynamo.maybe_mark_dynamic

    def compiled_attention(h, norm_w, wqkv, wo, kc, vc, cos, sin, slot: Tensor, n: int) -> Tensor:
        h = _standard_strides(h)
        mark(h, 1)  # rows
        for c in (kc, vc):
            mark(c, 0)  # lanes x rows
            mark(c, 2)  # slots: the request's length, or the window of a ring layer
        return attention(h, norm_w, wqkv, wo, kc, vc, cos, sin, slot, torch.tensor(n))

    def compiled_mlp(h, norm_w, w13, w2) -> Tensor:
        L, B, S, D = h.shape
        x = _standard_strides(h.reshape(L, B * S, 1, D))
        mark(x, 1)  # rows x positions
        return mlp(x, norm_w, w13, w2).view(L, B, S, -1)

    return compiled_attention, compiled_mlp


class LocalLanes:
    """Cross-lane communication when all lanes live in this process: sums are local reductions.

    `start_lane_sum` / `wait` are the issue and wait points of the delayed reduce; the DTP runtime
    replaces them with asynchronous collectives (`engine.dtp.DistLanes`), and with a gather of the
    ranks' vocab shards in `gather_logits` / `pick`.
    """

    def lane_sum(self, x: Tensor) -> Tensor:  # [L, ...] -> [1, ...], blocking
        return x if x.shape[0] == 1 else x.sum(0, keepdim=True)

    def start_lane_sum(self, x: Tensor):
        return x.sum(0, keepdim=True)

    def wait(self, handle) -> Tensor:
        return handle

    def ready(self, total: Tensor):
        """A handle for a sum that is already complete."""
        return total

    def gather_logits(self, logits: Tensor) -> tuple[Tensor, None]:
        """The head's output is already the whole vocabulary here."""
        return logits, None

    def verify_logits(self, logits: Tensor) -> Tensor:
        """A speculative verify's logits [B, S, V]: whole already."""
        return logits

    def pick(self, logits: Tensor, sampler: RowSampler) -> Tensor:
        return sampler(logits)

    def note_step(self, start: float, end: float) -> None:
        """A decode step's span (the DTP runtime records them for its timeline)."""

    def agree_stop(self, should_stop) -> bool:
        """Between prefill chunks: stop now? (Under DTP every rank must give the same answer.)"""
        return should_stop is not None and bool(should_stop())


# ---- KV cache --------------------------------------------------------------------------------

class KVCache:
    """Preallocated per-layer K/V, post-RoPE, before GQA repetition: [L*B, Hkv_lane, slots, hd].

    Full-attention layers have one slot per position; sliding-window layers a ring buffer of
    `W` slots (position p lives in slot p % W), so their memory does not grow with the sequence.

    The tensors are ordinary (not inference) tensors whatever mode they are made in, and none is a view
    of a larger tensor: a compiled decode block guards on both (an inference-mode cache and another one
    would compile it twice). Writing into a cache needs no inference mode.
    """

    def __init__(self, cfg: ModelConfig, n_lanes: int, batch: int, max_seq_len: int, dtype, device, spare: int = 0):
        """spare: ring slots beyond each window (the CUDA step's caches: a verify's later positions then
        land outside its earlier positions' windows, see `engine.static_step`)."""
        self.batch, self.max_seq_len = batch, max_seq_len
        self.k, self.v, self.slots = [], [], []
        with torch.inference_mode(False):
            for i in range(cfg.num_layers):
                w = cfg.window(i)
                slots = min(w + spare, max_seq_len) if w else max_seq_len
                shape = (n_lanes * batch, cfg.kv_heads_per_lane, slots, cfg.head_dim)
                self.k.append(torch.zeros(shape, dtype=dtype, device=device))
                self.v.append(torch.zeros(shape, dtype=dtype, device=device))
                self.slots.append(slots)

    def expand_batch(self, n: int) -> "KVCache":
        """A cache for n sequences that all start with this (batch-1) cache's content."""
        assert self.batch == 1
        out = object.__new__(KVCache)
        out.batch, out.max_seq_len, out.slots = n, self.max_seq_len, list(self.slots)
        out.k = [_repeat_rows(t, n) for t in self.k]
        out.v = [_repeat_rows(t, n) for t in self.v]
        return out




def _repeat_rows(t: Tensor, n: int) -> Tensor:
    """[L, ...] -> [L*n, ...], each row n times (lane-major: lane l's n rows are l*n .. l*n + n-1), as an
    ordinary tensor of its own: `repeat_interleave` gives a view of a larger tensor, and a compiled
    decode block guards on the layout of a view's base as well."""
    with torch.inference_mode(False):
        out = t.new_empty((t.shape[0] * n, *t.shape[1:]))
        out.view(t.shape[0], n, *t.shape[1:]).copy_(t.unsqueeze(1))
    return out


class KVPrefix:
    """The K/V a prompt's prefill wrote for positions [0, end), kept to start another request's prefill
    from: every position on full-attention layers; on sliding-window layers the last W positions before
    each chunk boundary (what a ring buffer holds there), so the prefix can restart at any whole chunk.
    Layer i holds positions pos[i] (ascending), with k[i], v[i] [L, Hkv, len(pos[i]), hd] in that order."""

    def __init__(self, layers: int):
        self.end = 0
        self.pos: list[Tensor] = [torch.empty(0, dtype=torch.long) for _ in range(layers)]
        self.k: list[Tensor | None] = [None] * layers
        self.v: list[Tensor | None] = [None] * layers

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (*self.k, *self.v) if t is not None)

    def add_chunk(self, cache: KVCache, a: int, b: int) -> None:
        """After a prefill chunk wrote positions [a, b) into the (batch-1) cache: keep what of them
        the cache still holds."""
        assert cache.batch == 1 and a == self.end
        for i, (kc, vc, slots) in enumerate(zip(cache.k, cache.v, cache.slots)):
            p = torch.arange(max(a, b - slots), b)
            idx = (p % slots).to(kc.device)
            k, v = kc.index_select(2, idx), vc.index_select(2, idx)
            self.pos[i] = torch.cat([self.pos[i], p])
            self.k[i] = k if self.k[i] is None else torch.cat([self.k[i], k], dim=2)
            self.v[i] = v if self.v[i] is None else torch.cat([self.v[i], v], dim=2)
        self.end = b

    def truncated(self, end: int) -> "KVPrefix":
        out = KVPrefix(len(self.pos))
        out.end = end
        for i, p in enumerate(self.pos):
            n = int((p < end).sum())
            out.pos[i], out.k[i], out.v[i] = p[:n], self.k[i][:, :, :n], self.v[i][:, :, :n]
        return out

    def covers(self, end: int, slots: list[int]) -> bool:
        """Whether it holds every position [0, end) that a cache with these slots per layer keeps."""
        if end > self.end:
            return False
        for p, s in zip(self.pos, slots):
            lo = max(0, end - s)
            if int(((p >= lo) & (p < end)).sum()) != end - lo:
                return False
        return True

    def load(self, cache: KVCache, end: int) -> None:
        """Write positions [0, end) into a fresh batch-1 cache, each in the slot that cache keeps it in."""
        if cache.batch != 1 or not self.covers(end, cache.slots):
            raise ValueError("this prefix does not hold the positions the cache needs")
        for i, slots in enumerate(cache.slots):
            p = self.pos[i]
            src = torch.nonzero((p >= max(0, end - slots)) & (p < end)).flatten()
            if len(src) == 0:
                continue
            dst = (p[src] % slots).to(cache.k[i].device)
            src = src.to(cache.k[i].device)
            cache.k[i].index_copy_(2, dst, self.k[i].index_select(2, src))
            cache.v[i].index_copy_(2, dst, self.v[i].index_select(2, src))


class Rewind:
    """What a speculative verify overwrote on ring-buffer layers, to take back the positions it did not keep.

    A verify writes positions [pos, pos + S). On a full-attention layer position p has slot p of its own,
    and a position past the sequence's end is never read (attention reads slots [0, end)), so nothing
    needs restoring. On a sliding-window layer (W slots, position p in slot p % W) writing p overwrote
    position p - W, which the next positions still see: its K/V are saved here before the verify and put
    back for every position not kept. S <= W, so the verify writes each slot at most once.
    """

    def __init__(self, cache: KVCache, pos: int, S: int):
        self.cache, self.pos, self.S = cache, pos, S
        self.saved = []  # (layer, slot indices, k, v) of the ring layers
        for i, slots in enumerate(cache.slots):
            if slots >= cache.max_seq_len:
                continue  # slot = position: nothing a later step reads is overwritten
            if S > slots:
                raise ValueError(f"a verify of {S} positions does not fit a ring of {slots} slots")
            idx = (torch.arange(pos, pos + S) % slots).to(cache.k[i].device)
            self.saved.append((i, idx, cache.k[i].index_select(2, idx), cache.v[i].index_select(2, idx)))

    def keep(self, n: int) -> None:
        """Keep positions [pos, pos + n) as the verify wrote them; restore what the others overwrote."""
        if not 0 <= n <= self.S:
            raise ValueError(f"cannot keep {n} of {self.S} verified positions")
        if n == self.S:
            return
        with torch.inference_mode():  # k, v were saved in inference mode (a verify)
            for i, idx, k, v in self.saved:
                self.cache.k[i].index_copy_(2, idx[n:], k[:, :, n:])
                self.cache.v[i].index_copy_(2, idx[n:], v[:, :, n:])


def kv_cache_bytes(cfg: ModelConfig, n_lanes: int, batch: int, max_seq_len: int, element_size: int,
                   spare: int = 0) -> int:
    """What `KVCache(cfg, n_lanes, batch, max_seq_len, ..., spare)` allocates, without allocating it."""
    per_slot = 2 * n_lanes * batch * cfg.kv_heads_per_lane * cfg.head_dim * element_size  # K and V
    return sum(per_slot * (min(cfg.window(i) + spare, max_seq_len) if cfg.window(i) else max_seq_len)
               for i in range(cfg.num_layers))


def request_kv_bytes(cfg: ModelConfig, n: int, max_seq_len: int, element_size: int) -> int:
    """KV memory one request reserves, all lanes: the batch-1 prefill cache, plus its n-sample copy."""
    one = kv_cache_bytes(cfg, cfg.num_lanes, 1, max_seq_len, element_size)
    return one * (1 + n) if n > 1 else one


def _slot_positions(length: int, slots: int, device) -> Tensor:
    """Absolute position held by each slot after `length` positions were written (-1 = empty)."""
    s = torch.arange(slots, device=device)
    pos = s + ((length - 1 - s).div(slots, rounding_mode="floor")) * slots
    return torch.where(s < length, pos, torch.full_like(s, -1))


def _attention_mask(q_pos: Tensor, k_pos: Tensor, window: int | None) -> Tensor:
    """Bool [S, Skv]: query p sees key j iff j <= p (and p - W < j for sliding-window layers)."""
    allowed = (k_pos[None, :] <= q_pos[:, None]) & (k_pos[None, :] >= 0)
    if window:
        allowed &= k_pos[None, :] > q_pos[:, None] - window
    return allowed


# ---- the model -------------------------------------------------------------------------------

@dataclass
class LayerWeights:
    attn_norm: Tensor  # [D] or [L, 1, 1, D]
    wqkv: Tensor  # [L, (Hq_l + 2 Hkv_l) * hd, D]  (q, k, v of each lane's heads, fused)
    wo: Tensor  # [L, D, Hq_l * hd]
    ffn_norm: Tensor
    w13: Tensor  # [L, 2 F_l, D]  (gate rows, then up rows)
    w2: Tensor  # [L, D, F_l]


class LaneModel(nn.Module):
    """The whole model, or the lanes [l0, l1) of it. `weights` come from `engine.checkpoint`."""

    def __init__(self, cfg: ModelConfig, weights: dict[str, Tensor], lanes: range | None = None, comm=None):
        super().__init__()
        self.cfg = cfg
        self.lanes = lanes if lanes is not None else range(cfg.num_lanes)
        self.comm = comm if comm is not None else LocalLanes()
        nl = len(self.lanes)

        def norm(t: Tensor) -> Tensor:  # lane norms broadcast over [L, B, S, D]
            return t.view(nl, 1, 1, -1) if t.dim() == 2 else t

        self.embed = weights["embed"]  # [V, D]
        self.layers = [
            LayerWeights(
                attn_norm=norm(weights[f"layers.{i}.attn_norm"]), wqkv=weights[f"layers.{i}.wqkv"],
                wo=weights[f"layers.{i}.wo"], ffn_norm=norm(weights[f"layers.{i}.ffn_norm"]),
                w13=weights[f"layers.{i}.w13"], w2=weights[f"layers.{i}.w2"],
            )
            for i in range(cfg.num_layers)
        ]
        self.norm = norm(weights["norm"])
        self.head_weight = weights["head"]  # [V, D] | [L, V, D] (lane) | [L, V/L, D] (vocab_parallel)
        self.dtype, self.device = self.embed.dtype, self.embed.device
        self.cos, self.sin = rope_tables(cfg, cfg.max_position_embeddings, self.device)
        self.lowbit = not isinstance(self.layers[0].wqkv, Tensor) if self.layers else False
        self.fused_step = None
        self.kv_dtype = self.dtype  # what the KV cache holds
        if self.lowbit:  # packed weights (kernels.lowbit): fused low-bit decode blocks
            from laneplay.engine import lowbit_step
            from laneplay.kernels import lowbit

            self.kv_dtype = lowbit.KV_DTYPE

            self.attention_block, self.mlp_block = lowbit_step.decode_blocks(cfg)
            # one lane in one process: the whole step is one C call
            self.fused_step = lowbit_step.DecodeStep(self) if lowbit_step.DecodeStep.fits(self) else None
        else:
            self.attention_block, self.mlp_block = decode_blocks(cfg)

    def compile_blocks(self) -> None:
        """Compile the two per-layer block functions (fused elementwise work, no Python per op).
        The low-bit blocks are fused C calls already: nothing to compile.

        Each block compiles twice: for one row and for any number of rows >= 2, at any position and
        cache length (see `_compiled_blocks`); `LocalRunner.warm_up` runs both before any request."""
        if self.lowbit:
            return
        self.attention_block, self.mlp_block = _compiled_blocks(*decode_blocks(self.cfg))

    # -- sub-blocks (lane-local: lane l reads only its own stream and weights) ---------------------
    def attention(self, i: int, x: Tensor, pos: int, cache: KVCache | None) -> Tensor:
        """Prefill / full-forward attention of layer i on normed x [L, B, S, D] -> partial [L, B, S, D]."""
        cfg, w = self.cfg, self.layers[i]
        L, B, S, _ = x.shape
        q, k, v = project_qkv(x, w.wqkv, self.cos[pos:pos + S], self.sin[pos:pos + S], cfg)
        window = cfg.window(i)
        if cache is not None and cache.k[i].dtype != k.dtype:
            # a narrower cache (float16 on the low-bit path): the chunk attends to its own keys and values
            # as the cache will hold them, as every later token does (clamped to its range, as the C
            # attention stores a token's: an outlier saturates instead of becoming inf)
            top = torch.finfo(cache.k[i].dtype).max
            k, v = (t.clamp(-top, top).to(cache.k[i].dtype).to(t.dtype) for t in (k, v))
        if cache is not None and not window and x.device.type == "cpu":
            past = (cache.k[i][:, :, :pos].to(k.dtype), cache.v[i][:, :, :pos].to(v.dtype)) if pos > 0 else None
            o = chunk_attention(q, k, v, past)
            cache.k[i][:, :, pos:pos + S] = k  # full-attention layers: slot = position
            cache.v[i][:, :, pos:pos + S] = v
            return lane_linear(o.transpose(1, 2).reshape(L, B, S, -1), w.wo)
        if cache is not None:
            k, v, mask = self._prefill_cache(i, k, v, pos, cache, window)
        elif pos == 0 and (not window or S <= window):
            mask = None  # plain causal: the fused kernel, no S x S mask
        else:
            positions = torch.arange(pos, pos + S, device=x.device)
            mask = _attention_mask(positions, positions, window)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                           enable_gqa=q.shape[1] != k.shape[1])
        o = o.transpose(1, 2).reshape(L, B, S, -1)  # lane l gets its own heads back
        return lane_linear(o, w.wo)  # [L, B, S, D]: each lane's partial sum

    def _prefill_cache(self, i, k, v, pos, cache, window):
        """S > 1 new tokens: attend over (cached keys, new keys) by absolute position, then store."""
        kc, vc, slots = cache.k[i], cache.v[i], cache.slots[i]
        S, dev = k.shape[2], k.device
        q_pos = torch.arange(pos, pos + S, device=dev)
        if pos > 0:
            filled = min(pos, slots)
            k_all = torch.cat([kc[:, :, :filled].to(k.dtype), k], dim=2)
            v_all = torch.cat([vc[:, :, :filled].to(v.dtype), v], dim=2)
            k_pos = torch.cat([_slot_positions(pos, slots, dev)[:filled], q_pos])
        else:
            k_all, v_all, k_pos = k, v, q_pos
        keep = q_pos[-slots:]  # a ring keeps only the last W positions
        idx = keep % slots if window else keep
        kc.index_copy_(2, idx, k[:, :, -len(keep):].to(kc.dtype))
        vc.index_copy_(2, idx, v[:, :, -len(keep):].to(vc.dtype))
        if pos == 0 and (not window or S <= window):
            return k_all, v_all, None  # plain causal over the chunk itself: the fused kernel
        return k_all, v_all, _attention_mask(q_pos, k_pos, window)

    # -- the only cross-lane step (docs/laneformer.md §4) ------------------------------------------
    def reduce(self, i: int, kind: str, x: Tensor, saved: dict) -> Tensor:
        """What layer i's sub-block adds to the residual; `saved` carries the delayed partials."""
        cfg, comm = self.cfg, self.comm
        mode = cfg.reduce_mode(i, kind)
        future = cfg.broadcasts_to_future(i, kind)
        if mode == PRESENT:
            total = comm.lane_sum(x)
            if future:  # the early-layer quirk: layer i + d re-adds these (already summed) outputs
                saved[kind, i] = (x, comm.ready(total))
            return total
        if future:  # issue point: right after wo / w2 produced the partial
            saved[kind, i] = (x, comm.start_lane_sum(x))
        if mode == NO_REDUCE:
            return x * math.sqrt(cfg.num_lanes)
        if not cfg.consumes_past(i, kind):
            return x
        past, handle = saved.pop((kind, i - cfg.broadcast_delay))  # wait point
        return x + (comm.wait(handle) - past)  # own partial now + the other lanes' from layer i - d

    # -- forward ---------------------------------------------------------------------------------
    def hidden_states(self, ids: Tensor, pos: int = 0, cache: KVCache | None = None) -> Tensor:
        """ids [B, S] at positions pos..pos+S-1 -> final residual streams [L, B, S, D]."""
        cfg = self.cfg
        B, S = ids.shape
        if pos + S > cfg.max_position_embeddings:
            raise ValueError(f"positions up to {pos + S} exceed the model's context of {cfg.max_position_embeddings}")
        e = F.embedding(ids, self.embed)  # [B, S, D]
        h = e.unsqueeze(0).expand(len(self.lanes), B, S, cfg.hidden_size)  # lanes start identical
        saved: dict = {}
        for i, w in enumerate(self.layers):
            a = self.attention(i, rms_norm(h, w.attn_norm, cfg.norm_eps), pos, cache)
            h = h + self.reduce(i, "attention", a, saved)
            h = h + self.reduce(i, "mlp", self.mlp_block(h, w.ffn_norm, w.w13, w.w2), saved)
        return h

    @torch.inference_mode()
    def decode(self, tokens: Tensor, pos: int, cache: KVCache) -> Tensor:
        """The per-token hot path: tokens [B, 1] at position pos -> logits [B, V].

        Same function as `forward` with S = 1, organised as two pure block functions per layer
        (which the engine may compile) with the cross-lane reduce between them. Always in inference
        mode, as the engine runs it (a compiled block guards on the grad mode).
        """
        cfg = self.cfg
        if pos + 1 > cache.max_seq_len:
            raise ValueError(f"position {pos} is beyond the KV cache of {cache.max_seq_len} positions")
        if self.fused_step is not None:
            return self.fused_step(tokens, pos, cache)
        B = tokens.shape[0]
        h = F.embedding(tokens, self.embed).unsqueeze(0).expand(len(self.lanes), B, 1, cfg.hidden_size)
        cos, sin = self._rope_row(pos)
        # A layer writes slot pos (full) or pos % W (ring) and reads the filled slots: exactly the
        # visible keys, since the slot it overwrites is the one that just left the window.
        where = {slots: (pos % slots if self.lowbit else torch.tensor([pos % slots], device=self.device),
                         min(pos + 1, slots)) for slots in set(cache.slots)}
        saved: dict = {}
        for i, w in enumerate(self.layers):
            slot, n = where[cache.slots[i]]
            a = self.attention_block(h, w.attn_norm, w.wqkv, w.wo, cache.k[i], cache.v[i], cos, sin, slot, n)
            h = h + self.reduce(i, "attention", a, saved)
            h = h + self.reduce(i, "mlp", self.mlp_block(h, w.ffn_norm, w.w13, w.w2), saved)
        return self.head(h)[:, -1]

    def _rope_row(self, pos: int) -> tuple[Tensor, Tensor]:
        """cos, sin [1, hd/2] of one position, as tensors of their own (a compiled block would guard on
        the storage offset of a view into the tables, which changes with the position)."""
        return self.cos[pos:pos + 1].clone(), self.sin[pos:pos + 1].clone()

    def head(self, h: Tensor) -> Tensor:
        """Final norm, lane aggregation and LM head (docs/laneformer.md §7). h [L, B, S, D] -> logits [B, S, V]."""
        cfg, comm, eps = self.cfg, self.comm, self.cfg.norm_eps
        if cfg.pre_norm_lane_agg:  # a sum over lanes, then the norm
            y = rms_norm(comm.lane_sum(h)[0], self.norm, eps)
            return linear(y, self.head_weight).float()
        hn = rms_norm(h, self.norm, eps)
        if cfg.lm_head_type == "replicate":  # norm per lane, then the mean
            y = comm.lane_sum(hn)[0] / cfg.num_lanes
            return linear(y, self.head_weight).float()
        per_lane = lane_linear(hn, self.head_weight)  # [L, B, S, V] (lane) or [L, B, S, V/L]
        if cfg.lm_head_type == "lane":
            return comm.lane_sum(per_lane)[0].float()
        return self.gather_vocab(per_lane).float()  # vocab_parallel: lane l owns vocab slice l

    def gather_vocab(self, per_lane: Tensor) -> Tensor:
        L, B, S, Vl = per_lane.shape
        return per_lane.permute(1, 2, 0, 3).reshape(B, S, L * Vl)

    def forward(self, ids: Tensor, pos: int = 0, cache: KVCache | None = None, last_only: bool = False) -> Tensor:
        if cache is not None and ids.shape[1] == 1 and pos > 0:
            return self.decode(ids, pos, cache)[:, None]
        h = self.hidden_states(ids, pos, cache)
        if last_only:
            h = h[:, :, -1:]
        return self.head(h)

    def prefill(self, ids: Tensor, n: int, max_seq_len: int, should_stop=None,
                chunk: int = PREFILL_CHUNK) -> tuple[Tensor | None, KVCache | None]:
        """A prompt [1, S] at batch 1 into a fresh cache, then copied for n samples:
        (last-position logits [n, V] (a rank's shard under DTP), the n-sample cache).

        The prompt goes through in chunks of `chunk` tokens, each attending to the cache and to itself,
        so no step holds more than chunk x S attention scores. Between chunks the request may be
        stopped (`should_stop()`, agreed across ranks by `comm`): then (None, None).
        """
        steps = self.prefill_steps(ids, n, max_seq_len, chunk)
        for done in steps:
            if done is not None:
                return done
            if self.comm.agree_stop(should_stop):
                steps.close()
                return None, None
        raise AssertionError("prefill_steps ended without a result")

    def prefill_steps(self, ids: Tensor, n: int, max_seq_len: int, chunk: int = PREFILL_CHUNK,
                      start: tuple[KVCache, int] | None = None, keep=None, piece: int | None = None):
        """`prefill` one chunk at a time: yields None after each chunk but the last, then (logits [n, V],
        cache). The chunks are the same however the steps are interleaved with other work, so a prompt
        prefilled between other requests' decode steps gives exactly the cache it gets alone.

        start: (a batch-1 cache already holding positions [0, p), p) with p a multiple of `chunk`: the
        prompt goes on from p, through the chunks a cold prefill runs from there (so the result is the
        cold one exactly). keep(cache, a, b, last): called after each whole chunk [a, b) with the batch-1
        cache as it is at that moment (for a prefix cache to copy); last: no whole chunk follows. piece: a
        chunk that runs as one-token groups of the fused step (`prefills_as_groups`) goes in C calls of at
        most this many positions, a step each (its result does not depend on how it is cut), so that other
        work waits less.
        """
        S = ids.shape[1]
        cache, a0 = start if start is not None else (self.new_cache(1, max_seq_len), 0)
        if a0 % chunk or a0 >= S:
            raise ValueError(f"a prefill resumes at a whole chunk before the prompt's end, not at {a0}")
        whole = S // chunk * chunk  # the end of the last whole chunk
        h = logits = None
        for a in range(a0, S, chunk):
            if a > a0:
                yield None
            b = min(a + chunk, S)
            if self.prefills_as_groups(a, b, cache):
                # the chunk's positions as one-token groups of the fused step: each position's K/V is the one a
                # decode step writes; only the prompt's last row gets logits
                step = piece or b - a
                for c in range(a, b, step):
                    if c > a:
                        yield None
                    d = min(c + step, b)
                    with torch.inference_mode():
                        logits = self.fused_step.groups(ids[0, c:d].reshape(-1, 1), [(p, cache) for p in range(c, d)],
                                                        last_only=True)
            else:
                with torch.inference_mode():
                    h, logits = self.hidden_states(ids[:, a:b], pos=a, cache=cache), None
            if keep is not None and b <= whole:
                keep(cache, a, b, b == whole)
        if logits is None:
            with torch.inference_mode():
                logits = self.head(h[:, :, -1:])[:, -1]
        yield logits.expand(n, -1), (cache.expand_batch(n) if n > 1 else cache)

    def prefills_as_groups(self, a: int, b: int, cache: KVCache) -> bool:
        """Whether the prompt chunk of positions [a, b) runs as one-token groups of the fused low-bit step
        (`prefill_steps`): where a verify would (one lane's fused step, a one-sequence cache whose rings
        do not wrap before b), the chunk shorter than a float GEMM's rows (`gemm_min_rows`) and ending by
        GROUPS_PREFILL_END. Its positions are then decode steps exactly, in one C call: on the default
        model (int4, 2 cores) a prompt of 8 tokens takes 8.8 ms against 15.6 through the per-layer path,
        128 tokens 72 against 85 ms, 300 tokens 180 against 228; past ~1,000 positions the per-layer
        path's attention (one product over the chunk's queries) is the faster (a chunk at 1,408: 154
        against 159 ms)."""
        from laneplay.kernels import lowbit

        return (b <= GROUPS_PREFILL_END and self.verifies_as_groups(a, b - a, cache)
                and b - a < lowbit.gemm_min_rows())

    def verify(self, tokens: Tensor, pos: int, cache: KVCache) -> tuple[Tensor, Rewind]:
        """Speculative verification: tokens [B, S] (the last token, then S - 1 drafts) at positions
        pos..pos+S-1 in one forward over the cache -> (logits [B, S, V], a `Rewind` that takes back the
        positions the caller does not keep). Logit j is what a decode step at position pos + j gives
        after the tokens before it.

        On the one-lane low-bit path (while no ring buffer wraps inside the verify) the S positions are S
        groups of one fused C step over the same cache: every group's K/V is written before any attention
        reads, and group j sees slots [0, pos + j], so each row's logits are bit for bit those of a
        one-token decode step. Elsewhere it is a prefill chunk over the cache (`hidden_states`), the same
        function as S decode steps within float rounding.
        """
        B, S = tokens.shape
        if S < 1 or pos + S > cache.max_seq_len:
            raise ValueError(f"positions {pos}..{pos + S - 1} are beyond the KV cache of {cache.max_seq_len} positions")
        if B != cache.batch:
            raise ValueError(f"a cache of {cache.batch} sequences cannot verify {B} rows")
        with torch.inference_mode():
            rewind = Rewind(cache, pos, S)
            if self.verifies_as_groups(pos, S, cache):
                logits = self.fused_step.groups(tokens.reshape(S, 1), [(pos + j, cache) for j in range(S)])
                return logits.unsqueeze(0), rewind
            return self.head(self.hidden_states(tokens, pos, cache)), rewind

    def verifies_as_groups(self, pos: int, S: int, cache: KVCache) -> bool:
        """Whether a verify of S positions from pos runs as S one-token groups of the fused low-bit step
        (`verify`), and so may join other requests' rows in one `decode_groups` call: one lane's fused
        step, one sequence, and no ring buffer wrapping inside it (so nothing is overwritten)."""
        return self.fused_step is not None and cache.batch == 1 and pos + S <= min(cache.slots)

    @torch.inference_mode()
    def decode_groups(self, tokens: Tensor, groups: list[tuple[int, KVCache]]) -> Tensor:
        """One decode step for several sequences that do not share a cache or a position (separate
        requests): groups [(pos, cache)], cache i holding the next rows of tokens [B, 1] -> logits [B, V].

        The projections and the MLP run over all B rows at once; attention runs per group, on the
        group's own cache at its own position. On the low-bit one-lane path this is one C call, and a
        row's logits are bit for bit those it gets alone; on float paths they agree within rounding
        (the batched products sum in another order).
        """
        if len(groups) == 1:
            return self.decode(tokens, *groups[0])
        rows = [cache.batch for _, cache in groups]
        if sum(rows) != tokens.shape[0]:
            raise ValueError(f"caches of {sum(rows)} sequences cannot take {tokens.shape[0]} tokens")
        for pos, cache in groups:
            if pos + 1 > cache.max_seq_len:
                raise ValueError(f"position {pos} is beyond the KV cache of {cache.max_seq_len} positions")
        if self.fused_step is not None:
            return self.fused_step.groups(tokens, groups)
        cfg = self.cfg
        B = tokens.shape[0]
        h = F.embedding(tokens, self.embed).unsqueeze(0).expand(len(self.lanes), B, 1, cfg.hidden_size)
        edges = [0, *itertools.accumulate(rows)]
        per_group = []
        for pos, cache in groups:
            cos, sin = self._rope_row(pos)
            where = {slots: (pos % slots if self.lowbit else torch.tensor([pos % slots], device=self.device),
                             min(pos + 1, slots)) for slots in set(cache.slots)}
            per_group.append((cache, cos, sin, where))
        saved: dict = {}
        for i, w in enumerate(self.layers):
            parts = []
            for (a, b), (cache, cos, sin, where) in zip(itertools.pairwise(edges), per_group):
                slot, n = where[cache.slots[i]]
                parts.append(self.attention_block(h[:, a:b].contiguous(), w.attn_norm, w.wqkv, w.wo, cache.k[i],
                                                  cache.v[i], cos, sin, slot, n))
            h = h + self.reduce(i, "attention", torch.cat(parts, dim=1), saved)
            h = h + self.reduce(i, "mlp", self.mlp_block(h, w.ffn_norm, w.w13, w.w2), saved)
        return self.head(h)[:, -1]

    def new_cache(self, batch: int, max_seq_len: int | None = None, spare: int = 0) -> KVCache:
        return KVCache(self.cfg, len(self.lanes), batch, max_seq_len or self.cfg.max_position_embeddings,
                       self.kv_dtype, self.device, spare)
