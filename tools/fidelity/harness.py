"""The fidelity protocol: one batch of configurations decoding the same conversation.

Sequence 0 of the paged cache is the reference: the full cache, sampling its answers
(temperature TEMPERATURE, seeded by the session and the seed: each (session, seed) is one
conversation, the same in every run). Every other sequence is one (preset, budget)
configuration fed the reference's tokens (teacher forcing) and compressed by the
threshold trigger as it decodes. Because every configuration sees the same token at each
step, one matrix product per weight serves them all; only attention, through each
sequence's own block table and length, differs. At each step where the reference picks
an assistant token, each configuration's logits are compared with the reference's: top-1
agreement and KL(reference || configuration), with whether it had been compressed yet
(measures.py leaves out the steps before) and what its attention read (tokens per head,
mean and largest; per sequence; block slots).

The exact-answer tasks (tasks.py) run the same engine differently: the context is
prefilled, every configuration compressed to its budget at once (Engine.compress_now),
the question fed a token at a time, and each configuration answers for itself.

KV-Compress (`kv_compress`) lives in a cache of its own, per-head blocks (per_head_cache.py):
each (layer, KV head) of a sequence has its own table and length, and a compression frees
the sequence's budget in blocks across all of them, the cheapest first by its metric
(squared attention, accumulated every step). Its sequences share the decode step's matrix
products with the others; only their attention reads the other cache. Its trigger is the
threshold trigger's, on the tokens its heads hold together (PerHeadThreshold).

Hard-KV (`hard_kv`) keeps a count per (layer, KV head) in the paged cache, at most the budget
(its L_upper), its item budget the top-k union's floor (L_upper / 2: see
compression.hard_kv_item_budget); the cache's live bytes (cautious update) say which slots
each head holds, which its attention reads and its later compressions skip. The same
trigger as the others.

Kara (`--presets kara`) compresses a window at a time instead of to a budget: each of its
configurations (|W|, |U|, r) is compressed by kvp::trigger::periodic's rule, every
KARA_PERIOD steps, the |W| tokens in whole blocks before the last block once the tokens
since its last compression cover them, to ceil(r (|W| - |U|)) tokens of W \\ U plus the
buffer. Its window's queries come from a per-sequence ring of the queries it decoded.

Run: python harness.py [--quick] [--out DIR] [--presets ...]   (scripts/fidelity.sh runs it,
then report.py)
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import multiprocessing
import os
import pathlib
import sys
import time
import zlib

import numpy as np
from threadpoolctl import threadpool_limits

import compression
import model
import prompts
import stats
import tasks as tasklib
from paged_cache import PagedCache, decode_step
from per_head_cache import PerHeadCache

# b: the threshold trigger compresses when a block fills past the budget. 32 so that the
# budgets can reach down to Hard-KV's and KV-Compress's holdings (64, 96: multiples of b).
BLOCK_SIZE = 32
QUERY_WINDOW = 32  # w of the query cache: the largest preset window (snapkv's 32)
# KV-Compress's block (SPEC.md's b for it: the authors' vLLM integration's 16). It divides
# the threshold trigger's 32, so a head's blocks are whole at every compression.
PER_HEAD_BLOCK_SIZE = 16
BUDGETS = (64, 96, 128, 256, 512)
# The reference samples (issue 46: greedy answers of this model ran into loops, which reward
# recency); each (session, seed) is one conversation, seeded by both.
TEMPERATURE = 0.7
PROTOCOL = 2  # results.json's "protocol" (report.py includes notes.md only when written for it)
SEEDS = (0, 1, 2)
# Exact-answer tasks (tasks.py): context lengths in tokens, needle depths, answer caps.
TASK_LENGTHS = (1024, 2048, 4096, 6144)
TASK_DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
TASK_ANSWER_TOKENS = {"needle": 24, "arithmetic": 64}
# The default set: issue 35's six, KV-Compress over its per-head cache, and Hard-KV's two
# (calibrated top-p over window attention, and over R-KV's scores), whose per-head counts in
# the shared-table cache their attention reads through the live bytes.
SEED_PRESETS = ("zipage", "rkv", "gkv", "snapkv", "h2o", "streaming_llm")
DEFAULT_PRESETS = SEED_PRESETS + ("kv_compress", "hard_kv", "hard_kv_rkv")
# Kara's protocol rows: (|W|, |U|, r), the window a multiple of the block size. Each window
# keeps ceil(r (|W| - |U|)) tokens of W \ U and its buffer.
KARA_SETTINGS = ((128, 16, 0.3), (128, 16, 0.5), (256, 32, 0.3), (256, 32, 0.5))
# delta of trigger::periodic. At most b: a window becomes due when T - 1 crosses a block
# boundary, and window_begin stays the earliest allowed one for the next b steps, so a check
# every delta <= b steps compresses it before the next window would start a block later
# (KvLLM's 128 <= 256 likewise); a longer period would leave whole blocks never compressed.
KARA_PERIOD = BLOCK_SIZE
KEEPMAP_LAYERS = (2, 15, 27)  # heads whose kept positions are recorded after each compression
ANSWER_TOKENS = 32  # the most a configuration may say in answer to a probe


@dataclasses.dataclass
class SeqConfig:
    name: str
    preset: str | None  # None: the reference, never compressed
    budget: int | None  # Kara: tokens kept of each window's W \ U
    window: int | None = None  # Kara: |W|
    buffer: int | None = None  # Kara: |U|
    ratio: float | None = None  # Kara: r


def kara_config(window: int, buffer: int, ratio: float) -> SeqConfig:
    budget = math.ceil(round(ratio * (window - buffer), 6))
    return SeqConfig(f"kara@{window}/{buffer}/{ratio:g}", "kara", budget, window, buffer, ratio)


@dataclasses.dataclass
class SeqState:
    """kvp::sequence_state's fields that the threshold trigger and the items read."""

    generated_since_compression: int = 0
    history_tokens: int = 0
    compressions: int = 0


@dataclasses.dataclass(frozen=True)
class Threshold:
    """kvp::trigger::threshold (engine/triggers.hpp, Zipage 4.1): due when the sequence holds
    N >= N_max blocks with a full last block; keeps (N_max - 1) * b."""

    block_size: int
    max_blocks: int

    def due(self, length: int) -> bool:
        return length >= self.max_blocks * self.block_size and length % self.block_size == 0

    @property
    def budget(self) -> int:
        return (self.max_blocks - 1) * self.block_size


@dataclasses.dataclass(frozen=True)
class PerHeadThreshold:
    """The threshold trigger over a per-head cache: due when the sequence's position count
    T is a multiple of b (Threshold's full last block, in the harness's blocks) and its
    `rows` (layer, KV head) rows hold rows x (budget + b) tokens or more, the cache a uniform
    preset holds when its trigger fires. Before a first compression every head holds T
    tokens, so it fires at Threshold's step; after one (rows x budget tokens left, every
    head a whole number of per-head blocks, as b is a multiple of theirs) b steps later,
    as Threshold does."""

    block_size: int
    budget: int
    rows: int

    def due(self, positions: int, tokens: int) -> bool:
        return positions % self.block_size == 0 and tokens >= self.rows * (self.budget + self.block_size)


@dataclasses.dataclass(frozen=True)
class Periodic:
    """kvp::trigger::periodic (engine/triggers.hpp, Kara C.4), max_items 0: at every
    `period`-th step after the first |W|, a sequence whose window (the |W| tokens in whole
    blocks before its last, possibly partial, block) holds only tokens appended since its
    last compression (the prompt too, before the first); budget window_keep - buffer,
    counted within the window. The tokens between a compression's new length and the next
    block boundary are never in a window."""

    period: int
    block_size: int
    window: int
    buffer: int
    window_keep: int

    def window_begin_of(self, length: int) -> int:
        return -self.window if length <= 0 else (length - 1) // self.block_size * self.block_size - self.window

    def due(self, state: "SeqState", length: int, step: int) -> bool:
        begin = self.window_begin_of(length)
        tail = state.generated_since_compression if state.compressions > 0 else length  # uncompressed_tail()
        return step > self.window and step > 0 and step % self.period == 0 and begin >= 0 and tail >= length - begin

    @property
    def budget(self) -> int:
        return self.window_keep - self.buffer


class Engine:
    """The caches of every configuration (the paged cache; KV-Compress's per-head cache), the
    triggers, and the compression calls."""

    def __init__(self, w: model.Weights, configs: list[SeqConfig], prompt_len: int, max_len: int,
                 block_size: int = BLOCK_SIZE, kara_period: int | None = None,
                 per_head_block_size: int = PER_HEAD_BLOCK_SIZE):
        self.w = w
        self.configs = configs
        self.b = b = block_size
        cfg = w.config
        # Each configuration's sequence in its cache: the paged cache's, or the per-head one's.
        self.per_head_ids = np.array([i for i, c in enumerate(configs) if c.preset == "kv_compress"], dtype=np.int64)
        self.paged_ids = np.array([i for i, c in enumerate(configs) if c.preset != "kv_compress"], dtype=np.int64)
        self.local = {int(i): j for ids in (self.paged_ids, self.per_head_ids) for j, i in enumerate(ids)}
        self.triggers: list[Threshold | PerHeadThreshold | Periodic | None] = []
        peak = []  # the paged cache's blocks, per sequence
        per_head_peak = []  # the per-head cache's, per sequence
        rows = cfg.n_layers * cfg.n_kv_heads
        bh = per_head_block_size
        for c in configs:
            if c.preset == "kv_compress":
                if c.budget % b or b % bh:
                    raise ValueError(f"{c.name}: the budget must be a multiple of the block size {b}, and {b} a "
                                     f"multiple of the per-head block size {bh}")
                self.triggers.append(PerHeadThreshold(block_size=b, budget=c.budget, rows=rows))
                # Until the first compression every head grows to the trigger's length (at most
                # the session's); after, the sequence holds rows x (budget + b) tokens at most,
                # each head's last block partial at worst.
                first = max(-(-(prompt_len + 1) // b) * b, c.budget + b)
                per_head_peak.append(rows * (-(-min(max_len, first) // bh) + 2))
            elif c.preset is None:
                self.triggers.append(None)
                peak.append(-(-max_len // b) + 1)
            elif c.preset == "kara":
                if c.window % b:
                    raise ValueError(f"{c.name}: the window {c.window} is not a multiple of the block size {b}")
                self.triggers.append(Periodic(kara_period or KARA_PERIOD, b, c.window, c.buffer, c.budget + c.buffer))
                peak.append(-(-max_len // b) + 1)  # no cap: each window leaves its kept tokens
            else:
                if c.budget % b:
                    raise ValueError(f"budget {c.budget} is not a multiple of the block size {b}")
                t = Threshold(block_size=b, max_blocks=c.budget // b + 1)
                self.triggers.append(t)
                # Before the first compression the prompt and up to a block more; after, N_max.
                peak.append(max(-(-prompt_len // b) + 1, t.max_blocks) + 1)
        windows = {self.local[i]: c.window for i, c in enumerate(configs) if c.preset == "kara"}
        # A window's queries are at most |W| + b positions old when it is compressed.
        history = max(windows.values(), default=0) + b
        self.cache = PagedCache(cfg, len(self.paged_ids), sum(peak), b, max(peak), QUERY_WINDOW, list(windows), history)
        for i, c in enumerate(configs):
            self.cache.cautious[self.local[i]] = c.preset in compression.HEAD_ADAPTIVE
        self.per_head = (PerHeadCache(cfg, len(self.per_head_ids), sum(per_head_peak), bh, -(-max_len // bh) + 1,
                                      compression.KV_COMPRESS.excluded_distance) if len(self.per_head_ids) else None)
        self.states = [SeqState() for _ in configs]
        # Tokens the last logits attended to: per (layer, KV head), the mean of the heads' for KV-Compress.
        self.attended = np.zeros(len(configs))
        self.step_count = 0  # decode steps run, probes included
        self.clock = 0  # the engine's step counter the periodic trigger reads (a probe goes on from the last turn's)
        self.compress_seconds = 0.0
        self.compress_calls = 0
        self.short_frees = 0  # KV-Compress compressions that freed fewer blocks than their budget asked
        self.keepmaps: dict[int, list[dict]] = {i: [] for i, c in enumerate(configs) if c.preset}
        self.rows = rows
        self.peak_slots = np.zeros(len(configs))  # the most token slots each configuration's blocks held

    def held(self) -> dict[str, np.ndarray]:
        """[configs] each: tokens per (layer, KV head) held, the mean over the heads ('mean')
        and the largest head's ('peak_head'); tokens the sequence holds over all its rows
        ('sequence'); token slots of the blocks it holds ('slots': a paged block holds b
        tokens of every row, a per-head block b_h tokens of one)."""
        n = len(self.configs)
        out = {k: np.empty(n) for k in ("mean", "peak_head", "sequence", "slots")}
        for j, i in enumerate(self.paged_ids):
            if self.cache.cautious[j]:
                per = self.cache.held_slots(j).sum(-1)
            else:
                per = np.full(1, int(self.cache.lengths[j]))
            out["mean"][i], out["peak_head"][i] = per.mean(), per.max()
            out["sequence"][i] = per.mean() * self.rows
            out["slots"][i] = int(self.cache.held[j]) * self.b * self.rows
        if self.per_head is not None:
            for j, i in enumerate(self.per_head_ids):
                per = self.per_head.lengths[:, j]
                out["mean"][i], out["peak_head"][i] = per.mean(), per.max()
                out["sequence"][i] = per.sum()
                out["slots"][i] = int((self.per_head.tables[:, j] >= 0).sum()) * self.per_head.b
        self.peak_slots = np.maximum(self.peak_slots, out["slots"])
        return out

    def cache_tokens(self) -> np.ndarray:
        """[configs]: tokens per (layer, KV head) each holds (KV-Compress: the mean over its heads)."""
        out = np.empty(len(self.configs))
        out[self.paged_ids] = self.cache.lengths
        for j in np.flatnonzero(self.cache.cautious):  # Hard-KV: the mean over its heads of what each holds
            out[self.paged_ids[j]] = self.cache.held_slots(int(j)).sum(-1).mean()
        if self.per_head is not None:
            out[self.per_head_ids] = self.per_head.mean_tokens()
        return out

    def snapshot(self) -> tuple:
        return self.cache, self.per_head, self.states, self.clock

    def restore(self, snap: tuple) -> None:
        """Copies of a snapshot's caches and states (the snapshot stays as it was)."""
        cache, per_head, states, clock = snap
        self.cache = cache.snapshot()
        self.per_head = per_head.snapshot() if per_head is not None else None
        self.states = [dataclasses.replace(s) for s in states]
        self.clock = clock

    def prefill(self, tokens: list[int]) -> np.ndarray:
        """The first user turn, once, copied into every sequence (none is compressed yet)."""
        logits, k, v, q = model.prefill_dense(self.w, np.asarray(tokens))
        self.cache.fill_prompt(k, v, q)
        if self.per_head is not None:
            self.per_head.fill_prompt(k, v)
            window = q[:, -compression.KV_COMPRESS.metric_window :]
            compression.kv_compress_prefill_metric(self.per_head, np.ascontiguousarray(window[:, None]))
        self.attended[:] = len(tokens)
        for s in self.states:
            s.generated_since_compression = len(tokens)
        self.last_held = self.held()  # the prompt's blocks count in the peaks
        self.last_compressed = np.zeros(len(self.configs), dtype=bool)
        return np.repeat(logits[-1:], len(self.configs), axis=0)

    def compress_now(self) -> None:
        """Compress every budgeted configuration that holds more than its budget, whatever
        the trigger says (the tasks: a long context prefilled at once is compressed before
        the question, as a prefill compression would)."""
        self._compress_due(force=True)

    def step(self, tokens: np.ndarray) -> np.ndarray:
        parts = [(self.cache, self.paged_ids)]
        if self.per_head is not None:
            parts.append((self.per_head, self.per_head_ids))
        logits = decode_step(self.w, parts, tokens)
        self.attended[:] = self.cache_tokens()
        # What the step's attention read, before the step's compression (as `attended`),
        # and whether that cache had been compressed yet.
        self.last_held = self.held()
        self.last_compressed = np.array([st.compressions > 0 for st in self.states])
        self.step_count += 1
        self.clock += 1
        for s in self.states:
            s.generated_since_compression += 1
        self._compress_due()
        return logits

    def _compress_due(self, force: bool = False) -> None:
        # One call per preset, and per Kara (window, buffer): the policy of a call is one.
        # Items name a sequence of their own cache; paged_ids / per_head_ids map it back to its configuration.
        calls: dict[tuple, list[compression.Item]] = {}
        for i, (c, t) in enumerate(zip(self.configs, self.triggers)):
            j, st = self.local[i], self.states[i]
            if isinstance(t, PerHeadThreshold):
                if t.due(int(self.per_head.next_pos[j]), self.per_head.tokens(j)) or (
                        force and self.per_head.tokens(j) > t.rows * t.budget):
                    item = compression.Item(seq=j, budget=t.budget, history_tokens=0)
                    calls.setdefault(("kv_compress",), []).append(item)
                continue
            T = int(self.cache.lengths[j])
            if isinstance(t, Periodic):
                if not force and t.due(st, T, self.clock):
                    begin = t.window_begin_of(T)
                    calls.setdefault(("kara", c.window, c.buffer), []).append(compression.Item(
                        seq=j, budget=t.budget, history_tokens=max(0, st.history_tokens - begin), window_begin=begin))
            elif t is not None and (t.due(T) or (force and T > t.budget)):
                # A head-adaptive preset's policy carries the budget as L_upper (one call per
                # budget); its items' budget is the top-k union's floor (hard_kv_item_budget).
                if c.preset in compression.HEAD_ADAPTIVE:
                    key, budget = (c.preset, t.budget), compression.hard_kv_item_budget(c.preset, t.budget)
                else:
                    key, budget = (c.preset,), t.budget
                calls.setdefault(key, []).append(
                    compression.Item(seq=j, budget=budget, history_tokens=st.history_tokens)
                )
        for key, items in calls.items():
            t0 = time.perf_counter()
            if key[0] == "kv_compress":
                results = compression.compress_per_head(self.per_head, items)
            elif key[0] == "kara":
                results = compression.compress_windows(self.cache, items, window=key[1], buffer=key[2])
            else:
                results = compression.compress(key[0], self.cache, items, upper=key[1] if len(key) > 1 else None)
            self.compress_seconds += time.perf_counter() - t0
            self.compress_calls += 1
            for it, r in zip(items, results):
                if key[0] == "kv_compress":
                    i = int(self.per_head_ids[it.seq])
                    self.per_head.release(it.seq, r.new_lengths, r.freed_blocks, r.freed_counts)
                    self.short_frees += r.freed < r.asked
                    st = self.states[i]
                else:
                    i = int(self.paged_ids[it.seq])
                    self.cache.release(it.seq, r.new_length, r.released_blocks)
                    st = self.states[i]
                    st.history_tokens = r.new_length
                st.generated_since_compression = 0
                st.compressions += 1
                self._record_keepmap(i)

    def _record_keepmap(self, i: int) -> None:
        """The positions config i's heads of KEEPMAP_LAYERS hold, ascending: [layer][KV head][...]."""
        j = self.local[i]
        layers = [l for l in KEEPMAP_LAYERS if l < self.w.config.n_layers]
        hk = self.w.config.n_kv_heads
        if self.configs[i].preset == "kv_compress":
            ph = self.per_head
            pos = [[ph.head_positions(l, j, h).tolist() for h in range(hk)] for l in layers]
            next_pos = ph.next_pos[j]
        else:
            length = int(self.cache.lengths[j])
            tbl = self.cache.block_table[j, : -(-length // self.b)]
            pos = self.cache.positions[layers][:, tbl].reshape(len(layers), -1, hk)[:, :length].transpose(0, 2, 1)
            if self.cache.cautious[j]:  # the slots each head holds
                held = self.cache.held_slots(j)[layers]
                pos = [[pos[li, h][held[li, h]].tolist() for h in range(hk)] for li in range(len(layers))]
            else:
                pos = pos.tolist()
            next_pos = self.cache.next_pos[j]
        self.keepmaps[i].append({"step": self.step_count, "next_pos": int(next_pos), "positions": pos})


kl_and_top1 = stats.kl_and_top1  # per configuration: KL(reference || it), top-1 agreement


def conversation_rng(session: str, seed: int) -> np.random.Generator:
    """The reference's sampler for one conversation: seeded by the session's name and the
    seed, so a conversation is the same in every run (and in any process)."""
    return np.random.default_rng([zlib.crc32(session.encode()), seed])


def run_session(w, tok, session: prompts.Session, configs, scale: float, log, seed: int = 0,
                temperature: float = TEMPERATURE) -> dict:
    """One conversation: the full cache samples each assistant turn (`temperature`, seeded
    by the session and `seed`; 0 is greedy), every configuration is fed its tokens and
    measured at each assistant step; then the probes, each configuration answering for
    itself."""
    name = f"{session.name}#{seed}"
    rng = conversation_rng(session.name, seed)
    im_end = tok.token_to_id("<|im_end|>")
    first = tok.encode(model.chat_prompt([{"role": "user", "content": session.turns[0].user}])).ids
    caps = [max(4, int(t.cap * scale)) for t in session.turns]
    max_len = len(first) + sum(caps) + sum(len(tok.encode(t.user).ids) + 12 for t in session.turns[1:])
    max_len += max((len(tok.encode(p.question).ids) for p in session.probes), default=0) + 12 + ANSWER_TOKENS
    eng = Engine(w, configs, len(first), max_len)
    S = len(configs)
    kls, agrees, turn_of_step, attended, compressed = [], [], [], [], []
    held = {k: [] for k in ("mean", "peak_head", "sequence", "slots")}
    tokens = list(first)  # the conversation's text, for the repeated n-grams
    measured_at = []  # index in `tokens` of the token chosen at each measured step
    answers = []
    t0 = time.perf_counter()
    logits = eng.prefill(first)
    log(f"[{name}] prompt {len(first)} tokens prefilled in {time.perf_counter() - t0:.1f}s; {S} sequences, "
        f"{eng.cache.num_blocks} blocks of {eng.b}"
        + (f"; {len(eng.per_head_ids)} in the per-head cache, {eng.per_head.num_blocks} blocks of {eng.per_head.b}"
           if eng.per_head is not None else ""))
    for ti, turn in enumerate(session.turns):
        if ti > 0:
            for t in tok.encode(f"\n<|im_start|>user\n{turn.user}<|im_end|>\n<|im_start|>assistant\n").ids:
                logits = eng.step(np.full(S, t))
                tokens.append(t)
        gen = []
        while True:
            kl, ag = kl_and_top1(logits)
            kls.append(kl), agrees.append(ag), turn_of_step.append(ti), attended.append(eng.attended.copy())
            # A step counts for a configuration once it has been compressed at least once
            # (before, it holds the full cache and agrees by construction).
            compressed.append(eng.last_compressed.copy())
            h = eng.last_held  # what these logits' attention read
            for k in held:
                held[k].append(h[k])
            nxt = stats.sample_token(logits[0], temperature, rng)
            if len(gen) >= caps[ti] and nxt != im_end:
                nxt = im_end  # the cap: close the turn (this forced token is still measured above)
            gen.append(nxt)
            measured_at.append(len(tokens))
            tokens.append(nxt)
            logits = eng.step(np.full(S, nxt))
            if nxt == im_end:
                break
        answers.append(tok.decode(gen))
        el = time.perf_counter() - t0
        log(f"[{name}] turn {ti + 1}/{len(session.turns)}: {len(gen)} tokens; {eng.step_count} steps, "
            f"{el:.0f}s ({el / max(eng.step_count, 1):.2f} s/step), compress {eng.compress_seconds:.1f}s in "
            f"{eng.compress_calls} calls")

    # Probes: each on its own copy of every cache; every configuration answers greedily for itself.
    base = eng.snapshot()
    base_states = base[2]
    base_steps = eng.step_count
    final_tokens = eng.cache_tokens()
    peak_slots = eng.peak_slots.copy()  # the conversation's, before the probes
    probe_results = []
    for p in session.probes:
        eng.restore(base)
        for t in tok.encode(f"\n<|im_start|>user\n{p.question}<|im_end|>\n<|im_start|>assistant\n").ids:
            logits = eng.step(np.full(S, t))
        texts = free_run(eng, tok, logits, int(ANSWER_TOKENS * max(scale, 0.5)))
        right = [any(a.lower() in t.lower() for a in p.accept) for t in texts]
        probe_results.append({"question": p.question, "accept": list(p.accept), "answers": texts, "right": right})
        log(f"[{name}] probe {p.question!r}: reference {texts[0]!r} ({'right' if right[0] else 'wrong'}); "
            f"{sum(right[1:])}/{S - 1} configurations right")
    el = time.perf_counter() - t0
    return {
        "name": name,
        "session": session.name,
        "seed": seed,
        "temperature": temperature,
        "prompt_tokens": len(first),
        "assistant_answers": answers,
        "measured_steps": len(kls),
        "decode_steps": eng.step_count,
        "conversation_steps": base_steps,
        "seconds": el,
        "compress_seconds": eng.compress_seconds,
        "compress_calls": eng.compress_calls,
        "kv_compress_short_frees": eng.short_frees,
        "peak_blocks": int(eng.cache.peak_blocks_used),
        "per_head_peak_blocks": int(eng.per_head.peak_blocks_used) if eng.per_head is not None else None,
        "kl": np.array(kls).T.tolist(),  # [config][step]
        "agree": np.array(agrees).T.astype(int).tolist(),
        "compressed": np.array(compressed).T.astype(int).tolist(),  # [config][step]: compressed before the step
        "turn_of_step": turn_of_step,
        "compressions": [s.compressions for s in base_states],
        # Tokens per (layer, KV head) each configuration's attention read for the measured
        # logits, and held after the last turn (KV-Compress: the mean over its heads).
        "cache_tokens": np.array(attended).T.tolist(),  # [config][step]
        # At each measured step: the largest head's tokens, the sequence's tokens over all
        # its rows, and the token slots of its blocks ([config][step] each).
        "peak_head_tokens": np.array(held["peak_head"]).T.tolist(),
        "sequence_tokens": np.array(held["sequence"]).T.tolist(),
        "block_slots": np.array(held["slots"]).T.tolist(),
        "peak_block_slots": peak_slots.tolist(),  # [config]: the conversation's most
        "rows": eng.rows,
        "final_lengths": [int(x) if x == int(x) else round(float(x), 1) for x in final_tokens],
        "repeated_8gram_share": stats.repeated_ngram_share(tokens, measured_at, 8),
        "probes": probe_results,
        "keepmaps": {configs[i].name: v for i, v in eng.keepmaps.items()},
    }


def free_run(eng: Engine, tok, logits: np.ndarray, max_tokens: int) -> list[str]:
    """Every configuration answers for itself, greedily, until <|im_end|> or max_tokens
    (the trigger still running): the texts, the reference's first."""
    im_end = tok.token_to_id("<|im_end|>")
    S = len(eng.configs)
    outs = [[] for _ in range(S)]
    done = np.zeros(S, dtype=bool)
    for _ in range(max_tokens):
        nxt = logits.argmax(-1)
        for s in range(S):
            if not done[s]:
                if nxt[s] == im_end:
                    done[s] = True
                else:
                    outs[s].append(int(nxt[s]))
        if done.all():
            break
        logits = eng.step(np.where(done, im_end, nxt))
    return [tok.decode(o) for o in outs]


def run_task(w, tok, task: tasklib.Task, configs, log) -> dict:
    """One exact-answer task: the context prefilled once, every configuration compressed to
    its budget (compress_now), then the question fed a token at a time and each
    configuration's free-running answer checked."""
    configs = [c for c in configs if c.preset != "kara"]  # Kara compresses windows of decoded tokens
    text = model.chat_prompt([{"role": "user", "content": task.prompt}])
    cut = text.index(task.question)
    ids = tok.encode(text[:cut]).ids
    tail = tok.encode(text[cut:]).ids
    answer_tokens = TASK_ANSWER_TOKENS[task.kind]
    t0 = time.perf_counter()
    eng = Engine(w, configs, len(ids), len(ids) + len(tail) + answer_tokens + 2)
    logits = eng.prefill(ids)
    eng.compress_now()
    held = eng.held()
    for t in tail[:-1]:
        logits = eng.step(np.full(len(configs), t))
    logits = eng.step(np.full(len(configs), tail[-1]))
    texts = free_run(eng, tok, logits, answer_tokens)
    right = [tasklib.is_right(task, t) for t in texts]
    log(f"[{task.kind} {task.context_tokens}@{','.join(f'{d:g}' for d in task.depths)} seed {task.seed}] "
        f"{len(ids)} context tokens; reference {texts[0]!r} ({'right' if right[0] else 'wrong'}, answer "
        f"{task.answer}); {sum(right[1:])}/{len(configs) - 1} configurations right; "
        f"{time.perf_counter() - t0:.0f}s")
    return {
        **{k: v for k, v in dataclasses.asdict(task).items() if k != "prompt"},
        "context_ids": len(ids),
        "configs": [c.name for c in configs],
        "answers": texts,
        "right": right,
        "held_after_context": held["mean"].tolist(),  # tokens per (layer, KV head) after compress_now
        "peak_block_slots": eng.peak_slots.tolist(),
        "seconds": time.perf_counter() - t0,
    }


def parse_keywords(text: str) -> dict:
    """'a=1,b=0.5,c=layer' -> {'a': 1, 'b': 0.5, 'c': 'layer'}."""
    out = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise SystemExit(f"--kv-compress: {item!r} is not KEY=VALUE")
        for kind in (int, float, str):
            try:
                out[key.strip()] = kind(value)
                break
            except ValueError:
                continue
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true",
                    help="the whole protocol, small: two sessions of two short turns, one seed, budgets 64 and "
                         "128, three needles and one word problem in contexts of 512 tokens (a few minutes)")
    ap.add_argument("--out", default=str(pathlib.Path(__file__).parent / "out"), help="where results.json goes")
    ap.add_argument("--scale", type=float, default=None, help="multiply every turn's token cap (default 1; quick 0.2)")
    ap.add_argument("--sessions", default=None,
                    help="comma-separated session names (default: all; quick: story,arithmetic); 'none' runs none")
    ap.add_argument("--seeds", default=None,
                    help=f"the reference's sampling seeds, one conversation per (session, seed) (default "
                         f"{','.join(map(str, SEEDS))}; quick 0)")
    ap.add_argument("--temperature", type=float, default=TEMPERATURE,
                    help=f"the reference's sampling temperature (default {TEMPERATURE}; 0 is greedy)")
    ap.add_argument("--tasks", default=None,
                    help="exact-answer tasks: 'none', or 'needle', 'arithmetic' or both, comma-separated "
                         "(default both; quick both, small)")
    ap.add_argument("--task-lengths", default=None,
                    help=f"context lengths in tokens (default {','.join(map(str, TASK_LENGTHS))}; quick 512)")
    ap.add_argument("--task-depths", default=None,
                    help=f"needle depths (default {','.join(f'{d:g}' for d in TASK_DEPTHS)}; quick 0.1,0.5,0.9)")
    ap.add_argument("--task-seeds", default=None, help="task seeds (default 0; quick 0)")
    ap.add_argument("--arithmetic-per-length", type=int, default=None,
                    help="word problems per (context length, seed) (default 2; quick 1)")
    ap.add_argument("--presets", default=",".join(DEFAULT_PRESETS),
                    help="comma-separated presets (default: the six seed presets and kv_compress, over a per-head "
                         "cache; 'kara' runs Kara's window configurations, see --kara); 'none' runs the full "
                         "cache alone")
    ap.add_argument("--budgets", default=",".join(map(str, BUDGETS)),
                    help="comma-separated budgets of the budgeted presets, multiples of the block size "
                         f"(default {','.join(map(str, BUDGETS))})")
    ap.add_argument("--kara", default=",".join(f"{w}/{u}/{r:g}" for w, u, r in KARA_SETTINGS),
                    help="Kara's configurations, comma-separated window/buffer/ratio (default: "
                         + ", ".join(f"{w}/{u}/{r:g}" for w, u, r in KARA_SETTINGS) + ")")
    ap.add_argument("--kv-compress", default="", metavar="KEY=VALUE,...",
                    help="kv_compress with some KVCompress keywords changed, e.g. excluded_distance=10 (KVC-full's "
                         "v); default: the preset's published parameters. Its budget is --budgets' (max_cache_tokens)")
    ap.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                    help="sessions run at once, each in a process of its own (default: 2, or 1 on one core); the "
                         "sessions are independent, so the results are the same for any value")
    ap.add_argument("--blas-threads", type=int, default=1,
                    help="BLAS threads (default 1: on the shared 2-core machine two threads made the small "
                         "per-layer products 6x slower, 60 ms against 9 ms for the gate/up product)")
    args = ap.parse_args(argv)
    with threadpool_limits(limits=args.blas_threads, user_api="blas"):
        return run(args)


# What run_jobs' worker processes read: set before they fork, so that the model, the
# tokenizer and the jobs reach them without being pickled.
_shared: tuple = ()


def _job_at(i: int) -> dict:
    w, tok, jobs, configs, scale, log, temperature = _shared
    return run_job(w, tok, jobs[i], configs, scale, log, temperature)


def run_job(w, tok, job: tuple, configs, scale, log, temperature) -> dict:
    """('session', Session, seed) or ('task', Task)."""
    if job[0] == "session":
        return run_session(w, tok, job[1], configs, scale, log, job[2], temperature)
    return run_task(w, tok, job[1], configs, log)


def run_jobs(w, tok, jobs: list[tuple], configs, scale, log, n_procs: int, temperature: float) -> list[dict]:
    """run_job of each job, `n_procs` at a time in forked processes (one BLAS thread each:
    on the 2-core machine two side by side take about the time of the longer one); in
    order. Every job is seeded by what it is, so the results are the same for any n_procs."""
    global _shared
    if n_procs <= 1 or len(jobs) <= 1:
        return [run_job(w, tok, j, configs, scale, log, temperature) for j in jobs]
    _shared = (w, tok, jobs, configs, scale, log, temperature)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the tokenizer is used on both sides of the fork
    with multiprocessing.get_context("fork").Pool(min(n_procs, len(jobs))) as pool:
        return pool.map(_job_at, range(len(jobs)))


def run(args) -> int:
    def log(msg):
        print(msg, flush=True)

    t0 = time.perf_counter()
    presets = [] if args.presets == "none" else args.presets.split(",")
    unknown = [p for p in presets if p not in compression.PRESETS]
    if unknown:
        raise SystemExit(f"unknown presets {unknown}; kvpolicy has {list(compression.PRESETS)}")
    if args.kv_compress:  # checked before the model loads
        try:
            compression.configure_kv_compress(parse_keywords(args.kv_compress))
        except (TypeError, compression.kvpolicy.Error) as e:
            raise SystemExit(f"--kv-compress: {e}") from None
    w = model.load()
    tok = model.build_tokenizer(w.tokenizer_fields)
    log(f"model {w.path.name} loaded and dequantised in {time.perf_counter() - t0:.1f}s; compression backend: {compression.BACKEND}")
    if args.quick and args.budgets == ",".join(map(str, BUDGETS)):
        args.budgets = "64,128"
    budgets = [int(b) for b in args.budgets.split(",")]
    budgeted = [p for p in presets if p != "kara"]
    kara = [kara_config(int(w), int(u), float(r)) for w, u, r in (x.split("/") for x in args.kara.split(","))] \
        if "kara" in presets else []
    configs = [SeqConfig("full", None, None)] + [SeqConfig(f"{p}@{b}", p, b) for b in budgets for p in budgeted] + kara
    scale = args.scale if args.scale is not None else (0.2 if args.quick else 1.0)
    names = (args.sessions.split(",") if args.sessions else
             (["story", "arithmetic"] if args.quick else [s.name for s in prompts.SESSIONS]))
    sessions = [s for s in prompts.SESSIONS if s.name in names]
    if args.quick:
        sessions = [dataclasses.replace(s, turns=s.turns[:2], probes=s.probes[:1]) for s in sessions]
    seeds = [int(x) for x in (args.seeds or ("0" if args.quick else ",".join(map(str, SEEDS)))).split(",")]
    kinds = (args.tasks or "needle,arithmetic").split(",") if args.tasks != "none" else []
    if set(kinds) - {"needle", "arithmetic"}:
        raise SystemExit(f"--tasks: unknown kinds {sorted(set(kinds) - {'needle', 'arithmetic'})}")
    lengths = [int(x) for x in (args.task_lengths or ("512" if args.quick else ",".join(map(str, TASK_LENGTHS)))).split(",")]
    depths = [float(x) for x in (args.task_depths or ("0.1,0.5,0.9" if args.quick else
                                                      ",".join(f"{d:g}" for d in TASK_DEPTHS))).split(",")]
    task_seeds = [int(x) for x in (args.task_seeds or "0").split(",")]
    per_length = args.arithmetic_per_length if args.arithmetic_per_length is not None else (1 if args.quick else 2)
    count = lambda text: len(tok.encode(text).ids)  # noqa: E731
    task_list = tasklib.build(count, lengths, depths, task_seeds, per_length if "arithmetic" in kinds else 0)
    task_list = [t for t in task_list if t.kind in kinds]
    jobs = [("session", s, seed) for s in sessions for seed in seeds] + [("task", t) for t in task_list]
    log(f"{len(sessions) * len(seeds)} conversations ({len(sessions)} sessions x seeds {seeds}, temperature "
        f"{args.temperature:g}), {len(task_list)} tasks, {len(configs) - 1} configurations")
    done = run_jobs(w, tok, jobs, configs, scale, log, args.jobs, args.temperature)
    n_conv = len(sessions) * len(seeds)
    results = {
        # 2: sampled references over 20 sessions and seeds, measures after the first
        # compression, memory held, tasks (issue 46); 1: greedy, two sessions, every step.
        "protocol": PROTOCOL,
        "quick": args.quick,
        "scale": scale,
        "backend": compression.BACKEND,
        "block_size": BLOCK_SIZE,
        "query_window": QUERY_WINDOW,
        "blas_threads": args.blas_threads,
        "budgets": budgets,
        "kara_period": KARA_PERIOD,
        "per_head_block_size": PER_HEAD_BLOCK_SIZE,
        "kv_compress": compression.KV_COMPRESS.params(),
        "presets": presets,
        "keepmap_layers": list(KEEPMAP_LAYERS),
        "configs": [dataclasses.asdict(c) for c in configs],
        "jobs": args.jobs,
        "temperature": args.temperature,
        "seeds": seeds,
        "task_lengths": lengths,
        "task_depths": depths,
        "sessions": done[:n_conv],
        "tasks": done[n_conv:],
    }
    results["seconds"] = time.perf_counter() - t0
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results))
    log(f"done in {results['seconds']:.0f}s: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
