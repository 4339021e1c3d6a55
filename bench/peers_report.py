"""The pure part of ``python -m bench serve-vs-vllm``: workloads, prompt counts, level summaries,
the best peer per level, the goals, CPU per output token, the markdown and the plot.

Nothing here starts a server; bench/serve_peers.py runs them and hands the figures over.
Method and details: bench/README.md, section ``bench/serve_peers.py``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from bench import common

# ``vllm bench serve`` result keys we keep (ms, tok/s, req/s, s).
METRICS = ("completed", "failed", "num_prompts", "total_input_tokens", "total_output_tokens", "duration",
           "request_throughput", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
           "median_itl_ms", "p99_itl_ms", "median_e2el_ms", "p99_e2el_ms")
OURS = "kvwire"
TOK_S_GOAL = 1.2  # ours >= 1.2x the best peer's output tok/s
TTFT_TAIL_GOAL, TTFT_TAIL_MAX_CONCURRENCY = 2.0, 16  # TTFT p99 <= 2x our p50 at concurrency <= 16
ITL_TAIL_GOAL = 3.0  # ITL p99 <= 3x our ITL p50


@dataclass(frozen=True)
class Workload:
    name: str
    input_len: int
    output_len: int
    prompts: dict[int, int]  # default prompts per concurrency level (each level >= ~20 s on 2 cores)


WORKLOADS = {
    "short": Workload("short", 128, 32, {1: 64, 4: 128, 16: 256, 32: 384}),
    "long": Workload("long", 512, 256, {1: 8, 4: 24, 16: 64, 32: 128}),
}


def parse_levels(spec: str) -> dict[int, int]:
    """'1:12,4:40' -> {1: 12, 4: 40} (concurrency: prompts)."""
    out = {}
    for part in (p.strip() for p in spec.split(",") if p.strip()):
        c, sep, n = part.partition(":")
        if not sep or int(c) < 1 or int(n) < 1:
            raise ValueError(f"bad level {part!r}: want CONCURRENCY:PROMPTS, both >= 1")
        out[int(c)] = int(n)
    return out


def prompts_plan(workloads: list[str], concurrency: list[int], specs: list[str],
                 num_prompts: int | None = None) -> dict[str, dict[int, int]]:
    """{workload: {concurrency: prompts}}. ``specs``: '1:12,4:40' (every workload) or 'long=1:4,4:16'
    (that one); later specs win. Where no spec names a level: ``num_prompts`` when given, else the
    workload's default (WORKLOADS), else 8 x concurrency."""
    given: dict[str, dict[int, int]] = {w: {} for w in workloads}
    for spec in specs:
        name, sep, levels = spec.partition("=")
        if sep and name.strip() not in given:
            raise ValueError(f"--prompts-per-level {spec!r}: workload {name.strip()!r} is not run ({', '.join(workloads)})")
        for w in ([name.strip()] if sep else workloads):
            given[w].update(parse_levels(levels if sep else spec))
    plan = {}
    for w in workloads:
        default = WORKLOADS[w].prompts if w in WORKLOADS else {}
        plan[w] = {c: given[w].get(c) or num_prompts or default.get(c) or 8 * c for c in concurrency}
    return plan


def extended_prompts(num_prompts: int, duration_s: float, min_level_s: float, cap: int) -> int | None:
    """Prompts for a rerun of a level that lasted ``duration_s`` < ``min_level_s``: scaled to 1.25x
    the minimum at the measured rate, capped; None when no rerun is needed (or possible)."""
    if min_level_s <= 0 or not duration_s or duration_s >= min_level_s or num_prompts >= cap:
        return None
    return min(cap, max(num_prompts + 1, math.ceil(num_prompts * 1.25 * min_level_s / duration_s)))


def level_summary(result: dict, concurrency: int) -> dict:
    """The figures we report from one ``vllm bench serve`` result JSON."""
    s = {k: result.get(k) for k in METRICS}
    s["concurrency"] = concurrency
    if s["failed"] is None and s["num_prompts"] is not None and s["completed"] is not None:
        s["failed"] = s["num_prompts"] - s["completed"]
    done = s["completed"] or 0
    s["mean_output_tokens"] = (s["total_output_tokens"] or 0) / done if done else None
    return s


def cpu_per_token(level: dict) -> dict[str, float | None]:
    """CPU seconds per output token of each measured process (and the load generator), for one level."""
    cpu, tokens = level.get("cpu") or {}, level.get("total_output_tokens") or 0
    per = {name: (s / tokens if tokens else None) for name, s in (cpu.get("processes") or {}).items()}
    if cpu.get("client_s") is not None:
        per["load generator"] = cpu["client_s"] / tokens if tokens else None
    return per


def eligible(level: dict | None) -> bool:
    """A level that can be compared: some requests done, none failed."""
    return bool(level) and bool(level.get("completed")) and not level.get("failed")


def levels_at(report: dict, workload: str, concurrency: int) -> dict[str, dict]:
    """{server: its level} at one workload and concurrency (servers that ran it)."""
    out = {}
    for name, srv in report["servers"].items():
        for lv in (srv.get("workloads") or {}).get(workload, []):
            if lv["concurrency"] == concurrency:
                out[name] = lv
    return out


def best(levels: dict[str, dict], key: str, higher: bool) -> str | None:
    """The server whose eligible level is best at ``key`` (ties: the first); None when none is."""
    ok = [(n, lv[key]) for n, lv in levels.items() if eligible(lv) and lv.get(key) is not None]
    if not ok:
        return None
    return (max if higher else min)(ok, key=lambda x: x[1])[0]


def family(report: dict, server: str) -> str:
    return report["servers"][server].get("family", server)


def compare(report: dict, workload: str, concurrency: int) -> dict:
    """Per level: the best configuration of each peer family (by output tok/s), the best peer by
    output tok/s and by TTFT p50 (every peer configuration at its best for that figure), the goals."""
    levels = levels_at(report, workload, concurrency)
    peers = {n: lv for n, lv in levels.items() if family(report, n) != OURS}
    families = sorted({family(report, n) for n in peers})
    by_family = {f: best({n: lv for n, lv in peers.items() if family(report, n) == f}, "output_throughput", True)
                 for f in families}
    tok, ttft = best(peers, "output_throughput", True), best(peers, "median_ttft_ms", False)
    ours = levels.get(OURS)
    return {"concurrency": concurrency, "best_by_family": by_family, "best_tok_s": tok, "best_ttft": ttft,
            "goals": goals(ours, peers.get(tok), peers.get(ttft), concurrency, tok, ttft)}


def _ratio(a, b):
    return a / b if a is not None and b else None


def goals(ours: dict | None, tok_peer: dict | None, ttft_peer: dict | None, concurrency: int,
          tok_name: str | None = None, ttft_name: str | None = None) -> list[dict]:
    """Every goal of one level: {goal, target, value, met}; met is True, False, or None (not
    checkable: no figures, no peer, or not a goal at this concurrency), never left out."""
    o = ours or {}
    out = []

    def add(goal, target, value, met):
        out.append({"goal": goal, "target": target, "value": value, "met": met})

    done, n = o.get("completed"), o.get("num_prompts")
    add("every request completed", f"{n if n is not None else '?'} of {n if n is not None else '?'}, 0 failed",
        f"{done} done, {o.get('failed')} failed" if ours else None,
        None if not ours else bool(done) and not o.get("failed") and (n is None or done == n))
    r = _ratio(o.get("output_throughput"), (tok_peer or {}).get("output_throughput"))
    add("output tok/s >= 1.2x the best peer's", f">= {TOK_S_GOAL:.2f}x {tok_name or 'no peer'}",
        r, None if r is None else r >= TOK_S_GOAL)
    a, b = o.get("median_ttft_ms"), (ttft_peer or {}).get("median_ttft_ms")
    add("TTFT p50 <= the best peer's", f"<= {common.fmt(b, 0)} ms ({ttft_name or 'no peer'})", a,
        None if a is None or b is None else a <= b)
    p50, p99 = o.get("median_ttft_ms"), o.get("p99_ttft_ms")
    if concurrency <= TTFT_TAIL_MAX_CONCURRENCY:
        r = _ratio(p99, p50)
        add("TTFT p99 <= 2x our TTFT p50", f"<= {TTFT_TAIL_GOAL:.1f}x", r, None if r is None else r <= TTFT_TAIL_GOAL)
    else:
        add("TTFT p99 <= 2x our TTFT p50", f"only at concurrency <= {TTFT_TAIL_MAX_CONCURRENCY}",
            _ratio(p99, p50), None)
    r = _ratio(o.get("p99_itl_ms"), o.get("median_itl_ms"))
    add("ITL p99 <= 3x our ITL p50", f"<= {ITL_TAIL_GOAL:.1f}x", r, None if r is None else r <= ITL_TAIL_GOAL)
    return out


def met_text(met: bool | None, applicable: bool = True) -> str:
    if met is None:
        return "n/a" if not applicable else "not checked"
    return "met" if met else "**not met**"


def _value(g: dict) -> str:
    v = g["value"]
    if v is None:
        return "-"
    if isinstance(v, str):
        return v
    return f"{v:.0f} ms" if g["goal"].startswith("TTFT p50") else f"{v:.2f}x"


def _levels(report: dict, workload: str) -> list[int]:
    return sorted({lv["concurrency"] for srv in report["servers"].values()
                   for lv in (srv.get("workloads") or {}).get(workload, [])})


def markdown(report: dict) -> str:
    f = common.fmt
    servers = report["servers"]
    head = [
        f"kvwire ({report.get('kvwire_shape', 'split')}: weights {report['weights']}, KV {report['kv_dtype']}"
        f"{', decode_svc ' + report['decode_args'] if report.get('decode_args') else ''}) against every peer "
        f"configuration below, model {report['model']} (the same weights: vLLM serves them exported to an HF "
        f"directory, llama.cpp the GGUF). Every server is driven by `vllm bench serve --backend openai --endpoint "
        f"/v1/completions --dataset-name random --ignore-eos` (the same seed: the same prompts), one server after "
        f"the other, {report.get('warmups', 'no')} warm-up requests per level (= its concurrency unless set). "
        f"Temperature: {'each server default' if report.get('temperature') is None else report['temperature']}. "
        f"A level shorter than {report.get('min_level_s', 0):g} s is rerun with proportionally more prompts.",
        common_machine(report), ""]
    rows = [[f"`{n}`", s.get("family", n), f"`{s.get('command', '-')}`", f(s.get("startup_s"), 0),
             " -> ".join(f"{x:.2f}" for x in s.get("load_avg_1m", [])) or "-"]
            for n, s in servers.items()]
    parts = head + ["Servers (the exact command lines; a peer's configurations each run as their own server):", "",
                    common.table(["server", "family", "command", "start s", "load avg 1m"], rows), ""]
    for name, why in (report.get("errors") or {}).items():
        parts.append(f"- `{name}` did not complete: {why}")
    if report.get("errors"):
        parts.append("")
    for w, spec in report["workloads"].items():
        parts += [f"#### Workload {w}: random {spec['input_len']} tokens in, {spec['output_len']} out", "",
                  _per_server(report, w), "", _comparison(report, w), "", _goals_table(report, w), "",
                  _cpu_table(report, w), ""]
    return "\n".join(parts).rstrip() + "\n"


def common_machine(report: dict) -> str:
    from bench import machine
    m = report.get("machine")
    return machine.describe(m) if m else ""


def _per_server(report: dict, w: str) -> str:
    f = common.fmt
    rows = []
    for c in _levels(report, w):
        for n, lv in levels_at(report, w, c).items():
            short = " (short)" if lv.get("duration") and lv["duration"] < report.get("min_level_s", 0) else ""
            rows.append([c, f"`{n}`", f"{lv.get('completed')} / {lv.get('failed')}",
                         f"{f(lv.get('duration'), 0)}{short}", f(lv.get("output_throughput")),
                         f(lv.get("request_throughput"), 2), f(lv.get("median_ttft_ms"), 0),
                         f(lv.get("p99_ttft_ms"), 0), f(lv.get("median_itl_ms")), f(lv.get("p99_itl_ms")),
                         f(lv.get("median_tpot_ms")), f(lv.get("median_e2el_ms"), 0)])
    return common.table(["concurrency", "server", "done / failed", "level s", "output tok/s", "req/s",
                         "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms", "TPOT p50 ms", "E2E p50 ms"], rows)


def _comparison(report: dict, w: str) -> str:
    f = common.fmt
    fams = sorted({s.get("family", n) for n, s in report["servers"].items()} - {OURS})
    rows = []
    for c in _levels(report, w):
        cmp, lv = compare(report, w, c), levels_at(report, w, c)
        ours = lv.get(OURS, {})
        cells = [c, f(ours.get("output_throughput"))]
        for fam in fams:
            b = cmp["best_by_family"].get(fam)
            cells.append(f"{f(lv[b]['output_throughput'])} (`{b}`)" if b else "-")
        tok, ttft = cmp["best_tok_s"], cmp["best_ttft"]
        cells += [common.ratio(ours.get("output_throughput"), lv[tok]["output_throughput"] if tok else None),
                  f(ours.get("median_ttft_ms"), 0),
                  f"{f(lv[ttft]['median_ttft_ms'], 0)} (`{ttft}`)" if ttft else "-",
                  common.ratio(ours.get("median_ttft_ms"), lv[ttft]["median_ttft_ms"] if ttft else None)]
        rows.append(cells)
    header = (["concurrency", "kvwire tok/s"] + [f"best {fam} tok/s (config)" for fam in fams]
              + ["tok/s ratio vs best peer", "kvwire TTFT p50 ms", "best peer TTFT p50 ms", "TTFT ratio"])
    return ("Against each peer's faster configuration at that level (output tok/s; the TTFT column takes the "
            "peer configuration with the lowest TTFT p50). Only levels with every request done count.\n\n"
            + common.table(header, rows))


def _goals_table(report: dict, w: str) -> str:
    rows = []
    for c in _levels(report, w):
        for g in compare(report, w, c)["goals"]:
            applicable = not g["target"].startswith("only at")
            rows.append([c, g["goal"], g["target"], _value(g), met_text(g["met"], applicable)])
    return "Goals (every one, every level):\n\n" + common.table(["concurrency", "goal", "target", "kvwire", "status"],
                                                               rows)


def _cpu_table(report: dict, w: str) -> str:
    f = common.fmt
    rows = []
    for c in _levels(report, w):
        for n, lv in levels_at(report, w, c).items():
            cpu = lv.get("cpu") or {}
            per = cpu_per_token(lv)
            window, client = cpu.get("window_s"), cpu.get("client_s")
            ms = {p: (v * 1e3 if v is not None else None) for p, v in per.items()}
            procs = "; ".join(f"{p} {f(v, 2)}" for p, v in ms.items() if p != "load generator")
            total = sum((cpu.get("processes") or {}).values())
            rows.append([c, f"`{n}`", procs or "-", f(ms.get("load generator"), 2),
                         f(total / window if window else None, 2),
                         f(client / window if window and client is not None else None, 2)])
    return ("Where the cores go: CPU ms per output token of each process tree (utime + stime, children included, "
            "from /proc, sampled when the load generator starts its main run and when it exits) and cores busy "
            "over that window.\n\n"
            + common.table(["concurrency", "server", "server processes, CPU ms / output token",
                            "load generator CPU ms / token", "server cores busy", "load generator cores busy"], rows))


def plot(report: dict, out: Path, stem: str) -> list[Path]:
    """Output tok/s (top) and TTFT p50 (bottom) against concurrency, one line per server, one column
    per workload."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ws = list(report["workloads"])
    fig, axes = plt.subplots(2, len(ws), figsize=(6 * len(ws), 8), squeeze=False)
    for col, w in enumerate(ws):
        cs = _levels(report, w)
        for i, (name, srv) in enumerate(report["servers"].items()):
            lv = sorted((srv.get("workloads") or {}).get(w, []), key=lambda x: x["concurrency"])
            if not lv:
                continue
            style = dict(marker="o", color=f"C{i % 10}", label=name, lw=2.5 if name == OURS else 1.5)
            axes[0][col].plot([x["concurrency"] for x in lv], [x.get("output_throughput") for x in lv], **style)
            axes[1][col].plot([x["concurrency"] for x in lv], [x.get("median_ttft_ms") for x in lv], **style)
        spec = report["workloads"][w]
        for row, (label, log_y) in enumerate((("output tokens/s", False), ("TTFT p50 (ms)", True))):
            ax = axes[row][col]
            ax.set(xscale="log", xlabel="concurrency", ylabel=label,
                   title=f"{w}: {spec['input_len']} in / {spec['output_len']} out")
            if log_y:
                ax.set_yscale("log")
            if cs:
                ax.set_xticks(cs, [str(c) for c in cs])
                ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
            ax.grid(alpha=0.3)
            ax.legend(fontsize=8)
    fig.suptitle(f"{report['model']}: served output tok/s and TTFT p50 against concurrency")
    fig.tight_layout()
    path = out / f"{stem}-peers.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return [path]
