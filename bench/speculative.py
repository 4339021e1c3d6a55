"""Speculative decoding benchmark: batch-1 decode tokens/s for none, draft and ngram.

    python -m bench.speculative --max-tokens 96 --k 4

In process through the public engine API (``kvwire.LLM``: ``add_request`` + ``step``, no gRPC),
so the numbers isolate decoding: the first step prefills the prompt locally (what prefill_svc
would ship) and is not timed; only the decode steps after it are (the draft's prefill of the
prompt, which decode_svc runs too, included).
Two tasks on the embedded model pair:

* heldout: the start of each held-out pydoc topic (tools/train_embedded.py's split), continued;
* grounded: a long held-out passage pasted twice, the second copy cut short, so the model
  continues (repeats) text it has in its context: the case prompt lookup is for.

Greedy decoding, so every mode must produce the same tokens (checked and reported). Writes JSON and
a markdown table under bench/out/.
"""
from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from kvwire import LLM, SamplingParams
from kvwire.cli import DEFAULT_MODEL_DIR
from kvwire.config import KVDtype
from kvwire.tokenizer import ModelTokenizer

OUT = Path(__file__).parent / "out"


class Timer:
    """Adds up the time spent in a bound method (the runner's drafting and target forwards)."""

    def __init__(self, obj, name: str):
        self.seconds, inner = 0.0, getattr(obj, name)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t
        setattr(obj, name, timed)


@dataclass
class Run:
    tokens: list[int]
    seconds: float
    steps: int
    drafted: int
    accepted: int
    spec_steps: int
    t_draft: float
    t_target: float


@dataclass
class Row:
    task: str
    mode: str
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0
    drafted: int = 0
    accepted: int = 0
    spec_steps: int = 0
    t_draft: float = 0.0
    t_target: float = 0.0
    outputs: list = field(default_factory=list)

    def add(self, r: Run) -> None:
        self.tokens += len(r.tokens)
        self.seconds += r.seconds
        for f in ("steps", "drafted", "accepted", "spec_steps", "t_draft", "t_target"):
            setattr(self, f, getattr(self, f) + getattr(r, f))
        self.outputs.append(r.tokens)

    def summary(self, base: "Row | None") -> dict:
        tok_s = self.tokens / self.seconds
        return {"task": self.task, "mode": self.mode, "decode_tokens": self.tokens, "tok_s": round(tok_s, 1),
                "speedup": round(tok_s / (base.tokens / base.seconds), 2) if base else 1.0,
                "acceptance_rate": round(self.accepted / self.drafted, 3) if self.drafted else None,
                "accepted_per_step": round(self.accepted / self.spec_steps, 2) if self.spec_steps else None,
                "tokens_per_step": round(self.tokens / self.steps, 2),
                "ms_per_step": round(1e3 * self.seconds / self.steps, 2),
                "draft_ms_per_step": round(1e3 * self.t_draft / self.steps, 2),
                "target_ms_per_step": round(1e3 * self.t_target / self.steps, 2),
                "identical_to_none": None if base is None else self.outputs == base.outputs}


def decode_one(llm: LLM, timers: dict[str, Timer], prompt: list[int], mode: str, k: int, max_tokens: int) -> Run:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, speculative=mode, num_speculative_tokens=k or None)
    rid = llm.add_request(prompt, params)
    req = llm.core.requests[rid]  # its counters (steps, drafted, accepted) outlive the request
    llm.step()  # admission + local prefill: the first token, not timed
    for t in timers.values():
        t.seconds = 0.0
    t0 = time.perf_counter()
    while llm.has_unfinished():
        llm.step()
    seconds = time.perf_counter() - t0
    return Run(req.output_ids[1:], seconds, req.steps, req.drafted, req.accepted, req.spec_steps,
               timers["draft"].seconds, timers["target"].seconds)


def build_prompts(tok: ModelTokenizer, n: int, prompt_len: int, passage_len: int, cut: int):
    from tools.train_embedded import load_corpus
    _, held, names = load_corpus()
    heldout, grounded = [], []
    for text in held[:n]:
        ids = tok.encode(text)
        heldout.append(ids[:prompt_len])
        passage = ids[1:1 + passage_len]
        grounded.append(ids[:1] + passage + tok.encode("\n\n", add_special_tokens=False) + passage[:cut])
    return {"heldout": heldout, "grounded": grounded}, names[:n]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--draft-model-dir", type=Path, default=DEFAULT_MODEL_DIR.parent / "kvwire-tiny-draft")
    ap.add_argument("--kv-dtype", choices=[d.value for d in KVDtype], default=KVDtype.FP8_E4M3.value)
    ap.add_argument("--draft-kv-dtype", choices=[d.value for d in KVDtype], default=KVDtype.BF16.value)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens for draft")
    ap.add_argument("--ngram-k", type=int, default=8, help="num_speculative_tokens for ngram")
    ap.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--prompts", type=int, default=8, help="held-out topics used (8 are held out)")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--passage-len", type=int, default=320, help="grounded task: tokens pasted")
    ap.add_argument("--cut", type=int, default=16, help="grounded task: tokens of the second copy given")
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (tiny matmuls gain nothing from more)")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    llm = LLM(args.model_dir, kv_dtype=args.kv_dtype, num_pages=256, draft_model=args.draft_model_dir,
              draft_kv_dtype=args.draft_kv_dtype, speculative_adaptive=args.adaptive)
    llm.core.runner.warm_up()
    timers = {"draft": Timer(llm.core.runner, "propose"), "target": Timer(llm.core.runner, "step")}
    prompts, names = build_prompts(ModelTokenizer(args.model_dir), args.prompts, args.prompt_len,
                                   args.passage_len, args.cut)
    plan = [("heldout", "none", 0), ("heldout", "draft", args.k), ("heldout", "ngram", args.ngram_k),
            ("grounded", "none", 0), ("grounded", "draft", args.k), ("grounded", "ngram", args.ngram_k)]
    rows = {(t, m): Row(t, m) for t, m, _ in plan}
    for task, mode, k in plan:  # one untimed warm-up decode per configuration
        decode_one(llm, timers, prompts[task][0], mode, k, 8)
    total = sum(len(prompts[t]) for t, _, _ in plan)
    with tqdm(total=total, desc="decoding", unit="run") as bar:
        for i in range(args.prompts):  # modes interleaved per prompt: machine noise hits all alike
            for task, mode, k in plan:
                rows[task, mode].add(decode_one(llm, timers, prompts[task][i], mode, k, args.max_tokens))
                bar.update(1)
    results = [rows[t, m].summary(None if m == "none" else rows[t, "none"]) for t, m, _ in plan]
    meta = {"model_dir": str(args.model_dir), "draft_model_dir": str(args.draft_model_dir),
            "kv_dtype": args.kv_dtype, "draft_kv_dtype": args.draft_kv_dtype, "k_draft": args.k,
            "k_ngram": args.ngram_k, "adaptive_k": args.adaptive, "max_tokens": args.max_tokens,
            "prompt_len": args.prompt_len, "passage_len": args.passage_len, "threads": args.threads,
            "heldout_topics": names, "torch": torch.__version__}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "speculative.json").write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")
    cols = ["task", "mode", "tok_s", "speedup", "acceptance_rate", "accepted_per_step", "tokens_per_step",
            "ms_per_step", "draft_ms_per_step", "target_ms_per_step", "identical_to_none"]
    md = [f"# Speculative decoding, batch 1 (greedy, {args.max_tokens} tokens, k draft {args.k} / ngram "
          f"{args.ngram_k}, adaptive {args.adaptive}, KV {args.kv_dtype}, {args.threads} threads)", "",
          "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in results]
    (args.out / "speculative.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
