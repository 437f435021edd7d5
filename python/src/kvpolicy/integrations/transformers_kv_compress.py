"""KV-Compress inside transformers' continuous batching (``Adapter(kvpolicy.KVCompress(), budget=B,
attention="kvpolicy")``): the adapter's run for one batch processor when the policy evicts per
(layer, KV head).

Differences from the other presets' run (``transformers._Run``):

- The engine's K/V memory is re-homed into KV-Compress's unified per-head pool
  (``per_head_pool.PerHeadPool``); every request, compressed or not, has a row of per-head
  tables there, and the adapter's attention is the only reader: kvpolicy's per-head decode
  attention for one-token requests (which adds each query's squared attention to the metric,
  as KV-Compress's modified paged attention does) and a torch SDPA over the gathered heads
  for prompt chunks.
- When a prompt is complete, KV-Compress's prefill metric (``kvpolicy.per_head_metric``) is
  written from its last ``metric_window`` queries (the adapter's query ring).
- The engine's ``position_offset`` is not the length of any head: after each step the adapter
  sets it so that the engine allocates a block exactly when the request's heads need one more
  engine block for the next token (``PerHeadPool.engine_blocks_next``), and the logical
  position lives in the record's ``delta`` as for the other presets.
- A compression (``kvpolicy.compress_per_head``, the trigger's budget as KV-Compress's
  ``max_cache_tokens``; due as soon as a prompt longer than the budget is complete, as
  KV-Compress compresses after a prefill, then by the trigger) frees per-head blocks; the pool then gathers the request's heads into
  as few engine blocks as hold them and hands the rest back to the engine's block manager.
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import torch

import kvpolicy

from .paged_attention import put_decode_rows, raise_first_status
from .per_head_pool import PerHeadPool
from .transformers import RequestStatus, _refuse, _Run


def _host(x) -> np.ndarray:
    return x.detach().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


class PerHeadAttention:
    """The step's plan over the per-head pool, run once per layer: new K/V into each head's next
    slot, then kvpolicy's per-head decode attention (metric update on) for one-token requests and
    one SDPA per request with a prompt chunk."""

    def __init__(self, pool: PerHeadPool, scale: float, policy):
        self.pool = pool
        self.scale = scale
        self.excluded_distance = int(policy.params()["excluded_distance"])
        self.dst = None  # [L, rows * h_kv] flat slot of each (row, head)'s new token
        self.decoding = 0
        self.decode_rows = None  # query rows of the one-token requests (None: 0 .. n - 1)
        self.table_rows = self.query_positions = None
        self.max_tokens = 0
        self.prefills: list = []  # (first row, tokens, index [L, h_kv, n] flat slots, causal mask [q, n])
        self.workspace, self.sized = None, False
        self.statuses: list = []  # device status words, checked at the next plan

    def plan(self, requests, rows: int) -> None:
        """``requests``: (pool row, query tokens, logical position of the first) per request in
        batch order; ``rows`` the forward's query rows (padding included). Grows the heads, writes
        the new tokens' positions and zero metrics, uploads the tables."""
        self.check()
        pool, L, h = self.pool, self.pool.L, self.pool.h
        dst = np.broadcast_to(pool.trash_slots()[:, None, :], (L, rows, h)).copy()
        positions = np.zeros((L, rows, h), dtype=np.int32)
        decode_at, table_rows, query_positions, self.prefills = [], [], [], []
        start, dev = 0, pool.device
        for row, q, logical in requests:
            if q == 1:  # one token: all of them at once below
                decode_at.append(start)
                table_rows.append(row)
                query_positions.append(logical)
                start += 1
                continue
            first = pool.lengths[:, row].copy()
            if (first != first.flat[0]).any():
                _refuse("batch", f"a prompt chunk of {q} tokens for table row {row}, whose heads hold different "
                        "lengths (compressed): the adapter attends prompt chunks only before a compression")
            pool.grow(row, q)
            dst[:, start:start + q] = pool.slots(row, first, q)
            positions[:, start:start + q] = np.arange(logical, logical + q, dtype=np.int32)[None, :, None]
            n = int(first.flat[0]) + q
            index = pool.slots(row, np.zeros_like(first), n).transpose(0, 2, 1)  # [L, h, n]
            allowed = torch.arange(n, device=dev)[None, :] <= (n - q + torch.arange(q, device=dev))[:, None]
            self.prefills.append((start, q, torch.from_numpy(np.ascontiguousarray(index)).to(dev), allowed))
            start += q
        if decode_at:
            at = np.array(decode_at)
            dst[:, at] = pool.grow_by_one(np.array(table_rows))
            positions[:, at] = np.array(query_positions, dtype=np.int32)[None, :, None]
        pool.upload()
        self.dst = torch.from_numpy(dst.reshape(L, rows * h)).to(dev)
        flat = self.dst.view(-1)
        pool.positions.view(-1).index_copy_(0, flat, torch.from_numpy(positions.reshape(-1)).to(dev))
        pool.metric.view(-1).index_fill_(0, flat, 0.0)  # a new token's metric counts from its own query on
        self.decoding = len(decode_at)
        self.workspace, self.sized = None, False
        self.table_rows = self.query_positions = self.decode_rows = None
        if self.decoding:
            i32 = dict(dtype=torch.int32, device=dev)
            self.table_rows = torch.tensor(table_rows, **i32)
            self.query_positions = torch.tensor(query_positions, **i32)
            self.max_tokens = int(pool.lengths[:, table_rows].max())
            contiguous = decode_at == list(range(self.decoding))
            self.decode_rows = None if contiguous else torch.tensor(decode_at, dtype=torch.int64, device=dev)
        self.rows = rows

    def run(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        """``query``: ``[rows, h_q, d]``; ``key``/``value``: ``[rows, h_kv, d]``. Returns ``[rows, h_q, d]``."""
        pool = self.pool
        d = pool.d
        kf, vf = pool.k.view(-1, d), pool.v.view(-1, d)
        kf.index_copy_(0, self.dst[layer], key.reshape(-1, d))
        vf.index_copy_(0, self.dst[layer], value.reshape(-1, d))
        everything = self.decoding == self.rows
        out = None if everything else torch.zeros_like(query)
        if self.decoding:
            q = query[: self.decoding] if self.decode_rows is None else query.index_select(0, self.decode_rows)
            args = (q, pool.k, pool.v, pool.tables_dev, pool.lengths_dev)
            if not self.sized:  # one sizing per step (0 on the host)
                need = kvpolicy.decode_attention_per_head_workspace_bytes(
                    *args, max_tokens=self.max_tokens, update="squared", metric=pool.metric)
                self.workspace = torch.empty(need, dtype=torch.uint8, device=pool.device) if need else None
                self.sized = True
            r = kvpolicy.decode_attention_per_head(
                *args, layer=layer, seqs=self.table_rows, scale=self.scale, update="squared", metric=pool.metric,
                positions=pool.positions, excluded_distance=self.excluded_distance,
                query_positions=self.query_positions, max_tokens=self.max_tokens, workspace=self.workspace,
                check=False)
            if r.status is not None:
                self.statuses.append(r.status)
            if everything:
                return r.out
            put_decode_rows(out, self.decode_rows, r.out)
        h_q, h_kv = query.shape[1], pool.h
        for start, q, index, allowed in self.prefills:
            k = kf.index_select(0, index[layer].reshape(-1)).view(h_kv, -1, d)  # [h_kv, n, d]
            v = vf.index_select(0, index[layer].reshape(-1)).view(h_kv, -1, d)
            qq = query[start:start + q].transpose(0, 1).reshape(h_kv, h_q // h_kv, q, d)
            o = torch.nn.functional.scaled_dot_product_attention(
                qq, k[:, None], v[:, None], attn_mask=allowed[None, None], scale=self.scale, enable_gqa=True)
            out[start:start + q] = o.reshape(h_q, q, d).transpose(0, 1)
        return out

    def check(self) -> None:
        """Raises the kvpolicy.Error a device call of the last step found (one wait for them all)."""
        statuses, self.statuses = self.statuses, []
        raise_first_status(statuses)


class PerHeadRun(_Run):
    """The adapter's state for one batch processor running KV-Compress (see the module)."""

    def _views(self) -> None:
        cache = self.cache
        self.k = self.v = None  # the nhd views of the other presets: the memory is the pool's now
        slots = self.adapter.max_requests or self.processor.cb_config.max_requests_per_batch
        self.pool = PerHeadPool(cache.key_cache, cache.value_cache, cache.num_blocks + 2, cache.block_size,
                                cache.num_key_value_heads, cache.head_dim, trash_block=cache.num_blocks + 1,
                                rows=max(slots, 1))

    def _backend(self, scale: float):
        return PerHeadAttention(self.pool, scale, self.policy)

    def _drop(self, rid) -> None:
        rec = self.records[rid]
        if rec.row >= 0:
            self.pool.give_row(rec.row)
        super()._drop(rid)

    def _plan_attention(self, plan) -> None:
        requests = []
        for rec, blocks, past, q in plan:
            if rec.row < 0:
                rec.row = self.pool.take_row()
            self.pool.sync_blocks(rec.row, blocks)
            requests.append((rec.row, q, past + rec.delta))
        self.backend.plan(requests, self.io.num_q_tokens)

    def _attention_by_backend(self, layer, query, key, value):
        out = self.backend.run(layer, query[0].transpose(0, 1).contiguous(), key[0].transpose(0, 1),
                               value[0].transpose(0, 1))
        return out.unsqueeze(0), None

    # -- after the step ----------------------------------------------------------------------

    def _advance(self, batch) -> None:
        if not batch:
            return
        prompts_done = []
        rows = np.array([rec.row for rec, _, _ in batch])
        means, needs = self.pool.mean_length(rows).tolist(), self.pool.engine_blocks_next(rows).tolist()
        for (rec, q, decode), mean, need in zip(batch, means, needs):
            state = rec.state
            if decode:
                rec.seq.generated_since_compression += q
            elif state.status == RequestStatus.DECODING and rec.slot >= 0:
                prompts_done.append(rec)
            rec.seq.length = mean
            if state.status == RequestStatus.DECODING:
                self._place(rec, need)
        if prompts_done:
            self._prefill_metric(prompts_done)

    def _place(self, rec, need: int) -> None:
        """Set the engine's position_offset so that it allocates exactly the engine blocks the
        request's heads need for the next token (``need``: one more or none); the logical length
        stays."""
        state, b = rec.state, self.block_size
        held = len(self.manager_of_blocks.block_table[state.request_id])
        if need > held + 1:
            _refuse("blocks", f"request {state.request_id!r} needs {need} engine blocks for its next token and holds "
                    f"{held}; a decode step adds at most one")
        logical = state.position_offset + rec.delta
        state.position_offset = held * b if need > held else held * b - 1
        rec.delta = logical - state.position_offset

    def _prefill_metric(self, recs) -> None:
        """KV-Compress's metric of each completed prompt from its last metric_window queries."""
        w, n = self.window, len(recs)
        device = self.ring.device
        stream = self.io.compute_stream
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            picks = [rec.slot * w + (rec.seen - w + j) % w for rec in recs for j in range(w)]  # oldest first
            queries = self.ring.index_select(1, torch.tensor(picks, dtype=torch.int64, device=device))
            queries = queries.view(self.layers, n, w, self.h_q, self.cache.head_dim)
            pool = self.pool
            r = kvpolicy.per_head_metric(self.policy, queries, pool.k, pool.metric, pool.tables_dev,
                                         pool.lengths_dev, seqs=[rec.row for rec in recs], query_slots=list(range(n)),
                                         mode="prefill", positions=pool.positions, check=False)
            if r.status is not None:
                self.backend.statuses.append(r.status)
        for rec in recs:
            rec.metric_ready = True
            rec.prefilled_at = self.step

    def _due(self, rec) -> bool:
        """The trigger's rule, and KV-Compress's own after a prefill: a prompt longer than the
        budget is compressed as soon as it is complete (its metric written), not 128 tokens later."""
        if not (rec.slot >= 0 and rec.metric_ready and rec.state.status == RequestStatus.DECODING
                and rec.seen >= self.window and rec.seq.length > self.protected):
            return False
        budget = getattr(self.trigger, "budget", None)
        after_prefill = rec.prefilled_at == self.step and budget is not None and rec.seq.length > budget
        return after_prefill or self.trigger.due(rec.seq, self.step)

    def _compress(self, due) -> None:
        pool, b = self.pool, self.block_size
        rows = [rec.row for rec in due]
        logical = [rec.state.position_offset + rec.delta for rec in due]
        stream = self.io.compute_stream
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            pool.upload()
            counts = kvpolicy.blocks_to_free(self.policy, pool.lengths, b, rows, logical_lengths=logical)
            r = kvpolicy.compress_per_head(self.policy, pool.k, pool.v, pool.metric, pool.tables_dev,
                                           pool.lengths_dev, seqs=rows, blocks_to_free=counts,
                                           logical_lengths=logical, positions=pool.positions)
            r.check()  # waits for the stream: the new lengths decide the engine's next step
            new_lengths, freed_counts = _host(r.new_lengths), _host(r.freed_counts)
            freed_blocks, evicted = _host(r.freed_blocks), _host(r.evicted)
            released = []
            for i, rec in enumerate(due):
                pool.shrink(rec.row, new_lengths[i], freed_counts[i], freed_blocks[i])
                src, dst, gone = pool.defragment(rec.row)
                pool.move(src, dst)
                released.append(gone)
        stats = self.adapter.stats
        stats.compression_events += 1
        for i, rec in enumerate(due):
            state = rec.state
            blocks = self.manager_of_blocks.block_table[state.request_id]
            gone = set(released[i])
            blocks[:] = [e for e in blocks if e not in gone]  # the engine's own list, in place
            if released[i]:
                self.cache._block_manager.free_blocks(released[i],
                                                      shareable=self.manager_of_blocks.uses_block_sharing)
            state.allocated_blocks -= len(released[i])
            self._place(rec, int(pool.engine_blocks_next(rec.row)))
            rec.seq.record_compression(int(pool.mean_length(rec.row)), self.step)
            stats.compressions += 1
            stats.tokens_evicted += int(evicted[i].sum())
            stats.blocks_freed += len(released[i])
