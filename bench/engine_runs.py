"""One engine configuration timed in a process of its own, so that its peak memory is its own.

    python -m bench.engine_runs '{"engine": "kvwire", "model_dir": "...", "weights": "int8", ...}'

Prints one line ``RESULT {json}``. Every engine is timed the same way on the same token ids:
  - prefill: one forward over ``prompt_len`` ids (logits of the last row only), tokens/s, the
    fastest of three passes after a warm-up pass over the same prompt (a first pass at a new length
    pays one-off costs: allocator growth, matmul primitives built for the shape);
  - batch-1 decode: ``decode_tokens`` greedy steps after that prompt, tokens/s;
  - batched decode at each batch size b: b sequences of ``batch_ctx`` ids prefilled in one call,
    then ``decode_tokens`` steps that advance all b together (one model call per step), b x steps / s;
  - peak RSS (/proc VmHWM) and the RSS after imports, before the model was loaded.
On a CUDA device (``"device": "cuda"``) every step ends by reading its tokens back (``tolist``),
which waits for the GPU, so the times are whole steps; the peak GPU memory is torch's allocator peak.
The decode phases run once after that warm-up (the caller repeats whole runs if it wants).
"""
from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch


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


def prompts(s: dict, vocab: int) -> tuple[list[int], list[list[int]]]:
    g = torch.Generator().manual_seed(s.get("seed", 0))
    main = torch.randint(3, vocab, (s["prompt_len"],), generator=g).tolist()
    ctx = [torch.randint(3, vocab, (s["batch_ctx"],), generator=g).tolist() for _ in range(max(s["batches"]))]
    return main, ctx


def linear_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes a decode step reads: every linear's stored weights (the embedding reads one row)."""
    return sum(t.numel() * t.element_size() for name, mod in model.named_modules()
               if name.endswith(("qkv", ".o", "gate_up", "down", "lm_head"))
               for t in list(mod.parameters()) + list(mod.buffers()))


def time_phases(prefill, decode, prompt: list[int], ctx: list[list[int]], s: dict) -> dict:
    """prefill(list of id lists) -> next ids (one per sequence); decode(ids) -> next ids."""
    from tqdm import tqdm
    bar = tqdm(total=2 + len(s["batches"]), desc=f"{s['engine']} {s['weights']} phases", leave=False)
    prefill([prompt]), decode([1])  # warm-up: allocator, kernels, lazy init, the prompt's shapes
    took = []
    for _ in range(3):
        t0 = time.perf_counter()
        nxt = prefill([prompt])
        took.append(time.perf_counter() - t0)
    t1 = time.perf_counter()
    bar.update()
    for _ in range(s["decode_tokens"]):
        nxt = decode(nxt)
    t2 = time.perf_counter()
    bar.update()
    res = {"prefill_tok_s": len(prompt) / min(took), "decode_tok_s": s["decode_tokens"] / (t2 - t1), "batched_tok_s": {}}
    for b in s["batches"]:
        nxt = prefill(ctx[:b])
        t = time.perf_counter()
        for _ in range(s["decode_tokens"]):
            nxt = decode(nxt)
        res["batched_tok_s"][str(b)] = b * s["decode_tokens"] / (time.perf_counter() - t)
        bar.update()
    bar.close()
    return res


def run_kvwire(s: dict) -> dict:
    from kvwire.config import KVDtype, QuantMode
    from kvwire.runtime import EngineConfig, load_engine
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
    import transformers
    dtype = torch.bfloat16 if s["weights"] == "bf16" else torch.float32
    from bench.hf_weights import hf_dir
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
        from bench.llamacpp import run_llamacpp
        res = run_llamacpp(s)
    gpu = {"peak_gpu_mb": torch.cuda.max_memory_allocated() / 2**20} if s.get("device", "cpu") != "cpu" else {}
    return {**res, **gpu, "baseline_rss_mb": base, "peak_rss_mb": rss_mb(), "threads": torch.get_num_threads()}


def main() -> None:
    print("RESULT " + json.dumps(run_spec(json.loads(sys.argv[1]))), flush=True)


if __name__ == "__main__":
    main()
