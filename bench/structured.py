"""Structured output's cost: the grammar engines at our vocabulary, and the engine's step time with and
without a constrained request in the batch.

    python -m bench structured [--model smollm2-135m-instruct] [--weights gguf] [--batch 4] [--steps 40]

1. Backends (docs/decisions/063-structured-output.md): xgrammar and llguidance on the model's
   tokenizer, a typical JSON Schema: compile time (fresh compiler state, median of --compiles) and
   the per-step mask time (fill the next-token bitmask) along a fixed document of the schema.
2. Engine: decode step time (median, steps where every request is decoding) for ``--batch`` plain
   greedy requests, ``--batch`` + 1 plain, and ``--batch`` plain + 1 constrained by a JSON Schema;
   the unconstrained requests' tokens must be the same with and without the constrained neighbour.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from bench import common

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "city": {"type": "string", "enum": ["Paris", "London", "Tokyo"]},
    "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 3}},
    "required": ["name", "age", "city", "tags"], "additionalProperties": False}
DOCUMENT = {"name": "Alice Smith", "age": 31, "city": "Paris", "tags": ["a", "bb"]}
# a constraint that keeps the request decoding through the measured steps: it cannot end before
# 64 strings (at least 3 tokens each)
LONG = {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 64}


def backends(tok, compiles: int) -> dict:
    """Compile and per-step mask times of both engines on ``tok`` (a ModelTokenizer)."""
    import llguidance as llg
    import llguidance.torch as llgt
    import xgrammar as xgr

    from kvwire.grammar import vocab_type

    n = tok.vocab_size
    eos = sorted(tok.eos_ids)
    ids = tok.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    vocab = [""] * n
    for text, i in tok.tok.get_vocab(with_added_tokens=True).items():
        vocab[i] = text
    info = xgr.TokenizerInfo(vocab, getattr(xgr.VocabType, vocab_type(json.loads(tok.tok.to_str()))),
                             vocab_size=n, stop_token_ids=eos)
    lt = llg.LLTokenizer(tok.tok.to_str(), n_vocab=n, eos_token=eos[0])
    out = {}

    def xg():
        c = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        t0 = time.perf_counter()
        g = c.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, strict_mode=True)
        compile_s = time.perf_counter() - t0
        m, bm = xgr.GrammarMatcher(g), xgr.allocate_token_bitmask(1, n)
        return compile_s, lambda: m.fill_next_token_bitmask(bm, 0), m.accept_token

    def lg():
        t0 = time.perf_counter()
        g = llg.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA), defaults={
            "whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "})
        m = llg.LLMatcher(lt, g)
        compile_s = time.perf_counter() - t0
        bm = llgt.allocate_token_bitmask(1, n)
        return compile_s, lambda: llgt.fill_next_token_bitmask(m, bm, 0), m.consume_token

    for name, make in (("xgrammar", xg), ("llguidance", lg)):
        compile_ms, mask_us = [], []
        for _ in range(compiles):
            compile_s, fill, accept = make()
            compile_ms.append(compile_s * 1e3)
            for t in [*ids, eos[0]]:
                t0 = time.perf_counter()
                fill()
                mask_us.append((time.perf_counter() - t0) * 1e6)
                if not accept(t):
                    raise RuntimeError(f"{name} refused token {t} of the schema's own document")
        out[name] = {"compile_ms": statistics.median(compile_ms), "mask_us": common.stats(mask_us),
                     "tokens": len(ids) + 1}
    return out


def mask_row(llm, reps: int = 200) -> dict:
    """What a constrained row costs beside the fill: ``Matcher.mask`` (a float32 copy of the row and
    the bitmask applied), at the model's vocabulary, in microseconds."""
    import torch

    from kvwire.sampling_params import StructuredKind, StructuredOutput

    m = llm.core.grammars.matcher(StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(SCHEMA)), {0})
    row = torch.randn(llm.core.grammars.vocab_size)
    m.fill()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        m._filled = True  # the same filled mask each time: the copy and the apply are what is timed
        m.mask(row)
        times.append((time.perf_counter() - t0) * 1e6)
    return common.stats(times)


def engine_steps(llm, prompt: list[int], batch: int, steps: int, rounds: int) -> dict:
    from kvwire.sampling_params import SamplingParams, StructuredKind, StructuredOutput

    plain = SamplingParams(max_tokens=steps + 8, ignore_eos=True)
    constrained = SamplingParams(max_tokens=steps + 8, structured=StructuredOutput(StructuredKind.JSON_SCHEMA,
                                                                                   json.dumps(LONG)))
    llm.generate(prompt, SamplingParams(max_tokens=4, structured=constrained.structured))  # compile + warm
    configs = {"plain": [plain] * batch, "plain+1": [plain] * (batch + 1),
               "plain+constrained": [plain] * batch + [constrained]}
    times: dict[str, list[float]] = {k: [] for k in configs}
    tokens: dict[str, list[list[int]]] = {}
    for _ in range(rounds):  # interleaved: a shared machine's load drifts over the run
        for label, params in configs.items():
            times[label] += run_batch(llm, prompt, params, tokens.setdefault(label, []))
    same = tokens["plain"][:batch] == tokens["plain+constrained"][:batch]
    return {"rows": {k: {"step_ms": common.stats(v)} for k, v in times.items()}, "neighbours_unchanged": same}


def run_batch(llm, prompt: list[int], params: list, plain_tokens: list[list[int]]) -> list[float]:
    """Step times (ms) while every request decodes one token a step; the first requests' tokens
    into ``plain_tokens`` (first call only)."""
    rids = [llm.add_request(prompt, p) for p in params]
    times, tokens = [], {r: [] for r in rids}
    while llm.has_unfinished():
        t0 = time.perf_counter()
        outs = llm.step()
        dt = time.perf_counter() - t0
        for o in outs:
            tokens[o.request_id] += o.token_ids
        running = llm.core.scheduler.running.values()
        if len(outs) == len(rids) and all(len(o.token_ids) == 1 for o in outs) and \
                all(r.prefill_tokens is None for r in running):
            times.append(dt * 1e3)
    if not plain_tokens:
        plain_tokens += [tokens[r] for r in rids]
    return times


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct", help="model dir or registered name")
    ap.add_argument("--weights", default="gguf")
    ap.add_argument("--batch", type=int, default=4, help="plain requests decoding together")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--compiles", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=3, help="times each batch runs, interleaved")
    ap.add_argument("--out", type=Path, default=common.OUT)
    args = ap.parse_args(argv)
    from kvwire import LLM
    from kvwire.tokenizer import ChatMessage

    llm = LLM(args.model, weights=args.weights, num_pages=1024)
    prompt = llm.encode(llm.tokenizer.apply_chat_template([ChatMessage("user", "List a few names as JSON.")]))
    report = {"benchmark": "structured", "model": Path(args.model).name, "weights": args.weights,
              "vocab_size": llm.tokenizer.vocab_size, "batch": args.batch, "steps": args.steps, "rounds": args.rounds,
              "schema": SCHEMA, "backends": backends(llm.tokenizer, args.compiles),
              "mask_row_us": mask_row(llm), "engine": engine_steps(llm, prompt, args.batch, args.steps, args.rounds)}
    common.save(report, markdown(report), args.out)
    return report


def markdown(r: dict) -> str:
    b = r["backends"]
    t1 = common.table(["engine", "compile ms (median)", "mask us p50", "mask us p99", "mask us mean"],
                      [[k, common.fmt(v["compile_ms"], 2), common.fmt(v["mask_us"]["p50"]),
                        common.fmt(v["mask_us"]["p99"]), common.fmt(v["mask_us"]["mean"])] for k, v in b.items()])
    e = r["engine"]["rows"]
    t2 = common.table(["batch", "step ms p50", "step ms mean", "steps", "vs plain+1"],
                      [[k, common.fmt(v["step_ms"]["p50"], 2), common.fmt(v["step_ms"]["mean"], 2), v["step_ms"]["n"],
                        common.ratio(v["step_ms"]["p50"], e["plain+1"]["step_ms"]["p50"])] for k, v in e.items()])
    return (f"Structured output, model {r['model']} ({r['weights']}, vocabulary {r['vocab_size']}).\n\n"
            f"Grammar engines, a {len(r['schema']['properties'])}-property JSON Schema:\n\n{t1}\n\n"
            f"Masking a constrained row (copy + apply, xgrammar): p50 {common.fmt(r['mask_row_us']['p50'])} us, "
            f"p99 {common.fmt(r['mask_row_us']['p99'])} us.\n\n"
            f"Decode steps, {r['batch']} plain greedy requests (+1 plain, or +1 JSON-Schema constrained):\n\n{t2}\n\n"
            f"Plain requests' tokens unchanged beside the constrained one: {r['engine']['neighbours_unchanged']}\n")


if __name__ == "__main__":
    main()
