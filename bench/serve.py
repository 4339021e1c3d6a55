"""Load generator against the front door (tokenizer_svc GenerateText) over loopback gRPC.

    python -m bench serve [--model-dir models/kvwire-tiny] [--input-len 128] [--output-len 32] \
        [--num-prompts 32] [--concurrency 1,4,16] [--slo-ttft-ms 1000] [--slo-tpot-ms 100] \
        [--speculative none|draft|ngram]

Method and details: bench/README.md, section ``bench/serve.py``.
"""
from __future__ import annotations

import argparse
import asyncio
import random
import shlex
import time
from pathlib import Path

import grpc
from tqdm import tqdm

from bench import common, machine, plots
from bench.metrics import RequestRecord, summarize
from kvwire.config import DEFAULT_MODEL_DIR
from kvwire.tokenizer import ModelTokenizer
from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc as pbg
from tools.stack import Stack


def build_prompts(tok: ModelTokenizer, n: int, input_len: int, dataset: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    if dataset == "heldout":
        from tools.train_embedded import load_corpus  # imports transformers (the bench extra)
        ids = [t for text in load_corpus()[1] for t in tok.encode(text, add_special_tokens=False)]
        if len(ids) > 2 * input_len:
            starts = [rng.randrange(len(ids) - input_len) for _ in range(n)]
            return [tok.decode(ids[s:s + input_len]) for s in starts]
    special = set(tok.eos_ids) | ({tok.bos_id} if tok.bos_id is not None else set())
    vocab = [i for i in range(tok.vocab_size) if i not in special]
    return [tok.decode([rng.choice(vocab) for _ in range(input_len)]) for _ in range(n)]


async def one_request(stub, text: str, output_len: int) -> RequestRecord:
    req = pb.GenerateTextRequest(text=text, sampling=pb.SamplingParams(max_tokens=output_len, ignore_eos=True))
    rec = RequestRecord(start=time.perf_counter())
    try:
        async for msg in stub.GenerateText(req):
            now = time.perf_counter()
            if msg.token_ids:
                rec.chunks.append((now, len(msg.token_ids)))
            if msg.HasField("usage"):
                rec.prompt_tokens, rec.output_tokens = msg.usage.prompt_tokens, msg.usage.completion_tokens
        rec.end = time.perf_counter()
        if not rec.output_tokens:
            rec.output_tokens = sum(n for _, n in rec.chunks)
    except grpc.RpcError as e:
        rec.error = f"{e.code().name}: {e.details()}"
    return rec


async def run_level(addr: str, prompts: list[str], output_len: int, concurrency: int,
                    desc: str) -> tuple[list[RequestRecord], float]:
    sem = asyncio.Semaphore(concurrency)
    bar = tqdm(total=len(prompts), desc=desc, unit="req", leave=False)
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = pbg.TokenizerServiceStub(ch)

        async def limited(text: str) -> RequestRecord:
            async with sem:
                rec = await one_request(stub, text, output_len)
            bar.update()
            return rec

        t0 = time.perf_counter()
        records = await asyncio.gather(*(limited(p) for p in prompts))
        duration = time.perf_counter() - t0
    bar.close()
    return list(records), duration


def run(addr: str, prompts: list[str], args) -> list[dict]:
    slo = {k: v / 1e3 for k, v in (("ttft", args.slo_ttft_ms), ("tpot", args.slo_tpot_ms),
                                    ("e2el", args.slo_e2el_ms)) if v}
    asyncio.run(run_level(addr, prompts[:1], args.output_len, 1, "warm-up"))
    levels = []
    for c in tqdm([int(x) for x in args.concurrency.split(",")], desc="concurrency levels", unit="level"):
        records, duration = asyncio.run(run_level(addr, prompts, args.output_len, c, f"concurrency {c}"))
        s = summarize(records, duration, slo)
        s["concurrency"] = c
        s["ttft_samples_ms"] = sorted(1e3 * r.ttft for r in records if r.ok)
        s["e2el_samples_ms"] = sorted(1e3 * r.e2e for r in records if r.ok)
        s["itl_samples_ms"] = sorted(1e3 * g for r in records if r.ok for g in r.itl)
        levels.append(s)
        tqdm.write(f"concurrency {c}: {s['completed']} done, {s['failed']} failed, "
                   f"{s['output_throughput']:.1f} out tok/s, TTFT p50 {s['ttft_ms']['p50']:.0f} ms")
    return levels


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench serve", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--weights", default="none", choices=["none", "bf16", "int8", "fp8"])
    ap.add_argument("--kv-dtype", default="fp8_e4m3", choices=["fp8_e4m3", "bf16"])
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=32)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--dataset", default="heldout", choices=["heldout", "random"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slo-ttft-ms", type=float, default=1000.0, help="goodput limit on TTFT (0: none)")
    ap.add_argument("--slo-tpot-ms", type=float, default=100.0, help="goodput limit on TPOT (0: none)")
    ap.add_argument("--slo-e2el-ms", type=float, default=0.0, help="goodput limit on E2E latency (0: none)")
    ap.add_argument("--addr", default="", help="a running tokenizer_svc; default: start a stack")
    ap.add_argument("--decode-pages", type=int, default=2048)
    ap.add_argument("--speculative", default="none", choices=["none", "draft", "ngram"], help="decode_svc's mode")
    ap.add_argument("--draft-model-dir", default=None,
                    help="decode_svc's draft model (default: <model-dir>-draft beside the model when present)")
    ap.add_argument("--log-dir", type=Path, default=None, help="service logs (default: discarded)")
    ap.add_argument("--share-cores", action=argparse.BooleanOptionalAction, default=True,
                    help="prefill_svc and decode_svc lend each other their cores (--no-share-cores: the static split)")
    ap.add_argument("--prefill-replicas", type=int, default=1,
                    help="prefill_svc processes (0: none, decode_svc prefills every prompt on every core)")
    ap.add_argument("--decode-args", default="", help="more decode_svc flags, one string "
                                                       "(e.g. '--prefill-chunk-size 128')")
    ap.add_argument("--out", type=Path, default=common.OUT)
    args = ap.parse_args(argv)

    tok = ModelTokenizer(args.model_dir)
    prompts = build_prompts(tok, args.num_prompts, args.input_len, args.dataset, args.seed)
    facts = machine.facts()
    if args.addr:
        levels = run(args.addr, prompts, args)
    else:
        print("starting tokenizer_svc, decode_svc, prefill_svc ...", flush=True)
        draft = args.draft_model_dir
        if draft is None:
            sibling = args.model_dir.parent / f"{args.model_dir.name}-draft"
            draft = str(sibling) if (sibling / "config.json").is_file() else ""
        decode_flags = ["--speculative", args.speculative, "--draft-model-dir", draft, *shlex.split(args.decode_args)]
        with Stack(model_dir=args.model_dir, weights=args.weights, kv_dtype=args.kv_dtype, log_dir=args.log_dir,
                   decode_pages=args.decode_pages, extra={"decode_svc": decode_flags},
                   share_cores=args.share_cores, prefill_replicas=args.prefill_replicas) as stack:
            levels = run(stack.addr("tokenizer_svc"), prompts, args)
    report = {"benchmark": "serve", "model": args.model_dir.name, "weights": args.weights, "kv_dtype": args.kv_dtype,
              "speculative": args.speculative if not args.addr else "(running service)",
              "share_cores": args.share_cores if not args.addr else None,
              "prefill_replicas": args.prefill_replicas if not args.addr else None,
              "decode_args": args.decode_args if not args.addr else None,
              "input_len": args.input_len, "output_len": args.output_len, "num_prompts": args.num_prompts,
              "dataset": args.dataset, "slo_ms": {"ttft": args.slo_ttft_ms, "tpot": args.slo_tpot_ms,
                                                  "e2el": args.slo_e2el_ms},
              "machine": facts, "levels": levels}
    common.save(report, markdown(report), args.out, plots.serve)
    return report


def markdown(report: dict) -> str:
    f = common.fmt
    slo = ", ".join(f"{k.upper()} <= {v:g} ms" for k, v in report["slo_ms"].items() if v) or "none"
    head = (f"Front door (tokenizer_svc GenerateText) over loopback gRPC, model {report['model']} "
            f"(weights {report['weights']}, KV {report['kv_dtype']}, speculative {report.get('speculative', 'none')}), "
            f"{report['num_prompts']} requests per level, "
            f"{report['dataset']} prompts of {report['input_len']} tokens, exactly {report['output_len']} output "
            f"tokens; goodput limits: {slo}. Latencies in ms as mean / p50 / p99.\n"
            f"{machine.describe(report['machine'])}\n")
    rows = []
    for s in report["levels"]:
        lat = {k: "{} / {} / {}".format(*(f(s[k][q]) for q in ("mean", "p50", "p99")))
               for k in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")}
        rows.append([s["concurrency"], f"{s['completed']}/{s['completed'] + s['failed']}", lat["ttft_ms"],
                     lat["tpot_ms"], lat["itl_ms"], lat["e2el_ms"], f(s["request_throughput"], 2),
                     f(s["output_throughput"]), f(s["goodput"], 2)])
    return head + "\n" + common.table(
        ["concurrency", "done", "TTFT", "TPOT", "ITL", "E2E", "req/s", "output tok/s", "goodput req/s"], rows) + "\n"


if __name__ == "__main__":
    main()
