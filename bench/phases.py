"""The phases every engine of ``python -m bench engine`` is timed in, on the same token ids.

Method and details: bench/README.md, section ``bench/phases.py``.
"""
from __future__ import annotations

import time

import torch
from tqdm import tqdm


def prompts(s: dict, vocab: int) -> tuple[list[int], list[list[int]]]:
    g = torch.Generator().manual_seed(s.get("seed", 0))
    main = torch.randint(3, vocab, (s["prompt_len"],), generator=g).tolist()
    ctx = [torch.randint(3, vocab, (s["batch_ctx"],), generator=g).tolist() for _ in range(max(s["batches"]))]
    return main, ctx


def time_phases(prefill, decode, prompt: list[int], ctx: list[list[int]], s: dict) -> dict:
    """prefill(list of id lists) -> next ids (one per sequence); decode(ids) -> next ids."""
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
