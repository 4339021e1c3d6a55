"""The fused CPU decode step (kvwire.model.fast_decode) against the model's own PyTorch forward.

Both paths run on one loaded model and two caches filled by the same prompt (prompts always take
the PyTorch path); then decode and verification steps go through each. The fused path must give
the same logits within the activations' rounding (the PyTorch int8/bf16 paths round activations
to bf16; the fused one keeps them fp32, except int8 per block of 32 into int8 layers on VNNI CPUs
and bf16 into bf16 layers on AVX512-BF16 CPUs), and each row must be bit-identical whatever it was batched
with: one token at a time, k + 1 tokens of a verification, or beside other sequences.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvwire_kernels import cpu
from kvwire.config import KVDtype, QuantMode
from kvwire.kv.pool import RELEASED
from kvwire.runtime import EngineConfig, load_engine

MODEL = Path(__file__).resolve().parents[2] / "models" / "kvwire-tiny"
pytestmark = pytest.mark.skipif(not cpu.available(), reason=cpu.unavailable_reason or "")
PROMPTS = [[5, 17, 300, 41, 9, 77, 1000, 12, 3, 64, 90, 2048, 7], [8, 8, 15, 16, 23, 42, 4000], list(range(100, 160))]


def runtime(weights: str, kv: str):
    rt = load_engine(EngineConfig(MODEL, weights=QuantMode(weights), kv_dtype=KVDtype(kv), num_pages=64))
    assert rt.model.step_fn is not None, "the fused path should take this model"
    return rt


def filled(rt):
    cache = rt.new_cache()
    for i, p in enumerate(PROMPTS):
        rt.model(torch.tensor(p), cache.prepare([i], [len(p)]), cache)
    return cache


def step(rt, cache, seqs, tokens, fused: bool):
    saved = rt.model.step_fn
    rt.model.step_fn = saved if fused else None
    try:
        positions = cache.prepare(seqs, [len(t) for t in tokens])
        return rt.model(torch.tensor([t for ts in tokens for t in ts]), positions, cache)
    finally:
        rt.model.step_fn = saved


@pytest.mark.parametrize("weights,kv,tol", [("none", "fp8_e4m3", 1e-3), ("none", "bf16", 1e-3), ("int8", "fp8_e4m3", 0.05),
                                            ("bf16", "bf16", 0.05), ("fp8", "fp8_e4m3", 0.05)])
def test_fused_step_matches_pytorch(weights, kv, tol):
    rt = runtime(weights, kv)
    ours, ref = filled(rt), filled(rt)
    feed = [[11], [12], [13]]
    for _ in range(4):
        a = step(rt, ours, [0, 1, 2], feed, fused=True)
        b = step(rt, ref, [0, 1, 2], feed, fused=False)
        assert (a - b).abs().max() <= tol * b.abs().max(), f"{weights}/{kv}: fused logits diverge"
        feed = [[int(t)] for t in b.argmax(-1)]


@pytest.mark.parametrize("weights,kv", [("int8", "fp8_e4m3"), ("int8", "bf16"), ("bf16", "fp8_e4m3")])
def test_rows_do_not_depend_on_their_batch(weights, kv):
    rt = runtime(weights, kv)
    alone, together = filled(rt), filled(rt)
    proposals = [40, 41, 42, 43]
    one_by_one = torch.cat([step(rt, alone, [0], [[t]], fused=True) for t in proposals])  # plain decoding
    others = step(rt, alone, [1, 2], [[5], [6]], fused=True)
    verify = step(rt, together, [1, 0, 2], [[5], proposals, [6]], fused=True)  # k + 1 rows of seq 0, in a batch
    assert torch.equal(verify[1:5], one_by_one)
    assert torch.equal(verify[[0, 5]], others)
    for layer in range(rt.model_config.num_layers):  # and the pages hold the same bytes
        for a, b in zip(alone.layer_tensors(layer), together.layer_tensors(layer)):
            if a is not None:
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_int8_layers_take_int8_activations_where_the_cpu_has_vnni(monkeypatch):
    """The descriptor says which kernel runs: int8 x int8 on VNNI builds, unless switched off."""
    rt = runtime("int8", "fp8_e4m3")
    fast = rt.model.step_fn
    kinds = {d.wt for layer in fast.layers for d in (layer.qkv, layer.o, layer.gate_up, layer.down)} | {fast.head.wt}
    # VNNI: the weights are stored only in the packed GEMM's layout (kvwire.model.quant.vnni_layout)
    assert kinds == ({cpu.WT_I8A8_PACKED} if cpu.library().kvw_has_vnni() else {cpu.WEIGHT_TYPES[torch.int8]})
    monkeypatch.setenv("KVWIRE_INT8_ACTIVATIONS", "0")
    fp32_acts = runtime("int8", "fp8_e4m3").model.step_fn
    assert {layer.down.wt for layer in fp32_acts.layers} == {cpu.WEIGHT_TYPES[torch.int8]}


def test_bf16_layers_take_bf16_activations_where_the_cpu_has_avx512_bf16(monkeypatch):
    fast = runtime("bf16", "fp8_e4m3").model.step_fn
    kinds = {d.wt for layer in fast.layers for d in (layer.qkv, layer.o, layer.gate_up, layer.down)} | {fast.head.wt}
    assert kinds == ({cpu.WT_BF16A16} if cpu.library().kvw_has_bf16() else {cpu.WEIGHT_TYPES[torch.bfloat16]})
    monkeypatch.setenv("KVWIRE_BF16_ACTIVATIONS", "0")
    fp32_acts = runtime("bf16", "fp8_e4m3").model.step_fn
    assert {layer.down.wt for layer in fp32_acts.layers} == {cpu.WEIGHT_TYPES[torch.bfloat16]}


def test_disabled_by_environment(monkeypatch):
    import subprocess
    import sys
    code = "from kvwire_kernels import cpu; print(cpu.available(), cpu.unavailable_reason)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**__import__("os").environ, "KVWIRE_CPU_KERNELS": "0"}).stdout
    assert out.startswith("False disabled by KVWIRE_CPU_KERNELS=0")


# ---- prefill steps (kvw_prefill_layers) -------------------------------------------------------

def prefill(rt, cache, seqs, chunks, fused: bool):
    """One prefill step: ``chunks[i]`` after what ``seqs[i]`` holds; the last row of each chunk's logits."""
    saved = rt.model.step_fn
    rt.model.step_fn = saved if fused else None
    try:
        positions = cache.prepare(seqs, [len(c) for c in chunks], prefill=True)
        ends = torch.tensor([len(c) for c in chunks]).cumsum(0) - 1
        return rt.model(torch.tensor([t for c in chunks for t in c]), positions, cache, logits_rows=ends)
    finally:
        rt.model.step_fn = saved


def chunked(rt, cache, prompt, size, fused: bool, seq: int = 0):
    return torch.cat([prefill(rt, cache, [seq], [prompt[a:a + size]], fused) for a in range(0, len(prompt), size)])


def windowed(tmp_path) -> Path:
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    transformers.MistralForCausalLM(transformers.MistralConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, sliding_window=16, max_position_embeddings=512, initializer_range=0.1)
    ).save_pretrained(tmp_path)
    return tmp_path


def test_prefill_steps_take_the_fused_path_only_on_row_independent_gemms(monkeypatch):
    assert runtime("int8", "fp8_e4m3").model.step_fn.prefill == bool(cpu.library().kvw_has_vnni())  # packed int8
    assert not runtime("none", "fp8_e4m3").model.step_fn.prefill  # fp32: torch's GEMM prefills faster
    monkeypatch.setenv("KVWIRE_PREFILL_LAYERS", "0")
    assert not runtime("int8", "fp8_e4m3").model.step_fn.prefill


@pytest.mark.parametrize("model,kv,tol", [("tiny", "bf16", 1e-4), ("tiny", "fp8_e4m3", 0.02), ("window", "bf16", 1e-4)])
def test_fused_prefill_matches_pytorch(tmp_path, model, kv, tol):
    """fp32 weights (the fused path forced on: the same math, the C GEMM), prompts in chunks of 24 so
    each chunk after the first reads the pages (behind a 16-token window in the windowed model)."""
    path = MODEL if model == "tiny" else windowed(tmp_path)
    rt = load_engine(EngineConfig(path, weights=QuantMode.NONE, kv_dtype=KVDtype(kv), num_pages=64))
    rt.model.step_fn.prefill = True
    prompt = [(i * 37) % 500 + 3 for i in range(100)]
    a = chunked(rt, rt.new_cache(), prompt, 24, fused=True)
    b = chunked(rt, rt.new_cache(), prompt, 24, fused=False)
    assert (a - b).abs().max() <= tol * b.abs().max()


def test_prefill_rows_do_not_depend_on_their_step_or_threads():
    rt = runtime("int8", "fp8_e4m3")
    if not rt.model.step_fn.prefill:
        pytest.skip("no packed int8 GEMM on this CPU")
    alone, together = rt.new_cache(), rt.new_cache()
    first = [prefill(rt, alone, [i], [p[:5]], fused=True) for i, p in enumerate(PROMPTS)]
    rest = [prefill(rt, alone, [i], [p[5:]], fused=True) for i, p in enumerate(PROMPTS)]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        both = prefill(rt, together, [0, 1, 2], [p[:5] for p in PROMPTS], fused=True)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(both, torch.cat(first))
    assert torch.equal(prefill(rt, together, [2, 0, 1], [PROMPTS[i][5:] for i in (2, 0, 1)], fused=True),
                       torch.cat([rest[i] for i in (2, 0, 1)]))
    for layer in range(rt.model_config.num_layers):  # and the pages hold the same bytes
        for a, b in zip(alone.layer_tensors(layer), together.layer_tensors(layer)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("model,kv", [("tiny", "fp8_e4m3"), ("tiny", "bf16"), ("window", "fp8_e4m3")])
def test_several_chunks_of_a_prompt_in_one_step_give_one_step_per_chunk(tmp_path, model, kv):
    """A prompt cut at the same places, its chunks in a step each or several in one step (beside another
    prompt): the last row's logits and every page byte are the same (a chunk reads the one before it
    from the pages either way), behind a 16-token sliding window too (fp32 weights, the fused path
    forced on)."""
    if model == "tiny":
        rt = runtime("int8", kv)
        if not rt.model.step_fn.prefill:
            pytest.skip("no packed int8 GEMM on this CPU")
    else:
        rt = load_engine(EngineConfig(windowed(tmp_path), weights=QuantMode.NONE, kv_dtype=KVDtype(kv), num_pages=64))
        rt.model.step_fn.prefill = True
    prompt = [(i * 37) % 500 + 3 for i in range(90)]
    ref_cache = rt.new_cache()
    ref = [prefill(rt, ref_cache, [0], [prompt[a:b]], fused=True) for a, b in ((0, 32), (32, 64), (64, 90))][-1]
    together = rt.new_cache()  # all three chunks in one step
    last = prefill(rt, together, [0, 0, 0], [prompt[:32], prompt[32:64], prompt[64:]], fused=True)[-1:]
    beside = rt.new_cache()  # two of them in one step beside another prompt, then the third
    prefill(rt, beside, [0, 0, 1], [prompt[:32], prompt[32:64], prompt[:20]], fused=True)
    results = [(last, together), (prefill(rt, beside, [0], [prompt[64:]], fused=True), beside)]
    for last, cache in results:
        assert torch.equal(last, ref) and cache.tables.length(0) == len(prompt)
        live = [(a, b) for a, b in zip(ref_cache.tables.table(0), cache.tables.table(0)) if RELEASED not in (a, b)]
        assert len(live) >= 2  # (behind the window, a step gives back the pages no query sees)
        ref_pages, pages = (torch.tensor(ids) for ids in zip(*live))
        for layer in range(rt.model_config.num_layers):
            for a, b in zip(ref_cache.layer_tensors(layer), cache.layer_tensors(layer)):
                if a is not None:  # K, V (and FP8's scales)
                    assert torch.equal(a[ref_pages].view(torch.uint8), b[pages].view(torch.uint8))
