"""The engine on a CUDA device: weights and KV pages there, KV through the compiled Triton kernels,
matmuls through cuBLAS. Skipped without a GPU (CI has none); run on one with

    python -m pytest tests/engine/test_cuda.py tests/kvwire_kernels/test_kernels.py

The CPU engine is the oracle. Both are fed the same tokens (the CPU's greedy choices), so every
step of every sequence is compared, and a GPU choice may differ from the CPU's only where the
CPU's two best logits are within a near-tie margin: float32 sums in another order move logits by
about 1e-5, and a K/V value on an FP8 (or bf16) rounding boundary can round the other way.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch

from kvwire import LLM, SamplingParams
from kvwire.config import DEFAULT_MODEL_DIR
from kvwire.config import KVDtype, QuantMode
from kvwire.runtime import EngineConfig, load_engine

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")

GPU = "cuda"  # the device under test
PROMPTS = [list(range(5, 5 + n)) for n in (3, 17, 40, 90)] + [[40, 41, 42] * 11]
NEAR_TIE = {KVDtype.BF16: 0.01, KVDtype.FP8_E4M3: 0.05}  # logits; the embedded model's span about 30


def teacher_forced(eng, prompts, forced=None, steps=24):
    """Prefill ``prompts`` in one call, then ``steps`` decode steps of all sequences together, each
    fed ``forced[s][i]`` (or its own greedy choice). Returns per sequence the logits [steps + 1, vocab]
    (float32, on CPU) of the prompt's last position and of every step."""
    dev = eng.cfg.device
    cache = eng.new_cache(64)
    ids = list(range(len(prompts)))
    ends = torch.tensor([len(p) for p in prompts]).cumsum(0) - 1
    logits = eng.model(torch.tensor([t for p in prompts for t in p], device=dev),
                       cache.prepare(ids, [len(p) for p in prompts]), cache, logits_rows=ends.to(dev))
    out = [[row] for row in logits.float().cpu()]
    for i in range(steps):
        nxt = [int(o[-1].argmax()) if forced is None else forced[s][i] for s, o in enumerate(out)]
        logits = eng.model(torch.tensor(nxt, device=dev), cache.prepare(ids, [1] * len(ids)), cache)
        for s, row in enumerate(logits.float().cpu()):
            out[s].append(row)
    return [torch.stack(o) for o in out]


@pytest.mark.parametrize("kv", [KVDtype.BF16, KVDtype.FP8_E4M3], ids=["bf16-kv", "fp8-kv"])
@pytest.mark.parametrize("weights", [QuantMode.NONE, QuantMode.BF16], ids=["fp32", "bf16"])
def test_cuda_greedy_matches_cpu_step_for_step(weights, kv):
    cpu = load_engine(EngineConfig(model_dir=DEFAULT_MODEL_DIR, weights=weights, kv_dtype=kv))
    gpu = load_engine(EngineConfig(model_dir=DEFAULT_MODEL_DIR, weights=weights, kv_dtype=kv, device=GPU))
    assert gpu.fingerprint == cpu.fingerprint  # same weights, same page format: pages may move between them
    want = teacher_forced(cpu, PROMPTS)
    forced = [w[:-1].argmax(-1).tolist() for w in want]  # the CPU's greedy tokens
    got = teacher_forced(gpu, PROMPTS, forced)
    # bf16 weights: the CPU multiplies bf16 x fp32 with fp32 sums, cuBLAS rounds activations to bf16
    tol = {KVDtype.BF16: 0.05, KVDtype.FP8_E4M3: 0.25}[kv] if weights is QuantMode.NONE else 0.5
    diffs = [float((g - w).abs().max()) for w, g in zip(want, got)]
    choices = sum(int((g.argmax(-1) != w.argmax(-1)).sum()) for w, g in zip(want, got))
    print(f"\n{weights.value}/{kv.value}: largest logit difference per sequence {[round(d, 4) for d in diffs]}, "
          f"{choices} of {sum(len(w) for w in want)} greedy choices differ")
    for s, (w, g) in enumerate(zip(want, got)):
        assert (g - w).abs().max() < tol, f"sequence {s}: logits differ by {(g - w).abs().max():.4f}"
        top2 = w.topk(2, dim=-1).values
        gap = top2[:, 0] - top2[:, 1]
        differ = g.argmax(-1) != w.argmax(-1)
        margin = NEAR_TIE[kv] if weights is QuantMode.NONE else 0.5
        assert (gap[differ] < margin).all(), f"sequence {s}: GPU chose otherwise at steps {differ.nonzero().tolist()}"


def test_llm_on_cuda_generates_and_speculates_exactly():
    """The whole engine (scheduler, sampler, n-gram verification in one forward) on the GPU: greedy
    speculative output equals plain greedy output there, and every page comes back."""
    llm = LLM(DEFAULT_MODEL_DIR, weights="bf16", num_pages=256, device=GPU, speculative="ngram",
              num_speculative_tokens=5)
    llm.core.spec_cfg = dataclasses.replace(llm.core.spec_cfg, greedy_max_batch=0, auto_off=False)
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    plain = llm.generate(PROMPTS, dataclasses.replace(params, speculative="none"))
    ngram = llm.generate(PROMPTS, params)
    assert [o.token_ids for o in ngram] == [o.token_ids for o in plain]
    sampled = llm.generate(PROMPTS[:2], SamplingParams(max_tokens=16, temperature=0.8, seed=7, ignore_eos=True,
                                                       speculative="none"))
    assert all(len(o.token_ids) == 16 for o in sampled)
    assert llm.stats()["used"] == 0
