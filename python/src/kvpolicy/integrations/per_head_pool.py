"""KV-Compress's per-head blocks carved out of a paged engine's blocks.

An engine such as transformers' continuous batching gives a request whole blocks of ``b``
tokens for every KV head of every layer at once, one block list per request, and counts its
memory in those blocks. KV-Compress evicts per (layer, KV head): after a compression each head
holds its own number of blocks. ``PerHeadPool`` reconciles the two without changing the
engine's allocator:

- The engine's K and V tensors (one per layer, ``[E * b, h_kv, d]`` with ``E`` engine blocks)
  are re-homed into one allocation each, ``[L, E, h_kv, b, d]``, which the pool reads as
  KV-Compress's unified pool of per-head blocks ``[L * E * h_kv, b, d]``: engine block ``e``
  of layer ``l`` is the ``h_kv`` per-head blocks ``(l * E + e) * h_kv + j``. The engine's
  per-layer tensors become views of it (same shapes, same bytes); only the adapter's attention
  and its writes read them.
- A request (a table row) owns the engine blocks the engine gave it; each of them brings
  ``L * h_kv`` per-head blocks, any of which any (layer, head) of that request may take. A
  head takes one when its length crosses a block edge.
- After a compression the request needs ``ceil(held / (L * h_kv))`` engine blocks
  (``held``: its heads' blocks over all layers). The pool keeps the engine blocks that hold
  the most of them, moves the per-head blocks out of the others (a block copy each, metric
  and positions with them) and hands those engine blocks back: the engine's scheduler admits
  new requests into them.
- ``engine_blocks_next(row)`` says how many engine blocks the request needs for its next
  decode token (its heads grow by one token each); the adapter sets the engine's
  ``position_offset`` so that the engine allocates exactly that.

Host mirrors (NumPy) of the tables and lengths decide everything; the device copies are
written before each forward and each compression. Block ids and tables are int32.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from ..errors import Error


def _refuse(field: str, message: str):
    raise Error(f"kvpolicy.integrations.per_head_pool: {field}: {message}", field)


def rehome(tensors: list, shape: tuple) -> torch.Tensor:
    """One allocation ``shape`` (``[L, ...]``) in place of the engine's ``L`` per-layer tensors,
    which become views of it (same shapes). The old tensors are released first, so the peak
    memory is one cache, not two: nothing may be stored in them yet."""
    first = tensors[0]
    dtype, device, per_layer = first.dtype, first.device, first.shape
    count = len(tensors)
    tensors.clear()  # the engine's own list: its other holders see the new views
    del first
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the released bytes back to the driver: one allocation of L layers fits them
    whole = torch.zeros(shape, dtype=dtype, device=device)
    tensors.extend(layer.view(per_layer) for layer in whole.unbind(0))
    if len(tensors) != count:
        _refuse("tensors", f"{count} layers re-homed into {len(tensors)}")
    return whole


class PerHeadPool:
    """Per-head block tables over the re-homed memory of an engine with ``num_layers`` layers,
    ``engine_blocks`` blocks per layer (trash blocks included) of ``block_size`` tokens,
    ``num_kv_heads`` heads of ``head_dim``. ``k_layers`` / ``v_layers``: the engine's per-layer
    tensor lists (re-homed in place). ``rows``: table rows to start with (grown on demand);
    ``trash_block``: an engine block no request ever holds (padding rows write there)."""

    def __init__(self, k_layers: list, v_layers: list, engine_blocks: int, block_size: int, num_kv_heads: int,
                 head_dim: int, trash_block: int, rows: int = 16, width: int = 8):
        L = len(k_layers)
        if L == 0 or len(v_layers) != L:
            _refuse("layers", f"has {L} K and {len(v_layers)} V tensors; expected the same positive count")
        if not 0 <= trash_block < engine_blocks:
            _refuse("trash_block", f"is {trash_block}; the engine has {engine_blocks} blocks")
        self.L, self.E, self.b, self.h, self.d = L, engine_blocks, block_size, num_kv_heads, head_dim
        shape = (L, engine_blocks, num_kv_heads, block_size, head_dim)
        self.k_all = rehome(k_layers, shape)
        self.v_all = rehome(v_layers, shape)
        device = self.k_all.device
        self.device = device
        n = L * engine_blocks * num_kv_heads
        self.k = self.k_all.view(n, block_size, head_dim)  # the unified pool, as compress_per_head takes it
        self.v = self.v_all.view(n, block_size, head_dim)
        self.metric = torch.zeros(n, block_size, dtype=torch.float32, device=device)
        self.positions = torch.zeros(n, block_size, dtype=torch.int32, device=device)
        self.trash_block = trash_block
        self.tables = np.zeros((L, rows, num_kv_heads, width), dtype=np.int32)
        self.lengths = np.zeros((L, rows, num_kv_heads), dtype=np.int32)
        self.tables_dev = torch.zeros(self.tables.shape, dtype=torch.int32, device=device)
        self.lengths_dev = torch.zeros(self.lengths.shape, dtype=torch.int32, device=device)
        self._pending: list = []  # (flat index into tables_dev, block id) arrays not yet written there
        self.owned: list = [[] for _ in range(rows)]  # engine blocks each row holds, in the engine's order
        self.free: list = [[] for _ in range(rows)]  # per-head block ids of those engine blocks no head holds
        self.free_rows = list(range(rows - 1, -1, -1))

    # -- ids -------------------------------------------------------------------------------

    def ids_of_engine_block(self, e: int) -> np.ndarray:
        """The ``L * h_kv`` per-head block ids of engine block ``e``, layer by layer."""
        layers = np.arange(self.L, dtype=np.int64)[:, None]
        return ((layers * self.E + e) * self.h + np.arange(self.h)[None, :]).reshape(-1)

    def engine_block_of(self, ids) -> np.ndarray:
        return (np.asarray(ids, dtype=np.int64) // self.h) % self.E

    @property
    def rows(self) -> int:
        return self.tables.shape[1]

    @property
    def width(self) -> int:
        return self.tables.shape[3]

    # -- rows ------------------------------------------------------------------------------

    def take_row(self) -> int:
        """A free table row for a new request (the tables grow when none is left)."""
        if not self.free_rows:
            self._resize(rows=2 * self.rows)
        row = self.free_rows.pop()
        self.lengths[:, row] = 0
        self.owned[row], self.free[row] = [], []
        return row

    def give_row(self, row: int) -> None:
        """The request finished or was reset: the engine has its blocks back."""
        self.lengths[:, row] = 0
        self.owned[row], self.free[row] = [], []
        self.free_rows.append(row)

    def _resize(self, rows: Optional[int] = None, width: Optional[int] = None) -> None:
        old_rows, old_width = self.rows, self.width
        rows, width = rows or old_rows, width or old_width
        tables = np.zeros((self.L, rows, self.h, width), dtype=np.int32)
        tables[:, :old_rows, :, :old_width] = self.tables
        lengths = np.zeros((self.L, rows, self.h), dtype=np.int32)
        lengths[:, :old_rows] = self.lengths
        self.tables, self.lengths = tables, lengths
        # Pending writes index the old shape: write the whole table once instead.
        self._pending = []
        self.tables_dev = torch.from_numpy(tables).to(self.device)
        self.lengths_dev = torch.zeros(lengths.shape, dtype=torch.int32, device=self.device)
        for r in range(old_rows, rows):
            self.owned.append([])
            self.free.append([])
            self.free_rows.insert(0, r)

    # -- growth ----------------------------------------------------------------------------

    def sync_blocks(self, row: int, engine_blocks: Sequence[int]) -> None:
        """The engine's block list of the row's request: blocks it added since are the row's."""
        owned = self.owned[row]
        if len(engine_blocks) == len(owned) and (not owned or engine_blocks[-1] == owned[-1]):
            return  # the common step: nothing new (a full check costs a pass over the list)
        if list(engine_blocks[: len(owned)]) != owned:
            _refuse("engine_blocks", f"row {row}: the engine's list {list(engine_blocks)} does not start with the "
                    f"blocks the pool knows {owned} (the engine moved or freed a block of a running request)")
        for e in engine_blocks[len(owned):]:
            if e == self.trash_block:
                _refuse("engine_blocks", f"row {row}: holds the trash block {e}")
            owned.append(int(e))
            # Popped from the end: the layer-major order gives a new engine block's ids to its own
            # layer's heads first, so an uncompressed request's head j reads block e's slice j.
            self.free[row].extend(self.ids_of_engine_block(int(e))[::-1].tolist())

    def grow(self, row: int, tokens: int) -> None:
        """Every head of ``row`` takes ``tokens`` more tokens: blocks for those crossing an edge."""
        b = self.b
        old = self.lengths[:, row].astype(np.int64)  # [L, h]
        new = old + tokens
        have, want = -(-old // b), -(-new // b)
        need = (want - have).reshape(-1)
        total = int(need.sum())
        if want.max(initial=0) > self.width:
            self._resize(width=max(2 * self.width, int(want.max())))
        if total:
            free = self.free[row]
            if total > len(free):
                _refuse("grow", f"row {row}: its heads need {total} more blocks and its engine blocks have {len(free)} "
                        "free (the engine allocated fewer blocks than engine_blocks_next asked for)")
            ids = np.array(free[len(free) - total:][::-1], dtype=np.int32)
            del free[len(free) - total:]
            heads = np.repeat(np.arange(need.size), need)
            first = np.repeat(have.reshape(-1), need)
            offset = np.arange(total) - np.repeat(np.cumsum(need) - need, need)
            layer, head = heads // self.h, heads % self.h
            index = first + offset
            self.tables[layer, row, head, index] = ids
            flat = ((layer * self.rows + row) * self.h + head) * self.width + index
            self._pending.append((flat, ids))
        self.lengths[:, row] = new.astype(np.int32)

    def grow_by_one(self, rows: np.ndarray) -> np.ndarray:
        """Every head of each of ``rows`` takes one token (a decode step): the heads on a block
        edge take a block. Returns the new tokens' flat slots ``[L, len(rows), h]``."""
        b = self.b
        old = self.lengths[:, rows].astype(np.int64)  # [L, n, h]
        crossing = np.flatnonzero((old % b == 0).any(axis=(0, 2)))
        for j in crossing.tolist():
            self.grow(int(rows[j]), 1)  # takes blocks for the heads on an edge, lengths + 1
        others = np.setdiff1d(np.arange(len(rows)), crossing, assume_unique=True)
        self.lengths[:, rows[others]] += 1
        layer = np.arange(self.L)[:, None, None]
        head = np.arange(self.h)[None, None, :]
        blocks = self.tables[layer, rows[None, :, None], head, old // b].astype(np.int64)
        return blocks * b + old % b

    def slots(self, row: int, first: np.ndarray, tokens: int) -> np.ndarray:
        """Flat slot indices (block * b + offset) of tokens ``first .. first + tokens - 1`` of each
        head of ``row`` (``first``: ``[L, h]``): ``[L, tokens, h]`` int64."""
        t = first.astype(np.int64)[:, None, :] + np.arange(tokens)[None, :, None]  # [L, q, h]
        layer = np.arange(self.L)[:, None, None]
        head = np.arange(self.h)[None, None, :]
        blocks = self.tables[layer, row, head, t // self.b].astype(np.int64)
        return blocks * self.b + t % self.b

    def trash_slots(self) -> np.ndarray:
        """``[L, h]`` slots of the trash engine block: where padding rows write."""
        return self.ids_of_engine_block(self.trash_block).reshape(self.L, self.h) * self.b

    def engine_blocks_next(self, rows, tokens: int = 1):
        """Engine blocks each of ``rows`` (an int or an array) needs once each of its heads holds
        ``tokens`` more tokens."""
        lengths = self.lengths[:, rows].astype(np.int64) + tokens
        held = (-(-lengths // self.b)).sum(axis=(0, -1))
        return -(-held // (self.L * self.h))

    def mean_length(self, rows):
        """Tokens per (layer, head) of each of ``rows`` (an int or an array), rounded up: what a
        budget in tokens per head reads."""
        return -(-self.lengths[:, rows].astype(np.int64).sum(axis=(0, -1)) // (self.L * self.h))

    # -- device copies -----------------------------------------------------------------------

    def upload(self) -> None:
        """The host tables' new entries and every length to the device (the current stream)."""
        if self._pending:
            flat = np.concatenate([f for f, _ in self._pending]).astype(np.int64)
            ids = np.concatenate([i for _, i in self._pending])
            self._pending = []
            # An entry written twice since the last upload (taken, freed, taken again; or moved)
            # keeps its last value: a device index_copy_ with repeated indices picks any of them.
            _, last = np.unique(flat[::-1], return_index=True)
            keep = flat.size - 1 - last
            flat, ids = flat[keep], ids[keep]
            self.tables_dev.view(-1).index_copy_(0, torch.from_numpy(flat).to(self.device),
                                                 torch.from_numpy(ids).to(self.device))
        self.lengths_dev.copy_(torch.from_numpy(self.lengths))

    # -- after a compression -------------------------------------------------------------------

    def shrink(self, row: int, new_lengths: np.ndarray, freed_counts: np.ndarray, freed_blocks: np.ndarray) -> None:
        """A compression left each head of ``row`` ``new_lengths[l, h]`` tokens and freed its last
        blocks in table order (``freed_blocks[l, h, :freed_counts[l, h]]``): checked, then free."""
        b = self.b
        old = self.lengths[:, row].astype(np.int64)
        new_lengths = np.asarray(new_lengths).astype(np.int64)
        if (new_lengths > old).any() or (new_lengths < 0).any():
            _refuse("new_lengths", f"row {row}: a head's new length lies outside [0, its length]")
        have, keep = -(-old // b), -(-new_lengths // b)
        index = np.arange(self.width)[None, None, :]
        tail = self.tables[:, row][(index >= keep[..., None]) & (index < have[..., None])]  # (layer, head) order
        width = freed_blocks.shape[-1]
        got_mask = np.arange(width)[None, None, :] < np.asarray(freed_counts)[..., None]
        got = np.asarray(freed_blocks)[got_mask]
        heads = np.repeat(np.arange(self.L * self.h), (have - keep).reshape(-1))
        got_heads = np.repeat(np.arange(self.L * self.h), np.asarray(freed_counts).reshape(-1))
        # Each head's freed ids against its table's tail (as sets: the order within a head is free).
        want = np.sort(heads * (1 << 32) + tail.astype(np.int64))
        seen = np.sort(got_heads * (1 << 32) + got.astype(np.int64))
        if want.shape != seen.shape or (want != seen).any():
            _refuse("freed_blocks", f"row {row}: the compression freed {got.tolist()}, not its heads' blocks past "
                    f"their new lengths {tail.tolist()}")
        self.free[row].extend(tail.tolist())
        self.lengths[:, row] = new_lengths.astype(np.int32)

    def defragment(self, row: int):
        """Hand back the engine blocks the row no longer needs. Returns ``(src, dst, released)``:
        per-head blocks to copy (``src[i]`` into ``dst[i]``, ``move`` does it) so that every block
        a head holds lies in the engine blocks kept, and the engine blocks released (in the
        engine's order). Updates the tables; the caller moves the bytes and tells the engine."""
        b, per = self.b, self.L * self.h
        owned = self.owned[row]
        counts = -(-self.lengths[:, row].astype(np.int64) // b)  # [L, h]
        held = np.arange(self.width)[None, None, :] < counts[..., None]
        layer, head, index = np.nonzero(held)  # every held block, in (layer, head, table) order
        ids = self.tables[layer, row, head, index].astype(np.int64)
        keep_count = -(-ids.size // per)
        if keep_count >= len(owned):
            return np.zeros(0, np.int64), np.zeros(0, np.int64), []
        engine = self.engine_block_of(ids)
        # Keep the engine blocks holding the most of the row's per-head blocks (fewest moves); ties:
        # the engine's earlier blocks.
        owned_arr = np.array(owned, dtype=np.int64)
        load = (engine[None, :] == owned_arr[:, None]).sum(axis=1)
        ranked = np.lexsort((np.arange(len(owned)), -load))
        kept = np.sort(ranked[:keep_count])  # positions in the engine's list, in its order
        kept_blocks = owned_arr[kept]
        kept_at = set(kept.tolist())
        released = [e for i, e in enumerate(owned) if i not in kept_at]
        movers = np.flatnonzero(~np.isin(engine, kept_blocks))
        candidates = np.concatenate([self.ids_of_engine_block(int(e)) for e in kept_blocks])
        spare = candidates[~np.isin(candidates, ids)]
        if movers.size > spare.size:
            _refuse("defragment", f"row {row}: {movers.size} blocks to move and {spare.size} free in the kept engine "
                    "blocks")
        src, dst = ids[movers], spare[: movers.size]
        self.tables[layer[movers], row, head[movers], index[movers]] = dst.astype(np.int32)
        flat = ((layer[movers] * self.rows + row) * self.h + head[movers]) * self.width + index[movers]
        self._pending.append((flat.astype(np.int64), dst.astype(np.int32)))
        self.owned[row] = kept_blocks.tolist()
        self.free[row] = spare[movers.size:][::-1].tolist()
        return src, dst, released

    def move(self, src: np.ndarray, dst: np.ndarray) -> None:
        """Copy per-head blocks ``src`` into ``dst`` (K, V, metric and positions), on the current
        stream. The two sets are disjoint (``defragment``'s moves go into free blocks)."""
        if src.size == 0:
            return
        s = torch.from_numpy(src).to(self.device)
        t = torch.from_numpy(dst).to(self.device)
        for pool in (self.k, self.v, self.metric, self.positions):
            pool.index_copy_(0, t, pool.index_select(0, s))
