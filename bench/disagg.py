"""Disaggregated path against in-process generation: TTFT, inter-token latency, KV bytes on the wire.

    python -m bench disagg [--prompt-lens 128,512,1024] [--gen 32] [--repeats 3]
    python -m bench disagg --model smollm2-135m-instruct --weights int8 --speculative ngram

Method and details: bench/README.md, section ``bench/disagg.py``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import grpc
import torch

from bench import common
from kvwire import LLM, SamplingParams
from kvwire.config import DEFAULT_MODEL_DIR
from kvwire.threads import usable_cpus
from kvwire.tokenizer import ModelTokenizer
from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc as pbg
from tools.stack import Stack, split_cpus
from tools.train_embedded import load_corpus

OUT = common.OUT


def prompt_ids(tok: ModelTokenizer, n: int) -> list[int]:
    _, held, _ = load_corpus()
    ids = [t for text in held for t in tok.encode(text, add_special_tokens=False)]
    return ids[:n]


async def served(addr: str, ids: list[int], gen: int, kv_source: int = pb.KV_SOURCE_REMOTE) -> tuple[float, list[float]]:
    """(TTFT, inter-token gaps) of one token-level request through decode_svc's GenerateTokens,
    its prompt prefilled on prefill_svc (KV_SOURCE_REMOTE) or inside decode_svc (KV_SOURCE_LOCAL)."""
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = pbg.DecodeServiceStub(ch)
        t0 = time.perf_counter()
        stamps = []
        async for msg in stub.GenerateTokens(pb.GenerateTokensRequest(
                prompt_token_ids=ids, sampling=pb.SamplingParams(max_tokens=gen, ignore_eos=True),
                kv_source=kv_source)):
            stamps += [time.perf_counter()] * len(msg.token_ids)
    return stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:])]


async def front_door(addr: str, text: str, gen: int) -> float:
    async with grpc.aio.insecure_channel(addr) as ch:
        t0 = time.perf_counter()
        async for msg in pbg.TokenizerServiceStub(ch).GenerateText(pb.GenerateTextRequest(
                text=text, sampling=pb.SamplingParams(max_tokens=gen, ignore_eos=True))):
            if msg.token_ids:
                return time.perf_counter() - t0
    return float("nan")


async def kv_bytes(addr: str, ids: list[int]) -> int:
    async with grpc.aio.insecure_channel(addr) as ch:
        total = 0
        async for msg in pbg.PrefillServiceStub(ch).Prefill(pb.PrefillRequest(token_ids=ids)):
            if msg.WhichOneof("kind") == "chunk":
                c = msg.chunk
                total += len(c.k_values) + len(c.v_values) + len(c.k_scales) + len(c.v_scales)
        return total


def decode_flags(args) -> list[str]:
    """decode_svc's speculative flags: none by default; draft flags only when a draft is asked for."""
    if args.speculative == "none":
        return []
    flags = ["--speculative", args.speculative, "--num-speculative-tokens", str(args.num_speculative_tokens)]
    if args.speculative == "draft" and args.draft_model_dir is not None:
        flags += ["--draft-model-dir", str(args.draft_model_dir)]
    return flags


def in_process(llm: LLM, ids: list[int], gen: int) -> tuple[float, list[float]]:
    t0 = time.perf_counter()
    stamps = []
    for delta in llm.stream(ids, SamplingParams(max_tokens=gen, ignore_eos=True)):
        stamps += [time.perf_counter()] * len(delta.token_ids)
    return stamps[0] - t0, [b - a for a, b in zip(stamps, stamps[1:])]


def service_threads() -> int:
    """The compute threads decode_svc gets from tools.stack.Stack on this machine."""
    return int(os.environ["OMP_NUM_THREADS"]) if "OMP_NUM_THREADS" in os.environ else split_cpus(usable_cpus())["decode_svc"]


def in_process_with_threads(llm: LLM, ids: list[int], gen: int, repeats: int, threads: int) -> list:
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return [in_process(llm, ids, gen) for _ in range(repeats)]
    finally:
        torch.set_num_threads(before)


async def served_concurrent(addr: str, prompts: list[list[int]], gen: int) -> float:
    """Output tok/s of all ``prompts`` sent at once through decode_svc, which picks where each
    prefills as it does by default (past ``--remote-prefill-max-inflight`` pulls, inside decode_svc)."""
    t0 = time.perf_counter()
    runs = await asyncio.gather(*(served(addr, ids, gen, pb.KV_SOURCE_UNSPECIFIED) for ids in prompts))
    return sum(1 + len(gaps) for _, gaps in runs) / (time.perf_counter() - t0)


def in_process_concurrent(llm: LLM, prompts: list[list[int]], gen: int) -> float:
    """Output tok/s of the same prompts through the in-process engine, batched (``LLM.generate``)."""
    t0 = time.perf_counter()
    outs = llm.generate(prompts, SamplingParams(max_tokens=gen, ignore_eos=True))
    return sum(len(o.token_ids) for o in outs) / (time.perf_counter() - t0)


def summarize(runs: list[tuple[float, list[float]]]) -> dict:
    gaps = [g for _, gs in runs for g in gs]
    return {"ttft_ms": 1000 * statistics.median(t for t, _ in runs),
            "itl_ms": 1000 * statistics.median(gaps), "itl_p99_ms": 1000 * sorted(gaps)[int(0.99 * (len(gaps) - 1))]}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--model", help="a registered model name (python -m tools.fetch_model --list)")
    src.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR, help="an HF directory or a .gguf")
    ap.add_argument("--weights", default="none", choices=["none", "bf16", "int8", "fp8"])
    ap.add_argument("--speculative", default="none", choices=["none", "ngram", "draft"],
                    help="default speculative mode, served and in process")
    ap.add_argument("--num-speculative-tokens", type=int, default=4)
    ap.add_argument("--draft-model-dir", type=Path, default=None,
                    help="with --speculative draft (default: <model-dir>-draft beside the model)")
    ap.add_argument("--prompt-lens", default="128,512,1024")
    ap.add_argument("--gen", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv", default="fp8_e4m3,bf16")
    ap.add_argument("--concurrency", type=int, default=16,
                    help="then this many different prompts at once, served and in-process (0: skip)")
    ap.add_argument("--concurrent-prompt-len", type=int, default=128)
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args(argv)
    if args.model:
        args.model_dir = Path(args.model)
    if args.speculative == "draft" and args.draft_model_dir is None:
        args.draft_model_dir = args.model_dir.parent / f"{args.model_dir.name}-draft"
    tok = ModelTokenizer(args.model_dir)
    lens = [int(x) for x in args.prompt_lens.split(",")]
    prompts = {n: prompt_ids(tok, n) for n in lens}
    m = args.concurrent_prompt_len
    pool = prompt_ids(tok, m * args.concurrency)
    batch = [pool[i * m:(i + 1) * m] for i in range(args.concurrency)]
    rows, concurrent, svc_threads = [], [], service_threads()
    for kv in args.kv.split(","):
        draft = args.draft_model_dir if args.speculative == "draft" else None
        llm = LLM(args.model_dir, weights=args.weights, kv_dtype=kv, num_pages=256, draft_model=draft,
                  speculative=args.speculative, num_speculative_tokens=args.num_speculative_tokens)
        with Stack(model_dir=args.model_dir, weights=args.weights, kv_dtype=kv,
                   extra={"decode_svc": decode_flags(args)}) as stack:
            for n, ids in prompts.items():
                asyncio.run(served(stack.addr("decode_svc"), ids, 4))  # warm the path
                in_process(llm, ids, 4)
                srv, loc, same, here, auto, fds = [], [], [], [], [], []
                for _ in range(args.repeats):  # rounds: the machine's drift hits every column alike
                    srv.append(asyncio.run(served(stack.addr("decode_svc"), ids, args.gen)))
                    loc.append(in_process(llm, ids, args.gen))
                    same += in_process_with_threads(llm, ids, args.gen, 1, svc_threads)
                    here.append(asyncio.run(served(stack.addr("decode_svc"), ids, args.gen, pb.KV_SOURCE_LOCAL)))
                    auto.append(asyncio.run(served(stack.addr("decode_svc"), ids, args.gen,
                                                   pb.KV_SOURCE_UNSPECIFIED)))
                    fds.append(asyncio.run(front_door(stack.addr("tokenizer_svc"), tok.decode(ids), args.gen)))
                fd = statistics.median(fds)
                nbytes = asyncio.run(kv_bytes(stack.addr("prefill_svc"), ids))
                row = {"kv": kv, "prompt_tokens": len(ids), "served": summarize(srv), "in_process": summarize(loc),
                       "in_process_service_threads": summarize(same), "service_threads": svc_threads,
                       "served_local_prefill": summarize(here), "served_default": summarize(auto),
                       "front_door_ttft_ms": 1000 * fd, "kv_bytes": nbytes, "kv_bytes_per_token": nbytes / len(ids)}
                rows.append(row)
                print(json.dumps(row), flush=True)
            if batch and len(batch[-1]) == m:
                asyncio.run(served_concurrent(stack.addr("decode_svc"), batch[:2], 4))  # warm
                srv, loc = [], []
                for _ in range(args.repeats):
                    srv.append(asyncio.run(served_concurrent(stack.addr("decode_svc"), batch, args.gen)))
                    loc.append(in_process_concurrent(llm, batch, args.gen))
                concurrent.append({"kv": kv, "requests": len(batch), "prompt_tokens": m,
                                   "served_tok_s": statistics.median(srv), "in_process_tok_s": statistics.median(loc)})
                print(json.dumps(concurrent[-1]), flush=True)
    report = {"benchmark": "disagg", "model": args.model_dir.name, "weights": args.weights,
              "threads": torch.get_num_threads(),
              "speculative": args.speculative, "gen": args.gen, "repeats": args.repeats, "rows": rows,
              "concurrent": concurrent}
    common.save(report, markdown(report), args.out)
    return report


def markdown(report: dict) -> str:
    lines = [f"Model {report['model']} ({report.get('weights', 'none')} weights, speculative "
             f"{report.get('speculative', 'none')}), batch 1, {report['gen']} generated tokens, median of "
             f"{report['repeats']} runs.",
             "", "| KV | prompt | TTFT served (ms) | TTFT served, local prefill (ms) | TTFT served, decode's choice (ms) "
             "| TTFT in-process (ms) | ratio | ratio, decode's choice "
             "| TTFT in-process, service threads (ms) | ratio | TTFT via front door (ms) | ITL served (ms) "
             "| ITL in-process (ms) | ratio | ITL in-process, service threads (ms) | served - in-process (ms) "
             "| KV bytes/prompt token |",
             "|---" * 17 + "|"]
    for r in report["rows"]:
        s, p = r["served"], r["in_process"]
        t = r.get("in_process_service_threads", p)
        auto = r.get("served_default", {}).get("ttft_ms", float("nan"))  # reports before it was measured
        lines.append(f"| {r['kv']} | {r['prompt_tokens']} | {s['ttft_ms']:.1f} | "
                     f"{r['served_local_prefill']['ttft_ms']:.1f} | {auto:.1f} | {p['ttft_ms']:.1f} | "
                     f"{s['ttft_ms'] / p['ttft_ms']:.2f}x | {auto / p['ttft_ms']:.2f}x | "
                     f"{t['ttft_ms']:.1f} | {s['ttft_ms'] / t['ttft_ms']:.2f}x | "
                     f"{r['front_door_ttft_ms']:.1f} | {s['itl_ms']:.2f} | {p['itl_ms']:.2f} | "
                     f"{s['itl_ms'] / p['itl_ms']:.2f}x | {t['itl_ms']:.2f} | {s['itl_ms'] - p['itl_ms']:+.2f} | "
                     f"{r['kv_bytes_per_token']:.0f} |")
    threads = {r.get("service_threads") for r in report["rows"]} - {None}
    if threads:
        lines.append(f"\nService threads: decode_svc's share of the cores while prefill computes "
                     f"({', '.join(map(str, sorted(threads)))}), "
                     f"the in-process engine set to the same; the other in-process columns use this process's "
                     f"threads ({report.get('threads', 'all usable cores')}).")
    for c in report.get("concurrent", []):
        lines.append(f"\n{c['requests']} different {c['prompt_tokens']}-token prompts at once, {report['gen']} tokens each "
                     f"({c['kv']} KV): served {c['served_tok_s']:.1f} output tok/s, in-process (batched, "
                     f"{report.get('threads', 'all')} threads) {c['in_process_tok_s']:.1f}: "
                     f"{c['served_tok_s'] / c['in_process_tok_s']:.2f}x")
    fp8 = {r["prompt_tokens"]: r["kv_bytes_per_token"] for r in report["rows"] if r["kv"] == "fp8_e4m3"}
    bf16 = {r["prompt_tokens"]: r["kv_bytes_per_token"] for r in report["rows"] if r["kv"] == "bf16"}
    for n in sorted(set(fp8) & set(bf16)):
        lines.append(f"\nKV on the wire, {n}-token prompt: fp8 {fp8[n]:.0f} B/token vs bf16 {bf16[n]:.0f} B/token "
                     f"= {fp8[n] / bf16[n]:.3f}x")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
