"""A small paged cache built by hand in NumPy, in any of kvpolicy's layouts.

The cache is held canonically as K and V of shape [L, num_blocks, b, h_kv, d] (one
row per physical block, slot and head); `tensors(layout)` lays it out as an engine
would (a copy in that layout's own axis order) and `canonical(...)` reads a layout's
tensors back, so a test can compress in any layout and compare in one.
"""

from __future__ import annotations

import dataclasses

import numpy as np

import kvpolicy

# Canonical axes of the stacked cache: K/V, layer, block, token, head, dim.
CANONICAL = "2LBTHD"


@dataclasses.dataclass
class PagedCase:
    kv: np.ndarray  # [2, L, NB, b, h, d]: K then V, canonical
    block_table: np.ndarray  # int32 [num_seqs, max_blocks]
    lengths: np.ndarray  # int32 [num_seqs]
    queries: np.ndarray  # [L, num_seqs, window, h_q, d]
    scores: np.ndarray  # float32 F [L, NB, b, h]
    positions: np.ndarray  # int32 [L, NB, b, h]

    @property
    def num_layers(self):
        return self.kv.shape[1]

    @property
    def block_size(self):
        return self.kv.shape[3]

    def axes(self, layout: str) -> str:
        """The axes of the layout's tensor, with L in front of a per-layer one."""
        axes, split, per_layer, _ = kvpolicy.LAYOUTS[layout]
        return ("L" if per_layer else "") + axes

    def tensors(self, layout: str, stacked: bool = False) -> dict:
        """PagedCache's cache arguments for `layout`: kv=..., or k=... and v=...; per-layer
        layouts get a list of per-layer tensors (or one stacked tensor)."""
        axes, split, per_layer, _ = kvpolicy.LAYOUTS[layout]
        full = self.axes(layout)

        def lay(x: np.ndarray, src_axes: str):
            if "T" not in full:  # blocks of one token (SGLang)
                assert self.block_size == 1
                x = x.squeeze(src_axes.index("T"))
                src_axes = src_axes.replace("T", "")
            x = np.ascontiguousarray(x.transpose([src_axes.index(a) for a in full.replace("C", "2D")]))
            if "C" in full:  # K and V side by side (vLLM): merge the K/V axis and the head dim
                c = full.index("C")
                x = x.reshape(x.shape[:c] + (-1,) + x.shape[c + 2 :])
            return x if stacked or not per_layer else [x[l].copy() for l in range(x.shape[0])]

        if split:
            return {"k": lay(self.kv[0], CANONICAL[1:]), "v": lay(self.kv[1], CANONICAL[1:])}
        return {"kv": lay(self.kv, CANONICAL)}

    def canonical(self, layout: str, args: dict) -> np.ndarray:
        """The inverse of tensors(): [2, L, NB, b, h, d] from a layout's tensors."""
        axes, split, per_layer, _ = kvpolicy.LAYOUTS[layout]
        full = self.axes(layout)

        def back(x, dst_axes: str):
            x = np.stack(x) if isinstance(x, list) else x
            src = full
            if "C" in full:  # split K|V back into the K/V axis and the head dim
                c = full.index("C")
                x = x.reshape(x.shape[:c] + (2, -1) + x.shape[c + 1 :])
                src = full.replace("C", "2D")
            if "T" not in full:
                x = np.expand_dims(x, -2)  # T sits before D in the canonical order
                src = full[:-1] + "TD"
                src = src.replace("TD", "") + "TD" if False else src
            order = [src.index(a) for a in dst_axes]
            return x.transpose(order)

        if split:
            return np.stack([back(args["k"], CANONICAL[1:]), back(args["v"], CANONICAL[1:])])
        return back(args["kv"], CANONICAL)

    def cache(self, layout: str = "nano_vllm", stacked: bool = False, **extra):
        args = self.tensors(layout, stacked)
        cache = kvpolicy.PagedCache(layout, **args, block_table=self.block_table, lengths=self.lengths, **extra)
        return cache, args

    def rows(self, kv: np.ndarray, seq: int, length: int) -> np.ndarray:
        """K and V rows of sequence `seq`'s first `length` tokens: [2, L, length, h, d]."""
        b = self.block_size
        t = np.arange(length)
        blocks = self.block_table[seq, t // b]
        return kv[:, :, blocks, t % b]


def make_case(
    *,
    layers=2,
    kv_heads=2,
    q_heads=4,
    head_dim=16,
    block_size=4,
    lengths=(40, 37, 0),
    window=32,
    num_blocks=None,
    dtype=np.float32,
    seed=0,
) -> PagedCase:
    """Random K, V and queries; each sequence's blocks a random choice of physical blocks."""
    rng = np.random.default_rng(seed)
    lengths = np.asarray(lengths, dtype=np.int32)
    need = [int(-(-n // block_size)) for n in lengths]
    max_blocks = max(max(need), 1)
    num_blocks = num_blocks or sum(need) + 3
    ids = rng.permutation(num_blocks).astype(np.int32)
    table = np.zeros((len(lengths), max_blocks), dtype=np.int32)
    at = 0
    for s, n in enumerate(need):
        table[s, :n] = ids[at : at + n]
        at += n
    # Values exact in float16 and bfloat16 too (multiples of 1/8 in [-4, 4)), so a
    # test can compare bytes in any dtype.
    shape = (2, layers, num_blocks, block_size, kv_heads, head_dim)
    kv = (rng.integers(-32, 32, size=shape) / 8).astype(dtype)
    queries = (rng.integers(-32, 32, size=(layers, len(lengths), window, q_heads, head_dim)) / 8).astype(dtype)
    scores = np.zeros((layers, num_blocks, block_size, kv_heads), dtype=np.float32)
    positions = np.zeros((layers, num_blocks, block_size, kv_heads), dtype=np.int32)
    for s, n in enumerate(lengths):
        for t in range(n):
            positions[:, table[s, t // block_size], t % block_size, :] = t
    return PagedCase(kv, table, lengths, queries, scores, positions)
