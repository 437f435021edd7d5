"""A paged KV cache in kvpolicy's `nano_vllm` layout, and the decode step that reads it.

What an engine holds, and what the presets read (docs/views.md):

- `kv`: one float32 tensor `[2, L, num_blocks, b, h_kv, d]` (K then V), `layouts::nano_vllm`;
- `block_table`: `[num_seqs, max_blocks]` int32, dense; `lengths`: `[num_seqs]` int32;
- `queries`: the observation-query window `[L, slots, w, h_q, d]` (query_window_view), one
  slot per sequence. The library wants entry j to be the query of position T - w + j,
  oldest first; rather than shifting the window every step, each query is written twice
  into a ring of 2w entries (at p % w and p % w + w), so the last w queries are always the
  contiguous slice `[(p + 1) % w, (p + 1) % w + w)`: `query_window()` is that view, no copy;
- `scores`: the global score F, `[L, num_blocks, b, h_kv]` fp32 (score_view::contiguous);
- `positions`: each cached token's original position, `[L, num_blocks, b, h_kv]` int32
  (position_view::contiguous), moved with its token by a compression;
- `live`: whether each (layer, KV head) still holds each cached token, `[L, num_blocks, b,
  h_kv]` uint8 (live_view::contiguous: cautious update, for Hard-KV's per-head counts): 1 when
  a token is written, rewritten by a head-adaptive compression for the rows it compacts;
- `history`: for the sequences that compress a window at a time (Kara), the queries of
  their last `history_len` positions, `[L, seqs, history_len, h_q, d]`, a ring indexed by
  original position (`p % history_len`): a window's |W| queries are not the newest ones
  (the last, partial block comes after the window), so the short ring above cannot serve
  them. `window_queries()` gathers a window's into the layout a query slot wants.

Attention reads a sequence's tokens through its block table up to its length, so after a
compression (kept tokens moved to the front, length shortened) the model sees only what
was kept; for the sequences of a head-adaptive preset (`cautious`), only the tokens each
head still holds (the live bytes), as an engine's attention mask over them would. K is stored with RoPE at the token's original position and is never rotated
again, as the token-eviction methods assume.
"""

from __future__ import annotations

import copy

import numpy as np

from model import Config, Weights, apply_rope, rmsnorm, rope_tables, silu


class PagedCache:
    def __init__(self, cfg: Config, num_seqs: int, num_blocks: int, block_size: int, max_blocks: int, window: int,
                 history_seqs=(), history_len: int = 0):
        self.cfg = cfg
        self.b = block_size
        self.window = window
        L, hk, hq, d = cfg.n_layers, cfg.n_kv_heads, cfg.n_heads, cfg.head_dim
        self.kv = np.zeros((2, L, num_blocks, block_size, hk, d), dtype=np.float32)
        self.block_table = np.full((num_seqs, max_blocks), -1, dtype=np.int32)
        self.lengths = np.zeros(num_seqs, dtype=np.int32)
        self.held = np.zeros(num_seqs, dtype=np.int32)  # table entries in use
        self.next_pos = np.zeros(num_seqs, dtype=np.int64)  # original position of the next token
        self.queries = np.zeros((L, num_seqs, 2 * window, hq, d), dtype=np.float32)
        self.scores = np.zeros((L, num_blocks, block_size, hk), dtype=np.float32)
        self.positions = np.zeros((L, num_blocks, block_size, hk), dtype=np.int32)
        self.live = np.zeros((L, num_blocks, block_size, hk), dtype=np.uint8)
        self.cautious = np.zeros(num_seqs, dtype=bool)  # sequences whose attention reads the live bytes
        # The long query rings of the sequences that compress windows (row per sequence).
        self.history_row = {int(s): i for i, s in enumerate(history_seqs)}
        self.history_len = history_len if self.history_row else 0
        self.history = np.zeros((L, len(self.history_row), self.history_len, hq, d), dtype=np.float32)
        # Free list, lowest id first, as a simple engine allocator would hand them out.
        self.free = list(range(num_blocks - 1, -1, -1))
        self.peak_blocks_used = 0

    @property
    def num_seqs(self) -> int:
        return len(self.lengths)

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[2]

    # -- allocation -------------------------------------------------------------------

    def _allocate(self, seq: int, n_tokens: int) -> None:
        """Give `seq` enough blocks to hold n_tokens."""
        need = -(-n_tokens // self.b)
        if need > self.block_table.shape[1]:
            raise RuntimeError(f"seq {seq}: {n_tokens} tokens need {need} blocks, table holds {self.block_table.shape[1]}")
        while self.held[seq] < need:
            if not self.free:
                raise RuntimeError("out of KV blocks: size the pool larger")
            self.block_table[seq, self.held[seq]] = self.free.pop()
            self.held[seq] += 1
        self.peak_blocks_used = max(self.peak_blocks_used, self.num_blocks - len(self.free))

    def release(self, seq: int, new_length: int, released: np.ndarray | list[int]) -> None:
        """The engine's side of a compression (views.md): new length, table tail, free list."""
        keep = -(-int(new_length) // self.b)
        tail = [int(x) for x in self.block_table[seq, keep : self.held[seq]]]
        if sorted(tail) != sorted(int(x) for x in released):
            raise RuntimeError(f"seq {seq}: released blocks {list(released)} are not the table's tail {tail}")
        self.block_table[seq, keep:] = -1
        self.held[seq] = keep
        self.lengths[seq] = new_length
        self.free.extend(reversed(tail))

    # -- prefill: the same prompt in every sequence -----------------------------------

    def fill_prompt(self, k: np.ndarray, v: np.ndarray, q: np.ndarray, seqs=None) -> None:
        """Write a prefilled prompt (k, v: [L, P, h_kv, d]; q: [L, P, h_q, d]) into every sequence."""
        seqs = range(self.num_seqs) if seqs is None else seqs
        P = k.shape[1]
        t = np.arange(P)
        for s in seqs:
            if self.lengths[s] != 0:
                raise RuntimeError("fill_prompt into a non-empty sequence")
            self._allocate(s, P)
            blocks = self.block_table[s, t // self.b]
            slots = t % self.b
            self.kv[0][:, blocks, slots] = k
            self.kv[1][:, blocks, slots] = v
            self.positions[:, blocks, slots] = t[None, :, None]
            self.live[:, blocks, slots] = 1
            self.lengths[s] = P
            self.next_pos[s] = P
            last = np.arange(max(0, P - self.window), P)
            self.queries[:, s, last % self.window] = q[:, last]
            self.queries[:, s, last % self.window + self.window] = q[:, last]
            if s in self.history_row:
                kept = np.arange(max(0, P - self.history_len), P)
                self.history[:, self.history_row[s], kept % self.history_len] = q[:, kept]

    # -- the observation window for a compression -----------------------------------

    def query_window(self) -> np.ndarray:
        """[L, slots, w, h_q, d] view, entry j of slot s the query of position T - w + j.

        Every sequence decodes in step here (one token each per step), so they share the
        position of their newest token and one slice serves every slot.
        """
        newest = self.next_pos - 1
        if not (newest == newest[0]).all():
            raise RuntimeError("sequences at different positions: one window slice cannot serve them all")
        start = int(newest[0] + 1) % self.window
        return self.queries[:, :, start : start + self.window]

    def window_queries(self, seq: int, window_begin: int, count: int) -> np.ndarray:
        """[L, count, h_q, d]: the queries of the sequence's tokens window_begin .. + count - 1,
        oldest first, from its ring. Those tokens must be uncompressed (generated since the
        last compression, so their original positions are consecutive) and recent enough
        to be in the ring; both are checked."""
        row = self.history_row[seq]
        t = np.arange(window_begin, window_begin + count)
        pos = self.positions[0, self.block_table[seq, t // self.b], t % self.b, 0].astype(np.int64)
        first = int(pos[0])
        if not (pos == first + np.arange(count)).all():
            raise RuntimeError(f"seq {seq}: window [{window_begin}, {window_begin + count}) holds positions that are "
                               "not consecutive: it reaches into compressed tokens")
        if first < self.next_pos[seq] - self.history_len:
            raise RuntimeError(f"seq {seq}: position {first} has left the query ring of {self.history_len}")
        return self.history[:, row, (first + np.arange(count)) % self.history_len]

    # -- one decode step (decode_step calls these) ----------------------------------

    def begin_step(self) -> np.ndarray:
        """Allocate the new token's slot in every sequence; returns its position per sequence."""
        t_new = self.lengths.copy()  # slot of the new token in each sequence
        for s in range(self.num_seqs):
            self._allocate(s, int(t_new[s]) + 1)
        pos = self.next_pos.copy()
        self._step = {
            "t": t_new,
            "blk": self.block_table[np.arange(self.num_seqs), t_new // self.b],
            "slot": t_new % self.b,
            "pos": pos,
            "ring": pos % self.window,
            # Sequences of equal length (the presets at one budget compress at the same
            # steps) share one batched attention product.
            "groups": [np.flatnonzero(t_new == T) for T in np.unique(t_new)],
            "h_seqs": np.fromiter(self.history_row, dtype=np.int64),  # sequences with a long query ring
            "h_rows": np.fromiter(self.history_row.values(), dtype=np.int64),
        }
        return pos

    def attend(self, l: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Layer l: write the new token (k, v: [seqs, h_kv, d]; q: [seqs, h_q, d]) and its
        query, then attend through each sequence's table and length. Returns [seqs, h_kv, G, d]."""
        st = self._step
        S, hk, d = k.shape
        G = self.cfg.group
        blk, slot, pos, ring = st["blk"], st["slot"], st["pos"], st["ring"]
        self.kv[0, l, blk, slot] = k
        self.kv[1, l, blk, slot] = v
        self.positions[l, blk, slot] = pos[:, None]
        self.live[l, blk, slot] = 1
        self.queries[l, np.arange(S), ring] = q
        self.queries[l, np.arange(S), ring + self.window] = q
        if len(st["h_seqs"]):
            self.history[l, st["h_rows"], pos[st["h_seqs"]] % self.history_len] = q[st["h_seqs"]]
        o = np.empty((S, hk, G, d), dtype=np.float32)
        kl, vl = self.kv[0, l], self.kv[1, l]
        scale = np.float32(1.0 / np.sqrt(d))
        for g in st["groups"]:
            T = int(st["t"][g[0]]) + 1
            nb = -(-T // self.b)
            tbl = self.block_table[g, :nb]  # [n, nb]
            K = kl[tbl].reshape(len(g), nb * self.b, hk, d)[:, :T]  # [n, T, hk, d]
            V = vl[tbl].reshape(len(g), nb * self.b, hk, d)[:, :T]
            qg = q[g].reshape(len(g), hk, G, d)
            sc = np.matmul(qg, K.transpose(0, 2, 3, 1)) * scale  # [n, hk, G, T]
            if self.cautious[g].any():  # each head reads the tokens it holds (1 in every other row's [0, T))
                held = self.live[l][tbl].reshape(len(g), nb * self.b, hk)[:, :T].transpose(0, 2, 1)
                sc = np.where(held[:, :, None, :] != 0, sc, -np.inf)
            sc = np.exp(sc - sc.max(axis=-1, keepdims=True))
            sc /= sc.sum(axis=-1, keepdims=True)
            o[g] = np.matmul(sc, V.transpose(0, 2, 1, 3))  # [n, hk, G, d]
        return o

    def end_step(self) -> None:
        self.lengths += 1
        self.next_pos += 1

    def held_slots(self, seq: int) -> np.ndarray:
        """[L, h_kv, length] bool: the slots of seq each (layer, KV head) holds (its live bytes)."""
        T = int(self.lengths[seq])
        tbl = self.block_table[seq, : -(-T // self.b)]
        return self.live[:, tbl].reshape(self.live.shape[0], -1, self.live.shape[3])[:, :T].transpose(0, 2, 1) != 0

    def snapshot(self) -> "PagedCache":
        return copy.deepcopy(self)


def decode_step(w: Weights, caches, tokens: np.ndarray) -> np.ndarray:
    """One token for every sequence (tokens: [S]); returns logits [S, vocab].

    `caches` is one cache holding all S sequences, or a list of (cache, rows): the rows of
    `tokens` (and of the logits) that each cache holds, in its own sequence order (a
    PagedCache, or per_head_cache.PerHeadCache for KV-Compress). The weights are read once
    for all sequences (one matrix product per weight, whichever cache a sequence lives
    in); only attention is per cache and per sequence, each cache reading its own tables
    and lengths.
    """
    c = w.config
    S = len(tokens)
    parts = [(caches, np.arange(S))] if not isinstance(caches, (list, tuple)) else caches
    hq, hk, d = c.n_heads, c.n_kv_heads, c.head_dim
    pos = np.empty(S, dtype=np.int64)
    for cache, rows in parts:
        pos[rows] = cache.begin_step()
    cos, sin = rope_tables(c, pos)

    x = w.embed[tokens]
    for l in range(c.n_layers):
        h = rmsnorm(x, w.attn_norm[l], c.rms_eps)
        qkv = h @ w.wqkv[l]
        q = apply_rope(qkv[:, : c.hidden].reshape(S, hq, d), cos, sin)
        k = apply_rope(qkv[:, c.hidden : c.hidden + hk * d].reshape(S, hk, d), cos, sin)
        v = qkv[:, c.hidden + hk * d :].reshape(S, hk, d)
        o = np.empty((S, hk, c.group, d), dtype=np.float32)
        for cache, rows in parts:
            o[rows] = cache.attend(l, q[rows], k[rows], v[rows])
        x = x + o.reshape(S, c.hidden) @ w.wo[l]
        h = rmsnorm(x, w.ffn_norm[l], c.rms_eps)
        gu = h @ w.wgu[l]
        x = x + (silu(gu[:, : c.ffn]) * gu[:, c.ffn :]) @ w.wdown[l]
    for cache, _ in parts:
        cache.end_step()
    return rmsnorm(x, w.out_norm, c.rms_eps) @ w.embed_t
