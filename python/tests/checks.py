"""What every compression must leave behind, checked on a PagedCase."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np


def whole_sequence(result, begins, lengths, seqs):
    """A window-only preset's result (Kara: keep masks over [window_begin, T)) with its
    keep masks widened to the whole sequence, the tokens before each window kept where
    they are, as check_moved reads them."""
    masks = np.zeros_like(np.asarray(result.keep_masks))
    for i, (seq, wb) in enumerate(zip(seqs, begins)):
        T = int(lengths[seq])
        masks[i, :, :, :wb] = 1
        masks[i, :, :, wb:T] = np.asarray(result.keep_masks)[i, :, :, : T - wb]
    return dataclasses.replace(result, keep_masks=masks)


def check_moved(case, before: np.ndarray, after: np.ndarray, seqs, lengths, result, positions_before=None,
                positions_after=None):
    """Each compressed (layer, KV head) holds its kept tokens' K and V bytes, in their
    original order, at the front; every other sequence's blocks are untouched; the
    released blocks are the sequence's blocks past its new length.

    before / after: canonical [2, L, NB, b, h, d]; lengths: each sequence's length
    before the call.
    """
    b = case.block_size
    touched = set()
    for i, seq in enumerate(seqs):
        T = int(lengths[seq])
        new_length = int(result.new_lengths[i])
        old_rows = case.rows(before, seq, T)  # [2, L, T, h, d]
        new_rows = case.rows(after, seq, new_length)
        masks = np.asarray(result.keep_masks[i])
        for l in range(masks.shape[0]):
            for h in range(masks.shape[1]):
                kept = np.flatnonzero(masks[l, h, :T])
                assert len(kept) == int(result.kept_counts[i][l, h])
                np.testing.assert_array_equal(new_rows[:, l, : len(kept), h], old_rows[:, l, kept, h])
                if positions_before is not None:
                    t = np.arange(len(kept))
                    blocks = case.block_table[seq, t // b]
                    np.testing.assert_array_equal(positions_after[l, blocks, t % b, h], kept)
        used = -(-T // b)
        kept_blocks = -(-new_length // b)
        assert sorted(np.asarray(result.released(i)).tolist()) == sorted(case.block_table[seq, kept_blocks:used].tolist())
        touched.update(case.block_table[seq, :used].tolist())
    untouched = sorted(set(range(before.shape[2])) - touched)
    np.testing.assert_array_equal(after[:, :, untouched], before[:, :, untouched])


def captured(fn):
    """Captures fn() into a new CUDA graph (PyTorch); returns (graph, fn's result). Fails
    if the capture recorded nothing (the work ran on a stream other than the capturing one)."""
    import torch

    graph = torch.cuda.CUDAGraph()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with torch.cuda.graph(graph):
            result = fn()
    empty = [w for w in seen if "empty" in str(w.message)]
    assert not empty, f"the capture recorded nothing: {empty[0].message}"
    return graph, result
