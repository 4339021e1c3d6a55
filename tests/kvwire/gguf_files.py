"""Tiny GGUF files written with ``gguf.GGUFWriter``, laid out as llama.cpp's convert_hf_to_gguf.py
lays them out (tensor names, Q/K row permutation for llama, metadata keys), with a byte-level BPE
tokenizer in the metadata. Used by the GGUF tests; transformers reading the same file is the oracle.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = ["The for statement iterates over the items of any sequence, in the order that they appear.",
          "Lists are mutable sequences, typically used to store collections of homogeneous items.",
          "What is the capital of France? Paris is the capital of France. 12345 + 678 = 13023."] * 20
TEXTS = ["The for statement", "What is the capital of France?", "12345 items, mutable   lists!\n\tend",
         "<|im_start|>user\nhi<|im_end|>\n", "naïve café 你好 👍"]


def tiny_bpe(vocab_size: int = 300) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return tok


def add_bpe_tokenizer(w: GGUFWriter, tok: Tokenizer, pre: str = "default") -> None:
    import json

    model = json.loads(tok.to_str())["model"]
    vocab = tok.get_vocab(with_added_tokens=True)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types([3 if t in SPECIALS else 1 for t in tokens])
    w.add_token_merges(merges)
    w.add_bos_token_id(vocab["<|im_start|>"])
    w.add_eos_token_id(vocab["<|im_end|>"])
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)


def permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute (HF rotate-half rows -> llama.cpp's interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_matrix(w: GGUFWriter, name: str, value: np.ndarray, qtype: GGMLQuantizationType) -> None:
    value = np.ascontiguousarray(value, dtype=np.float32)
    if qtype == GGMLQuantizationType.F32 or value.ndim == 1:
        w.add_tensor(name, value)
    elif qtype == GGMLQuantizationType.F16:
        w.add_tensor(name, value.astype(np.float16))
    else:
        w.add_tensor(name, quantize(value, qtype), raw_dtype=qtype)


def write_from_hf(hf, tok: Tokenizer, path: Path, arch: str, qtype=GGMLQuantizationType.F32) -> Path:
    """An HF Llama/Qwen2 model as the GGUF llama.cpp would convert it to."""
    c = hf.config
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}
    w = GGUFWriter(path, arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
    w.add_rope_freq_base(float(c.rope_parameters["rope_theta"]) if getattr(c, "rope_parameters", None)
                         else float(c.rope_theta))
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_vocab_size(c.vocab_size)
    w.add_file_type(int(qtype))
    add_bpe_tokenizer(w, tok, pre="qwen2" if arch == "qwen2" else "default")
    add_matrix(w, "token_embd.weight", sd["model.embed_tokens.weight"], qtype)
    add_matrix(w, "output_norm.weight", sd["model.norm.weight"], qtype)
    if not c.tie_word_embeddings:
        add_matrix(w, "output.weight", sd["lm_head.weight"], qtype)
    names = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
             "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
             "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}
    for i in range(c.num_hidden_layers):
        for ours, theirs in names.items():
            for kind in ("weight", "bias"):
                key = f"model.layers.{i}.{theirs}.{kind}"
                if key not in sd:
                    continue
                value = sd[key]
                if arch == "llama" and ours in ("attn_q", "attn_k"):
                    value = permute(value, c.num_attention_heads if ours == "attn_q" else c.num_key_value_heads)
                add_matrix(w, f"blk.{i}.{ours}.{kind}", value, qtype)
    _finish(w)
    return path


def random_blocks(rows: int, cols: int, qtype: GGMLQuantizationType, rng: np.random.Generator) -> np.ndarray:
    """Random quantized blocks of ``qtype`` with small, finite fp16 scales, as uint8 [rows, bytes]."""
    block, size = GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, (rows, cols // block, size), dtype=np.uint8)
    k_quant = qtype.name.endswith("_K")  # scales multiply 6-bit sub-block scales: keep them smaller
    low, high = (1e-5, 1e-4) if k_quant else (1e-4, 1e-3)

    def scale(n: int) -> np.ndarray:
        return rng.uniform(low, high, (rows, cols // block, n)).astype(np.float16).view(np.uint8)

    where = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q2_K": (80, 2), "Q3_K": (108, 1), "Q6_K": (208, 1),
             "Q4_1": (0, 2), "Q5_1": (0, 2)}.get(qtype.name, (0, 1))  # Q4_0, Q5_0, Q8_0: d first
    raw[..., where[0]:where[0] + 2 * where[1]] = scale(where[1])
    return raw.reshape(rows, -1)


def write_random(path: Path, qtype: GGMLQuantizationType, tok: Tokenizer, hidden: int = 256,
                 inter: int = 512, heads: int = 4, kv_heads: int = 2, layers: int = 1, seed: int = 0,
                 types: dict[str, GGMLQuantizationType] | None = None) -> Path:
    """A llama-layout GGUF whose matrices are random ``qtype`` blocks (types gguf cannot quantize to);
    ``types``: another type for some tensors, by name suffix (``attn_v.weight``), as Q4_K_M files mix them."""
    rng = np.random.default_rng(seed)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    d = hidden // heads
    default = qtype
    w = GGUFWriter(path, "llama")
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(inter)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(d)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    add_bpe_tokenizer(w, tok)

    def matrix(name: str, rows: int, cols: int) -> None:
        qtype = next((t for suffix, t in (types or {}).items() if name.endswith(suffix)), default)
        if qtype in (GGMLQuantizationType.F16, GGMLQuantizationType.BF16, GGMLQuantizationType.F32):
            add_matrix(w, name, rng.normal(0, 0.05, (rows, cols)), qtype)
        else:
            w.add_tensor(name, random_blocks(rows, cols, qtype, rng), raw_dtype=qtype)

    def norm(name: str, n: int) -> None:
        w.add_tensor(name, rng.uniform(0.8, 1.2, n).astype(np.float32))

    matrix("token_embd.weight", vocab, hidden)
    norm("output_norm.weight", hidden)
    for i in range(layers):
        matrix(f"blk.{i}.attn_q.weight", heads * d, hidden)
        matrix(f"blk.{i}.attn_k.weight", kv_heads * d, hidden)
        matrix(f"blk.{i}.attn_v.weight", kv_heads * d, hidden)
        matrix(f"blk.{i}.attn_output.weight", hidden, heads * d)
        matrix(f"blk.{i}.ffn_gate.weight", inter, hidden)
        matrix(f"blk.{i}.ffn_up.weight", inter, hidden)
        matrix(f"blk.{i}.ffn_down.weight", hidden, inter)
        norm(f"blk.{i}.attn_norm.weight", hidden)
        norm(f"blk.{i}.ffn_norm.weight", hidden)
    _finish(w)
    return path


def _finish(w: GGUFWriter) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def hf_logits(hf, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


def write_sentencepiece(path: Path) -> Path:
    """A GGUF with a SentencePiece ("llama") vocabulary as llama.cpp stores Llama 2's: <unk> <s> </s>,
    256 byte tokens, then pieces with scores (no merges), and a stub embedding."""
    from tokenizers import SentencePieceBPETokenizer

    sp = SentencePieceBPETokenizer(add_prefix_space=True)
    sp.train_from_iterator(CORPUS, vocab_size=200, min_frequency=1, show_progress=False, limit_alphabet=100)
    pieces = [t for t, _ in sorted(sp.get_vocab().items(), key=lambda kv: kv[1])]
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + pieces
    w = GGUFWriter(path, "llama")
    w.add_block_count(1)
    w.add_embedding_length(32)
    w.add_head_count(2)
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * 259 + [-float(i) for i in range(len(pieces))])
    w.add_token_types([2, 3, 3] + [6] * 256 + [1] * len(pieces))  # unknown, control, byte, normal
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_tensor("token_embd.weight", np.zeros((len(tokens), 32), dtype=np.float32))
    _finish(w)
    return path
