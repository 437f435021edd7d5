"""A per-head block cache, KV-Compress's layout (KV-Compress 4.2.1; docs/views.md, "Per-head
blocks"), and its side of the decode step.

What it holds, in the arrays `kvpolicy.compress_per_head` and `kvpolicy.per_head_metric` read:

- `k`, `v`: one float32 pool `[num_blocks, b, d]` for every layer and KV head (the paper's
  unified cache: a block holds `b` tokens of one head of one layer, and a block id names
  one block whatever its layer);
- `tables`: `[L, seqs, h_kv, max_blocks]` int32, each (layer, sequence, KV head) its own
  row of block ids; `lengths`: `[L, seqs, h_kv]` int32, the tokens each head holds;
- `metric`: `[num_blocks, b]` float32, each slot's eviction metric: squared attention,
  the prefill's written by compression.kv_compress_prefill_metric (kvpolicy.per_head_metric),
  each decode step's added by `attend` from the probabilities it has just computed
  (KV-Compress eq. 20), which saves recomputing the step's attention;
- `positions`: `[num_blocks, b]` int32, each slot's original position.

A compression evicts a different number of blocks from each head and makes each head
dense again by moving its newest survivors into the holes (MoveCache): K, V, metric and
position move together, and a head's slots are no longer in position order. Attention does
not need that order (K was rotated at its original position when it was written, and
softmax over a head's keys does not depend on where they sit); the positions serve the
compression's protected window and the keep map.
"""

from __future__ import annotations

import copy

import numpy as np

from model import Config


class PerHeadCache:
    def __init__(self, cfg: Config, num_seqs: int, num_blocks: int, block_size: int, max_blocks: int,
                 excluded_distance: int = 0):
        self.cfg = cfg
        self.b = block_size
        self.excluded_distance = excluded_distance  # v: a query adds nothing to keys fewer than v positions back
        L, hk, d = cfg.n_layers, cfg.n_kv_heads, cfg.head_dim
        self.k = np.zeros((num_blocks, block_size, d), dtype=np.float32)
        self.v = np.zeros((num_blocks, block_size, d), dtype=np.float32)
        self.metric = np.zeros((num_blocks, block_size), dtype=np.float32)
        self.positions = np.zeros((num_blocks, block_size), dtype=np.int32)
        self.tables = np.full((L, num_seqs, hk, max_blocks), -1, dtype=np.int32)
        self.lengths = np.zeros((L, num_seqs, hk), dtype=np.int32)
        self.next_pos = np.zeros(num_seqs, dtype=np.int64)  # each sequence's position count
        self.free = list(range(num_blocks - 1, -1, -1))  # lowest id first
        self.peak_blocks_used = 0

    @property
    def num_seqs(self) -> int:
        return self.lengths.shape[1]

    @property
    def num_blocks(self) -> int:
        return self.k.shape[0]

    def tokens(self, seq: int) -> int:
        """Tokens the sequence holds over all its layers and KV heads."""
        return int(self.lengths[:, seq].sum())

    def mean_tokens(self) -> np.ndarray:
        """[seqs]: tokens per (layer, KV head), the measure a uniform preset's length is."""
        return self.lengths.mean(axis=(0, 2))

    # -- allocation -------------------------------------------------------------------

    def _take(self, n: int) -> np.ndarray:
        if n > len(self.free):
            raise RuntimeError(f"out of per-head blocks: {n} wanted, {len(self.free)} free; size the pool larger")
        out = np.array(self.free[len(self.free) - n :][::-1], dtype=np.int32)
        del self.free[len(self.free) - n :]
        self.peak_blocks_used = max(self.peak_blocks_used, self.num_blocks - len(self.free))
        return out

    def _grow(self) -> None:
        """A block for every head whose next token starts one."""
        l, s, h = np.nonzero(self.lengths % self.b == 0)
        at = self.lengths[l, s, h] // self.b
        if len(at) and at.max() >= self.tables.shape[3]:
            raise RuntimeError(f"a head needs block {int(at.max())}; the tables hold {self.tables.shape[3]}")
        self.tables[l, s, h, at] = self._take(len(at))

    def release(self, seq: int, new_lengths: np.ndarray, freed_blocks: np.ndarray, freed_counts: np.ndarray) -> None:
        """The engine's side of a compression: each head's new length ([L, h_kv]), its table
        trimmed to ceil(new length / b), its freed blocks (`[L, h_kv, max_blocks]`, the first
        freed_counts[l, h] of each row) back to the pool. Refuses blocks that are not the
        head's table tail."""
        for l in range(self.lengths.shape[0]):
            for h in range(self.lengths.shape[2]):
                keep = -(-int(new_lengths[l, h]) // self.b)
                held = -(-int(self.lengths[l, seq, h]) // self.b)
                tail = self.tables[l, seq, h, keep:held].tolist()
                freed = freed_blocks[l, h, : int(freed_counts[l, h])].tolist()
                if freed != tail:
                    raise RuntimeError(f"seq {seq}, layer {l}, head {h}: freed blocks {freed} are not the "
                                       f"table's tail {tail}")
                self.tables[l, seq, h, keep:] = -1
                self.lengths[l, seq, h] = new_lengths[l, h]
                self.free.extend(reversed(tail))

    # -- prefill: the same prompt in every sequence -----------------------------------

    def fill_prompt(self, k: np.ndarray, v: np.ndarray) -> None:
        """Write a prefilled prompt (k, v: [L, P, h_kv, d]) into every sequence's heads; the
        metric starts at 0 (compression.kv_compress_prefill_metric writes the prefill's)."""
        L, P, hk, _ = k.shape
        nb = -(-P // self.b)
        t = np.arange(P)
        for s in range(self.num_seqs):
            if self.lengths[:, s].any():
                raise RuntimeError("fill_prompt into a non-empty sequence")
            self.tables[:, s, :, :nb] = self._take(L * hk * nb).reshape(L, hk, nb)
            blk = self.tables[:, s][:, :, t // self.b]  # [L, h_kv, P]
            slot = np.broadcast_to(t % self.b, blk.shape)
            self.k[blk, slot] = k.transpose(0, 2, 1, 3)
            self.v[blk, slot] = v.transpose(0, 2, 1, 3)
            self.metric[blk, slot] = 0.0
            self.positions[blk, slot] = t
            self.lengths[:, s] = P
            self.next_pos[s] = P

    # -- one decode step (paged_cache.decode_step calls these) ----------------------

    def begin_step(self) -> np.ndarray:
        """Allocate the new token's slot in every head; returns its position per sequence."""
        self._grow()
        return self.next_pos.copy()

    def attend(self, l: int, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """Layer l: write the new token (k, v: [seqs, h_kv, d]) at the end of each of its heads,
        attend q ([seqs, h_q, d]) over each head's own table and length, and add the
        squared probabilities, summed over the query group, to the metric of the keys they
        weigh. Returns [seqs, h_kv, G, d]."""
        S, hk, d = k.shape
        G = self.cfg.group
        t = self.lengths[l]  # [S, h_kv]: the new token's slot in each head
        blk = np.take_along_axis(self.tables[l], (t // self.b)[..., None], axis=2)[..., 0]
        slot = t % self.b
        self.k[blk, slot] = k
        self.v[blk, slot] = v
        self.metric[blk, slot] = 0.0  # the slot may hold an evicted token's metric
        self.positions[blk, slot] = self.next_pos[:, None]

        T = t + 1
        nb = -(-int(T.max()) // self.b)
        tbl = np.maximum(self.tables[l, :, :, :nb], 0)  # entries past a head's blocks are masked below
        K = self.k[tbl].reshape(S, hk, nb * self.b, d)
        V = self.v[tbl].reshape(S, hk, nb * self.b, d)
        sc = np.matmul(q.reshape(S, hk, G, d), K.transpose(0, 1, 3, 2)) * np.float32(1.0 / np.sqrt(d))
        valid = np.arange(nb * self.b) < T[..., None]  # [S, h_kv, nb * b]
        sc = np.where(valid[:, :, None], sc, -np.inf)
        sc = np.exp(sc - sc.max(axis=-1, keepdims=True))
        sc /= sc.sum(axis=-1, keepdims=True)

        blocks = np.repeat(tbl, self.b, axis=2)  # [S, h_kv, nb * b]: each key's block
        slots = np.broadcast_to(np.arange(nb * self.b) % self.b, blocks.shape)
        if self.excluded_distance:
            valid &= self.next_pos[:, None, None] - self.positions[blocks, slots] >= self.excluded_distance
        # A head's slots are its own blocks', so no two valid entries name one slot.
        self.metric[blocks[valid], slots[valid]] += (sc * sc).sum(axis=2)[valid]
        return np.matmul(sc, V)  # [S, h_kv, G, d]

    def end_step(self) -> None:
        self.lengths += 1
        self.next_pos += 1

    # -- reading it back --------------------------------------------------------------

    def head_slots(self, l: int, seq: int, h: int) -> tuple[np.ndarray, np.ndarray]:
        """(blocks, slots) of the head's tokens, in slot order."""
        t = np.arange(int(self.lengths[l, seq, h]))
        return self.tables[l, seq, h, t // self.b], t % self.b

    def head_positions(self, l: int, seq: int, h: int) -> np.ndarray:
        """The original positions the head holds, ascending."""
        return np.sort(self.positions[self.head_slots(l, seq, h)])

    def snapshot(self) -> "PerHeadCache":
        return copy.deepcopy(self)
