"""PNG plots for the benchmark reports (matplotlib, Agg backend): each takes (report, out, stem)
and returns the files it wrote.

- serve: latency CDFs (TTFT, ITL, E2E) per concurrency; throughput and goodput against concurrency;
- engine: batch-1 decode tokens/s against the bandwidth roofline (bandwidth / weight bytes per
  token), and batched decode throughput against batch size;
- kv: per-layer compute end (in-process) against chunk arrival (served) during one prefill.
"""
from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.ticker

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from bench import machine  # noqa: E402


def _save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def serve(report: dict, out: Path, stem: str) -> list[Path]:
    levels = report["levels"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for ax, key, title in zip(axes, ("ttft_samples_ms", "itl_samples_ms", "e2el_samples_ms"), ("TTFT", "ITL", "E2E")):
        for s in levels:
            xs = s[key]
            if xs:
                ax.plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=f"concurrency {s['concurrency']}")
        ax.set(xlabel=f"{title} (ms)", ylabel="fraction of samples", title=f"{title} CDF")
        ax.set_xscale("log")
        ax.legend()
    p1 = _save(fig, out / f"{stem}-latency-cdf.png")
    fig, ax = plt.subplots(figsize=(6, 4))
    cs = [s["concurrency"] for s in levels]
    ax.plot(cs, [s["output_throughput"] for s in levels], "o-", label="output tokens/s")
    ax2 = ax.twinx()
    ax2.plot(cs, [s["request_throughput"] for s in levels], "s--", color="C1", label="requests/s")
    ax2.plot(cs, [s["goodput"] for s in levels], "^:", color="C2", label="goodput (requests/s)")
    ax.set(xlabel="concurrency", ylabel="output tokens/s", xscale="log", xticks=cs, xticklabels=cs,
           title=f"{report['model']}: throughput against concurrency")
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax2.set_ylabel("requests/s")
    fig.legend(loc="upper left", bbox_to_anchor=(0.12, 0.88))
    return [p1, _save(fig, out / f"{stem}-throughput.png")]


def engine(report: dict, out: Path, stem: str) -> list[Path]:
    rows = [r for r in report["results"] if not r.get("error")]
    bw = machine.roofline_gbs(report["machine"]) * 1e9
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    ax = axes[0]
    xs = np.geomspace(min(r["weight_bytes_per_token"] for r in rows) / 2,
                      max(r["weight_bytes_per_token"] for r in rows) * 2, 50)
    ax.plot(xs / 1e6, bw / xs, "k--", label=f"roofline ({bw / 1e9:.1f} GB/s)")
    for i, r in enumerate(rows):
        ax.plot(r["weight_bytes_per_token"] / 1e6, r["decode_tok_s"], "o", color=f"C{i % 10}", label=r["engine"])
    ax.set(xscale="log", yscale="log", xlabel="weight MB read per token", ylabel="batch-1 decode tokens/s",
           title=f"{report['model']}: decode against the bandwidth roofline")
    ax.legend(fontsize=7)
    ax = axes[1]
    for i, r in enumerate(rows):
        b = sorted(r.get("batched_tok_s", {}).items(), key=lambda kv: int(kv[0]))
        if b:
            ax.plot([int(k) for k, _ in b], [v for _, v in b], "o-", color=f"C{i % 10}", label=r["engine"])
    ax.set(xscale="log", yscale="log", xlabel="sequences decoded together", ylabel="decode tokens/s (all sequences)",
           title="batched decode")
    ax.legend(fontsize=7)
    return [_save(fig, out / f"{stem}-decode-roofline.png")]


def kv(report: dict, out: Path, stem: str) -> list[Path]:
    rows = [r for r in report["rows"] if r.get("layer_compute_ms")]
    if not rows:
        return []
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 4), squeeze=False)
    for ax, r in zip(axes[0], rows):
        layers = np.arange(len(r["layer_compute_ms"]))
        ax.plot(layers, r["layer_compute_ms"], "o-", label="layer computed (in-process forward)")
        ax.plot(layers, r["layer_arrival_ms"], "s-", label="layer's last chunk arrived (served)")
        ax.set(xlabel="layer", ylabel="ms since forward start / header arrival",
               title=f"{r['kv']} KV, {r['prompt_tokens']}-token prompt")
        ax.legend(fontsize=7)
    return [_save(fig, out / f"{stem}-layer-timeline.png")]
