"""The low-bit CPU decode path of `LaneModel` (packed weights, `kernels.lowbit`).

`decode_blocks(cfg)` gives the low-bit twins of `engine.model.decode_blocks`; `DecodeStep` runs a whole
step of a one-lane model in one C call. They live in the engine, not beside the kernels: they read the
model (its config, layers, cache) and hand the kernels tensors and numbers only.
"""
from __future__ import annotations

import weakref

import torch
from torch import Tensor

from laneplay.engine.model import LocalLanes
from laneplay.kernels import lowbit


def decode_blocks(cfg):
    """The low-bit twins of `engine.model.decode_blocks`: the same two per-layer functions, with
    the norm fused into the projection's input, RoPE + cache write + attention in one call, and
    SwiGLU fused into w2's input."""
    eps, hq, hkv = cfg.norm_eps, cfg.heads_per_lane, cfg.kv_heads_per_lane

    def attention_block(h, norm_w, wqkv, wo, kc, vc, cos, sin, slot, n: int) -> Tensor:
        L, B = h.shape[:2]
        qkv = wqkv.linear(h, norm=norm_w, eps=eps)  # [L, B, 1, (Hq + 2 Hkv) hd]
        o = lowbit.attend(qkv.view(L * B, -1), cos.view(-1), sin.view(-1), kc, vc, slot, n, hq, hkv)
        return wo.linear(o.view(L, B, 1, -1))

    def mlp_block(h, norm_w, w13, w2) -> Tensor:
        return w2.linear(w13.linear(h, norm=norm_w, eps=eps), swiglu=True)

    return attention_block, mlp_block


class DecodeStep:
    """A whole decode step of a one-lane packed model in one C call (`kernels.lowbit.step`).

    With one lane in one process the residual stream needs no cross-lane sums, so every layer is
    h += wo . attend(wqkv . norm(h)); h += w2 . swiglu(w13 . norm(h)), and the logits are
    head . norm(h): the same C products and attention the per-block path calls, without Python
    between them. `LaneModel.decode` uses it when `DecodeStep.fits(model)`.
    """

    def __init__(self, model):
        lowbit.require()
        cfg = model.cfg
        self.hq, self.hkv, self.hd, self.eps = cfg.heads_per_lane, cfg.kv_heads_per_lane, cfg.head_dim, cfg.norm_eps
        self.embed, self.cos, self.sin = model.embed, model.cos, model.sin
        self.norms = []  # contiguous float32 norm weights, kept alive for the plan's pointers
        rows = []
        for w in model.layers:
            an, fn = self._norm(w.attn_norm), self._norm(w.ffn_norm)
            rows.append([an.data_ptr(), *w.wqkv.desc(), *w.wo.desc(), fn.data_ptr(), *w.w13.desc(), *w.w2.desc()])
        self.plan = torch.tensor(rows, dtype=torch.int64).contiguous()
        self.norm = self._norm(model.norm)
        self.head = torch.tensor(model.head_weight.desc(), dtype=torch.int64)
        self.vocab = model.head_weight.rows
        self.layers = len(rows)
        self._tables = weakref.WeakKeyDictionary()  # cache -> its table

    def _norm(self, t: Tensor) -> Tensor:
        t = t.detach().reshape(-1).float().contiguous()
        self.norms.append(t)
        return t

    @staticmethod
    def fits(model) -> bool:
        """One lane, all of it in this process (no collectives), packed projections and head."""
        return (lowbit.available() and model.lowbit and len(model.lanes) == 1 and model.cfg.num_lanes == 1
                and isinstance(model.comm, LocalLanes) and isinstance(model.head_weight, lowbit.PackedWeight)
                and model.head_weight.lanes == 1 and model.cos.dtype == torch.float32
                and all(w.wqkv.lanes == w.wo.lanes == w.w13.lanes == w.w2.lanes == 1 for w in model.layers))

    def _table(self, cache) -> Tensor:
        """The cache's buffers as the C step reads them, made once per cache (and forgotten with it)."""
        table = self._tables.get(cache)
        if table is None:
            table = torch.tensor([[k.data_ptr(), v.data_ptr(), s, lowbit.cache_half(k, v)]
                                  for k, v, s in zip(cache.k, cache.v, cache.slots)], dtype=torch.int64)
            self._tables[cache] = table
        return table

    def __call__(self, tokens: Tensor, pos: int, cache) -> Tensor:
        """tokens [B, 1] at position pos -> logits [B, V]; writes this position into the cache."""
        return self.groups(tokens, [(pos, cache)])

    def groups(self, tokens: Tensor, groups: list, last_only: bool = False) -> Tensor:
        """One step for several sequences at once: groups [(pos, cache)], each cache holding its own
        rows of tokens [B, 1] (in group order) at its own position -> logits [B, V] ([1, V]: the last
        row's, with last_only). The products run over all B rows; each group's attention is the one it
        runs alone, so a row's logits do not depend on the other groups."""
        B = tokens.shape[0]
        rows = [cache.k[0].shape[0] for _, cache in groups]
        if sum(rows) != B:
            raise ValueError(f"caches of {sum(rows)} sequences cannot take {B} tokens")
        table = torch.tensor([[n, pos, self.cos[pos].data_ptr(), self.sin[pos].data_ptr(),
                               self._table(cache).data_ptr()] for n, (pos, cache) in zip(rows, groups)],
                             dtype=torch.int64)
        h = torch.nn.functional.embedding(tokens.reshape(B), self.embed).float().contiguous()
        logits = torch.empty(1 if last_only else B, self.vocab, dtype=torch.float32)
        return lowbit.step(self.plan, table, len(groups), self.hq, self.hkv, self.hd, h, self.head, self.norm,
                           logits, self.eps, B - 1 if last_only else 0)
