"""``python -m bench trace``: one request through the three real services, its trace drawn as a waterfall.

Method and details: bench/README.md, section ``bench/trace.py``.
"""
from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
from pathlib import Path

import grpc

from bench import common
from kvwire.config import DEFAULT_MODEL_DIR
from kvwire.tokenizer import ModelTokenizer
from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc as pbg
from tools.otlp_receiver import OtlpReceiver
from tools.stack import Stack

SERVICE_COLOURS = {"kvwire-tokenizer": "#4C72B0", "kvwire-decode": "#DD8452", "kvwire-prefill": "#55A868"}
DOCS_PNG = common.ROOT / "docs" / "trace.png"


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench trace", description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path, default=None, help="default: the embedded model")
    ap.add_argument("--weights", default="none")
    ap.add_argument("--kv-dtype", default="fp8_e4m3")
    ap.add_argument("--prompt-tokens", type=int, default=256, help="about this many prompt tokens")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=common.OUT)
    ap.add_argument("--docs", action="store_true", help=f"copy the PNG to {DOCS_PNG.relative_to(common.ROOT)}")
    return ap.parse_args(argv)


def label(span) -> str:
    """'decode: /kvwire.v1.PrefillService/Prefill (client)' style row labels."""
    service = span.service_name.removeprefix("kvwire-")
    kind = {2: " (server)", 3: " (client)"}.get(span.kind, "")
    name = span.name.rsplit("/", 1)[-1] + kind if span.name.startswith("/") else span.name
    return f"{service}: {name}"


def tree_order(spans) -> list:
    """Depth-first from the root, children by start time (a waterfall's row order), with depths."""
    children: dict[str, list] = {}
    for s in sorted(spans, key=lambda s: s.start_ns):
        children.setdefault(s.parent_span_id, []).append(s)
    out: list = []

    def walk(s, depth):
        out.append((s, depth))
        for c in children.get(s.span_id, []):
            walk(c, depth + 1)
    ids = {s.span_id for s in spans}
    for root in [s for s in spans if s.parent_span_id not in ids]:
        walk(root, 0)
    return out


def draw(rows: list[dict], path: Path, title: str) -> Path:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(figsize=(12, 0.42 * len(rows) + 1.6))
    end = max(r["start_ms"] + r["duration_ms"] for r in rows)
    for i, r in enumerate(rows):
        ax.barh(i, r["duration_ms"], left=r["start_ms"], height=0.6,
                color=SERVICE_COLOURS.get(r["service"], "#888888"))
        ax.text(r["start_ms"] + r["duration_ms"] + end * 0.005, i, f"{r['duration_ms']:.1f} ms", va="center",
                fontsize=8)
    ax.set_yticks(range(len(rows)), [r["label"] for r in rows], fontsize=9)
    ax.invert_yaxis()
    ax.set_xlim(0, end * 1.12)
    ax.set_xlabel("time since the request reached the front door (ms)")
    ax.set_title(title, fontsize=10)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(handles=[Patch(color=c, label=s) for s, c in SERVICE_COLOURS.items()], loc="upper center",
              bbox_to_anchor=(0.5, -0.5 / len(rows) - 0.08), ncol=len(SERVICE_COLOURS), fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def markdown(report: dict) -> str:
    rows = [[("&nbsp;&nbsp;" * r["depth"]) + r["label"], f"{r['start_ms']:.2f}", f"{r['duration_ms']:.2f}"]
            for r in report["spans"]]
    return (f"One request ({report['prompt_tokens']} prompt tokens, {report['output_tokens']} generated, KV "
            f"{report['kv_dtype']}), trace `{report['trace_id']}`: {len(report['spans'])} spans across "
            f"{', '.join(report['services'])}. KV transfer {report['kv_transfer_ms']:.1f} ms, "
            f"{report['kv_overlap_ms']:.1f} ms of it during prefill's forward; {report['kv_bytes']:,} KV bytes.\n\n"
            + common.table(["span", "start (ms)", "duration (ms)"], rows) + "\n")


async def _request(addr: str, text: str, max_tokens: int) -> list[int]:
    async with grpc.aio.insecure_channel(addr) as ch:
        ids: list[int] = []
        async for msg in pbg.TokenizerServiceStub(ch).GenerateText(pb.GenerateTextRequest(
                text=text, sampling=pb.SamplingParams(max_tokens=max_tokens),
                kv_source=pb.KV_SOURCE_REMOTE)):  # the page stream is what it draws, whatever the prompt's length
            ids += msg.token_ids
        return ids


def _complete(spans) -> bool:
    """The request's trace has arrived: the front door's server span and every span's parent."""
    ids = {s.span_id for s in spans}
    return any(s.name.endswith("TokenizerService/GenerateText") and s.kind == 2 for s in spans) and \
        {"kv_transfer", "prefill.forward", "decode"} <= {s.name for s in spans} and \
        all(not s.parent_span_id or s.parent_span_id in ids for s in spans)


def main(argv: list[str] | None = None) -> dict:
    args = parse(argv)
    model_dir = args.model_dir or DEFAULT_MODEL_DIR
    tok = ModelTokenizer(model_dir)
    sentence = "The for statement iterates over the items of any sequence, in the order they appear. "
    text = sentence * max(1, args.prompt_tokens // max(1, len(tok.encode(sentence, add_special_tokens=False))))
    prompt_tokens = len(tok.encode(text))
    log_dir = Path(tempfile.mkdtemp(prefix="kvwire-trace-"))
    with OtlpReceiver() as rx:
        env = {"OTEL_EXPORTER_OTLP_ENDPOINT": rx.endpoint, "OTEL_TRACES_EXPORTER": "otlp",
               "OTEL_BSP_SCHEDULE_DELAY": "100", "OTEL_SERVICE_NAME": ""}
        stack = Stack(model_dir=model_dir, weights=args.weights, kv_dtype=args.kv_dtype, decode_pages=512,
                      prefill_pages=512, env=env, log_dir=log_dir)
        print(f"[trace] starting the three services (logs in {log_dir})", file=sys.stderr, flush=True)
        with stack:
            addr = stack.addr("tokenizer_svc")
            asyncio.run(_request(addr, text, args.max_tokens))  # warm-up: first-call costs stay out
            rx.wait_for(_complete, timeout=30)
            rx.clear()
            ids = asyncio.run(_request(addr, text, args.max_tokens))
            spans = rx.wait_for(_complete, timeout=30)
    [trace_id] = {s.trace_id for s in spans}
    t0 = min(s.start_ns for s in spans)
    rows = [{"label": label(s), "service": s.service_name, "name": s.name, "kind": s.kind, "depth": d,
             "span_id": s.span_id, "parent_span_id": s.parent_span_id,
             "start_ms": (s.start_ns - t0) / 1e6, "duration_ms": (s.end_ns - s.start_ns) / 1e6}
            for s, d in tree_order(spans)]
    by_name = {s.name: s for s in spans}
    kv, fwd = by_name["kv_transfer"], by_name["prefill.forward"]
    overlap = max(0, min(kv.end_ns, fwd.end_ns) - max(kv.start_ns, fwd.start_ns)) / 1e6
    report = {"benchmark": "trace", "model": Path(model_dir).name, "trace_id": trace_id,
              "prompt_tokens": prompt_tokens, "output_tokens": len(ids), "kv_dtype": args.kv_dtype,
              "weights": args.weights, "services": sorted({s.service_name for s in spans}), "spans": rows,
              "kv_transfer_ms": (kv.end_ns - kv.start_ns) / 1e6, "kv_overlap_ms": overlap,
              "prefill_forward_ms": (fwd.end_ns - fwd.start_ns) / 1e6,
              "kv_bytes": int(kv.attributes.get("kvwire.kv.bytes", 0))}
    title = (f"One request through kvwire: {prompt_tokens} prompt tokens, {len(ids)} generated "
             f"({report['model']}, weights {args.weights}, KV {args.kv_dtype})\n"
             f"KV transfer {report['kv_transfer_ms']:.1f} ms, {overlap:.1f} ms of it during prefill's forward "
             f"({report['kv_bytes']:,} bytes)")

    def plots(rep, out, stem):
        return [draw(rows, out / f"{stem}.png", title)]
    json_path = common.save(report, markdown(report), args.out, plots)
    png = Path(report["files"]["plots"][0]) if "plots" in report["files"] else None
    if args.docs and png is not None:
        DOCS_PNG.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(png, DOCS_PNG)
        print(f"[trace] copied {png.name} to {DOCS_PNG}", file=sys.stderr)
    print(f"[trace] wrote {json_path} and {png}", file=sys.stderr)
    return report


if __name__ == "__main__":
    main()
