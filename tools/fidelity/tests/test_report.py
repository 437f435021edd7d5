"""measures.py and report.py on synthetic results: what is measured (steps after the first
compression, probes and tasks the full cache answers), the comparisons and their Holm
adjustment, and that the page's sentences follow the numbers."""

import copy
import json

import numpy as np
import pytest

import measures
import report


def synthetic(n_conv=4, steps=40, seed=0):
    """A results.json with the full cache, two uniform presets and Hard-KV at budget 64:
    zipage agrees everywhere after step 10, snapkv misses every fourth step, hard_kv every
    other; each is compressed from step 10 on."""
    rng = np.random.default_rng(seed)
    configs = [{"name": "full", "preset": None, "budget": None}] + [
        {"name": f"{p}@64", "preset": p, "budget": 64} for p in ("zipage", "snapkv", "hard_kv")]
    sessions = []
    for c in range(n_conv):
        agree, kl, comp = [], [], []
        for i, cfg in enumerate(configs):
            a = np.ones(steps, dtype=int)
            k = np.zeros(steps)
            if cfg["name"] == "snapkv@64":
                a[3::4] = 0
                k[3::4] = 0.4
            if cfg["name"] == "hard_kv@64":
                a[1::2] = 0
                k[1::2] = 0.8
            if cfg["preset"]:
                a[:10] = 1  # before the first compression: full cache, agrees
                k[:10] = 0.0
            agree.append(a.tolist()), kl.append(k.tolist())
            comp.append(([0] * 10 + [1] * (steps - 10)) if cfg["preset"] else [0] * steps)
        cache = [[float(100 + t) for t in range(steps)]] + [[64.0 + (t % 32) for t in range(steps)] for _ in range(2)] \
            + [[40.0 + (t % 8) for t in range(steps)]]
        sessions.append({
            "name": f"s{c}#0", "session": f"s{c}", "seed": 0, "measured_steps": steps, "agree": agree, "kl": kl,
            "compressed": comp, "cache_tokens": cache,
            "peak_head_tokens": [[x + 5 for x in row] for row in cache],
            "sequence_tokens": [[90 * x for x in row] for row in cache],
            "block_slots": [[90 * 96.0] * steps for _ in configs], "peak_block_slots": [90 * 160.0, 90 * 96.0, 90 * 96.0,
                                                                                        90 * 96.0],
            "compressions": [0, 3, 3, 3], "final_lengths": [140, 64, 64, 41],
            "repeated_8gram_share": [0.1, 0.3, 0.0, 0.2][c % 4],
            "probes": [{"question": "q?", "accept": ["x"], "answers": ["x"] * 4, "right": [True, True, False, False]},
                       {"question": "r?", "accept": ["y"], "answers": [""] * 4, "right": [False, True, True, True]}],
            "keepmaps": {}, "assistant_answers": ["a"], "prompt_tokens": 50, "decode_steps": steps,
            "conversation_steps": steps, "seconds": 1.0, "compress_seconds": 0.1, "compress_calls": 3,
        })
    tasks = [
        {"kind": "needle", "context_tokens": 512, "depths": [0.5], "seed": 0, "question": "q", "answer": "1234",
         "configs": [c["name"] for c in configs], "answers": ["1234"] * 4, "right": [True, True, False, True]},
        {"kind": "needle", "context_tokens": 512, "depths": [0.1], "seed": 0, "question": "q", "answer": "99",
         "configs": [c["name"] for c in configs], "answers": [""] * 4, "right": [False, True, True, True]},
        {"kind": "arithmetic", "context_tokens": 512, "depths": [0.2, 0.6], "seed": 0, "question": "q", "answer": "5",
         "configs": [c["name"] for c in configs], "answers": ["5"] * 4, "right": [True, False, True, True]},
    ]
    return {"quick": True, "scale": 1.0, "backend": "kvpolicy test", "block_size": 32, "query_window": 32,
            "budgets": [64], "presets": ["zipage", "snapkv", "hard_kv"], "configs": configs, "sessions": sessions,
            "tasks": tasks, "temperature": 0.7, "seeds": [0], "task_lengths": [512], "task_depths": [0.1, 0.5],
            "keepmap_layers": [2], "per_head_block_size": 16, "kara_period": 32, "seconds": 60.0, "jobs": 1,
            "blas_threads": 1}


def test_steps_before_the_first_compression_are_left_out():
    res = synthetic()
    summ = measures.summarise(res, draws=200)
    assert summ["zipage@64"]["agree"] == 1.0
    # snapkv misses steps 11, 15, ..., 39 of 10..39: 8 of 30 (step 3 and 7 are before compression).
    assert summ["snapkv@64"]["agree"] == pytest.approx(22 / 30)
    assert summ["snapkv@64"]["kl"] == pytest.approx(8 * 0.4 / 30)
    assert summ["hard_kv@64"]["agree"] == pytest.approx(0.5)
    assert summ["snapkv@64"]["steps"] == 4 * 30 and summ["snapkv@64"]["excluded"] == 4 * 10
    assert summ["full"]["steps"] == 4 * 40 and summ["full"]["excluded"] == 0
    # The same conversation four times: no spread between conversations.
    assert summ["snapkv@64"]["agree_ci"] == pytest.approx((22 / 30, 22 / 30))
    # Memory: means and peaks over the compressed steps (every step for the full cache).
    assert summ["hard_kv@64"]["cache"] == pytest.approx(np.mean([40 + (t % 8) for t in range(10, 40)]))
    assert summ["hard_kv@64"]["peak_head"] == 47 + 5
    assert summ["hard_kv@64"]["sequence_peak"] == 90 * 47
    assert summ["full"]["peak_head"] == 139 + 5 and summ["full"]["peak_slots"] == 90 * 96
    for s in res["sessions"]:  # a peak before the first compression is not counted
        s["block_slots"][1][0] = 10**6
        s["block_slots"][1][20] = 90 * 128.0
    assert measures.summarise(res, draws=10)["zipage@64"]["peak_slots"] == 90 * 128


def test_probes_count_only_where_the_full_cache_is_right():
    summ = measures.summarise(synthetic(), draws=100)
    assert summ["zipage@64"]["asked"] == 4 and summ["zipage@64"]["right"] == 4
    assert summ["snapkv@64"]["right"] == 0  # its right answers are to the question the full cache missed


def test_old_results_without_the_compressed_record_count_every_step():
    res = synthetic()
    for s in res["sessions"]:
        del s["compressed"]
    summ = measures.summarise(res, draws=100)
    assert summ["snapkv@64"]["agree"] == pytest.approx(32 / 40)  # misses at 11, 15, ..., 39: 8 of 40
    assert summ["snapkv@64"]["excluded"] == 0


def test_comparisons_pair_steps_and_adjust_by_holm():
    res = synthetic()
    for s in res["sessions"][:2]:  # conversations differ, so intervals have width
        s["agree"][2] = [1] * 40
        s["kl"][2] = [0.0] * 40
    summ = measures.summarise(res, draws=200)
    comp = measures.comparisons(res, summ, res["presets"], "agree", draws=500)
    assert comp[64]["best"] == "zipage@64"
    rows = {r["name"]: r for r in comp[64]["rows"]}
    assert rows["hard_kv@64"]["diff"] == pytest.approx(-0.5)
    assert rows["snapkv@64"]["diff"] == pytest.approx(-(2 * 8) / (4 * 30))
    assert rows["snapkv@64"]["low"] < rows["snapkv@64"]["diff"] < rows["snapkv@64"]["high"] <= 0
    p = [rows[n]["p"] for n in ("snapkv@64", "hard_kv@64")]
    np.testing.assert_allclose([rows[n]["p_holm"] for n in ("snapkv@64", "hard_kv@64")], measures.stats.holm(p))
    kl = measures.comparisons(res, summ, res["presets"], "kl", draws=200)
    assert kl[64]["best"] == "zipage@64" and all(r["diff"] > 0 for r in kl[64]["rows"])


def test_task_accuracy_keeps_what_the_full_cache_answers():
    acc = measures.task_accuracy(synthetic())
    assert acc["dropped"] == {"needle": 1}
    assert acc["kinds"]["needle"] == {"full": (1, 1), "zipage@64": (1, 1), "snapkv@64": (0, 1), "hard_kv@64": (1, 1)}
    assert acc["kinds"]["arithmetic"]["zipage@64"] == (0, 1)
    assert acc["by_length"]["needle"][512]["snapkv@64"] == (0, 1)


def test_repeated_share_weights_conversations_by_steps():
    res = synthetic(n_conv=2)
    res["sessions"][1]["measured_steps"] = 120
    assert measures.repeated_share(res) == pytest.approx((0.1 * 40 + 0.3 * 120) / 160)


def test_reference_sentence_follows_the_numbers():
    rec = json.loads((report.HERE / "tests" / "reference_logits.json").read_text())["measured"]
    text = measures.reference_sentence(rec)
    ours, own = rec["numpy_vs_llama_cpp"], rec["llama_cpp_vs_llama_cpp_flash_attn"]
    assert f"{ours['mean_abs_diff']:.4g}" in text and f"{own['kl_mean']:.4g}" in text
    worse = copy.deepcopy(rec)
    worse["numpy_vs_llama_cpp"]["kl_mean"] = own["kl_mean"] * 10
    worse["numpy_vs_llama_cpp"]["mean_abs_diff"] = own["mean_abs_diff"] * 2
    w = measures.reference_sentence(worse)
    assert w != text and "farther" in w and "a higher mean KL" in w
    assert ("no farther" in text) == (ours["mean_abs_diff"] <= own["mean_abs_diff"] and ours["kl_mean"] <= own["kl_mean"])


def test_page_is_computed_from_the_results(tmp_path):
    res = synthetic()
    summ = report.summarise(res)
    text = report.write_doc(res, summ, tmp_path, "caption")
    assert "73.3" in text  # snapkv's 22/30
    assert "1/1" in text  # the needle table
    assert "1 needle task dropped" in text
    assert f"{100 * measures.repeated_share(res):.1f}% complete an 8-gram" in text
    assert "Holm" in text and "| hard_kv@64 |" in text
    res2 = synthetic()
    for s in res2["sessions"]:
        s["agree"][2] = [1] * 40
    text2 = report.write_doc(res2, report.summarise(res2), tmp_path, "caption")
    assert text2 != text and "73.3" not in text2


def test_compare_runs():
    import compare_runs

    a, b = synthetic(), synthetic()
    assert compare_runs.compare(a, b)["ok"]
    b["sessions"][0]["kl"][2][20] += 0.5 * 120  # snapkv's pooled KL moves by 0.5
    r = compare_runs.compare(a, b)
    assert not r["ok"] and not r["configs"]["snapkv@64"]["ok"] and r["configs"]["zipage@64"]["ok"]
    assert r["configs"]["snapkv@64"]["kl"][1] - r["configs"]["snapkv@64"]["kl"][0] == pytest.approx(0.5)
    c = synthetic()
    c["sessions"][1]["assistant_answers"] = ["b"]
    c["tasks"][0]["answers"][0] = "4321"
    r = compare_runs.compare(a, c)
    assert r["answers_differ"] == ["s1#0"] and len(r["tasks_differ"]) == 1 and not r["ok"]
    d = synthetic(n_conv=3)
    assert compare_runs.compare(a, d)["missing"] == ["s3#0"]


def test_notes_are_left_out_when_written_for_another_protocol(tmp_path):
    res = synthetic()
    res["quick"] = False
    res["backend"] = "kvpolicy 0"
    res["protocol"] = 2
    text = report.write_doc(res, report.summarise(res), tmp_path, "caption")
    assert "discusses a run of protocol 1" in text  # the committed notes.md predates protocol 2
    assert report.notes_protocol("<!-- protocol 2 -->\n## Reading") == 2
