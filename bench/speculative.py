"""Speculative decoding benchmark: decode tokens/s of none, ngram and draft, side by side in one run.

    python -m bench speculative --model smollm2-135m-instruct            # n-gram, and the shipped draft head
    python -m bench speculative                                          # embedded pair: ngram + draft
    python -m bench speculative --model-dir DIR --draft-model-dir DRAFT --batches 1,8 --prompts 12

In process through the public engine API (``kvwire.LLM``: ``add_request`` + ``step``, no gRPC),
so the numbers isolate decoding: the first step admits and prefills the prompts (what prefill_svc
would ship) and is not timed; the decode steps after it are (drafting included). Prompt sets
(bench/prompts_spec.py): grounded (code editing, quoting from and summarizing a pasted document)
and free chat. Greedy, stopping at EOS or ``--max-tokens``; every mode must produce plain greedy's
tokens (checked and reported). ``--temperature T`` samples instead (``--seeded``: each prompt with
a seed of its own, which makes speculation ignore the batch): speculation keeps plain sampling's
distribution, not its tokens, so outputs are not compared, every request runs to ``--max-tokens``
(EOS ignored: equal lengths in every mode), and neither the lookup ceiling nor the transformers peer
(greedy) is run. Each mode runs on the same prompts interleaved, so machine noise
hits all alike; speedups are against plain decode of the same run. Batch b steps b requests
together (throughput). Acceptance rate = accepted / proposed tokens; proposed / accepted per
spec step: per verification step; tokens per step = decode tokens / decode steps, per request;
turned_off / turned_on = requests whose speculation turned itself off / back on (SpecConfig).
With batch 1 and plain decoding in the run, the report adds prompt lookup's ceiling
(bench/lookup_ceiling.py): the plain outputs replayed with an oracle that proposes exactly what
greedy decoding then emits, at the row prices the engine measured in the run.
Greedy requests speculate only in steps of at most ``--greedy-max-batch`` requests
(SpecConfig.greedy_max_batch; 0 = any, to measure larger batches).

Peer: transformers' prompt lookup (``prompt_lookup_num_tokens``) and assisted generation (with
the draft) on the same prompts and the same weights (float32; a GGUF is exported to an HF
directory first, bench/hf_weights.py), batch 1, speedup against its own plain ``generate``.
Writes bench/out/speculative-<model>-<stamp>.{json,md}.
"""
from __future__ import annotations

import argparse
import dataclasses
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from bench import common, lookup_ceiling, prompts_spec
from kvwire import LLM, SamplingParams
from kvwire.config import DEFAULT_MODEL_DIR
from kvwire.config import KVDtype, QuantMode
from kvwire.model.draft_head import is_draft_head, shipped_head
from kvwire.spec import SpecConfig, Tuned


class Timer:
    """Adds up the time spent in a bound method (the draft's drafting, the runner's target forwards);
    ``obj`` None: nothing to time (no draft)."""

    def __init__(self, obj, name: str):
        self.seconds = 0.0
        if obj is None:
            return
        inner = getattr(obj, name)

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return inner(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - t
        setattr(obj, name, timed)


@dataclass
class Row:
    task: str
    batch: int
    mode: str
    tokens: int = 0
    seconds: float = 0.0
    steps: int = 0  # decode steps (a batch's step counts once)
    req_steps: int = 0  # decode steps summed over requests
    drafted: int = 0
    accepted: int = 0
    spec_steps: int = 0
    turned_off: int = 0
    turned_on: int = 0
    requests: int = 0
    t_draft: float = 0.0
    t_target: float = 0.0
    outputs: list = field(default_factory=list)
    prompts: list = field(default_factory=list)

    def summary(self, base: "Row | None") -> dict:
        tok_s = self.tokens / self.seconds if self.seconds else 0.0
        return {"task": self.task, "batch": self.batch, "mode": self.mode, "decode_tokens": self.tokens,
                "tok_s": round(tok_s, 1),
                "speedup": round(tok_s / (base.tokens / base.seconds), 2) if base else 1.0,
                "acceptance_rate": round(self.accepted / self.drafted, 3) if self.drafted else None,
                "accepted_per_spec_step": round(self.accepted / self.spec_steps, 2) if self.spec_steps else None,
                "proposed_per_spec_step": round(self.drafted / self.spec_steps, 2) if self.spec_steps else None,
                "tokens_per_step": round(self.tokens / self.req_steps, 2) if self.req_steps else None,
                "turned_off": f"{self.turned_off}/{self.requests}", "turned_on": f"{self.turned_on}/{self.requests}",
                "ms_per_step": round(1e3 * self.seconds / self.steps, 2) if self.steps else None,
                "draft_ms_per_step": round(1e3 * self.t_draft / self.steps, 2) if self.steps else None,
                "target_ms_per_step": round(1e3 * self.t_target / self.steps, 2) if self.steps else None,
                "identical_to_none": None if base is None else self.outputs == base.outputs}


def decode(llm: LLM, timers: dict[str, Timer], row: Row, prompts: list[list[int]], mode: str, k: int,
           max_tokens: int, temperature: float = 0.0, seeded: bool = False, top_p: float = 1.0) -> None:
    """Run ``prompts`` as one batch; add the decode-phase counts to ``row``. With a temperature and
    ``seeded``, each prompt samples with a seed of its own (the same in every mode and repeat); a
    sampled request ignores EOS, so every mode decodes the same number of tokens per request (its
    own draws would otherwise end requests at other lengths and leave a batch's steps fuller or
    emptier by chance)."""
    def params(p: list[int]) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, speculative=mode, num_speculative_tokens=k or None,
                              temperature=temperature, top_p=top_p, ignore_eos=bool(temperature),
                              seed=zlib.crc32(repr(p).encode()) if seeded else None)
    reqs = [llm.core.requests[llm.add_request(p, params(p))] for p in prompts]  # counters outlive the request
    llm.step()  # admission + local prefill: the first tokens, not timed
    for t in timers.values():
        t.seconds = 0.0
    steps, t0 = 0, time.perf_counter()
    while llm.has_unfinished():
        llm.step()
        steps += 1
    row.seconds += time.perf_counter() - t0
    row.steps += steps
    row.t_draft += timers["draft"].seconds
    row.t_target += timers["target"].seconds
    for r in reqs:
        row.tokens += len(r.output_ids) - 1
        row.req_steps += r.steps
        if r.spec is not None:
            s = r.spec
            row.drafted, row.accepted, row.spec_steps = row.drafted + s.drafted, row.accepted + s.accepted, \
                row.spec_steps + s.spec_steps
            row.turned_off += s.turned_off > 0
            row.turned_on += s.turned_on > 0
        row.requests += 1
        row.outputs.append(r.output_ids)
        row.prompts.append(r.prompt)


def batches_of(prompts: list[list[int]], b: int) -> list[list[list[int]]]:
    """Groups of b prompts (cycling through the set when it has fewer)."""
    n = max(len(prompts), b)
    return [[prompts[(i + j) % len(prompts)] for j in range(b)] for i in range(0, n - b + 1, b)] or [prompts[:b]]


def transformers_peer(model_path: Path, draft_dir: Path | None, prompts: dict, k: int, max_tokens: int,
                      eos: list[int]) -> list[dict]:
    """Batch-1 decode tok/s of transformers' plain, prompt-lookup and assisted generate, float32."""
    import transformers
    from bench.hf_weights import hf_dir
    transformers.logging.set_verbosity_error()
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir(model_path), dtype=torch.float32).eval()
    assistant = transformers.AutoModelForCausalLM.from_pretrained(hf_dir(draft_dir)).eval() if draft_dir else None
    modes = {"none": {}, "ngram": {"prompt_lookup_num_tokens": k}}
    if assistant is not None:
        modes["draft"] = {"assistant_model": assistant}
    out = []

    def gen(ids, n, kw):
        t = time.perf_counter()
        with torch.no_grad():
            o = hf.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=eos,
                            pad_token_id=eos[0] if eos else 0, **kw)
        return time.perf_counter() - t, o[0, len(ids):].tolist()

    for task, ps in prompts.items():
        acc = {m: [0, 0.0, []] for m in modes}
        for ids in tqdm(ps, desc=f"transformers {task}", unit="prompt"):
            first, _ = gen(ids, 1, {})  # prefill + first token: subtracted from every mode's time
            for m, kw in modes.items():
                t, toks = gen(ids, max_tokens, kw)
                acc[m][0] += len(toks) - 1
                acc[m][1] += max(t - first, 1e-9)
                acc[m][2].append(toks)
        base = acc["none"][0] / acc["none"][1]
        for m, (n, s, outs) in acc.items():
            out.append({"task": task, "mode": m, "decode_tokens": n, "tok_s": round(n / s, 1),
                        "speedup": round(n / s / base, 2), "identical_to_none": outs == acc["none"][2]})
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench speculative", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="a registered model name (python -m tools.fetch_model --list)")
    src.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR, help="an HF directory or a .gguf")
    ap.add_argument("--draft-model-dir", type=Path, default=None,
                    help="draft model (default: <model-dir>-draft beside the model when it exists; none: "
                         "the draft mode is skipped)")
    ap.add_argument("--modes", default="none,ngram,draft", help="comma list of none, ngram, draft")
    ap.add_argument("--weights", choices=[m.value for m in QuantMode], default=QuantMode.INT8.value)
    ap.add_argument("--kv-dtype", choices=[d.value for d in KVDtype], default=KVDtype.FP8_E4M3.value)
    ap.add_argument("--draft-kv-dtype", choices=[d.value for d in KVDtype], default=KVDtype.BF16.value)
    ap.add_argument("--k", type=int, default=4, help="num_speculative_tokens for draft")
    ap.add_argument("--ngram-k", type=int, default=8, help="num_speculative_tokens for ngram")
    ap.add_argument("--adaptive", action=argparse.BooleanOptionalAction, default=True, help="adapt k per request")
    ap.add_argument("--auto-off", action=argparse.BooleanOptionalAction, default=True,
                    help="speculation turns itself off per request at low acceptance (SpecConfig)")
    ap.add_argument("--greedy-max-batch", type=int, default=SpecConfig.greedy_max_batch,
                    help="greedy requests speculate only in steps of at most this many requests (0: any)")
    ap.add_argument("--tasks", default="grounded,chat")
    ap.add_argument("--prompts", type=int, default=6, help="prompts per task")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=0.0,
                    help="0: greedy (outputs checked against plain); above: sampling (distributions match "
                         "plain, tokens do not; no ceiling, no peer)")
    ap.add_argument("--top-p", type=float, default=1.0, help="with --temperature: nucleus sampling")
    ap.add_argument("--seeded", action="store_true",
                    help="with --temperature: a seed per prompt (speculation then ignores the batch: "
                         "SamplingParams.batch_aware); default unseeded, as most clients send")
    ap.add_argument("--repeats", type=int, default=1, help="run every group this many times (less noise)")
    ap.add_argument("--context", type=int, default=400, help="grounded: tokens of pasted document at most")
    ap.add_argument("--peers", default="transformers", help="'transformers' or '' (none)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads, ours and the peer's")
    ap.add_argument("--out", type=Path, default=common.OUT)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = Path(args.model) if args.model else args.model_dir
    draft = args.draft_model_dir
    if draft is None and args.model is None and (model.parent / f"{model.name}-draft").is_dir():
        draft = model.parent / f"{model.name}-draft"
    if draft is None and args.model is not None:
        draft = shipped_head(args.model)  # the draft head trained for it (models/), if any
    modes = [m for m in args.modes.split(",") if m and (m != "draft" or draft is not None)]
    k_of = {"none": 0, "ngram": args.ngram_k, "draft": args.k}

    llm = LLM(model, weights=args.weights, kv_dtype=args.kv_dtype, num_pages=2048, draft_model=draft,
              draft_kv_dtype=args.draft_kv_dtype, speculative_adaptive=args.adaptive,
              speculative_auto_off=args.auto_off)
    llm.core.spec_cfg = dataclasses.replace(llm.core.spec_cfg, greedy_max_batch=args.greedy_max_batch)
    llm.core.runner.warm_up()
    tok = llm.tokenizer
    texts = {"grounded": prompts_spec.grounded(tok, args.prompts, args.context),
             "chat": prompts_spec.chat(args.prompts)}
    prompts = {t: [prompts_spec.encode(tok, x) for x in texts[t]] for t in args.tasks.split(",")}
    timers = {"draft": Timer(llm.core.draft, "draft"), "target": Timer(llm.core.runner, "step")}
    batches = [int(b) for b in args.batches.split(",")]
    rows = {(t, b, m): Row(t, b, m) for t in prompts for b in batches for m in modes}
    for m in modes:  # one untimed warm-up decode per mode
        decode(llm, timers, Row("warm", 1, m), [prompts[next(iter(prompts))][0]], m, k_of[m], 8, args.temperature,
               args.seeded, args.top_p)
    plan = [(t, b, group) for _ in range(args.repeats) for t in prompts for b in batches
            for group in batches_of(prompts[t], b)]
    with tqdm(total=len(plan) * len(modes), desc="decoding", unit="run") as bar:
        for t, b, group in plan:
            for m in modes:  # modes interleaved per group: machine noise hits all alike
                decode(llm, timers, rows[t, b, m], group, m, k_of[m], args.max_tokens, args.temperature,
                       args.seeded, args.top_p)
                bar.update(1)
    results = [rows[t, b, m].summary(None if m == "none" else rows[t, b, "none"])
               for t in prompts for b in batches for m in modes]
    if args.temperature:  # sampled: the same distribution as plain, not the same tokens
        results = [{**r, "identical_to_none": None} for r in results]
    # what 1, 2, .. proposals of one request added to a step, in its plain steps, as the engine measured (StepCost)
    cost = llm.core.runner.step_cost
    row_cost = {b: [None if (c := cost.extra(b, i)) is None else round(c, 2) for i in range(1, 9)] for b in batches}
    # prompt lookup's best case at these row prices, replayed over the plain outputs (bench/lookup_ceiling.py)
    ceilings = {}
    if 1 in batches and "none" in modes and not args.temperature:
        extra, spec = cost.extras(1, args.ngram_k, Tuned.ngram_cost), llm.core.spec_cfg
        for t in prompts:
            base = rows[t, 1, "none"]
            ceilings[t] = {lk: round(lookup_ceiling.ceiling(list(zip(base.prompts, base.outputs)), extra, args.ngram_k,
                                                            spec.ngram_max, spec.ngram_min, lk), 2)
                           for lk in ("latest", "any_match")}
    peer = []
    if args.peers == "transformers" and not args.temperature:
        try:
            eos = sorted(llm.core.eos_ids)
            # transformers' assisted generation takes a draft model, not a head on the target's states
            peer = transformers_peer(model, draft if "draft" in modes and not is_draft_head(draft) else None,
                                     {t: ps for t, ps in prompts.items()},
                                     args.ngram_k, args.max_tokens, eos)
        except Exception as e:  # a peer failure must not lose our own numbers
            peer = [{"error": repr(e)}]
    report = {"benchmark": "speculative", "model": model.stem if model.suffix == ".gguf" else model.name,
              "draft": str(draft) if draft else None, "weights": args.weights, "kv_dtype": args.kv_dtype,
              "draft_kv_dtype": args.draft_kv_dtype, "k_draft": args.k, "k_ngram": args.ngram_k,
              "adaptive": args.adaptive, "auto_off": args.auto_off, "greedy_max_batch": args.greedy_max_batch,
              "max_tokens": args.max_tokens, "temperature": args.temperature,
              "top_p": args.top_p, "seeded": bool(args.temperature and args.seeded), "repeats": args.repeats,
              "measured_row_cost": row_cost,
              "ngram_ceiling": ceilings,
              "threads": args.threads, "prompts": {t: len(ps) for t, ps in prompts.items()},
              "prompt_tokens_mean": {t: round(sum(map(len, ps)) / len(ps)) for t, ps in prompts.items()},
              "torch": torch.__version__, "results": results, "transformers": peer}
    common.save(report, markdown(report), args.out)
    return report


def markdown(report: dict) -> str:
    cols = ["task", "batch", "mode", "tok_s", "speedup", "acceptance_rate", "proposed_per_spec_step",
            "accepted_per_spec_step", "tokens_per_step", "turned_off",
            "turned_on", "ms_per_step", "draft_ms_per_step", "target_ms_per_step", "identical_to_none"]
    t = report.get("temperature", 0.0)
    top_p = f", top-p {report['top_p']}" if report.get("top_p", 1.0) < 1.0 else ""
    how = (f"sampled at temperature {t}{top_p} ({'a seed per prompt' if report.get('seeded') else 'unseeded'})"
           if t else "greedy")
    lines = [f"Model {report['model']}, {report['weights']} weights, KV {report['kv_dtype']}, {how}, up to "
             f"{report['max_tokens']} tokens, {report['repeats']} repeat(s), k ngram {report['k_ngram']} / draft "
             f"{report['k_draft']}, adaptive "
             f"{report['adaptive']}, auto-off {report['auto_off']}, greedy max batch {report['greedy_max_batch']}, "
             f"{report['threads']} thread(s); prompts per task "
             f"{report['prompts']} (mean prompt tokens {report['prompt_tokens_mean']}). Speedup: decode tokens/s "
             "against plain decode in the same run; tokens_per_step per request. 1, 2, .. 8 proposals added "
             f"{report['measured_row_cost']} plain steps to a step (by batch size, as the engine measured them).", "",
             common.table(cols, [[r[c] for c in cols] for r in report["results"]])]
    if report.get("ngram_ceiling"):
        lines += ["", "Prompt lookup's ceiling at batch 1 (bench/lookup_ceiling.py: an oracle proposing exactly the "
                  "lookup tokens greedy decoding then emits, at the row prices above, replayed over the plain "
                  "outputs): " + "; ".join(f"{t} {c['latest']}x (the engine's lookup), {c['any_match']}x "
                                           "(best of every earlier match)" for t, c in report["ngram_ceiling"].items())]
    peer = report.get("transformers") or []
    if peer and "error" in peer[0]:
        lines += ["", f"transformers: {peer[0]['error']}"]
    elif peer:
        pc = ["task", "mode", "tok_s", "speedup", "identical_to_none"]
        lines += ["", "transformers (float32, batch 1; ngram = prompt_lookup_num_tokens, draft = assistant_model):",
                  "", common.table(pc, [[r[c] for c in pc] for r in peer])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
