"""One engine configuration timed in a process of its own, so that its peak memory is its own.

    python -m bench.engine_runs '{"engine": "kvwire", "model_dir": "...", "weights": "int8", ...}'

Prints one line ``RESULT {json}``: the phases of ``bench.phases``, the peak RSS (/proc VmHWM) and
the RSS after imports, before the model was loaded. On a CUDA device every step ends by reading its
tokens back (``tolist``), which waits for the GPU, so the times are whole steps; the peak GPU memory
is torch's allocator peak.
"""
from __future__ import annotations

import json
import resource
import sys
from pathlib import Path

import torch

from bench.hf_weights import hf_dir
from bench.llamacpp import run_llamacpp
from bench.phases import prompts, time_phases
from kvwire.config import KVDtype, QuantMode
from kvwire.runtime import EngineConfig, load_engine


def rss_mb() -> float:
    """Peak resident set of this process in MB. /proc's VmHWM starts afresh at exec; getrusage's
    maxrss does not (it keeps the forking parent's peak), so it is only the fallback."""
    try:
        for line in open("/proc/self/status"):
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024  # KiB
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def linear_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads: every linear's stored weights (the embedding reads one row)."""
    return sum(t.numel() * t.element_size() for name, mod in model.named_modules()
               if name.endswith(("qkv", ".o", "gate_up", "down", "lm_head"))
               for t in list(mod.parameters()) + list(mod.buffers()))


def run_kvwire(s: dict) -> dict:
    dev = s.get("device", "cpu")
    eng = load_engine(EngineConfig(model_dir=Path(s["model_dir"]), weights=QuantMode(s["weights"]),
                                   kv_dtype=KVDtype(s["kv"]), device=dev))
    if not s.get("fused", True):
        eng.model.step_fn = None  # eager PyTorch ops, for comparison with the fused decode kernels
    prompt, ctx = prompts(s, eng.model_config.vocab_size)
    longest = max(s["prompt_len"], s["batch_ctx"]) + s["decode_tokens"] + 2
    pages = max(s["batches"]) * eng.spec.pages_for(longest) + 4
    state = {"cache": eng.new_cache(pages), "ids": []}  # one pool, reused as a server reuses its own

    def prefill(seqs: list[list[int]]) -> list[int]:
        cache = state["cache"]
        for i in state["ids"]:
            cache.free_sequence(i)  # the previous phase's pages go back to the pool
        ids = state["ids"] = list(range(len(seqs)))
        ends = torch.tensor([len(x) for x in seqs]).cumsum(0) - 1
        logits = eng.model(torch.tensor([t for x in seqs for t in x], device=dev),
                           cache.prepare(ids, [len(x) for x in seqs]), cache, logits_rows=ends.to(dev))  # [seqs, vocab]
        return logits.argmax(-1).tolist()

    def decode(tokens: list[int]) -> list[int]:
        cache, ids = state["cache"], state["ids"][:len(tokens)]
        logits = eng.model(torch.tensor(tokens, device=dev), cache.prepare(ids, [1] * len(ids)), cache)  # [n, vocab]
        return logits.argmax(-1).tolist()

    res = time_phases(prefill, decode, prompt, ctx, s)
    return {**res, "weight_bytes_per_token": linear_weight_bytes(eng.model)}


def run_transformers(s: dict) -> dict:
    import transformers  # a peer, never a runtime dependency (the bench extra)
    dtype = torch.bfloat16 if s["weights"] == "bf16" else torch.float32
    dev = s.get("device", "cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir(s["model_dir"]), dtype=dtype).eval().to(dev)
    prompt, ctx = prompts(s, hf.config.vocab_size)
    state = {}

    @torch.inference_mode()
    def prefill(seqs: list[list[int]]) -> list[int]:
        out = hf(input_ids=torch.tensor(seqs, device=dev), use_cache=True, logits_to_keep=1)  # equal lengths: no padding
        state["past"] = out.past_key_values
        return out.logits[:, -1].argmax(-1).tolist()

    @torch.inference_mode()
    def decode(tokens: list[int]) -> list[int]:
        out = hf(input_ids=torch.tensor(tokens, device=dev)[:, None], past_key_values=state["past"], use_cache=True)
        state["past"] = out.past_key_values
        return out.logits[:, -1].argmax(-1).tolist()

    res = time_phases(prefill, decode, prompt, ctx, s)
    wb = sum(m.weight.numel() * m.weight.element_size() for m in hf.modules() if isinstance(m, torch.nn.Linear))
    return {**res, "weight_bytes_per_token": wb}


def run_spec(s: dict) -> dict:
    torch.manual_seed(0)
    torch.set_num_threads(s["threads"])
    base = rss_mb()
    if s["engine"] == "kvwire":
        res = run_kvwire(s)
    elif s["engine"] == "transformers":
        res = run_transformers(s)
    else:
        res = run_llamacpp(s)
    gpu = {"peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20} if s.get("device", "cpu") != "cpu" else {}
    return {**res, **gpu, "baseline_rss_mb": base, "peak_rss_mb": rss_mb(), "threads": torch.get_num_threads()}


def main() -> None:
    print("RESULT " + json.dumps(run_spec(json.loads(sys.argv[1]))), flush=True)


if __name__ == "__main__":
    main()
