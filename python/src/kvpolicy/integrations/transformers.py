"""kvpolicy inside Hugging Face transformers' continuous batching, without a fork.

Tested with transformers 5.17.x (``TESTED_TRANSFORMERS``; ``pip install 'kvpolicy[transformers]'``).
Any other version is refused at attach time: the adapter reads and changes the engine's
internal state (block tables, request states), which transformers does not promise to keep.

    import kvpolicy
    from kvpolicy.integrations.transformers import Adapter
    from transformers import ContinuousBatchingConfig

    adapter = Adapter(kvpolicy.SnapKV(), budget=512)          # the preset's own trigger
    cb = ContinuousBatchingConfig(allow_block_sharing=False, num_blocks=..., block_size=256)
    with adapter.attach(model):                              # or adapter.attach(manager) before start()
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    print(adapter.stats)

What it does, between decode steps of the engine's own loop:

- keeps each running request's recent post-RoPE queries (the preset's observation window)
  in a ring buffer ``[L, slots * w + 1, h_q * d]``, written by the attention function the
  engine calls (``paged|sdpa`` and ``paged|eager`` are re-registered in ``AttentionInterface``
  as wrappers: calls for caches no adapter holds go straight to the shipped function);
- after a step, asks the preset's trigger (``kvpolicy.integrations.triggers``) which
  requests are due, and compresses them with ``kvpolicy.torch_ops.compress`` on the engine's
  own K/V tensors (``[(num_blocks + 2) * b, h_kv, d]`` per layer, viewed as the ``nhd``
  layout; the two trash blocks are never in a table) on the engine's compute stream;
- shortens each compressed request's block list and returns the blocks past its new length
  to the engine's block manager: the engine's scheduler admits new requests into them;
- keeps logical positions: the engine's ``position_offset`` becomes the physical length
  (its read and write indices, attention lengths and block allocation follow it), and each
  request carries the difference to its logical length; the position ids of every batch are
  rewritten to ``physical + difference`` after the engine builds them, so RoPE continues
  from the true position;
- for Hard-KV (per-head counts), keeps the cautious-update live bytes beside the cache (1
  for every token the engine writes) and runs the attention itself with each KV head's
  dropped slots masked out;
- with ``attention="flashinfer"``, ``"kvpolicy"`` (kvpolicy's own decode attention, which
  reads only the slots each Hard-KV head kept) or ``"torch"``, runs the engine's attention
  itself over its blocks, planned once per step (``kvpolicy.integrations.paged_attention``),
  with the engine on its decode fast path and without its [tokens, all keys] mask;
- for KV-Compress (``attention="kvpolicy"``), carves per-head blocks out of the engine's
  blocks (``kvpolicy.integrations.transformers_kv_compress``): each head holds its own
  blocks, and the engine gets back the blocks no head needs.

Refused at attach time, with the reason: KV-Compress with another attention, Kara (its window
queries), block sharing / prefix caching,
CPU offloading, asynchronous batching, CUDA graphs and torch.compile of the forward,
sliding-window layers, tensor parallelism, ``num_return_sequences > 1``, flash paged
attention, and untested transformers versions.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from contextlib import nullcontext
from typing import Optional

try:
    import torch
    import transformers
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager
    from transformers.generation.continuous_batching.requests import RequestStatus
    from transformers.modeling_utils import AttentionInterface
except ImportError as e:  # pragma: no cover - the message is the point
    raise ImportError(f"kvpolicy.integrations.transformers needs PyTorch and transformers 5.17.x "
                      f"(pip install 'kvpolicy[transformers]'): {e}") from e

import kvpolicy
import kvpolicy.torch_ops

from ..errors import Error
from .paged_attention import FlashInferPagedAttention, KvpolicyPagedAttention, TorchPagedAttention, import_flashinfer
from .triggers import SequenceState, default_trigger

TESTED_TRANSFORMERS = ("5.17",)  # major.minor releases the adapter is tested with
WRAPPED_ATTENTION = ("paged|sdpa", "paged|eager")  # the engine's paged attention functions it wraps
ATTENTION = ("engine", "torch", "flashinfer", "kvpolicy")  # who computes the attention (Adapter's attention=)

_USES_SCORES = frozenset({"zipage", "gkv", "h2o"})  # presets that keep the global score F
_USES_LIVE = frozenset({"hard_kv", "hard_kv_rkv"})  # per-head counts: the live mask (cautious update)
_NO_QUERIES = frozenset({"streaming_llm"})  # position-only: no observation window


def _refuse(field: str, message: str):
    raise Error(f"kvpolicy.integrations.transformers: {field}: {message}", field)


def check_version(version: Optional[str] = None) -> None:
    """Raises kvpolicy.Error unless ``version`` (default: the installed transformers) is tested."""
    version = transformers.__version__ if version is None else version
    if ".".join(version.split(".")[:2]) not in TESTED_TRANSFORMERS:
        _refuse("transformers", f"version {version} is not tested with the adapter (tested: "
                f"{', '.join(v + '.x' for v in TESTED_TRANSFORMERS)}); it reads and changes the engine's block "
                "tables and request states, which change between releases")


# ---------------------------------------------------------------------------------------------
# The attention functions: one wrapper per shipped paged function, installed while any
# adapter is attached. A call for a cache no adapter holds goes to the shipped function.

_registry_lock = threading.Lock()
_runs_by_cache: dict = {}  # id(PagedAttentionCache) -> _Run
_shipped: dict = {}  # name -> the shipped function, while the wrappers are installed
_installs = 0


def _wrapper(shipped):
    def attention(module, query, key, value, attention_mask, **kwargs):
        run = _runs_by_cache.get(id(kwargs.get("cache")))
        if run is None:
            return shipped(module, query, key, value, attention_mask, **kwargs)
        return run.attention(shipped, module, query, key, value, attention_mask, **kwargs)

    attention.__wrapped__ = shipped
    attention.__name__ = f"kvpolicy_{getattr(shipped, '__name__', 'paged_attention')}"
    return attention


def _install_attention() -> None:
    global _installs
    with _registry_lock:
        if _installs == 0:
            for name in WRAPPED_ATTENTION:
                shipped = AttentionInterface._global_mapping[name]
                _shipped[name] = shipped
                AttentionInterface.register(name, _wrapper(shipped))
        _installs += 1


def _uninstall_attention() -> None:
    global _installs
    with _registry_lock:
        _installs -= 1
        if _installs == 0:
            for name, shipped in _shipped.items():
                AttentionInterface.register(name, shipped)
            _shipped.clear()


# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Stats:
    """What the adapter saw of the engine's run (reset by ``Adapter.reset_stats``)."""

    steps: int = 0  # engine steps (one forward each)
    step_seconds: float = 0.0  # wall time of the steps: scheduling, forward, update, compression
    compress_seconds: float = 0.0  # of which compression (the op, its wait and the bookkeeping)
    # The adapter's own host time per phase, of the step time (where a step is bound by its
    # Python, these are what the adapter adds to it):
    prepare_seconds: float = 0.0  # after the engine built a batch: records, positions, the attention's plan
    attention_seconds: float = 0.0  # inside the attention calls (every layer): Python and launches
    update_seconds: float = 0.0  # after the step, compression excluded: triggers, lengths, positions
    compression_events: int = 0  # steps that compressed at least one request
    compressions: int = 0  # requests compressed (items)
    tokens_evicted: int = 0
    blocks_freed: int = 0  # returned to the engine's block manager by compressions
    batch_requests: int = 0  # sum over steps of the requests in the step's batch
    peak_blocks: int = 0  # most blocks in use after a step's scheduling
    requests_without_slot: int = 0  # requests never compressed: every query slot was taken

    @property
    def mean_running_requests(self) -> float:
        return self.batch_requests / self.steps if self.steps else 0.0

    @property
    def compress_share(self) -> float:
        """Compression's share of the step time."""
        return self.compress_seconds / self.step_seconds if self.step_seconds else 0.0


@dataclasses.dataclass
class _Record:
    """One running request: its state object, query slot and logical position offset."""

    state: object  # the engine's RequestState (a soft reset makes a new one: a new record)
    slot: int  # query slot, -1 for none
    seen: int = 0  # queries written to its slot since the record began
    delta: int = 0  # logical length - physical length (position_offset)
    seq: SequenceState = dataclasses.field(default_factory=SequenceState)
    row: int = -1  # KV-Compress: its table row in the per-head pool (-1 until its first step)
    metric_ready: bool = False  # KV-Compress: its prompt's metric is written
    prefilled_at: int = -1  # KV-Compress: the step its prompt was complete after


class Adapter:
    """A kvpolicy preset attached to transformers' continuous batching (5.17.x).

    ``policy``: a kvpolicy preset (``kvpolicy.SnapKV()``, ``kvpolicy.preset("zipage")``, ...),
    or None to only watch the engine (``stats``: the same steps, nothing recorded or changed:
    the baseline of a comparison). ``budget``: tokens a compressed request keeps, for the
    preset's own trigger (Zipage, SnapKV, H2O, StreamingLLM: the threshold trigger, a
    multiple of the block size; R-KV, G-KV: every 128 generated tokens; Hard-KV: every 128
    steps, to at most the budget). ``trigger``: a trigger of
    ``kvpolicy.integrations.triggers`` instead. ``max_requests``: query slots (requests
    that can be compressed at once; others run uncompressed), default the engine's
    ``max_requests_per_batch``.

    ``attention``: who computes the engine's attention while attached. ``"engine"`` (default):
    the engine's own ``paged|sdpa`` / ``paged|eager``, which gather every running request's K/V
    and build a [tokens, all keys] mask each step. ``"flashinfer"``: FlashInfer's paged decode
    (prefill for steps with a prompt chunk) straight over the engine's blocks, planned once per
    step (``kvpolicy.integrations.paged_attention``); the engine is switched to its decode fast
    path (no per-token read indices, no mask) for as long as the adapter is attached.
    ``"torch"``: the same plan with one PyTorch SDPA per request (any device; the reference
    the other two are tested against). ``"kvpolicy"``: kvpolicy's own decode attention
    (``kvpolicy.decode_attention``: on CUDA its split-K kernel, bf16/f16 with head dim 64 or
    128; on the CPU its host reference) for the one-token requests, skipping the slots
    Hard-KV's heads dropped, and the torch SDPA for prompt chunks; the one attention
    KV-Compress (``kvpolicy.KVCompress()``, ``budget`` its tokens per layer and KV head) takes.
    ``Adapter(None, attention="flashinfer")`` runs the engine with that attention and no
    compression: the baseline a comparison needs.

    ``attach(model)`` makes every continuous-batching manager the model creates (also the one
    ``generate_batch`` makes) use the preset; ``attach(manager)`` one manager, before its
    ``start()``. Both return the adapter, a context manager whose exit detaches it.
    """

    def __init__(self, policy=None, *, budget: Optional[int] = None, trigger=None,
                 max_requests: Optional[int] = None, attention: str = "engine"):
        name = None if policy is None else getattr(policy, "name", None)
        if attention not in ATTENTION:
            _refuse("attention", f"is {attention!r}; expected one of {', '.join(ATTENTION)}")
        if attention == "flashinfer":
            if name in _USES_LIVE:
                _refuse("attention", f"is 'flashinfer'; {name} drops tokens per KV head (the live mask), and "
                        "FlashInfer's paged kernels read every slot of a page for every head: use attention='torch' "
                        "or 'engine'")
            import_flashinfer()  # a missing or untested FlashInfer fails here, not mid-run
        if policy is not None:
            if name == "kv_compress":
                policy = _kv_compress_policy(policy, budget, trigger, attention)
            if name == "kara":
                _refuse("policy", "Kara compresses a window of older tokens with that window's own queries "
                        "(docs/integration.md, section 7); the adapter keeps only the newest queries")
            if name not in kvpolicy.PRESETS and name != "kv_compress":
                _refuse("policy", f"is {policy!r}; expected a kvpolicy preset ({', '.join(kvpolicy.PRESETS)})")
            if trigger is None and budget is None:
                _refuse("budget", "is None; pass budget= (the preset's own trigger) or trigger=")
            if trigger is not None:
                trigger.validate()
        if max_requests is not None and (not isinstance(max_requests, int) or max_requests <= 0):
            _refuse("max_requests", f"is {max_requests!r}; must be a positive int")
        self.policy = policy
        self.policy_name = name
        self.budget = budget
        self.trigger = trigger
        self.max_requests = max_requests
        self.attention = attention
        self.stats = Stats()
        self._spec = None if policy is None or name == "kv_compress" else kvpolicy.torch_ops.policy_spec(policy)
        self._window = 0 if policy is None or name in _NO_QUERIES else int(policy.params().get(
            "window", policy.params().get("metric_window", 0)))  # KV-Compress: its metric's query window
        self._undo: list = []
        self._managers: list = []
        self._runs: dict = {}  # id(batch processor) -> _Run

    # -- attaching -------------------------------------------------------------------------

    def attach(self, target) -> "Adapter":
        """Attach to a model (every manager it creates) or to one ContinuousBatchingManager."""
        check_version()
        if isinstance(target, ContinuousBatchingManager):
            self._attach_manager(target)
        elif hasattr(target, "init_continuous_batching"):
            self._attach_model(target)
        else:
            _refuse("target", f"is a {type(target).__name__}; expected a transformers model or a "
                    "ContinuousBatchingManager")
        return self

    def __enter__(self) -> "Adapter":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def detach(self) -> None:
        """Undo every change to the engine (the managers must be stopped)."""
        for manager in self._managers:
            if manager.is_running():
                _refuse("detach", "a manager the adapter is attached to is still running; stop() it first (its "
                        "compressed requests need the adapter's positions)")
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        self._managers.clear()
        self._runs.clear()

    def reset_stats(self) -> None:
        self.stats = Stats()

    @property
    def takes_attention(self) -> bool:
        """Whether the engine's attention calls come to the adapter (queries recorded, or its own attention)."""
        return self.policy is not None or self.attention != "engine"

    def protected_tokens(self) -> int:
        """Tokens the preset always keeps: its observation window and sinks."""
        params = self.policy.params()
        window = params.get("protect_window", params.get("protected_window", params.get("window", 0)))
        return window + params.get("sinks", 0)

    def trigger_for(self, block_size: int):
        """The trigger used with blocks of ``block_size`` tokens (validated)."""
        trigger = self.trigger or default_trigger(self.policy_name, self.budget, block_size)
        trigger.validate()
        protected = self.protected_tokens()
        budget = getattr(trigger, "budget", None)
        if budget is None:  # the threshold trigger keeps N_max - 1 blocks
            budget = (trigger.max_blocks - 1) * trigger.block_size
        if budget < protected:
            _refuse("budget", f"is {budget}; {self.policy_name} always keeps its {protected} protected tokens "
                    "(observation window and sinks), so the budget must be at least that")
        return trigger

    def _attach_model(self, model) -> None:
        if "init_continuous_batching" in model.__dict__:
            _refuse("target", "the model already has an adapter attached (or another wrapper of "
                    "init_continuous_batching); detach it first")
        config = model.config.get_text_config()
        _check_model_config(config)
        cached = getattr(model, "_cached_continuous_batching_manager", None)
        if cached is not None:
            self._attach_manager(cached)
        shipped = model.init_continuous_batching

        def init_continuous_batching(*args, **kwargs):
            manager = shipped(*args, **kwargs)
            if manager not in self._managers:
                self._attach_manager(manager)
            return manager

        model.init_continuous_batching = init_continuous_batching
        self._undo.append(lambda: model.__dict__.pop("init_continuous_batching", None))

    def _attach_manager(self, manager) -> None:
        if manager in self._managers:
            return
        if manager.is_running():
            _refuse("manager", "is running; attach before start() (requests already running were not observed)")
        if "_create_batch_processor" in manager.__dict__:
            _refuse("manager", "already has an adapter attached; two would both rewrite its block tables and "
                    "positions: detach the other first")
        _check_manager(manager, observing_only=not self.takes_attention)
        if self.attention == "flashinfer":
            _check_flashinfer(manager.model)
        if self.attention == "kvpolicy":
            _check_kvpolicy_attention(manager.model)
        if self.policy is not None:
            self.trigger_for(manager.continuous_batching_config.block_size)  # a bad budget fails here, not mid-run
        shipped = manager._create_batch_processor
        cfg = manager.continuous_batching_config

        def create_batch_processor():
            if self.attention != "engine" and getattr(manager, "batch_processor", None) is None:
                # A block table of width 1 turns the engine's decode fast path on (the adapter's
                # attention plans from the block lists, so the engine's own table stays unused).
                fast = cfg.max_blocks_per_request
                cfg.max_blocks_per_request = max(fast or 0, 1)
                try:
                    processor = shipped()
                finally:
                    cfg.max_blocks_per_request = fast
            else:
                processor = shipped()
            self._hook(processor, manager.model)
            return processor

        manager._create_batch_processor = create_batch_processor
        self._managers.append(manager)
        self._undo.append(lambda: manager.__dict__.pop("_create_batch_processor", None))
        if self.takes_attention:
            _install_attention()
            self._undo.append(_uninstall_attention)
        if manager.batch_processor is not None:  # warmup() made it already
            self._hook(manager.batch_processor, manager.model)

    def _hook(self, processor, model) -> None:
        run = self._runs.get(id(processor))
        if run is not None:  # the manager reset and reused it: nothing running any more
            run.reset()
            return
        if self.policy_name == "kv_compress":
            from .transformers_kv_compress import PerHeadRun  # a _Run of its own (imports this module)

            run = PerHeadRun(self, processor, model)
        else:
            run = _Run(self, processor, model)
        self._runs[id(processor)] = run
        self._undo.append(run.unhook)


def _kv_compress_policy(policy, budget, trigger, attention: str):
    """KV-Compress as the adapter runs it: its budget in tokens per (layer, KV head) from the
    policy (max_cache_tokens or compression_rate) or, if it has none, from ``budget`` (or the
    trigger's); its attention kvpolicy's per-head decode, which also updates its metric."""
    if attention != "kvpolicy":
        _refuse("attention", f"is {attention!r}; KV-Compress gives each (layer, KV head) its own blocks, which only "
                "kvpolicy's per-head decode attention reads (it also adds each query's squared attention to "
                "KV-Compress's metric): pass attention='kvpolicy'")
    params = policy.params()
    own = params["max_cache_tokens"] >= 0 or params["compression_rate"] < 1.0
    tokens = budget if budget is not None else getattr(trigger, "budget", None)
    if own:
        if budget is not None and budget != params["max_cache_tokens"]:
            _refuse("budget", f"is {budget}, and the policy has its own budget (max_cache_tokens "
                    f"{params['max_cache_tokens']}, compression_rate {params['compression_rate']}): pass one")
        return policy
    if tokens is None:
        _refuse("budget", "is None and KVCompress has no budget of its own: pass budget= (tokens per layer and KV "
                "head, on average: KV-Compress's max_cache_tokens) or set max_cache_tokens / compression_rate")
    return kvpolicy.KVCompress(**{**params, "max_cache_tokens": int(tokens)})


def _attention_scale(model) -> float:
    """The softmax scale of the model's attention layers (one for all, or refused)."""
    scales = {float(m.scaling) for m in model.modules() if hasattr(m, "layer_idx") and hasattr(m, "scaling")}
    if len(scales) != 1:
        _refuse("attention", f"the model's attention layers have scales {sorted(scales)}; the adapter's attention "
                "plans one scale for every layer")
    return scales.pop()


FLASHINFER_HEAD_DIMS = (64, 128, 256)  # head dims FlashInfer 0.7's paged decode and prefill compile for


def _check_cuda_kernels(model, attention: str, kernels: str, head_dims) -> None:
    """The dtype and head dim a CUDA attention's kernels take, checked at attach (not mid-run)."""
    from transformers.generation.continuous_batching.cache import find_head_dim

    if model.dtype not in (torch.float16, torch.bfloat16):
        _refuse("attention", f"is {attention!r}, but the model's dtype is {model.dtype}; {kernels} take float16 or "
                "bfloat16 caches")
    head_dim = find_head_dim(model.config.get_text_config())
    if head_dim not in head_dims:
        _refuse("attention", f"is {attention!r}, but the model's head dim is {head_dim}; {kernels} take "
                f"{', '.join(map(str, head_dims))}")


def _check_flashinfer(model) -> None:
    """What attention="flashinfer" needs of the model."""
    if model.device.type != "cuda":
        _refuse("attention", f"is 'flashinfer', but the model is on {model.device}; FlashInfer runs on CUDA devices "
                "(attention='torch' runs anywhere)")
    _check_cuda_kernels(model, "flashinfer", "FlashInfer's paged kernels", FLASHINFER_HEAD_DIMS)


KVPOLICY_HEAD_DIMS = (64, 128)  # head dims kvpolicy's CUDA decode attention is built for


def _check_kvpolicy_attention(model) -> None:
    """What attention="kvpolicy" needs of the model on CUDA (the host reference takes any)."""
    if model.device.type != "cuda":
        return
    if not kvpolicy.has_cuda:
        _refuse("attention", "is 'kvpolicy' with the model on CUDA, but this kvpolicy was built without its CUDA "
                "path (KVPOLICY_PYTHON_CUDA=OFF or no nvcc)")
    _check_cuda_kernels(model, "kvpolicy", "kvpolicy's CUDA decode attention kernels", KVPOLICY_HEAD_DIMS)


def _check_model_config(config) -> None:
    """Refusals that the model's configuration decides."""
    layer_types = getattr(config, "layer_types", None)
    sliding = getattr(config, "sliding_window", None) is not None and (
        layer_types is None or "sliding_attention" in layer_types)
    if sliding or (layer_types is not None and any(t != "full_attention" for t in layer_types)):
        _refuse("model.config", "the model has sliding-window (or other non-full) attention layers; their blocks are "
                "a rolling buffer the engine rewrites in place, which compression cannot shorten")
    if getattr(config, "num_attention_heads", None) is None:
        _refuse("model.config", "has no num_attention_heads (the query heads the observation window holds)")


def _check_manager(manager, observing_only: bool) -> None:
    """Refusals that the manager's resolved configuration decides (attach time)."""
    cfg = manager.continuous_batching_config
    _check_model_config(manager.model.config.get_text_config())
    if observing_only:
        return
    impl = manager.model.config._attn_implementation
    if impl not in WRAPPED_ATTENTION:
        _refuse("attn_implementation", f"is {impl!r}; the adapter records the queries and masks Hard-KV's dropped "
                f"slots inside {' or '.join(WRAPPED_ATTENTION)} (load the model with attn_implementation='sdpa' or "
                "'eager'; flash paged attention reads the cache in its own kernel)")
    if cfg.allow_block_sharing:
        _refuse("allow_block_sharing", "is True; a compression rewrites a request's blocks in place, which prefix "
                "sharing would hand to other requests as the prompt's bytes: pass "
                "ContinuousBatchingConfig(allow_block_sharing=False)")
    if cfg.cpu_offload_space is None or cfg.cpu_offload_space > 0:
        _refuse("cpu_offload_space", f"is {cfg.cpu_offload_space!r}; an offloaded request is restored by its "
                "position_offset into fresh blocks, which the adapter does not follow: pass cpu_offload_space=0.0")
    if cfg.use_async_batching:
        _refuse("use_async_batching", "is True; asynchronous batching prepares step N+1 (position offsets, block "
                "tables) while step N runs, so no point between steps sees the cache and its tables agree: pass "
                "use_async_batching=False")
    if any(cfg.cuda_graph_booleans):
        _refuse("use_cuda_graph", f"is {cfg.use_cuda_graph!r}; CUDA graphs of the forward are not tested with the "
                "adapter yet: pass use_cuda_graph=False")
    if cfg.varlen_compile_config is not None or cfg.decode_compile_config is not None:
        _refuse("compile", "torch.compile of the forward is not tested with the adapter yet: pass "
                "default_compile_level=0 and no compile configs")
    if manager.distributed_helper.tp_size > 1:
        _refuse("tensor_parallel", f"tp_size is {manager.distributed_helper.tp_size}; each rank holds a share of "
                "the KV heads and would select different tokens")
    if manager.num_return_sequences > 1:
        _refuse("num_return_sequences", f"is {manager.num_return_sequences}; forked requests share their parent's "
                "blocks and have no observation window of their own")
    if manager.model.device.type == "cuda" and not kvpolicy.has_cuda:
        _refuse("device", "the model runs on CUDA but the installed kvpolicy is host-only (reinstall it where "
                "nvcc is found)")


class _Run:
    """The adapter's state for one batch processor (one PagedAttentionCache)."""

    def __init__(self, adapter: Adapter, processor, model):
        cache = processor.cache
        if cache.num_groups != 1 or cache.num_sliding_attention_groups:
            _refuse("cache", f"has {cache.num_groups} layer groups; the adapter handles one full-attention group")
        if cache.use_prefix_sharing:
            _refuse("allow_block_sharing", "the cache shares prefix blocks; pass allow_block_sharing=False")
        self.adapter = adapter
        self.processor = processor
        self.io = processor.inputs_and_outputs
        self.cache = cache
        self.manager_of_blocks = cache.group_cache_managers[0]
        self.policy = adapter.policy
        self.step = 0
        self.batch: list = []  # (record, query tokens, decode?) of the step in flight
        self.records: dict = {}
        self.step_started = None
        b, nb, h_kv, d = cache.block_size, cache.num_blocks, cache.num_key_value_heads, cache.head_dim
        self.block_size = b
        self.layers = len(cache.key_cache)
        self.window, self.free_slots = 0, []
        self.ring = self.trash_row = self.dst = self.scores = self.live = None
        if self.policy is not None:
            self.trigger = adapter.trigger_for(b)
            self.protected = adapter.protected_tokens()  # a request no longer than this has nothing to drop
            device = cache.key_cache[0].device
            self._views()
            self.h_q = processor.config.num_attention_heads
            self.window = adapter._window
            slots = adapter.max_requests or processor.cb_config.max_requests_per_batch
            self.free_slots = list(range(slots - 1, -1, -1)) if self.window else []
            if self.window:
                self.trash_row = slots * self.window  # rows of tokens outside every window land here
                self.ring = torch.zeros(self.layers, self.trash_row + 1, self.h_q * d, dtype=cache.dtype,
                                        device=device)
                self.dst = torch.full((cache.max_batch_tokens,), self.trash_row, dtype=torch.int64, device=device)
            name = adapter.policy_name
            self.scores = (torch.zeros(self.layers, nb + 2, b, h_kv, dtype=torch.float32, device=device)
                           if name in _USES_SCORES else None)
            self.live = (torch.zeros(self.layers, nb + 2, b, h_kv, dtype=torch.uint8, device=device)
                         if name in _USES_LIVE else None)
        self.backend = None
        self.taken_over = False  # the engine's mask and slow path are the adapter's to give back
        self.engine_mask = None
        self._capped: dict = {}  # Hard-KV: L_upper -> the policy's spec with that cap
        if adapter.attention != "engine":
            self.backend = self._backend(_attention_scale(model))
        self._hook()

    def _views(self) -> None:
        """The engine's tensors as the nhd layout: the two trash blocks are blocks nb and nb + 1."""
        cache = self.cache
        shape = (cache.num_blocks + 2, cache.block_size, cache.num_key_value_heads, cache.head_dim)
        self.k = [t.view(shape) for t in cache.key_cache]
        self.v = [t.view(shape) for t in cache.value_cache]

    def _backend(self, scale: float):
        """The attention the adapter runs over the engine's blocks (Adapter's ``attention``)."""
        cache, attention = self.cache, self.adapter.attention
        device = cache.key_cache[0].device
        if attention == "flashinfer":
            return FlashInferPagedAttention(cache.block_size, cache.write_trash_index, device, scale,
                                            self.processor.config.num_attention_heads, cache.num_key_value_heads,
                                            cache.head_dim, cache.dtype)
        backend = KvpolicyPagedAttention if attention == "kvpolicy" else TorchPagedAttention
        return backend(cache.block_size, cache.write_trash_index, device, scale)

    # -- hooks on the batch processor's instance -------------------------------------------

    def _hook(self) -> None:
        processor, io = self.processor, self.io
        shipped_next, shipped_prepare, shipped_update = (processor.prepare_next_batch, io.prepare_batch_tensors,
                                                         processor.update_batch)

        def prepare_next_batch():
            self.step_started = time.perf_counter()
            return shipped_next()

        def prepare_batch_tensors(*args, **kwargs):
            requests = args[0] if args else kwargs["requests_in_batch"]
            before = [(fs, fs.state.position_offset) for fs in requests]
            shipped_prepare(*args, **kwargs)
            started = time.perf_counter()
            self._after_prepare(before)
            self.adapter.stats.prepare_seconds += time.perf_counter() - started

        def update_batch():
            shipped_update()
            self._after_step()

        processor.prepare_next_batch = prepare_next_batch
        io.prepare_batch_tensors = prepare_batch_tensors
        processor.update_batch = update_batch
        if self.backend is not None:
            # The adapter's attention reads neither the engine's mask nor its block table: the
            # engine builds neither (the mask is [tokens, all keys] wide); decode-only steps take
            # the engine's fast path (no per-token read indices) at every length. Undone by unhook.
            scheduler = processor.scheduler
            self.taken_over, self.engine_mask = True, io.attention_mask
            io.attention_mask = None
            if self.cache.max_blocks_per_request > 0:
                scheduler.max_decode_fast_path_length = self.cache.num_pages + 1
            self.cache.fill_block_table = lambda *args, **kwargs: None
        if self.adapter.takes_attention:
            _runs_by_cache[id(self.cache)] = self

    def unhook(self) -> None:
        for obj, name in ((self.processor, "prepare_next_batch"), (self.io, "prepare_batch_tensors"),
                          (self.processor, "update_batch"), (self.cache, "fill_block_table")):
            obj.__dict__.pop(name, None)
        if self.taken_over:
            # The engine's own attention (paged|sdpa) needs its mask and read indices back: a
            # processor made while attached (block table of width 1) never takes the fast path.
            self.io.attention_mask, self.engine_mask = self.engine_mask, None
            self.processor.scheduler.max_decode_fast_path_length = 0
            self.taken_over = False
        if _runs_by_cache.get(id(self.cache)) is self:
            del _runs_by_cache[id(self.cache)]

    def reset(self) -> None:
        for rid in list(self.records):
            self._drop(rid)
        self.batch = []
        self.step = 0

    # -- records ---------------------------------------------------------------------------

    def _new_record(self, state) -> _Record:
        slot = -1
        if self.policy is not None and (self.window == 0 or self.free_slots):
            slot = self.free_slots.pop() if self.window else 0
        elif self.policy is not None:
            self.adapter.stats.requests_without_slot += 1
        rec = _Record(state=state, slot=slot)
        self.records[state.request_id] = rec
        return rec

    def _drop(self, rid) -> None:
        rec = self.records.pop(rid)
        if self.window and rec.slot >= 0:
            self.free_slots.append(rec.slot)

    # -- before the forward ----------------------------------------------------------------

    def _after_prepare(self, before) -> None:
        """The engine built the batch: records, logical positions, the query rows' slots."""
        stats = self.adapter.stats
        stats.peak_blocks = max(stats.peak_blocks, self.cache.num_blocks - self.cache.get_num_free_blocks())
        stats.batch_requests += len(before)
        positions, shifted, dst, plan = [], False, [], []
        w = self.window if self.policy is not None else 0
        blocks_of = self.manager_of_blocks.block_table
        for fs, past in before:
            state, q = fs.state, fs.query_length
            rec = self.records.get(state.request_id)
            if rec is None or rec.state is not state or past == 0:  # new, soft reset, or its first chunk
                if rec is not None:
                    self._drop(state.request_id)
                rec = self._new_record(state)
            positions.extend(range(past + rec.delta, past + rec.delta + q))
            shifted |= rec.delta != 0
            if w:
                rows = [self.trash_row] * q
                if rec.slot >= 0:
                    for k in range(max(0, q - w), q):  # the newest w queries of the step
                        rows[k] = rec.slot * w + (rec.seen + k) % w
                dst.extend(rows)
            rec.seen += q
            self.batch.append((rec, q, state.generated_len() > 0))
            if self.backend is not None:
                plan.append((rec, blocks_of[state.request_id], past, q))
        if shifted:
            ids = self.io.position_ids
            ids[: len(positions)] = torch.tensor(positions, dtype=ids.dtype, device=ids.device)
        if w:
            padded = self.io.num_q_tokens  # the forward's query rows (padding included)
            dst.extend([self.trash_row] * (padded - len(dst)))
            self.dst[:padded] = torch.tensor(dst, dtype=torch.int64, device=self.dst.device)
        if self.backend is not None:
            self._plan_attention(plan)
        stream = self.io.compute_stream
        if stream is not None and (shifted or w or self.backend is not None):
            stream.wait_stream(torch.cuda.current_stream())  # the forward reads what was just written here

    def _plan_attention(self, plan) -> None:
        """The backend's plan, once per step for every layer: ``plan`` holds (record, blocks,
        cache length before the step, query tokens) per request of the batch."""
        self.backend.plan([(blocks, past, q) for _, blocks, past, q in plan], self.io.num_q_tokens)

    # -- the attention (per layer) ---------------------------------------------------------

    def attention(self, shipped, module, query, key, value, attention_mask, **kwargs):
        started = time.perf_counter()
        try:
            return self._attention(shipped, module, query, key, value, attention_mask, **kwargs)
        finally:
            self.adapter.stats.attention_seconds += time.perf_counter() - started

    def _attention(self, shipped, module, query, key, value, attention_mask, **kwargs):
        layer = module.layer_idx
        if self.ring is not None:
            t = query.shape[2]
            rows = query[0].transpose(0, 1).reshape(t, -1).to(self.ring.dtype)
            self.ring[layer].index_copy_(0, self.dst[:t], rows)
        if self.backend is not None:
            return self._attention_by_backend(layer, query, key, value)
        if self.live is None:
            return shipped(module, query, key, value, attention_mask, **kwargs)
        return self._attention_over_live(module, query, key, value, attention_mask, **kwargs)

    def _attention_by_backend(self, layer, query, key, value):
        """The step's new K/V into their slots, then the backend's attention over the blocks."""
        cache, backend = self.cache, self.backend
        j = cache.layer_index_to_group_indices[layer][1]  # the layer's tensors in its (one) group
        k_cache, v_cache = cache.key_cache[j], cache.value_cache[j]
        backend.write(k_cache, v_cache, key[0].transpose(0, 1), value[0].transpose(0, 1))
        live = None
        if self.live is not None:
            live = self.live[layer].view(-1, cache.num_key_value_heads)
            live.index_fill_(0, backend.slots, 1)  # every token the engine writes is held by every head
        out = backend.run(query[0].transpose(0, 1).contiguous(), k_cache, v_cache, live)  # [rows, h_q, d]
        return out.unsqueeze(0), None

    def _attention_over_live(self, module, query, key, value, attention_mask, **kwargs):
        """The paged attention with each KV head's dropped slots masked (Hard-KV's per-head counts).

        As the shipped ``paged|sdpa``: write the new K/V, read the batch's through the read
        index; then the engine's mask [1, 1, Q, K], with the keys a head dropped masked for
        that head, over the query heads grouped by KV head.
        """
        cache, layer = kwargs["cache"], module.layer_idx
        h_kv = self.cache.num_key_value_heads
        live = self.live[layer].view(-1, h_kv)
        live.index_fill_(0, kwargs["write_index"][0], 1)  # every token the engine writes is held by every head
        k, v = cache.update(key_states=key, value_states=value, layer_idx=layer, read_index=kwargs["read_index"],
                            write_index=kwargs["write_index"])
        read = kwargs["read_index"][0]
        _, h_q, q_len, d = query.shape
        group = h_q // h_kv
        q = query[0].reshape(h_kv, group, q_len, d)
        kk, vv = k.transpose(0, 1).unsqueeze(1), v.transpose(0, 1).unsqueeze(1)  # [h_kv, 1, K, d]
        lowest = torch.finfo(query.dtype).min
        if attention_mask is None:
            mask = torch.zeros(1, 1, q_len, k.shape[0], dtype=query.dtype, device=query.device)
        else:
            mask = attention_mask
        mask = mask[0, 0].expand(h_kv, 1, q_len, k.shape[0])
        if read.numel():
            held = live.index_select(0, read).bool()  # [K, h_kv]
            mask = mask.masked_fill(~held.t()[:, None, None, :], lowest)
        out = torch.nn.functional.scaled_dot_product_attention(q, kk, vv, attn_mask=mask,
                                                               scale=kwargs.get("scaling"), enable_gqa=True)
        return out.reshape(1, h_q, q_len, d).transpose(1, 2).contiguous(), None

    # -- after the step ----------------------------------------------------------------------

    def _after_step(self) -> None:
        stats = self.adapter.stats
        began = time.perf_counter()
        compressing = 0.0
        self.step += 1
        active = self.processor.scheduler.active_requests
        for rid in [rid for rid, rec in self.records.items() if active.get(rid) is not rec.state]:
            self._drop(rid)  # finished, cancelled or soft reset: its blocks are the engine's again
        self._advance([(rec, q, decode) for rec, q, decode in self.batch
                       if self.records.get(rec.state.request_id) is rec])
        self.batch = []
        if self.policy is not None:
            due = [rec for rec in self.records.values() if self._due(rec)]
            if due:
                started = time.perf_counter()
                self._compress(due)
                compressing = time.perf_counter() - started
                stats.compress_seconds += compressing
        stats.update_seconds += time.perf_counter() - began - compressing
        stats.steps += 1
        if self.step_started is not None:
            stats.step_seconds += time.perf_counter() - self.step_started
            self.step_started = None

    def _advance(self, batch) -> None:
        """The step's requests still running: ``(record, query tokens, decode?)``."""
        for rec, q, decode in batch:
            rec.seq.length = rec.state.position_offset
            if decode:
                rec.seq.generated_since_compression += q

    def _due(self, rec) -> bool:
        """Whether the trigger compresses ``rec`` after this step."""
        return (rec.slot >= 0 and rec.state.status == RequestStatus.DECODING and rec.seen >= self.window
                and rec.seq.length == rec.state.position_offset and rec.seq.length > self.protected
                and self.trigger.due(rec.seq, self.step))

    def _compress(self, due) -> None:
        b, n = self.block_size, len(due)
        lengths = [rec.seq.length for rec in due]
        budgets = [self.trigger.budget_of(rec.seq) for rec in due]
        for rec, length, budget in zip(due, lengths, budgets):
            if not 1 <= budget <= length:
                _refuse("trigger", f"gives request {rec.state.request_id!r} a budget of {budget}; must lie in "
                        f"[1, its length {length}]")
        tables = [self.manager_of_blocks.block_table[rec.state.request_id] for rec in due]
        width = max(-(-length // b) for length in lengths)
        rows = [table[: -(-length // b)] for table, length in zip(tables, lengths)]
        device = self.k[0].device
        stream = self.io.compute_stream
        # Everything on the engine's compute stream, after its forward: the host-to-device
        # copies of the table and lengths too (a pageable copy may still be in flight when
        # torch.tensor returns, so it must be ordered before the kernels that read it).
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            table = torch.tensor([row + [0] * (width - len(row)) for row in rows], dtype=torch.int32,
                                 device=device)
            queries = None
            if self.window:
                w = self.window
                picks = [rec.slot * w + (rec.seen - w + j) % w for rec in due for j in range(w)]  # oldest first
                queries = self.ring.index_select(1, torch.tensor(picks, dtype=torch.int64, device=device))
                queries = queries.view(self.layers, n, w, self.h_q, self.cache.head_dim)
            spec = self._spec()
            if self.live is not None:
                spec, budgets = self._head_adaptive(budgets)
            r = kvpolicy.torch_ops.compress(
                spec, "nhd", k=self.k, v=self.v, block_table=table,
                lengths=torch.tensor(lengths, dtype=torch.int32, device=device), seqs=list(range(n)),
                budgets=budgets, history_tokens=[rec.seq.history_tokens for rec in due], queries=queries,
                scores=self.scores, live=self.live, max_tokens=width * b)
            r.check()  # waits for the stream: the new lengths decide the engine's next step
            new_lengths = r.new_lengths.tolist()
            counts = r.released_counts.tolist()
            released = r.released_blocks.tolist()
        stats = self.adapter.stats
        stats.compression_events += 1
        for i, rec in enumerate(due):
            state, new = rec.state, new_lengths[i]
            keep = -(-new // b)
            blocks = tables[i]
            if sorted(released[i][: counts[i]]) != sorted(rows[i][keep:]):
                _refuse("released_blocks", f"request {state.request_id!r}: the compression released "
                        f"{released[i][: counts[i]]}, not its table's tail past {keep} blocks {rows[i][keep:]}")
            freed = blocks[keep:]  # the released blocks and any the engine allocated ahead
            del blocks[keep:]  # the engine's own list, shortened in place
            self.cache._block_manager.free_blocks(freed, shareable=self.manager_of_blocks.uses_block_sharing)
            state.allocated_blocks -= len(freed)
            state.position_offset = new  # the physical length: reads, writes and allocation follow it
            rec.delta += lengths[i] - new  # the logical length stays: RoPE continues from it
            rec.seq.record_compression(new, self.step)
            stats.compressions += 1
            stats.tokens_evicted += lengths[i] - new
            stats.blocks_freed += len(freed)

    def _spec(self) -> str:
        return self.adapter._spec

    def _head_adaptive(self, budgets):
        """Hard-KV's call: each head capped at the trigger's budget B (L_upper, so a request
        never holds more than B tokens: its length is its largest head's), the items' budget
        (the top-k union's floor) L_upper / 2 as the authors run it, and never under the
        protected tokens (tools/fidelity's hard_kv_item_budget is the same rule)."""
        params = self.policy.params()
        upper = min(params["upper"], getattr(self.trigger, "budget", None) or max(budgets))
        spec = self._capped.get(upper)
        if spec is None:
            capped = kvpolicy.preset(self.adapter.policy_name, **{**params, "upper": upper})
            spec = self._capped[upper] = kvpolicy.torch_ops.policy_spec(capped)
        floor = max(upper // 2, params["protect_window"] + params["sinks"])
        return spec, [min(b, floor) for b in budgets]
