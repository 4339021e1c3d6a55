"""Write the distilled SmolLM2 draft (tools/train_draft.py) as one GGUF file the existing loader reads.

Method and details: tools/README.md, section ``tools/draft_gguf.py``.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.quants import quantize

from kvwire.kv.dense import DenseKVCache
from kvwire.model import gguf as kvgguf
from kvwire.model.loader import load_model
from kvwire.model.registry import resolve_model_path

TARGET = "smollm2-135m-instruct"
Q8 = GGMLQuantizationType.Q8_0


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """convert_hf_to_gguf.py's ``permute`` (the inverse of kvwire.model.gguf.unpermute_qk)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def copy_tokenizer(reader, writer: GGUFWriter) -> None:
    """Every ``tokenizer.*`` field of ``reader``, in file order and with its stored types."""
    for key, f in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        kind = GGUFValueType(int(f.types[0]))
        if kind == GGUFValueType.ARRAY:
            writer.add_key_value(key, list(f.contents()), kind, sub_type=GGUFValueType(int(f.types[-1])))
        else:
            writer.add_key_value(key, f.contents(), kind)


def export(student, head_vocab: list[int], path: Path, target: str = TARGET) -> Path:
    cfg = student.cfg
    reader = kvgguf.open_gguf(resolve_model_path(target))
    w = GGUFWriter(str(path), "llama")
    w.add_name("SmolLM2-135M-Instruct draft (kvwire)")
    w.add_license("apache-2.0")
    w.add_block_count(len(student.blocks))
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_heads)
    w.add_head_count_kv(cfg.num_kv_heads)
    w.add_rope_freq_base(cfg.rope.theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(cfg.head_dim)
    copy_tokenizer(reader, w)
    w.add_string("kvwire.draft.target", target)
    w.add_array("kvwire.draft.source_layers", [int(i) for i in student.source_layers])
    w.add_key_value("kvwire.draft.head_vocab", [int(i) for i in head_vocab], GGUFValueType.ARRAY,
                    sub_type=GGUFValueType.UINT32)

    embd = next(t for t in reader.tensors if t.name == "token_embd.weight")
    w.add_tensor("token_embd.weight", np.ascontiguousarray(embd.data), raw_dtype=embd.tensor_type)
    h, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    for i, block in enumerate(student.blocks):
        p = {k: v.detach().float().numpy() for k, v in block.p.items()}
        q, k, v = np.split(p["attn_qkv_weight"], [h * d, (h + hkv) * d])
        gate, up = np.split(p["mlp_gate_up_weight"], 2)
        mats = {"attn_q": permute_qk(q, h), "attn_k": permute_qk(k, hkv), "attn_v": v,
                "attn_output": p["attn_o_weight"], "ffn_gate": gate, "ffn_up": up, "ffn_down": p["mlp_down_weight"]}
        for name, m in mats.items():
            w.add_tensor(f"blk.{i}.{name}.weight", quantize(np.ascontiguousarray(m, dtype=np.float32), Q8), raw_dtype=Q8)
        w.add_tensor(f"blk.{i}.attn_norm.weight", p["attn_norm_weight"].astype(np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", p["mlp_norm_weight"].astype(np.float32))
    w.add_tensor("output_norm.weight", student.norm.detach().float().numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@torch.inference_mode()
def check(student, path: Path, ids: list[int]) -> float:
    """Max |logit difference| between the student and the written file loaded by kvwire (fp32), on ``ids``.
    Small but not zero: the blocks are stored as Q8_0."""
    loaded = load_model(path)
    cache = DenseKVCache(loaded.config, 1, len(ids))
    pos = cache.prepare([0], [len(ids)])
    ours = loaded.model(torch.tensor(ids), pos, cache)  # [T, V]
    theirs = student(torch.tensor([ids]))[0] @ student.embed.T
    return float((ours - theirs).abs().max())
