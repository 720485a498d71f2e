"""Plain-torch references of the decode-step kernels: the semantics each Triton kernel must reproduce.

They are also what the dispatcher (`laneplay.kernels.ops`) runs where Triton cannot (CPU). Shapes are
those of one decode step with the lane axis folded into the rows, lane-major: row `r = lane * B + b`.
Every function rounds where the engine's model code rounds (to the activation dtype after each op), so
on float32 the kernels agree to rounding and on float16 to the half-precision step.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor


def rms_norm(x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype | None = None) -> Tensor:
    """RMSNorm of rows x [R, D] by weight [D] (replicated) or [L, D] (per lane; R = L * B, lane-major),
    computed in float32, rounded to x's dtype, scaled, then cast to out_dtype (the fused cast)."""
    R, D = x.shape
    xf = x.float()
    y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype).float()
    w = weight.float()
    if w.dim() == 2:  # per-lane scale: rows of lane l are l*B .. l*B+B-1
        w = w.repeat_interleave(R // w.shape[0], dim=0)
    return (y * w).to(out_dtype or x.dtype)


def slot_positions(pos, slots: int, device=None) -> Tensor:
    """Absolute position held by each cache slot once positions 0..pos were written (-1: empty); pos an
    int, or a tensor of positions [N, 1] (then one row of slots per position).

    Slot s holds the latest position p <= pos with p = s (mod slots): a full layer (slots > pos) has
    slot = position; a ring buffer of W slots holds the last W positions.
    """
    s = torch.arange(slots, device=device)
    held = s + torch.div(pos - s, slots, rounding_mode="floor") * slots
    return torch.where(s <= pos, held, -1)


def rope_kv_write(qkv: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k_cache: Tensor, v_cache: Tensor,
                  num_q_heads: int, num_kv_heads: int, head_dim: int, cache_rows=None) -> Tensor:
    """Interleaved-pair RoPE (docs/laneformer.md §3) on the q and k heads of qkv [N, (Hq + 2 Hkv) * hd] at position
    `pos` (a one-element integer tensor, or one position per row: separate requests in one step); k and v
    go into slot pos % slots of the caches [N, Hkv, slots, hd] (the ring-buffer slot on sliding-window
    layers; with cache_rows (b, c), row lane * b + i goes into cache row lane * c + i of a pool of c rows
    per lane). Returns rotated q [N, Hq, hd]."""
    N = qkv.shape[0]
    p = _row_positions(pos, N)
    heads = qkv.view(N, num_q_heads + 2 * num_kv_heads, head_dim)
    qk = heads[:, :num_q_heads + num_kv_heads].float().unflatten(-1, (-1, 2))
    x0, x1 = qk[..., 0], qk[..., 1]
    c, s = cos[p].float()[:, None], sin[p].float()[:, None]  # [N, 1, hd / 2]
    rot = torch.stack((x0 * c - x1 * s, x0 * s + x1 * c), dim=-1).flatten(-2).to(qkv.dtype)
    rows, slot = _cache_row_index(N, cache_rows, qkv.device), p % k_cache.shape[2]
    k_cache[rows, :, slot] = rot[:, num_q_heads:]
    v_cache[rows, :, slot] = heads[:, num_q_heads + num_kv_heads:]
    return rot[:, :num_q_heads].contiguous()


def _cache_row_index(rows: int, cache_rows, device) -> Tensor:
    """The cache row of each row: itself, with cache_rows (b, c) lane * c + i for row lane * b + i, or
    with a tensor the one it gives each row (rows may share one: a verify's positions)."""
    if isinstance(cache_rows, Tensor):
        if cache_rows.numel() != rows or cache_rows.is_floating_point():
            raise ValueError(f"a cache row per row: {rows} integers; got {list(cache_rows.shape)}")
        return cache_rows.reshape(-1).long()
    r = torch.arange(rows, device=device)
    if cache_rows is None:
        return r
    b, c = cache_rows
    return r // b * c + r % b


def _row_positions(pos: Tensor, rows: int) -> Tensor:
    """The position of each of `rows` rows: `pos` holds one for all, or one per row."""
    p = pos.reshape(-1).long()
    if p.numel() not in (1, rows):
        raise ValueError(f"positions: one, or one per row ({rows}); got {p.numel()}")
    return p.expand(rows)


def decode_attention(q: Tensor, k_cache: Tensor, v_cache: Tensor, pos: Tensor, window: int | None,
                     cache_rows=None) -> Tensor:
    """One query per row over the visible cached keys: q [N, Hq, hd], caches [N, Hkv, slots, hd] ->
    [N, Hq, hd]. GQA: query head h reads KV head h // (Hq / Hkv). A key is visible when its slot holds
    a position j with pos - window < j <= pos (any j <= pos on a full layer); pos: one for all rows, or
    one per row. Scores and softmax in float32; probabilities rounded to the cache dtype before they
    weight the values, as in the model."""
    N, hq, hd = q.shape
    if cache_rows is not None:  # the rows' own cache rows of a pool (see rope_kv_write)
        index = _cache_row_index(N, cache_rows, q.device)
        k_cache, v_cache = k_cache[index], v_cache[index]
    hkv, slots = k_cache.shape[1], k_cache.shape[2]
    p = _row_positions(pos, N)[:, None]  # [N, 1]
    held = slot_positions(p, slots, q.device)  # [N, slots]
    visible = held >= 0
    if window:
        visible &= held > p - window
    qg = q.float().view(N, hkv, hq // hkv, hd)
    scores = torch.einsum("ngrd,ngsd->ngrs", qg, k_cache.float()) * hd ** -0.5
    scores = scores.masked_fill(~visible[:, None, None, :], float("-inf"))
    probs = scores.softmax(-1).to(v_cache.dtype).float()
    out = torch.einsum("ngrs,ngsd->ngrd", probs, v_cache.float())
    return out.reshape(N, hq, hd).to(q.dtype)


def rope_attention(qkv: Tensor, cos: Tensor, sin: Tensor, pos: Tensor, k_cache: Tensor, v_cache: Tensor,
                   num_q_heads: int, num_kv_heads: int, head_dim: int, window: int | None, cache_rows=None) -> Tensor:
    """RoPE + KV write, then attention over the cache (what the fused kernel does in one pass)."""
    q = rope_kv_write(qkv, cos, sin, pos, k_cache, v_cache, num_q_heads, num_kv_heads, head_dim, cache_rows)
    return decode_attention(q, k_cache, v_cache, pos, window, cache_rows)


def swiglu(gate_up: Tensor) -> Tensor:
    """silu(gate) * up of rows gate_up [R, 2F] (gate columns first) -> [R, F], in the input dtype."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def residual_update(h: Tensor, x: Tensor, *, present: bool = False, scale: float = 1.0,
                    total_old: Tensor | None = None, past: Tensor | None = None, want_sum: bool = False,
                    norm_weight: Tensor | None = None, eps: float = 1e-5,
                    norm_dtype: torch.dtype | None = None, out: Tensor | None = None,
                    total: Tensor | None = None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The delayed residual update of docs/laneformer.md §4 for all lanes at once, with the next sub-block's norm.

    h, x, past: [L, B, D]; total_old: [B, D] (the lane sum of `past`, issued d layers ago). Adds to h:
      present      Σ_lanes x                      (PRESENT: the all-reduce now)
      total_old    x + (total_old - past)         (PAST: own partial + the other lanes' from layer i - d)
      otherwise    scale * x                      (NO_REDUCE: scale = √L; a PAST layer with nothing to consume: 1)
    `out` (may be h itself) receives the new h. `total` [B, D]: with `present`, the lane sum computed
    elsewhere (a DTP rank's all-reduce over every rank's lanes) instead of this tensor's own lanes. Returns (new h, Σ_lanes x if present or want_sum (the sum to issue for layer i + d), RMSNorm of the
    new h by norm_weight [D] / [L, D] cast to norm_dtype, or None).
    """
    L, B, D = h.shape
    if total is None or not present:  # an external total: the sum over every rank's lanes (DTP)
        total = x.sum(0) if (present or want_sum) else None
    if present:
        add = total.unsqueeze(0)
    elif total_old is not None:
        add = x + (total_old.unsqueeze(0) - past)
    elif scale != 1.0:
        add = x * scale
    else:
        add = x
    new_h = h + add
    if out is not None:  # the kernel's in-place form
        out.copy_(new_h)
        new_h = out
    normed = None
    if norm_weight is not None:
        normed = rms_norm(new_h.reshape(L * B, D), norm_weight, eps, norm_dtype).view(L, B, D)
    return new_h, total, normed


def lane_gemv(x: Tensor, w: Tensor) -> Tensor:
    """y[l] = x[l] @ w[l].T for x [L, B, I], w [L, O, I] -> [L, B, O] (docs/laneformer.md §2's lane linear)."""
    return torch.bmm(x, w.transpose(1, 2))
