"""Check the NumPy model against llama.cpp (llama-cpp-python) on the same GGUF, and record it.

Both read the same quantised weights; llama.cpp's CPU backend also rounds on the way
(8-bit activations into each quantised product, an fp16 K/V cache), so the logits differ
by that noise. Its size is measured by llama.cpp against itself: the same prompt with
flash attention off and on. This script runs a fixed prompt through all three, prints the
agreement (tokenizer ids; max and mean |logit difference|, top-1 agreement and KL over
every position), and with --record writes tests/reference_logits.json: the token ids and
the top logits of llama.cpp and of the NumPy model at every position, which
tests/test_reference.py checks the NumPy model against without llama-cpp-python.

Run: python reference_check.py [--record]   (needs `pip install llama-cpp-python`)
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

import model

HERE = pathlib.Path(__file__).parent
RECORD = HERE / "tests" / "reference_logits.json"
PROMPT = model.chat_prompt(
    [{"role": "user", "content": "A farmer has 17 sheep. All but 9 run away. How many sheep does the farmer have left? Explain."}]
)
TOP = 5
GREEDY_PROMPTS = (
    "What is the capital of France?",
    "Write two sentences about a lighthouse keeper.",
    "Tom has 3 apples and buys 5 more. How many apples does he have? Answer step by step.",
)


def greedy_numpy(w: model.Weights, ids: list[int], n: int, stop: int) -> tuple[list[int], list[float]]:
    """Greedy decoding through the paged cache (one sequence), as the harness decodes.
    Also returns each step's margin between the top two logits."""
    from paged_cache import PagedCache, decode_step

    logits, k, v, q = model.prefill_dense(w, np.array(ids))
    cache = PagedCache(w.config, 1, -(-(len(ids) + n) // 64) + 1, 64, -(-(len(ids) + n) // 64) + 1, 32)
    cache.fill_prompt(k, v, q)
    out, margins = [], []
    last = logits[-1]
    while len(out) < n:
        nxt = int(last.argmax())
        top2 = np.sort(last)[-2:]
        margins.append(float(top2[1] - top2[0]))
        if nxt == stop:
            break
        out.append(nxt)
        last = decode_step(w, cache, np.array([nxt]))[0]
    return out, margins


def greedy_llama_cpp(path: pathlib.Path, ids: list[int], n: int, stop: int) -> list[int]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, n_threads=2, verbose=False)
    out = []
    for t in llm.generate(ids, temp=0.0, top_k=1, repeat_penalty=1.0, reset=True):
        if t == stop or len(out) >= n:
            break
        out.append(t)
    return out


def llama_cpp_logits(path: pathlib.Path, text: str, flash_attn: bool) -> tuple[list[int], np.ndarray, str]:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=512, logits_all=True, n_threads=2, verbose=False,
                          flash_attn=flash_attn)
    ids = llm.tokenize(text.encode(), add_bos=False, special=True)
    llm.eval(ids)
    return ids, np.array(llm.scores[: len(ids)], dtype=np.float32), llama_cpp.__version__


def compare(a: np.ndarray, b: np.ndarray) -> dict:
    """Max and mean |logit difference|, top-1 agreement and KL(a || b) over every position."""
    diff = np.abs(a - b)
    lpa, lpb = model.log_softmax(a.astype(np.float64)), model.log_softmax(b.astype(np.float64))
    kl = (np.exp(lpa) * (lpa - lpb)).sum(-1)
    top1 = a.argmax(-1) == b.argmax(-1)
    return {
        "max_abs_diff": round(float(diff.max()), 4),
        "mean_abs_diff": round(float(diff.mean()), 4),
        "top1_agree": f"{int(top1.sum())}/{len(top1)}",
        "kl_mean": float(f"{kl.mean():.3g}"),
        "kl_max": float(f"{kl.max():.3g}"),
    }


def top(logits: np.ndarray) -> tuple[list, list]:
    ids = np.argsort(-logits, axis=-1, kind="stable")[:, :TOP]
    return ids.tolist(), np.take_along_axis(logits, ids, -1).round(4).tolist()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--record", action="store_true", help=f"write {RECORD.relative_to(HERE)}")
    args = ap.parse_args(argv)

    w = model.load()
    tok = model.build_tokenizer(w.tokenizer_fields)
    ours_ids = tok.encode(PROMPT).ids
    ids, ref, version = llama_cpp_logits(w.path, PROMPT, flash_attn=False)
    _, ref_fa, _ = llama_cpp_logits(w.path, PROMPT, flash_attn=True)
    print(f"llama-cpp-python {version}; prompt {len(ids)} tokens")
    print(f"tokenizer: {'identical ids' if ids == ours_ids else 'DIFFERENT ids'}")
    if ids != ours_ids:
        print("  llama.cpp:", ids, "\n  ours:     ", ours_ids)
        return 1
    ours, _, _, _ = model.prefill_dense(w, np.array(ids))
    # llama.cpp against itself (flash attention off / on) is the scale of its own rounding
    # noise: the NumPy model is verified when it is no farther from llama.cpp than that.
    rows = {
        "numpy_vs_llama_cpp": compare(ref, ours),
        "numpy_vs_llama_cpp_flash_attn": compare(ref_fa, ours),
        "llama_cpp_vs_llama_cpp_flash_attn": compare(ref, ref_fa),
    }
    for k, v in rows.items():
        print(f"{k:36s} " + ", ".join(f"{a} {b}" for a, b in v.items()))
    print(f"logit range {ref.min():.1f} .. {ref.max():.1f}; last position top-{TOP}: llama.cpp {top(ref[-1:])[0][0]}, "
          f"ours {top(ours[-1:])[0][0]} ({tok.decode(top(ref[-1:])[0][0])!r})")
    stop = tok.token_to_id("<|im_end|>")
    for text in GREEDY_PROMPTS:
        pids = tok.encode(model.chat_prompt([{"role": "user", "content": text}])).ids
        (a, margins), b = greedy_numpy(w, pids, 48, stop), greedy_llama_cpp(w.path, pids, 48, stop)
        same = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        split = f"; they part where NumPy's top two logits are {margins[same]:.3f} apart" if same < min(len(a), len(b)) else ""
        print(f"greedy {text!r}\n  numpy:     {tok.decode(a)!r}\n  llama.cpp: {tok.decode(b)!r}\n"
              f"  first {same} of {len(a)} / {len(b)} tokens identical{split}")
    if args.record:
        ref_ids, ref_vals = top(ref)
        our_ids, our_vals = top(ours)
        rec = {
            "about": "reference_check.py --record: llama.cpp's and the NumPy model's top logits for PROMPT, same GGUF",
            "llama_cpp_python": version,
            "gguf": w.path.name,
            "prompt": PROMPT,
            "ids": ids,
            "llama_cpp": {"top_ids": ref_ids, "top_logits": ref_vals},
            "numpy": {"top_ids": our_ids, "top_logits": our_vals},
            "measured": rows,
        }
        RECORD.parent.mkdir(exist_ok=True)
        RECORD.write_text(json.dumps(rec, indent=1) + "\n")
        print(f"recorded {RECORD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
