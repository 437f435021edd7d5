"""When to compress, for a Python engine: the C++ triggers of ``kvpolicy/engine/`` in Python.

The same rules as ``engine/triggers.hpp`` and ``engine/sequence_state.hpp`` (docs/pipeline.md,
"Triggers and the memory plan"), for an engine loop written in Python (the transformers
adapter): one ``SequenceState`` per running request, ``append`` after each decode step,
``due`` and ``budget_of`` asked after the step, ``record_compression`` with the result.

    Threshold(block_size=b, max_blocks=N)   Zipage 4.1: N >= N_max full blocks -> (N_max - 1) b tokens
    Buffer(size=128, budget=B)              R-KV 3.1: every 128 generated tokens, when longer than B
    Interval(period=128, budget=B)          Hard-KV: every 128 engine steps, to at most B tokens
"""

from __future__ import annotations

import dataclasses

from ..errors import Error


@dataclasses.dataclass
class SequenceState:
    """One running request as the triggers see it (kvp::sequence_state)."""

    length: int = 0  # tokens the cache holds now (the physical length)
    generated_since_compression: int = 0  # decode tokens appended since the last compression (or the prefill)
    history_tokens: int = 0  # the length the last compression left; 0 before the first
    compressions: int = 0
    last_compression_step: int = -1

    def append(self, tokens: int = 1) -> None:
        """After a decode step that appended ``tokens`` generated tokens."""
        if tokens < 0:
            raise Error(f"kvpolicy: tokens: is {tokens}; negative", "tokens")
        self.length += tokens
        self.generated_since_compression += tokens

    def record_compression(self, new_length: int, step: int) -> None:
        """A compression at the engine's ``step`` left ``new_length`` tokens."""
        if not 0 <= new_length <= self.length:
            raise Error(f"kvpolicy: new_length: is {new_length}; must lie in [0, length {self.length}]",
                        "new_length")
        self.length = new_length
        self.history_tokens = new_length
        self.generated_since_compression = 0
        self.compressions += 1
        self.last_compression_step = step


def _positive(value, field: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise Error(f"kvpolicy: {field}: is {value!r}; must be a positive int", field)


@dataclasses.dataclass(frozen=True)
class Threshold:
    """Zipage 4.1: a request holding ``length >= max_blocks * block_size`` tokens with a full
    last block is compressed to ``(max_blocks - 1) * block_size`` tokens, one block freed."""

    block_size: int
    max_blocks: int

    def validate(self) -> None:
        _positive(self.block_size, "threshold.block_size")
        if not isinstance(self.max_blocks, int) or self.max_blocks < 2:
            raise Error(f"kvpolicy: threshold.max_blocks: is {self.max_blocks!r}; must be at least 2 (the budget "
                        "is (N_max - 1) * block_size)", "threshold.max_blocks")

    def due(self, s: SequenceState, step: int) -> bool:
        return s.length >= self.max_blocks * self.block_size and s.length % self.block_size == 0

    def budget_of(self, s: SequenceState) -> int:
        return (self.max_blocks - 1) * self.block_size


@dataclasses.dataclass(frozen=True)
class Buffer:
    """R-KV 3.1: every ``size`` generated tokens (counted from the last compression or the
    prefill), a request longer than ``budget`` is compressed to ``budget`` tokens."""

    budget: int
    size: int = 128

    def validate(self) -> None:
        _positive(self.size, "buffer.size")
        _positive(self.budget, "buffer.budget")

    def due(self, s: SequenceState, step: int) -> bool:
        g = s.generated_since_compression
        return g > 0 and g % self.size == 0 and s.length > self.budget

    def budget_of(self, s: SequenceState) -> int:
        return self.budget


@dataclasses.dataclass(frozen=True)
class Interval:
    """Hard-KV: every ``period`` engine steps, each request longer than ``min_length``, to at
    most ``budget`` tokens (its budget is ``min(budget, length)``)."""

    budget: int
    period: int = 128
    min_length: int = 0

    def validate(self) -> None:
        _positive(self.period, "interval.period")
        _positive(self.budget, "interval.budget")
        if not isinstance(self.min_length, int) or self.min_length < 0:
            raise Error(f"kvpolicy: interval.min_length: is {self.min_length!r}; must be a non-negative int",
                        "interval.min_length")

    def due(self, s: SequenceState, step: int) -> bool:
        return step > 0 and step % self.period == 0 and s.length > self.min_length

    def budget_of(self, s: SequenceState) -> int:
        return min(self.budget, s.length)


# Each preset's trigger as SPEC.md's preset table gives it (Kara's periodic trigger is not
# here: the adapter refuses Kara). KV-Compress compresses after a prefill or before a
# preemption in its own engine; the transformers adapter compresses it after a prefill
# (transformers_kv_compress) and, since it does not replace the engine's scheduler, as
# R-KV does, every 128 generated tokens once over its budget.
_DEFAULT_TRIGGER = {
    "zipage": "threshold",
    "snapkv": "threshold",
    "h2o": "threshold",
    "streaming_llm": "threshold",
    "rkv": "buffer",
    "gkv": "buffer",
    "hard_kv": "interval",
    "hard_kv_rkv": "interval",
    "kv_compress": "buffer",
}


def default_trigger(preset_name: str, budget: int, block_size: int):
    """The preset's own trigger for a budget of ``budget`` tokens and blocks of ``block_size``.

    The threshold trigger keeps whole blocks, so its budget must be a multiple of the block
    size (``max_blocks = budget / block_size + 1``); pass ``Buffer(budget)`` for another budget.
    """
    kind = _DEFAULT_TRIGGER.get(preset_name)
    if kind is None:
        raise Error(f"kvpolicy: preset: {preset_name!r} has no trigger here; expected one of "
                    f"{', '.join(map(repr, _DEFAULT_TRIGGER))}", "preset")
    _positive(budget, "budget")
    if kind == "threshold":
        if budget % block_size:
            raise Error(f"kvpolicy: budget: is {budget}; {preset_name}'s threshold trigger (Zipage 4.1) keeps whole "
                        f"blocks, so the budget must be a multiple of the block size {block_size} (or pass "
                        "trigger=Buffer(budget) to compress every 128 tokens to any budget)", "budget")
        return Threshold(block_size=block_size, max_blocks=budget // block_size + 1)
    if kind == "buffer":
        return Buffer(budget=budget)
    return Interval(budget=budget)
