"""The CUDA decode step: static buffers, the position on the device, one CUDA graph per batch size, for
separate requests in one step a shared static cache with one graph per bucket of rows (`groups`), and
for speculative decoding a verify of up to K_MAX + 1 positions of one request in one graph per bucket of
positions (`verify`; the static caches' rings carry SPARE slots beyond each window, so nothing a verify
writes needs restoring).

`StaticDecoder` runs the same function as `LaneModel.decode` (docs/laneformer.md §3-§7, all lanes in this
process) through the kernels of `laneplay.kernels` over buffers whose addresses never change: a KV
cache of fixed capacity per batch size, the token ids and the position as device tensors (attention
masks slots by the position it reads there, so nothing in the step depends on a host value). On CUDA
the whole step is captured once per batch size and each token is one graph replay; the only host
synchronisation per token is the caller reading the sampled ids. On the CPU the same step runs
eagerly through the torch references (what the tests compare against `LaneModel.decode`).

At load (`tune`) the step measures on its GPU which attention split to use, whether RoPE + KV write
run fused into the attention kernel, and, per weight shape, whether the Triton lane GEMV beats cuBLAS's
batched GEMM; anything that fails to measure keeps the default. On a DTP rank (`graphs=True` at world
size > 1) the same step runs on the rank's lanes without capture: the lane sums go through the model's
comm (blocking for PRESENT layers, issued and waited for d layers later otherwise), as in `LaneModel`.
"""
from __future__ import annotations

import math
import weakref
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from laneplay.engine.config import NO_REDUCE, PRESENT
from laneplay.engine.model import KVCache, LaneModel, LocalLanes, kv_cache_bytes
from laneplay.engine.speculative import K_MAX
from laneplay.kernels import ops


@dataclass
class _Batch:
    """Everything one batch size's step reads and writes, allocated once."""

    n: int
    cache: KVCache
    tokens: Tensor  # [n] int64
    pos: Tensor  # [1] int64
    h: Tensor  # [L, n, D] the lanes' residual streams
    graph: object = None
    logits: Tensor | None = None  # the captured step's output buffer
    loaded: bool = field(default=False)
    # a bucket of the shared cache: (its rows, the cache's rows) per lane; a verify: each row's cache row [L * n]
    cache_rows: tuple[int, int] | Tensor | None = None


BUCKETS = (1, 2, 4, 8, 16)  # the row counts separate requests' steps are captured for (padded up to one)
VERIFY_BUCKETS = (2, 4, 8, 16)  # the positions a verify is captured for: its last token and up to K_MAX drafts
# Ring slots beyond each sliding window in every static cache: a verify writes positions p..p + K_MAX of one
# request in one step, and with W + K_MAX slots the slot of a later position held a position that is out
# of every earlier row's window, so each row sees exactly what a decode step at its position sees, and
# nothing needs restoring for the positions a verify does not keep (their slots are rewritten before any
# step reads them).
SPARE = K_MAX


@dataclass
class _Resident:
    """A request's rows in the shared cache."""

    row: int
    n: int
    next_pos: int  # where its next step writes (a step it sits out writes its row's next slot, unread)


class StaticDecoder:
    """`load(cache)` after a prefill, then `step(tokens, pos)` per token (logits [n, V], float32; a vocab
    shard on a DTP rank with a vocab-parallel head)."""

    def __init__(self, model: LaneModel, capacity: int | None = None, graphs: bool | None = None,
                 impl: str | None = None, kv_budget_bytes: int = 0):
        self.model, self.cfg = model, model.cfg
        # all lanes here (world size 1): cross-lane sums are fused into the residual kernel; on a DTP rank
        # they go through the model's comm (collectives), and the step runs without capture
        self.local = isinstance(model.comm, LocalLanes) and len(model.lanes) == model.cfg.num_lanes
        self.capacity = min(capacity or self.cfg.max_position_embeddings, self.cfg.max_position_embeddings)
        self.graphs = (model.device.type == "cuda" and self.local) if graphs is None else bool(graphs)
        if self.graphs and model.device.type != "cuda":
            raise ValueError("CUDA graphs need a CUDA device")
        if self.graphs and not self.local:
            raise ValueError("a DTP rank's step is not captured as a CUDA graph (its collectives run eagerly)")
        self.impl = impl
        self.kv_budget_bytes = kv_budget_bytes
        self.gemv: dict[tuple[int, ...], tuple] = {}  # weight shape -> ("triton", config) where measured faster
        self.attention_config: tuple[int, int, int] | None = None  # the attention kernel's, where measured
        self.fused_rope = False  # RoPE + KV write inside the attention kernel (where measured faster)
        self.batches: dict[int, _Batch] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.graphs else None
        # separate requests' steps (`groups`): their rows in one shared cache, a bucket batch per row count
        self.shared: KVCache | None = None
        self.shared_rows = 0
        self.buckets: dict[int, _Batch] = {}
        self.resident: dict[int, _Resident] = {}  # id of a request's own cache -> its rows
        self.verifies: dict[tuple[str, int], _Batch] = {}  # ("one" | "shared", bucket) -> a verify's batch
        self._gone: list[int] = []  # requests whose caches were dropped (their rows free at the next step)
        L, D = len(model.lanes), self.cfg.hidden_size
        self._norm = lambda w: w.reshape(L, D) if w.dim() == 4 else w  # lane norms are stored [L, 1, 1, D]

    # -- capacity -----------------------------------------------------------------------------------
    def cache_bytes(self, n: int) -> int:
        return kv_cache_bytes(self.cfg, len(self.model.lanes), n, self.capacity, self.model.dtype.itemsize, SPARE)

    def fits(self, n: int, positions: int) -> bool:
        """Whether a request of n samples and `positions` positions can run here: within the capacity, and
        the static caches held (one per batch size used, each for the whole capacity) within the KV budget;
        a request that does not fit decodes through `LaneModel.decode` with its own cache."""
        if positions > self.capacity:
            return False
        held = sum(self.cache_bytes(b) for b in self.batches if b != n)
        return not self.kv_budget_bytes or n in self.batches or held + self.cache_bytes(n) <= self.kv_budget_bytes

    def _batch(self, n: int) -> _Batch:
        b = self.batches.get(n)
        if b is None:
            m, cfg = self.model, self.cfg
            b = _Batch(n=n, cache=m.new_cache(n, self.capacity, SPARE),
                       tokens=torch.zeros(n, dtype=torch.long, device=m.device),
                       pos=torch.zeros(1, dtype=torch.long, device=m.device),
                       h=torch.zeros(len(m.lanes), n, cfg.hidden_size, dtype=m.dtype, device=m.device))
            self.batches[n] = b
        return b

    # -- the request protocol -------------------------------------------------------------------------
    def load(self, cache: KVCache, length: int) -> None:
        """Copy a prefilled cache (n samples, `length` positions written) into the static cache of its
        batch size (see `_place`)."""
        if cache.max_seq_len > self.capacity:
            raise ValueError(f"a request of {cache.max_seq_len} positions exceeds the static cache of {self.capacity}")
        b = self._batch(cache.batch)
        L, n = len(self.model.lanes), cache.batch
        for dst, src in zip(b.cache.k + b.cache.v, cache.k + cache.v):
            _place(dst.view(L, n, *dst.shape[1:]), src.view(L, n, *src.shape[1:]), length)
        b.loaded = True

    # -- separate requests in one step (the scheduler's batches) ---------------------------------------
    def _shared_cache(self) -> int:
        """Rows per lane of the shared cache (made on first use): the largest bucket within the KV budget."""
        if self.shared is None:
            fit = [b for b in BUCKETS if not self.kv_budget_bytes or self.cache_bytes(b) <= self.kv_budget_bytes]
            self.shared_rows = fit[-1] if fit else 0
            if self.shared_rows:
                self.shared = self.model.new_cache(self.shared_rows, self.capacity, SPARE)
        return self.shared_rows

    def _bucket(self, rows: int) -> _Batch:
        n = next(b for b in BUCKETS if b >= rows)
        b = self.buckets.get(n)
        if b is None:
            m, L = self.model, len(self.model.lanes)
            b = _Batch(n=n, cache=self.shared, tokens=torch.zeros(n, dtype=torch.long, device=m.device),
                       pos=torch.zeros(L * n, dtype=torch.long, device=m.device),
                       h=torch.zeros(L, n, self.cfg.hidden_size, dtype=m.dtype, device=m.device),
                       loaded=True, cache_rows=(n, self.shared_rows))
            self.buckets[n] = b
        return b

    @property
    def rows_held(self) -> int:
        """Rows of the shared cache that running requests hold."""
        return sum(r.n for key, r in self.resident.items() if key not in self._gone)

    def warm_buckets(self) -> None:
        """Capture every bucket's graph now (at load), never inside a request. No request holds rows yet,
        so what the warm-up steps write is read by no one."""
        if not self.graphs or not self._shared_cache() or self.rows_held:
            return
        for n in BUCKETS:
            if n <= self.shared_rows and self._bucket(n).graph is None:
                self._capture(self._bucket(n))

    def inside(self, groups: list) -> list[bool]:
        """Which of these requests step in the shared cache: the resident ones, and in order those that
        come for the first time while their rows fit (and their length the capacity). The others step
        through `LaneModel.decode_groups` on their own caches, now and later."""
        if not self._shared_cache():
            return [False] * len(groups)
        rows, out = self.rows_held, []
        for _, cache in groups:
            fits = id(cache) in self.resident and id(cache) not in self._gone
            if not fits and cache.max_seq_len <= self.capacity and rows + cache.batch <= self.shared_rows:
                fits, rows = True, rows + cache.batch
            out.append(fits)
        return out

    def _arrange(self, groups: list) -> None:
        """Free the rows of requests that ended, close the gaps (rows move down, in order), and copy each
        request that comes for the first time into the rows after the last."""
        for key in self._gone:
            self.resident.pop(key, None)
        self._gone.clear()
        L, c = len(self.model.lanes), self.shared_rows
        row = 0
        for r in sorted(self.resident.values(), key=lambda r: r.row):
            if r.row != row:
                for t in self.shared.k + self.shared.v:
                    rows = t.view(L, c, *t.shape[1:])
                    rows[:, row:row + r.n] = rows[:, r.row:r.row + r.n].clone()
                r.row = row
            row += r.n
        for pos, cache in groups:
            if id(cache) in self.resident:
                continue
            if cache.max_seq_len > self.capacity or row + cache.batch > c:
                raise ValueError("a request that does not fit the shared static cache (see `inside`)")
            for dst, src in zip(self.shared.k + self.shared.v, cache.k + cache.v):
                _place(dst.view(L, c, *dst.shape[1:])[:, row:row + cache.batch], src.view(L, cache.batch, *src.shape[1:]), pos)
            self.resident[id(cache)] = _Resident(row, cache.batch, pos)
            weakref.finalize(cache, self._gone.append, id(cache))
            cache.k, cache.v = [], []  # its KV lives in the shared cache now (and `inside` keeps it there)
            row += cache.batch

    @torch.inference_mode()
    def groups(self, tokens: Tensor, groups: list) -> Tensor:
        """One decode step for separate requests: groups [(pos, cache)], cache i the request's own (from its
        prefill) holding the next rows of tokens [B, 1] -> logits [B, V], in the groups' order.

        The first time a request comes, its cache is copied into rows of the shared cache, which hold its
        KV from then on (its own cache is not written again; its rows are freed when that cache is
        dropped). The step runs every resident row in the smallest bucket that holds them, padded (on
        CUDA one captured graph per bucket); a resident request that sits this step out runs too, at its
        next position, whose slot its own next step rewrites before any read. Every group must be
        `inside`. The step's layout (which token each row takes, its position, where each group's logits
        are) goes to the device as one small copy."""
        self._shared_cache()
        self._arrange(groups)
        b = self._bucket(sum(r.n for r in self.resident.values()))
        B = tokens.shape[0]
        take = [B] * b.n  # each row's token: an index into tokens, B for a pad (token 0)
        pos = [0] * b.n
        for r in self.resident.values():  # (one at the capacity has stepped its last: it only waits to end)
            pos[r.row:r.row + r.n] = [min(r.next_pos, self.capacity - 1)] * r.n
        where, a = [], 0
        for p, cache in groups:
            r = self.resident[id(cache)]
            if p != r.next_pos:
                raise ValueError(f"a request at position {r.next_pos} was asked to step at {p}")
            take[r.row:r.row + r.n] = range(a, a + r.n)
            where += range(r.row, r.row + r.n)
            a += r.n
            r.next_pos += 1
        layout = torch.tensor(take + pos + where).to(b.tokens.device, non_blocking=True)
        b.tokens.copy_(torch.cat([tokens.view(-1), tokens.new_zeros(1)])[layout[:b.n]])
        b.pos.copy_(layout[b.n:2 * b.n].repeat(len(self.model.lanes)))
        return self._run(b)[layout[2 * b.n:]]

    # -- speculative verification -------------------------------------------------------------------
    def _verify_batch(self, where: str, S: int) -> _Batch:
        n = next(b for b in VERIFY_BUCKETS if b >= S)
        b = self.verifies.get((where, n))
        if b is None:
            m, L = self.model, len(self.model.lanes)
            b = _Batch(n=n, cache=self.shared if where == "shared" else self.batches[1].cache,
                       tokens=torch.zeros(n, dtype=torch.long, device=m.device),
                       pos=torch.zeros(L * n, dtype=torch.long, device=m.device),
                       h=torch.zeros(L, n, self.cfg.hidden_size, dtype=m.dtype, device=m.device),
                       loaded=True, cache_rows=torch.zeros(L * n, dtype=torch.long, device=m.device))
            self.verifies[where, n] = b
        return b

    def can_verify(self, cache=None, pos: int | None = None) -> bool:
        """Whether a verify can run here: the batch-1 request of `load`/`step` (cache None), or a request
        of one sample resident in the shared cache. Given its position, a request of one sample that is
        not resident yet but fits (`inside`) moves in now, as its first shared step would move it."""
        if cache is None:
            one = self.batches.get(1)
            return one is not None and one.loaded
        if pos is not None and cache.batch == 1 and id(cache) not in self.resident and self.inside([(pos, cache)])[0]:
            self._arrange([(pos, cache)])
        r = self.resident.get(id(cache))
        return r is not None and r.n == 1 and id(cache) not in self._gone

    @torch.inference_mode()
    def verify(self, tokens: Tensor, pos: int, cache=None) -> tuple[Tensor, "_Verified"]:
        """Speculative verification in one step: tokens [1, S] (the last token, then S - 1 <= K_MAX drafts)
        at positions pos.. of the batch-1 request (`load`, cache None) or of a request resident in the
        shared cache (its own cache object, see `groups`) -> (logits [1, S, V], what to call `keep(k)` on
        with the positions kept). Logit j is what a decode step at pos + j gives after the tokens before
        it: the S positions are S rows of one step over the request's cache row, every key written before
        any row attends (the unfused pair of kernels), and the ring slots beyond the window (SPARE) keep the
        later rows' keys out of the earlier rows' windows. Padded up to a bucket (the pads step at the
        positions after, whose slots no row reads before a later step rewrites them); on CUDA one
        captured graph per bucket and cache."""
        S = tokens.numel()
        if not 1 <= S <= K_MAX + 1:
            raise ValueError(f"a verify takes 1 to {K_MAX + 1} positions, got {S}")
        if pos + S > self.capacity:
            raise ValueError(f"positions {pos}..{pos + S - 1} are beyond the static cache of {self.capacity}")
        if not self.can_verify(cache):
            raise ValueError("a verify needs the loaded batch-1 request or a resident request of one sample")
        r = None if cache is None else self.resident[id(cache)]
        if r is not None and pos != r.next_pos:
            raise ValueError(f"a request at position {r.next_pos} was asked to verify from {pos}")
        b = self._verify_batch("one" if r is None else "shared", S)
        L, c, row = len(self.model.lanes), (1 if r is None else self.shared_rows), (0 if r is None else r.row)
        positions = [min(pos + j, self.capacity - 1) for j in range(b.n)]
        layout = torch.tensor(positions * L + [lane * c + row for lane in range(L) for _ in range(b.n)])
        layout = layout.to(b.pos.device, non_blocking=True)
        b.pos.copy_(layout[:L * b.n])
        b.cache_rows.copy_(layout[L * b.n:])
        b.tokens.zero_()
        b.tokens[:S].copy_(tokens.view(-1))
        return self._run(b)[:S].clone().unsqueeze(0), _Verified(r, pos, S)

    def warm_verifies(self) -> None:
        """Capture the verify graphs of the batch-1 cache and of the shared cache now (at load, never inside
        a request; nothing a request holds is written)."""
        if not self.graphs:
            return
        wheres = (["one"] if 1 in self.batches else []) + (["shared"] if self._shared_cache() and not self.rows_held else [])
        for where in wheres:
            for n in VERIFY_BUCKETS:
                b = self._verify_batch(where, n)
                if b.graph is None:
                    self._capture(b)

    @torch.inference_mode()
    def step(self, tokens: Tensor, pos: int) -> Tensor:
        """tokens [n, 1] at position pos -> logits [n, V] (a fresh tensor)."""
        n = tokens.shape[0]
        b = self.batches.get(n)
        if b is None or not b.loaded:
            raise RuntimeError("load() a prefilled cache of this batch size before stepping")
        if pos + 1 > self.capacity:
            raise ValueError(f"position {pos} is beyond the KV cache of {self.capacity} positions")
        b.tokens.copy_(tokens.view(-1), non_blocking=True)
        b.pos.fill_(pos)
        return self._run(b).clone()

    def _run(self, b: _Batch) -> Tensor:
        """The step over b's buffers: eager, or its graph's replay (captured on first use; the capture's
        warm-up replays the same inputs, so it writes exactly what the step writes)."""
        if not self.graphs:
            return self._forward(b)
        if b.graph is None:
            self._capture(b)
        b.graph.replay()
        return b.logits

    def _capture(self, b: _Batch) -> None:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # compiles every kernel outside the capture
                self._forward(b)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            b.logits = self._forward(b)
        b.graph = graph

    # -- the step itself ------------------------------------------------------------------------------
    def _linear(self, x: Tensor, w: Tensor) -> Tensor:
        choice = self.gemv.get(tuple(w.shape))
        if choice is not None and x.shape[1] <= choice[2]:
            return ops.lane_gemv(x, w, impl="triton", config=choice[1])
        if self.impl == "triton" and x.shape[1] <= 4:  # the CPU tests exercise the GEMV too
            return ops.lane_gemv(x, w, impl="triton")
        return torch.bmm(x, w.transpose(1, 2))

    def _attention(self, qkv: Tensor, kc: Tensor, vc: Tensor, pos: Tensor, window: int | None,
                   config=None, fused: bool | None = None, cache_rows=None) -> Tensor:
        """RoPE on q and k, the KV write, attention over the cache: two kernels, or one where measured faster.
        pos: one position, or one per row; cache_rows: a bucket's rows of the shared cache (see ops)."""
        cfg, m = self.cfg, self.model
        config = config if config is not None else self.attention_config
        args = (qkv, m.cos, m.sin, pos, kc, vc, cfg.heads_per_lane, cfg.kv_heads_per_lane, cfg.head_dim)
        if self.fused_rope if fused is None else fused:
            return ops.rope_attention(*args, window, impl=self.impl, config=config, cache_rows=cache_rows)
        q = ops.rope_kv_write(*args, impl=self.impl, cache_rows=cache_rows)
        return ops.decode_attention(q, kc, vc, pos, window, impl=self.impl, config=config, cache_rows=cache_rows)

    def _reduce(self, i: int, kind: str, h: Tensor, x: Tensor, saved: dict, next_norm: Tensor | None):
        """h += what layer i's sub-block adds (docs/laneformer.md §4), in place; returns the next sub-block's normed input.

        All lanes here: the lane sums are computed inside the residual kernel. On a DTP rank the sums come
        from the comm: issued right after the partial exists, waited for d layers later, as in `LaneModel`.
        """
        cfg, comm = self.cfg, self.model.comm
        mode, future = cfg.reduce_mode(i, kind), cfg.broadcasts_to_future(i, kind)
        kw = dict(out=h, impl=self.impl, want_sum=future and self.local, eps=cfg.norm_eps)
        if next_norm is not None:
            kw["norm_weight"] = self._norm(next_norm)
        issued = None
        if mode == PRESENT:
            kw["present"] = True
            if not self.local:
                kw["total"] = comm.lane_sum(x)[0]  # blocking: the all-reduce now
        else:
            if future and not self.local:
                issued = comm.start_lane_sum(x)  # issue point
            if mode == NO_REDUCE:
                kw["scale"] = math.sqrt(cfg.num_lanes)
            elif cfg.consumes_past(i, kind):
                past, handle = saved.pop((kind, i - cfg.broadcast_delay))
                total_old = handle if self.local else comm.wait(handle)[0]  # wait point
                kw.update(past=past, total_old=total_old)
        _, total, normed = ops.residual_update(h, x, **kw)
        if future:
            if self.local:
                saved[kind, i] = (x, total)  # the residual kernel summed the lanes (want_sum)
            else:
                saved[kind, i] = (x, comm.ready(kw["total"].unsqueeze(0)) if mode == PRESENT else issued)
        return normed

    def _forward(self, b: _Batch) -> Tensor:
        m, cfg = self.model, self.cfg
        L, n, D = len(m.lanes), b.n, cfg.hidden_size
        hq, hd = cfg.heads_per_lane, cfg.head_dim
        impl = self.impl
        h = b.h
        h.copy_(F.embedding(b.tokens, m.embed).unsqueeze(0).expand(L, n, D))
        x = ops.rms_norm(h.view(L * n, D), self._norm(m.layers[0].attn_norm), cfg.norm_eps, impl=impl).view(L, n, D)
        saved: dict = {}
        for i, w in enumerate(m.layers):
            qkv = self._linear(x, w.wqkv)
            o = self._attention(qkv.view(L * n, -1), b.cache.k[i], b.cache.v[i], b.pos, cfg.window(i),
                                cache_rows=b.cache_rows)
            x = self._reduce(i, "attention", h, self._linear(o.view(L, n, hq * hd), w.wo), saved, w.ffn_norm)
            gu = self._linear(x, w.w13)
            y = ops.swiglu(gu.view(L * n, -1), impl=impl).view(L, n, -1)
            nxt = m.layers[i + 1].attn_norm if i + 1 < len(m.layers) else None
            x = self._reduce(i, "mlp", h, self._linear(y, w.w2), saved, nxt)
        if self.local and cfg.lm_head_type == "replicate" and not cfg.pre_norm_lane_agg:  # through the norm kernel
            hn = ops.rms_norm(h.view(L * n, D), self._norm(m.norm), cfg.norm_eps, impl=impl).view(L, n, D)
            y = hn.sum(0) / L if L > 1 else hn[0]
            return (y @ m.head_weight.T).float()
        return m.head(h.unsqueeze(2))[:, -1]

    # -- measuring the GEMV choice on this GPU ------------------------------------------------------------
    @torch.inference_mode()
    def tune_gemv(self, batch: int = 1, reps: int = 20) -> list[dict]:
        """Time cuBLAS's batched GEMM against each Triton lane-GEMV config per weight shape (every layer's
        matrix of that shape in turn, so the timing streams from memory, not L2), each captured in a CUDA
        graph as the step runs them (host launch costs out of the comparison); keep the faster."""
        from laneplay.kernels import triton_kernels as tk

        if self.model.device.type != "cuda":
            raise ValueError("the GEMV choice is measured on a CUDA device")
        rows = []
        shapes: dict[tuple[int, ...], list[Tensor]] = {}
        for w in self.model.layers:
            for t in (w.wqkv, w.wo, w.w13, w.w2):
                shapes.setdefault(tuple(t.shape), []).append(t)
        for shape, ws in shapes.items():
            x = torch.randn(shape[0], batch, shape[2], dtype=self.model.dtype, device=self.model.device)
            candidates = [("cublas", None)] + [("triton", c) for c in tk.GEMV_CONFIGS]
            times = {}
            for name, cfg in candidates:
                def run():
                    for w in ws:
                        if cfg is None:
                            torch.bmm(x, w.transpose(1, 2))
                        else:
                            tk.lane_gemv(x, w, cfg)
                times[(name, cfg)] = _time_graph(run, reps) / len(ws)
            best = min(times, key=times.get)
            nbytes = ws[0].numel() * ws[0].element_size()
            for (name, cfg), t in times.items():
                rows.append({"shape": list(shape), "impl": name, "config": list(cfg) if cfg else None,
                             "us": round(t * 1e6, 2), "GB/s": round(nbytes / t / 1e9, 1), "chosen": (name, cfg) == best})
            if best[0] == "triton":
                self.gemv[shape] = ("triton", best[1], tk.GEMV_MAX_BATCH)
            else:
                self.gemv.pop(shape, None)
        self.reset_graphs()  # recapture with the chosen kernels
        return rows

    @torch.inference_mode()
    def tune_attention(self, pos: int | None = None, reps: int = 20) -> list[dict]:
        """Time each attention config of the Triton kernel, with RoPE + KV write as their own kernel and
        fused into it, over every layer's batch-1 cache at `pos` (default: half the capacity), captured as
        a graph; keep the fastest. (Slot `pos` is written with random keys; a request's `load` rewrites it.)"""
        from laneplay.kernels import triton_kernels as tk

        cfg, m = self.cfg, self.model
        b = self._batch(1)
        pos = min(self.capacity - 1, pos if pos is not None else self.capacity // 2)
        p = torch.tensor([pos], device=m.device)
        qkv = torch.randn(cfg.num_lanes, (cfg.heads_per_lane + 2 * cfg.kv_heads_per_lane) * cfg.head_dim,
                          dtype=m.dtype, device=m.device)
        rows, times = [], {}
        for conf in tk.ATTENTION_CONFIGS:
            for fused in (False, True):
                def run():
                    for i in range(cfg.num_layers):
                        self._attention(qkv, b.cache.k[i], b.cache.v[i], p, cfg.window(i), conf, fused)
                times[conf, fused] = _time_graph(run, reps)
        best = min(times, key=times.get)
        for (conf, fused), t in times.items():
            rows.append({"config": list(conf), "fused_rope": fused, "pos": pos,
                         "us_per_layer": round(t / cfg.num_layers * 1e6, 2), "chosen": (conf, fused) == best})
        self.attention_config, self.fused_rope = best
        self.reset_graphs()
        return rows

    def tune(self, log=None) -> dict:
        """Measure the attention and GEMV choices on this GPU (a few seconds at load, never in a request);
        a choice that fails to measure keeps the default (two-kernel attention, cuBLAS GEMVs)."""
        import logging
        import traceback

        log = log or logging.getLogger("laneplay.engine")
        out = {}
        for name, fn in (("attention", self.tune_attention), ("gemv", self.tune_gemv)):
            try:
                out[name] = fn()
            except Exception:  # a kernel that fails to build or run here: keep the default path
                log.warning("static step: measuring the %s choice failed; keeping the default\n%s", name,
                            traceback.format_exc())
                if name == "attention":
                    self.attention_config, self.fused_rope = None, False
                else:
                    self.gemv.clear()
        self.reset_graphs()
        return out

    def reset_graphs(self) -> None:
        """Drop every captured graph (the next step recaptures) and start a fresh memory pool for them."""
        for b in (*self.batches.values(), *self.buckets.values(), *self.verifies.values()):
            b.graph = None
        if self.graphs:
            self.pool = torch.cuda.graph_pool_handle()


class _Verified:
    """What a static verify leaves to its caller: `keep(k)` with how many of its positions were kept (the
    last token and the drafts accepted). Nothing is restored (see SPARE); a resident request's next
    step then writes at pos + k."""

    def __init__(self, resident: _Resident | None, pos: int, S: int):
        self.resident, self.pos, self.S = resident, pos, S

    def keep(self, n: int) -> None:
        if not 0 <= n <= self.S:
            raise ValueError(f"cannot keep {n} of {self.S} verified positions")
        if self.resident is not None:
            self.resident.next_pos = self.pos + n


def _place(dst: Tensor, src: Tensor, length: int) -> None:
    """A request's K or V of one layer into static rows: src [L, n, H, slots, hd] with `length` positions
    written, dst [L, n, H, slots', hd] (a view of the static cache's rows). Position p lives in slot
    p % slots on both sides: the same slot while the request's ring has not wrapped (or on a full layer);
    a wrapped ring's last `slots` positions move to their slots in the larger static ring."""
    have = src.shape[3]
    if length <= have:
        dst[:, :, :, :have] = src
        return
    p = torch.arange(length - have, length, device=src.device)
    dst[:, :, :, p % dst.shape[3]] = src[:, :, :, p % have]


def _time_graph(fn, reps: int) -> float:
    """Median seconds of one replay of fn() captured as a CUDA graph (after a warm-up that compiles)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, z = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        z.record()
        z.synchronize()
        times.append(a.elapsed_time(z) / 1e3)
    times.sort()
    return times[len(times) // 2]
