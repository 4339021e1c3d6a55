"""Tokenizer service benchmark: encode throughput over gRPC against in-process HF ``tokenizers``,
and the incremental detokenizer's latency per streamed token against ``tokenizers``' DecodeStream.

    python -m bench tokenizer [--model-dir models/kvwire-tiny] [--num-texts 512] [--concurrency 16]

Method and details: bench/README.md, section ``bench/tokenizer.py``.
"""
from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import grpc
from tqdm import tqdm

from bench import common, machine
from kvwire.config import DEFAULT_MODEL_DIR
from kvwire.tokenizer import ModelTokenizer
from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc as pbg
from tokenizer_svc.detokenizer import IncrementalDetokenizer
from tools.stack import REPO, free_port, wait_serving


def corpus(n: int) -> list[str]:
    from tools.train_embedded import load_corpus  # imports transformers (the bench extra)
    paras = [p.strip() for text in load_corpus()[1] for p in text.split("\n\n") if p.strip()]
    return paras[:n]


async def rpc_encode(addr: str, texts: list[str], concurrency: int) -> tuple[float, int]:
    sem = asyncio.Semaphore(concurrency)
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = pbg.TokenizerServiceStub(ch)
        await stub.Tokenize(pb.TokenizeRequest(text="warm up"))

        bar = tqdm(total=len(texts), desc=f"Tokenize x{concurrency}", leave=False)

        async def one(text: str) -> int:
            async with sem:
                n = len((await stub.Tokenize(pb.TokenizeRequest(text=text))).token_ids)
            bar.update()
            return n

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one(t) for t in texts))
        bar.close()
        return time.perf_counter() - t0, sum(counts)


def in_process(tok: ModelTokenizer, texts: list[str]) -> dict:
    tok.encode_batch(texts[:8])
    t0 = time.perf_counter()
    n_batch = sum(len(x) for x in tok.encode_batch(texts))
    t1 = time.perf_counter()
    n_loop = sum(len(tok.encode(t)) for t in texts)
    t2 = time.perf_counter()
    return {"encode_batch_tok_s": n_batch / (t1 - t0), "encode_loop_tok_s": n_loop / (t2 - t1), "tokens": n_batch}


def detok(tok: ModelTokenizer, ids: list[int]) -> dict:
    from tokenizers.decoders import DecodeStream
    ours = IncrementalDetokenizer(partial(tok.decode, skip_special_tokens=True))
    peer = DecodeStream(skip_special_tokens=True)
    t_ours, t_peer, text_ours, text_peer = [], [], [], []
    for i in tqdm(ids, desc="detokenize stream", leave=False):
        t = time.perf_counter()
        text_ours.append(ours.add([i]))
        t_ours.append(time.perf_counter() - t)
        t = time.perf_counter()
        text_peer.append(peer.step(tok.tok, i) or "")
        t_peer.append(time.perf_counter() - t)
    text_ours.append(ours.flush())
    return {"tokens": len(ids), "ours_us": common.stats(t_ours, 1e6), "decode_stream_us": common.stats(t_peer, 1e6),
            "same_text": "".join(text_ours) == "".join(text_peer)}


def start_service(model_dir: Path) -> tuple[subprocess.Popen, str]:
    addr = f"127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-m", "tokenizer_svc", "--listen", addr, "--model-dir", str(model_dir),
                             "--decode-addr", f"127.0.0.1:{free_port()}"], cwd=REPO,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_serving(addr, 60, proc)
    except BaseException:
        proc.kill()
        raise
    return proc, addr


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench tokenizer", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    ap.add_argument("--num-texts", type=int, default=512)
    ap.add_argument("--concurrency", type=int, default=16)
    ap.add_argument("--detok-tokens", type=int, default=4096)
    ap.add_argument("--addr", default="", help="a running tokenizer_svc; default: start one")
    ap.add_argument("--out", type=Path, default=common.OUT)
    args = ap.parse_args(argv)

    tok = ModelTokenizer(args.model_dir)
    texts = corpus(args.num_texts)
    facts = machine.facts(bandwidth=False)
    local = in_process(tok, texts)
    stream = [i for t in texts for i in tok.encode(t, add_special_tokens=False)][:args.detok_tokens]
    detok_result = detok(tok, stream)
    proc, addr = (None, args.addr) if args.addr else start_service(args.model_dir)
    try:
        rpc = {}
        for c in (1, args.concurrency):
            dt, n = asyncio.run(rpc_encode(addr, texts, c))
            rpc[c] = {"tok_s": n / dt, "texts_s": len(texts) / dt}
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(15)
    report = {"benchmark": "tokenizer", "model": args.model_dir.name, "texts": len(texts),
              "chars": sum(map(len, texts)), "machine": facts, "in_process": local,
              "rpc": {str(k): v for k, v in rpc.items()}, "detokenize": detok_result}
    common.save(report, markdown(report), args.out)
    return report


def markdown(report: dict) -> str:
    f, r, loc, d = common.fmt, common.ratio, report["in_process"], report["detokenize"]
    peer = loc["encode_batch_tok_s"]
    rows = [[f"Tokenize RPC, concurrency {c}", f(v["tok_s"], 0), f(v["texts_s"], 0), r(v["tok_s"], peer)]
            for c, v in report["rpc"].items()]
    rows += [["in-process `encode_batch` (peer)", f(peer, 0), "-", "1.00x"],
             ["in-process `encode` loop", f(loc["encode_loop_tok_s"], 0), "-", r(loc["encode_loop_tok_s"], peer)]]
    o, p = d["ours_us"], d["decode_stream_us"]
    return (f"Tokenizer of {report['model']}: {report['texts']} held-out paragraphs ({report['chars']} characters, "
            f"{loc['tokens']} tokens). {machine.describe(report['machine'])}\n\n"
            + common.table(["encode path", "tokens/s", "texts/s", "ours/peer"], rows)
            + f"\n\nStreaming detokenize, {d['tokens']} tokens one at a time (microseconds per token, mean / p50 / p99):"
              f" IncrementalDetokenizer {f(o['mean'])} / {f(o['p50'])} / {f(o['p99'])}; tokenizers DecodeStream "
              f"{f(p['mean'])} / {f(p['p50'])} / {f(p['p99'])}; ours/peer (mean) {r(o['mean'], p['mean'])}; "
              f"same text: {'yes' if d['same_text'] else 'NO'}.\n")


if __name__ == "__main__":
    main()
