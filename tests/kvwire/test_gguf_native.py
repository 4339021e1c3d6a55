"""``--weights gguf``: GGUF files (written with gguf.GGUFWriter, llama and qwen2 layouts) loaded on their
Q4_0 / Q4_1 / Q8_0 / Q4_K / Q5_K / Q6_K blocks. Every kept layer dequantizes to ``gguf.quants.dequantize``'s values of the
file's tensors bit for bit (Q/K rows in HF order), the others are int8 and logged, the model's logits
stay close to the fp32 model of the same file, and the fused decode step agrees with the eager one."""
from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
import transformers
from gguf import GGMLQuantizationType as Q
from gguf.quants import dequantize

from kvwire.config import KVDtype, WeightsMode
from kvwire.kv.dense import DenseKVCache
from kvwire.model import gguf
from kvwire.model.gguf_linear import NATIVE_TYPES, GGUFEmbedding, GGUFLinear, GGUFRows
from kvwire.model.loader import load_model
from kvwire.model.quant import Int8Linear, load_quantizer
from kvwire.runtime import EngineConfig, load_engine
from kvwire_kernels import cpu
from tests.kvwire.gguf_files import permute, tiny_bpe, write_from_hf, write_random

ARCHS = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM, False),
         "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM, True)}
# Our Linear -> the file's tensors, in the order their rows are concatenated.
PARTS = {"attn.qkv": ("attn_q", "attn_k", "attn_v"), "attn.o": ("attn_output",), "mlp.gate_up": ("ffn_gate", "ffn_up"),
         "mlp.down": ("ffn_down",)}


@pytest.fixture(scope="module")
def tok():
    return tiny_bpe()


@pytest.fixture(scope="module", params=[(a, q) for a in ARCHS for q in ("Q4_0", "Q4_1", "Q8_0")], ids="-".join)
def case(request, tok, tmp_path_factory):
    arch, qtype = request.param
    config_cls, model_cls, tied = ARCHS[arch]
    torch.manual_seed(0)
    hf = model_cls(config_cls(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              max_position_embeddings=256, tie_word_embeddings=tied)).eval()
    if arch == "qwen2":  # random init leaves the Q/K/V biases at zero; make them matter
        with torch.no_grad():
            for layer in hf.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    path = write_from_hf(hf, tok, tmp_path_factory.mktemp(arch) / f"tiny-{arch}.{qtype}.gguf", arch, Q[qtype])
    return arch, qtype, path


def assert_files_blocks(model, path, arch: str, qtype: str, heads: dict[str, int]) -> None:
    """Every layer of every block is a GGUFLinear of ``qtype`` whose values are the file's, bit for bit:
    llama files store Q and K rows permuted, and permuting ours the way the converter does gives them."""
    tensors = {t.name: t for t in gguf.open_gguf(path).tensors}
    for i, block in enumerate(model.layers):
        for ours, theirs in PARTS.items():
            layer = block.get_submodule(ours)
            assert isinstance(layer, GGUFLinear) and layer.qtype == qtype, (i, ours)
            got, row = layer.dequantized_weight().numpy(), 0
            for name in theirs:
                t = tensors[f"blk.{i}.{name}.weight"]
                assert t.tensor_type.name == qtype
                want = np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
                rows = got[row:row + want.shape[0]]
                if arch == "llama" and name in heads:
                    rows = permute(rows, heads[name])
                assert rows.view(np.int32).tolist() == want.view(np.int32).tolist(), (i, name)
                row += want.shape[0]
            assert row == got.shape[0]


def test_kept_layers_are_the_files_blocks_bit_for_bit(case, caplog):
    arch, qtype, path = case
    with caplog.at_level(logging.INFO, logger="kvwire.model.loader"):
        model = load_model(path, gguf_blocks=True, quantize=load_quantizer(WeightsMode.GGUF, include_lm_head=True)).model
    assert_files_blocks(model, path, arch, qtype, {"attn_q": 4, "attn_k": 2})
    # the 300-row vocabulary is not a multiple of 16 rows: lm_head is int8, and the log says so
    assert isinstance(model.lm_head, Int8Linear)
    assert "1 of 9 linear layers have no native GGUF kernel and were dequantized" in caplog.text
    assert f"lm_head ({qtype})" in caplog.text


def test_the_embedding_table_stays_in_its_blocks(case):
    """A lookup dequantizes the rows asked for to the file's values, bit for bit; a tied LM head whose
    rows have no native layout is int8 of those values."""
    arch, qtype, path = case
    model = load_model(path, gguf_blocks=True, quantize=load_quantizer(WeightsMode.GGUF, include_lm_head=True)).model
    table = {t.name: t for t in gguf.open_gguf(path).tensors}["token_embd.weight"]
    assert table.tensor_type.name in NATIVE_TYPES and isinstance(model.embed, GGUFEmbedding)
    assert model.embed.raw.numel() == table.data.nbytes  # the file's bytes, not fp32 rows
    ids = torch.tensor([0, 5, model.embed.num_embeddings - 1, 5])
    want = np.asarray(dequantize(table.data, table.tensor_type), dtype=np.float32)[ids.numpy()]
    assert model.embed(ids).numpy().view(np.int32).tolist() == want.view(np.int32).tolist()
    if arch == "qwen2":  # tied
        assert isinstance(model.lm_head, Int8Linear)


@pytest.mark.parametrize("qtype", ["Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_layers_are_the_files_blocks_bit_for_bit(qtype, tok, tmp_path):
    """K types (super-blocks of 256; gguf cannot quantize to them, so the blocks are random bytes):
    kept, exact, the model close to its fp32 image, and the fused step to the eager one."""
    path = write_random(tmp_path / f"{qtype}.gguf", Q[qtype], tok, layers=2)
    loaded = load_model(path, gguf_blocks=True)
    assert_files_blocks(loaded.model, path, "llama", qtype, {"attn_q": 4, "attn_k": 2})
    if cpu.available():
        ids = tok.encode("What is the capital of France?").ids
        ref = load_model(path)
        out = []
        for m in (loaded, ref):
            cache = DenseKVCache(m.config, 1, len(ids))
            out.append(m.model(torch.tensor(ids), cache.prepare([0], [len(ids)]), cache))
        assert 0 < float((out[0] - out[1]).abs().max() / out[1].abs().max()) < 0.05
        fused_step_matches_eager(path, tok)


@pytest.mark.skipif(not cpu.available(), reason=cpu.unavailable_reason or "")
def test_logits_close_to_the_fp32_model_of_the_same_file(case, tok):
    arch, qtype, path = case
    ids = tok.encode("What is the capital of France? The for statement").ids
    logits = {}
    for blocks in (True, False):
        loaded = load_model(path, gguf_blocks=blocks)
        cache = DenseKVCache(loaded.config, 1, len(ids))
        logits[blocks] = loaded.model(torch.tensor(ids), cache.prepare([0], [len(ids)]), cache)
    err = float((logits[True] - logits[False]).abs().max() / logits[False].abs().max())
    assert 0 < err < 0.05, err  # the same weights (and biases); only the activations' rounding differs


@pytest.mark.skipif(not cpu.available(), reason=cpu.unavailable_reason or "")
def test_fused_decode_step_matches_eager_and_rows_keep_their_bits(case, tok):
    fused_step_matches_eager(case[2], tok)


def fused_step_matches_eager(path, tok) -> None:
    rt = load_engine(EngineConfig(path, weights=WeightsMode.GGUF, kv_dtype=KVDtype.FP8_E4M3, num_pages=32))
    assert rt.model.step_fn is not None
    prompts = [tok.encode("The for statement iterates").ids, tok.encode("Lists are mutable").ids]
    caches = [rt.new_cache() for _ in range(3)]
    for cache in caches:
        for i, p in enumerate(prompts):
            rt.model(torch.tensor(p), cache.prepare([i], [len(p)]), cache)

    def step(cache, seqs, tokens, fused=True):
        saved, rt.model.step_fn = rt.model.step_fn, rt.model.step_fn if fused else None
        try:
            return rt.model(torch.tensor(tokens), cache.prepare(seqs, [1] * len(seqs)), cache)
        finally:
            rt.model.step_fn = saved

    fused, eager = step(caches[0], [0, 1], [11, 12]), step(caches[1], [0, 1], [11, 12], fused=False)
    # eager runs the same kernels layer by layer; the fused step's norms and attention differ in round-off,
    # which moves an activation across a rounding boundary of its int8 block now and then
    assert (fused - eager).abs().max() <= 0.02 * eager.abs().max()
    alone = step(caches[2], [1], [12])
    assert torch.equal(alone[0], fused[1])


def test_fused_parts_of_different_types_keep_their_blocks(tok, tmp_path):
    """A Q4_K_M-like file: V and down in Q6_K, Q and K in Q4_K, up in Q8_0. Each fused layer keeps its
    parts' blocks side by side (GGUFRows), exact; a layer with a part of a non-native type is int8."""
    types = {"attn_v.weight": Q.Q6_K, "ffn_down.weight": Q.Q6_K, "ffn_up.weight": Q.Q8_0, "attn_output.weight": Q.Q5_0}
    path = write_random(tmp_path / "mixed.gguf", Q.Q4_K, tok, layers=2, types=types)
    loaded = load_model(path, gguf_blocks=True, quantize=load_quantizer(WeightsMode.GGUF))
    tensors = {t.name: t for t in gguf.open_gguf(path).tensors}
    for i, block in enumerate(loaded.model.layers):
        qkv, gate_up = block.attn.qkv, block.mlp.gate_up
        assert isinstance(qkv, GGUFRows) and [p.qtype for p in qkv.parts] == ["Q4_K", "Q6_K"]
        assert isinstance(gate_up, GGUFRows) and [p.qtype for p in gate_up.parts] == ["Q4_K", "Q8_0"]
        assert isinstance(block.mlp.down, GGUFLinear) and isinstance(block.attn.o, Int8Linear)  # Q5_0: no kernel
        want = [np.asarray(dequantize(tensors[f"blk.{i}.{n}.weight"].data, tensors[f"blk.{i}.{n}.weight"].tensor_type))
                for n in ("ffn_gate", "ffn_up")]
        assert np.concatenate(want).view(np.int32).tolist() == gate_up.dequantized_weight().numpy().view(np.int32).tolist()
        v = np.asarray(dequantize(tensors[f"blk.{i}.attn_v.weight"].data, Q.Q6_K))
        assert v.view(np.int32).tolist() == qkv.dequantized_weight()[-v.shape[0]:].numpy().view(np.int32).tolist()
    if cpu.available():
        fused_step_matches_eager(path, tok)  # the C step runs the parts side by side as GGUFRows does


def test_weights_gguf_on_a_checkpoint_without_blocks_is_int8(tmp_path):
    from pathlib import Path
    model_dir = Path(__file__).resolve().parents[2] / "models" / "kvwire-tiny"
    rt = load_engine(EngineConfig(model_dir, weights=WeightsMode.GGUF, num_pages=8))
    kinds = {type(m) for m in rt.model.modules() if isinstance(m, (GGUFLinear, Int8Linear))}
    assert kinds == {Int8Linear}
    assert rt.fingerprint.quantization == "gguf"
