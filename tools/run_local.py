"""``python -m tools.run_local``: all three services on localhost with the embedded model, then one
streamed completion through the front door, then a graceful shutdown.

    python -m tools.run_local --prompt "The for statement" --max-tokens 80
    python -m tools.run_local --keep-running      # leave the services up (Ctrl-C or SIGTERM stops them)
    python -m tools.run_local --prefill-replicas 2 --decode-replicas 2 --decode-routing prefix
    python -m tools.run_local --model-dir smollm2-135m-instruct --weights int8 --chat \
        --prompt "What is the capital of France?"     # the real model (python -m tools.fetch_model first)

Service logs go to --log-dir (default: a temporary folder, printed at start).
"""
from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import tempfile
import time
from pathlib import Path

from kvwire.args import DecodeRouting
from kvwire.config import DEFAULT_MODEL_DIR
from tokenizer_svc.client import stream
from protos.kvwire.v1 import kvwire_pb2 as pb
from tools.stack import Stack, free_port


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.run_local", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR,
                    help="model directory, .gguf file or fetched model name (e.g. smollm2-135m-instruct)")
    ap.add_argument("--chat", action="store_true", help="send --prompt as a user chat message (chat template)")
    ap.add_argument("--weights", default="int8", help="int8 (default) | bf16 | fp8 | none")
    ap.add_argument("--kv-dtype", default="fp8_e4m3", help="fp8_e4m3 | bf16")
    ap.add_argument("--prompt", default="The for statement")
    ap.add_argument("--max-tokens", type=int, default=80)
    ap.add_argument("--keep-running", action="store_true", help="serve until Ctrl-C after the demo request")
    ap.add_argument("--log-dir", type=Path, default=None)
    ap.add_argument("--http-port", type=int, default=8000,
                    help="port of the OpenAI-compatible HTTP API on 127.0.0.1 (a free one if it is taken)")
    ap.add_argument("--prefill-replicas", type=int, default=1, help="prefill_svc processes (decode balances over them; "
                    "0: none, decode_svc prefills every prompt itself on every core)")
    ap.add_argument("--decode-replicas", type=int, default=1, help="decode_svc processes (the front door balances "
                    "over them)")
    ap.add_argument("--decode-routing", choices=[m.value for m in DecodeRouting],
                    default=DecodeRouting.ROUND_ROBIN.value,
                    help="how the front door picks a decode replica (tokenizer_svc --decode-routing)")
    args = ap.parse_args(argv)
    if args.prefill_replicas < 0 or args.decode_replicas < 1:
        ap.error("--prefill-replicas must be >= 0 and --decode-replicas >= 1")
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="kvwire-logs-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    with socket.socket() as probe:  # the demo must not fail because something else has port 8000
        http_port = args.http_port if probe.connect_ex(("127.0.0.1", args.http_port)) != 0 else free_port()
    stack = Stack(model_dir=args.model_dir, weights=args.weights, kv_dtype=args.kv_dtype, log_dir=log_dir,
                  prefill_replicas=args.prefill_replicas, decode_replicas=args.decode_replicas,
                  extra={"tokenizer_svc": ["--http-listen", f"127.0.0.1:{http_port}",
                                           "--decode-routing", args.decode_routing]})
    t = time.perf_counter()
    print(f"starting {args.prefill_replicas} prefill_svc, {args.decode_replicas} decode_svc, tokenizer_svc "
          f"(logs in {log_dir}) ...", file=sys.stderr)
    with stack:
        print(f"all SERVING after {time.perf_counter() - t:.1f} s: tokenizer_svc {stack.addr('tokenizer_svc')}, "
              f"decode_svc {stack.target('decode_svc')}, prefill_svc {stack.target('prefill_svc') or 'none'}; "
              f"OpenAI-compatible HTTP at http://127.0.0.1:{http_port}/v1", file=sys.stderr)
        sampling = pb.SamplingParams(max_tokens=args.max_tokens)
        if args.chat:
            request = pb.GenerateTextRequest(chat=pb.ChatMessages(messages=[
                pb.ChatMessage(role="user", content=args.prompt)]), sampling=sampling)
            sys.stdout.write(f"user: {args.prompt}\nassistant: ")
        else:
            request = pb.GenerateTextRequest(text=args.prompt, sampling=sampling)
            sys.stdout.write(args.prompt)
        asyncio.run(stream(stack.addr("tokenizer_svc"), request))
        if args.keep_running:
            print("serving; Ctrl-C to stop", file=sys.stderr)
            try:
                while all(p.poll() is None for p in stack.procs.values()):
                    time.sleep(1)
            except KeyboardInterrupt:
                pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
