"""The results tables in README.md and docs/benchmarks.md, generated from committed benchmark JSON.

    python -m bench report                    # exit 1 if README.md or docs/benchmarks.md is stale
    python -m bench report --write            # rewrite both generated blocks from docs/results/
    python -m bench report --add bench/out/engine-smollm2-135m-instruct-20261205-090000.json [--command "..."]

A run's JSON (``common.save``: date, command, machine facts) is committed as
``docs/results/<machine-slug>/<benchmark>-<model>.json``: one file per machine, benchmark and model,
the latest run replacing the one before (the history is told in CHANGELOG.md). ``python -m bench
NAME ... --save-results`` copies it there after the run; ``--add`` does it for a file already run.
The README's headline table (one machine, one command per row) goes between
``<!-- results:begin -->`` and ``<!-- results:end -->``; docs/benchmarks.md's "Latest results",
one subsection per machine and benchmark (each module's own ``markdown()``), between the same
markers there. Nothing here measures: it only reads JSON.
"""
from __future__ import annotations

import argparse
import importlib
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench import common

RESULTS = common.ROOT / "docs" / "results"
README = common.ROOT / "README.md"
BENCHMARKS_DOC = common.DOCS
BEGIN, END = "<!-- results:begin -->", "<!-- results:end -->"
MODULES = {"engine": "bench.engine", "accuracy": "bench.accuracy", "speculative": "bench.speculative",
           "disagg": "bench.disagg", "serve": "bench.serve", "tokenizer": "bench.tokenizer", "kv": "bench.kv",
           "prefix": "bench.prefix", "serve-vs-vllm": "bench.serve_peers", "memory": "bench.memory",
           "capacity": "bench.capacity", "lm-eval": "bench.lmeval"}
ORDER = ("engine", "accuracy", "speculative", "disagg", "capacity", "serve-vs-vllm")  # the README's rows, in this order
ISA_TAGS = (("avx512f", "avx512"), ("avx512_vnni", "vnni"), ("avx512_bf16", "bf16"), ("avx512_fp16", "fp16"),
            ("amx_int8", "amx"))


@dataclass(frozen=True)
class Row:
    """One line of the headline table: what, ours, against what, ratio, and the command that measured it."""
    measure: str
    ours: str
    baseline: str
    ratio: str
    command: str


def machine_slug(m: dict) -> str:
    """'AMD EPYC' + avx512f/avx512_vnni/avx512_bf16 -> 'amd-epyc-avx512-vnni-bf16' (the vendor and family
    from the CPU's model name, then the instruction sets the kernels choose between)."""
    name = re.sub(r"\((r|tm)\)|\bprocessor\b|\bcpu\b|@.*$", " ", m.get("cpu", "unknown"), flags=re.I)
    words = [w for w in re.split(r"[^a-z0-9]+", name.lower()) if w][:2] or ["unknown"]
    isa = set(m.get("isa", []))
    tags = [tag for flag, tag in ISA_TAGS if flag in isa] or (["avx2"] if "avx2" in isa else [])
    gpu = [re.sub(r"[^a-z0-9]+", "-", m["gpu"].lower()).strip("-")] if m.get("gpu") else []
    return "-".join(words + tags + gpu)


def ingest(path: Path, command: str | None = None, root: Path = RESULTS) -> Path:
    """Copy one run's JSON to root/<machine-slug>/<benchmark>-<model>.json (stamped as common.save does:
    a report written before it stamped gets the date of its file and this machine's facts)."""
    report = json.loads(Path(path).read_text())
    if "date" not in report:
        m = re.search(r"-(\d{4})(\d{2})(\d{2})-\d{6}\.json$", Path(path).name)
        report["date"] = "-".join(m.groups()) if m else None
    had_machine = "machine" in report
    common.stamp(report)
    if not had_machine:  # a report saved before common.stamp existed: these are this machine's facts now
        report["machine"]["load_avg_when"] = "when copied into docs/results (the run recorded none)"
    if command:
        report["command"] = command
    if not report.get("command"):
        raise SystemExit(f"{path}: no command recorded; pass --command")
    report.pop("files", None)  # paths under bench/out/ on the machine that ran it
    report = _without_local_paths(report, str(common.ROOT) + "/")
    dest = root / machine_slug(report["machine"]) / f"{report['benchmark']}-{report.get('model', 'x')}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps(report, indent=2, default=str) + "\n")
    return dest


def _without_local_paths(v: Any, root_prefix: str) -> Any:
    """Every path string, however deeply nested: inside the checkout relative to it (as committed),
    elsewhere its file name only (where it lay is this machine's business)."""
    if isinstance(v, dict):
        return {k: _without_local_paths(x, root_prefix) for k, x in v.items()}
    if isinstance(v, list):
        return [_without_local_paths(x, root_prefix) for x in v]
    if isinstance(v, str) and v.startswith(root_prefix):
        return v.removeprefix(root_prefix)
    if isinstance(v, str) and v.startswith("/") and Path(v).exists():
        return Path(v).name
    return v


def load(root: Path = RESULTS) -> dict[str, list[dict]]:
    """{machine slug: its reports, in ORDER then by name}."""
    out = {}
    for d in sorted(p for p in root.iterdir() if p.is_dir()) if root.exists() else []:
        reports = [json.loads(f.read_text()) for f in sorted(d.glob("*.json"))]
        rank = {b: i for i, b in enumerate(ORDER)}
        out[d.name] = sorted(reports, key=lambda r: (rank.get(r["benchmark"], len(ORDER)), r["benchmark"],
                                                     r.get("model", "")))
    return out


def _batched(r: dict, b: int):
    bt = r.get("batched_tok_s") or {}
    return bt.get(str(b), bt.get(b))


def _best(peers: list[dict], get) -> dict | None:
    ok = [p for p in peers if get(p)]
    return max(ok, key=get) if ok else None


def engine_rows(rep: dict) -> list[Row]:
    ok = [r for r in rep["results"] if not r.get("error")]
    ours = next((r for r in ok if r["engine"] == "kvwire int8/fp8_e4m3"),
                next((r for r in ok if r.get("kind") == "kvwire"), None))
    peers = [r for r in ok if r.get("kind") != "kvwire"]
    if ours is None:
        return []
    b_max = max(rep["batches"])
    metrics = [(f"Decode, batch 1, after a {rep['prompt_len']}-token prompt (tok/s)", lambda r: r.get("decode_tok_s")),
               (f"Decode, batch {b_max} x {rep['batch_ctx']}-token contexts (tok/s)", lambda r: _batched(r, b_max)),
               (f"Prefill, {rep['prompt_len']} tokens (tok/s)", lambda r: r.get("prefill_tok_s"))]
    rows = []
    for i, (label, get) in enumerate(metrics):
        best = _best(peers, get)
        extra = f", {ours['roofline_pct']:.0f}% of roofline" if i == 0 and "roofline_pct" in ours else ""
        rows.append(Row(f"{label}, {ours['engine'].removeprefix('kvwire ')}", f"{get(ours):.1f}{extra}",
                        f"{get(best):.1f} ({best['engine']}, best peer)" if best else "no peer run",
                        common.ratio(get(ours), get(best)) if best else "-", rep["command"]))
    return rows


def accuracy_rows(rep: dict) -> list[Row]:
    r = rep["results"]
    base, mine = r["bf16/bf16"]["perplexity"], r.get("int8/fp8_e4m3")
    if mine is None:
        return []
    q8 = (rep.get("llamacpp") or {}).get("q8_0")
    peer = f"; llama.cpp q8_0 {q8:.3f} ({100 * (q8 / base - 1):+.2f}%)" if isinstance(q8, float) else ""
    return [Row(f"Perplexity, int8 weights / FP8 KV, {rep['held_out_tokens']} held-out tokens",
                f"{mine['perplexity']:.3f}", f"{base:.3f} (bf16 / bf16 KV){peer}",
                f"{100 * (mine['perplexity'] / base - 1):+.2f}%", rep["command"])]


def speculative_rows(rep: dict) -> list[Row]:
    rows = []
    for mode, label in (("ngram", "n-gram prompt lookup"), ("draft", "draft head")):
        for r in rep["results"]:
            if r["task"] == "grounded" and r["batch"] == 1 and r["mode"] == mode:
                plain = next(x for x in rep["results"] if x["task"] == "grounded" and x["batch"] == 1
                             and x["mode"] == "none")
                same = "identical" if r.get("identical_to_none") in (True, "yes", 1) else "NOT identical"
                rows.append(Row(f"Speculative decoding, {label}, grounded prompts, batch 1 (tok/s; output {same} "
                                "to plain)", f"{r['tok_s']:.1f}", f"{plain['tok_s']:.1f} (plain decoding)",
                                f"{r['speedup']:.2f}x" if isinstance(r["speedup"], (int, float)) else str(r["speedup"]),
                                rep["command"]))
    return rows


def disagg_rows(rep: dict) -> list[Row]:
    rows = []
    for r in rep["rows"]:
        s, p = r["served"], r["in_process"]
        rows.append(Row(f"Time to first token, {r['prompt_tokens']}-token prompt, through the front door (ms)",
                        f"{r['front_door_ttft_ms']:.0f}", f"{p['ttft_ms']:.0f} (in-process `LLM`)",
                        common.ratio(r["front_door_ttft_ms"], p["ttft_ms"]), rep["command"]))
        rows.append(Row("Inter-token latency, served (ms)", f"{s['itl_ms']:.2f}", f"{p['itl_ms']:.2f} (in-process)",
                        f"{s['itl_ms'] - p['itl_ms']:+.2f} ms", rep["command"]))
    for c in rep.get("concurrent", []):
        rows.append(Row(f"{c['requests']} prompts at once, served (output tok/s)", f"{c['served_tok_s']:.1f}",
                        f"{c['in_process_tok_s']:.1f} (in-process, batched)",
                        common.ratio(c["served_tok_s"], c["in_process_tok_s"]), rep["command"]))
    return rows


def capacity_rows(rep: dict) -> list[Row]:
    by = {r["mode"]: r for r in rep["modes"] if not r.get("error")}
    head, base = by.get("int8/fp8_e4m3"), by.get("bf16/bf16")
    if not head or not base or not head.get("observed") or not base.get("observed"):
        return []
    seq = rep["prompt_len"] + rep["output_len"]
    rows = [Row(f"{rep['budget_mb']:g} MiB of KV pages: {seq}-token sequences held at once, served", str(head["observed"]),
                f"{base['observed']} (bf16 weights, bf16 pages)", f"{head['observed'] / base['observed']:.2f}x",
                rep["command"])]
    a = next((lv for lv in head.get("levels", []) if lv["concurrency"] == head["observed"]), None)
    b = next((lv for lv in base.get("levels", []) if lv["concurrency"] == base["observed"]), None)
    if a and b:
        rows.append(Row(f"{rep['budget_mb']:g} MiB of KV pages: output tok/s at that load ({rep['prompt_len']} in, "
                        f"{rep['output_len']} out), int8/fp8_e4m3", f"{a['output_throughput']:.1f}",
                        f"{b['output_throughput']:.1f} (bf16 weights, bf16 pages)",
                        common.ratio(a["output_throughput"], b["output_throughput"]), rep["command"]))
    return rows


def serve_peers_rows(rep: dict) -> list[Row]:
    """Per workload: our output tok/s and TTFT p50 at each concurrency against the best peer configuration there."""
    from bench import peers_report as pr
    rows = []
    for w, spec in rep.get("workloads", {}).items():
        cs = pr._levels(rep, w)
        cmp = [pr.compare(rep, w, c) for c in cs]
        for label, key, best_key in (("output tok/s", "output_throughput", "best_tok_s"),
                                     ("TTFT p50 ms", "median_ttft_ms", "best_ttft")):
            ours = [pr.levels_at(rep, w, c).get(pr.OURS, {}).get(key) for c in cs]
            peer = [pr.levels_at(rep, w, c).get(x[best_key] or "", {}).get(key) for c, x in zip(cs, cmp)]
            names = sorted({x[best_key] for x in cmp if x[best_key]})
            rows.append(Row(f"Served {label}, {w} ({spec['input_len']} in / {spec['output_len']} out), concurrency "
                            + " / ".join(map(str, cs)),
                            " / ".join(common.fmt(v, 0 if key != "output_throughput" else 1) for v in ours),
                            " / ".join(common.fmt(v, 0 if key != "output_throughput" else 1) for v in peer)
                            + f" (best peer per level: {', '.join(names)})",
                            " / ".join(common.ratio(a, b).strip("*") if a and b else "-" for a, b in zip(ours, peer)),
                            rep["command"]))
    return rows


def lm_eval_rows(rep: dict) -> list[Row]:
    """lm-evaluation-harness's scores through the OpenAI door against the same harness on transformers."""
    d, h, c = rep["door"], rep["hf"], rep["comparison"]
    return [Row(f"lm-evaluation-harness {m} (%) through the OpenAI door, {d['samples']} local multiple-choice "
                f"questions, weights {d['weights']} / KV {d['kv_dtype']}", f"{100 * d[m]:.2f}",
                f"{100 * h[m]:.2f} (the same harness on transformers, same GGUF)", f"{c[f'{m}_points']:+.2f} points",
                rep["command"]) for m in ("acc", "acc_norm")]


ROWS = {"engine": engine_rows, "accuracy": accuracy_rows, "speculative": speculative_rows, "disagg": disagg_rows,
        "capacity": capacity_rows, "serve-vs-vllm": serve_peers_rows, "lm-eval": lm_eval_rows}


def _dates(reports: list[dict]) -> str:
    ds = sorted({r.get("date") or "undated" for r in reports})
    return ds[0] if len(ds) == 1 else f"{ds[0]} to {ds[-1]}"


def _peak_load(rep: dict) -> float | None:
    """The highest 1-minute load average a run recorded: the machine's at the start, or any server's
    (serve-vs-vllm samples one before and after each server, so work that started mid-run shows)."""
    seen = [rep["machine"].get("load_avg_1m")] + [x for s in rep.get("servers", {}).values()
                                                  for x in s.get("load_avg_1m") or []]
    seen = [x for x in seen if x is not None]
    return max(seen) if seen else None


def _machine_line(reports: list[dict]) -> str:
    m = next((r["machine"] for r in reports if r["machine"].get("read_bandwidth_gbs")), reports[0]["machine"])
    loads = ", ".join(f"{r['benchmark']} {_peak_load(r) if _peak_load(r) is not None else '-'}" for r in reports)
    bw = f", {m['read_bandwidth_gbs']} GB/s read bandwidth" if m.get("read_bandwidth_gbs") else ""
    line = (f"{m['cpu']}, {m['cores']} cores, {m.get('memory_gib', '-')} GiB, ISA {' '.join(m.get('isa', [])) or '-'}"
            f"{bw}; torch {m.get('torch', '-')}; 1-minute load average ({loads})")
    if any("cpu_family" in r["machine"] for r in reports):  # one slug can hold two CPU generations
        line += "; CPU family / model per run (" + ", ".join(
            f"{r['benchmark']} {r['machine'].get('cpu_family', '?')}/{r['machine'].get('cpu_model', '?')}"
            for r in reports) + ", ? = not recorded)"
    return line


def _load_warning(reports: list[dict]) -> str:
    """A sentence when some run had more runnable work than cores: OpenMP barriers then wait for
    threads held off their cores, and absolute figures (ours and peers' alike) fall far below an idle
    machine's."""
    busy = [r for r in reports if (_peak_load(r) or 0) > (r["machine"].get("cores") or 1)]
    if not busy:
        return ""
    worst = max(busy, key=_peak_load)
    return (f" **The machine was oversubscribed during {', '.join(r['benchmark'] for r in busy)} (load average up "
            f"to {_peak_load(worst)} on {worst['machine']['cores']} cores): absolute figures there "
            "are far below an idle machine's and ratios are noisy; idle runs are in CHANGELOG.md's history.**")


def headline(results: dict[str, list[dict]]) -> str:
    """The README table: the machine with the most headline benchmarks (ties: the latest), one row each."""
    def key(item):
        slug, reps = item
        return (sum(r["benchmark"] in ROWS for r in reps), max(r.get("date") or "" for r in reps))
    if not results:
        return "No results committed yet (`python -m bench report --add FILE`).\n"
    slug, reps = max(results.items(), key=key)
    rows = [row for r in reps if r["benchmark"] in ROWS for row in ROWS[r["benchmark"]](r)]
    body = [[x.measure, x.ours, x.baseline, f"**{x.ratio}**", f"`{x.command}`"] for x in rows]
    models = sorted({r.get("model", "-") for r in reps if r["benchmark"] in ROWS})
    return (f"Measured {_dates(reps)} on {_machine_line([r for r in reps if r['benchmark'] in ROWS])}; "
            f"model {', '.join(models)}. One run each, ratios within a run; generated by `python -m bench report "
            f"--write` from [docs/results/{slug}/](docs/results/{slug}/), more in "
            f"[docs/benchmarks.md](docs/benchmarks.md#latest-results).{_load_warning(reps)}\n\n"
            + common.table(["measure", "kvwire", "baseline", "ratio", "command"], body) + "\n")


def latest(results: dict[str, list[dict]]) -> str:
    """docs/benchmarks.md's latest results: per machine, per benchmark its module's markdown()."""
    parts = []
    for slug, reps in results.items():
        parts += [f"### {reps[0]['machine']['cpu']} (`{slug}`)", "",
                  _machine_line(reps) + "." + _load_warning(reps), ""]
        for r in reps:
            mod = importlib.import_module(MODULES[r["benchmark"]])
            parts += [f"#### {r['benchmark']}, {r.get('model', '-')} ({r.get('date') or 'undated'})", "",
                      f"`{r['command']}`", "", mod.markdown(r).strip(), ""]
    return "\n".join(parts) if parts else "No results committed yet.\n"


def replace_block(text: str, block: str) -> str:
    """text with everything between BEGIN and END replaced by block (both markers must be there once)."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"expected one {BEGIN} ... {END} pair")
    head, rest = text.split(BEGIN)
    return f"{head}{BEGIN}\n{block.strip()}\n{END}{rest.split(END, 1)[1]}"


def targets(results: dict[str, list[dict]], readme: Path = README,
            benchmarks: Path = BENCHMARKS_DOC) -> dict[Path, str]:
    """{file: its text with the generated block as the committed JSON says}."""
    return {readme: replace_block(readme.read_text(), headline(results)),
            benchmarks: replace_block(benchmarks.read_text(), latest(results))}


def stale(results: dict[str, list[dict]], readme: Path = README, benchmarks: Path = BENCHMARKS_DOC) -> list[Path]:
    return [p for p, text in targets(results, readme, benchmarks).items() if p.read_text() != text]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench report", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true", help="rewrite the generated blocks")
    ap.add_argument("--add", nargs="+", type=Path, default=[], help="copy these runs' JSON into docs/results/")
    ap.add_argument("--command", help="with --add: the command that ran it, when the JSON lacks one")
    ap.add_argument("--results", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    for p in args.add:
        print(f"[report] {p} -> {ingest(p, args.command, args.results)}")
    results = load(args.results)
    if args.write or args.add:
        for p, text in targets(results).items():
            p.write_text(text)
            print(f"[report] wrote {p.relative_to(common.ROOT)}")
        return
    old = stale(results)
    if old:
        sys.exit("stale: " + ", ".join(str(p.relative_to(common.ROOT)) for p in old)
                 + " (python -m bench report --write)")
    print("[report] README.md and docs/benchmarks.md match docs/results/")


if __name__ == "__main__":
    main()
