"""What every benchmark shares: output files, ratio formatting, summary statistics, docs update.

Each benchmark module has ``main(argv) -> report`` and ``markdown(report) -> str``; ``save`` writes
``bench/out/<name>-<stamp>.{json,md}`` (plus PNG plots), stamping every report with its date, the
command that ran it and the machine's facts, so that ``python -m bench report`` (bench/report.py)
can build the committed results tables from the JSON alone.
"""
from __future__ import annotations

import json
import math
import re
import shlex
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(__file__).parent / "out"
MODELS = Path(__file__).parent / ".models"
DOCS = ROOT / "docs" / "benchmarks.md"


def stats(values, scale: float = 1.0) -> dict:
    """mean / p50 / p99 (numpy's linear-interpolation percentiles, as vLLM's bench uses), scaled."""
    xs = np.asarray([v for v in values if v is not None], dtype=float) * scale
    if xs.size == 0:
        return {"mean": math.nan, "p50": math.nan, "p99": math.nan, "n": 0}
    return {"mean": float(xs.mean()), "p50": float(np.percentile(xs, 50)),
            "p99": float(np.percentile(xs, 99)), "n": int(xs.size)}


def ratio(ours: float | None, peer: float | None) -> str:
    """'ours/peer' as '1.23x' ('-' when either side is missing)."""
    if not ours or not peer or math.isnan(ours) or math.isnan(peer):
        return "-"
    return f"{ours / peer:.2f}x"


def fmt(x: float | None, digits: int = 1) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{digits}f}"


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def command_line(argv: list[str] | None = None) -> str | None:
    """``python -m bench NAME ARGS`` as this process was started (``--out DIR``, ``--save-results`` and
    ``--write-docs`` dropped: where copies went is not how it was measured); None when it was not
    started through ``python -m bench``."""
    argv = sys.argv if argv is None else argv
    if not argv or not argv[0].replace("\\", "/").endswith("bench/__main__.py"):
        return None
    args, skip = [], False
    for a in argv[1:]:
        if skip or a.startswith("--out=") or a in ("--save-results", "--write-docs"):
            skip = False
            continue
        if a == "--out":
            skip = True
            continue
        args.append(a)
    return "python -m bench " + shlex.join(args)


def stamp(report: dict) -> dict:
    """Add what a committed result needs and a benchmark may not record itself: the date (UTC) and
    the machine's facts (CPU, ISA, cores, load average now, at the end of the run;
    bandwidth only where the benchmark measured it)."""
    from bench import machine  # torch: only once a benchmark has run
    report.setdefault("date", time.strftime("%Y-%m-%d", time.gmtime()))
    if "machine" not in report:
        report["machine"] = {**machine.facts(bandwidth=False), "load_avg_when": "end of run"}
    return report


def save(report: dict, md: str, out: Path = OUT, plots=None) -> Path:
    """Write <name>-<stamp>.json/.md (and plots(report, out, stem) PNGs); returns the JSON path."""
    report["command"] = command_line() or report.get("command")  # a module's own may name --out
    stamp(report)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{report['benchmark']}-{report.get('model', 'x')}-{time.strftime('%Y%m%d-%H%M%S')}"
    report["files"] = {"json": str(out / f"{stem}.json"), "md": str(out / f"{stem}.md")}
    if plots is not None:
        try:
            report["files"]["plots"] = [str(p) for p in plots(report, out, stem)]
        except Exception as e:  # a plot must never lose the numbers
            report["files"]["plots_error"] = repr(e)
    (out / f"{stem}.json").write_text(json.dumps(report, indent=2, default=str))
    (out / f"{stem}.md").write_text(md)
    print(md, flush=True)
    return out / f"{stem}.json"


def write_docs(name: str, md: str, path: Path = DOCS) -> None:
    """Replace the block between <!-- bench:NAME --> and <!-- /bench:NAME --> (append it if absent)."""
    begin, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    block = f"{begin}\n### {name} ({time.strftime('%Y-%m-%d')})\n\n{md.strip()}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmarks\n\n## Results\n"
    pattern = re.compile(re.escape(begin) + ".*?" + re.escape(end), re.S)
    text = pattern.sub(lambda _: block, text) if pattern.search(text) else text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)
