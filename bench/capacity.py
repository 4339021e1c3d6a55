"""Capacity at equal KV memory: how many sequences the decode pool holds, and the output tok/s
served at that load, per weights / KV-page mode.

    python -m bench capacity [--model smollm2-135m-instruct] [--budget-mb 64] \
        [--modes bf16/bf16,bf16/fp8,int8/fp8] [--prompt-len 960] [--output-len 64] [--waves 3]

For each mode the KV budget (MiB of decode_svc's page pool) becomes a page count from the real
page size (kvwire.kv.spec.KVPageSpec: FP8 pages carry per-token scales, bf16 pages are ~1.9x
larger); prefill_svc and decode_svc start with that pool. decode_svc reserves pages as sequences
grow and preempts when the pool runs short, so what a pool holds is the number of full-length
sequences that run at once without a preemption: the bench offers that many (the arithmetic's,
one fewer while the server preempted) reading GetPoolStats meanwhile (held = peak running), then
a probe offers more to show the pool's limit (preemptions or waiting); then closed-loop clients at
lower concurrencies and at that capacity measure output tok/s.
Goals: FP8 pages hold >= 1.9x the sequences of bf16 pages; int8 weights + FP8 KV serve >= 2x the
output tok/s of bf16 + bf16 KV. Method and details: bench/README.md, section ``bench/capacity.py``.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from tqdm import tqdm

from bench import common, machine
from bench.metrics import RequestRecord, summarize
from kvwire.config import KVDtype, ModelConfig, WeightsMode
from kvwire.kv.pool import BlockTables
from kvwire.kv.spec import KVPageSpec
from kvwire.model.registry import MODELS, resolve_model_path
from kvwire.model.source import load_config
from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc as pbg
from tools.stack import Stack

MB = 1 << 20  # the budget is in MiB, as bench/memory.py counts
DEFAULT_MODES = "bf16/bf16,bf16/fp8,int8/fp8"
KV_ALIASES = {"fp8": KVDtype.FP8_E4M3.value, "fp8_e4m3": KVDtype.FP8_E4M3.value, "bf16": KVDtype.BF16.value}
# The goals this benchmark checks (the project's headline claim).
SEQUENCES_GOAL = 1.9  # FP8 pages hold at least this x the sequences of bf16 pages
THROUGHPUT_GOAL = 2.0  # int8 weights + FP8 KV serve at least this x the output tok/s of bf16 + bf16 KV
BASELINE, HEADLINE = "bf16/bf16", "int8/fp8_e4m3"


# ---- the pure parts: pages, capacity, goals ------------------------------------------------------

def parse_modes(text: str) -> list[tuple[str, str]]:
    """'bf16/bf16,int8/fp8' -> [('bf16', 'bf16'), ('int8', 'fp8_e4m3')] (weights mode, KV dtype)."""
    modes = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        weights, _, kv = item.partition("/")
        if weights not in {m.value for m in WeightsMode} or kv not in KV_ALIASES:
            raise ValueError(f"mode {item!r}: expected WEIGHTS/KV with WEIGHTS in "
                             f"{', '.join(m.value for m in WeightsMode)} and KV in bf16, fp8")
        if (weights, KV_ALIASES[kv]) not in modes:
            modes.append((weights, KV_ALIASES[kv]))
    if not modes:
        raise ValueError("no mode given")
    return modes


def mode_name(weights: str, kv_dtype: str) -> str:
    return f"{weights}/{kv_dtype}"


def page_spec(cfg: ModelConfig, kv_dtype: str, block_size: int = 16) -> KVPageSpec:
    return KVPageSpec.for_model(cfg, block_size, KVDtype(kv_dtype))


def page_bytes(spec: KVPageSpec) -> int:
    """One page over all layers: K + V values, plus their scales for FP8 (what GetPoolStats reports)."""
    return spec.page_bytes_per_layer * spec.num_layers


def pages_for_budget(budget_mb: float, spec: KVPageSpec) -> int:
    """The most whole pages of ``spec`` that fit in ``budget_mb`` MiB."""
    return int(budget_mb * MB) // page_bytes(spec)


def pages_per_sequence(cfg: ModelConfig, spec: KVPageSpec, prompt_len: int, output_len: int) -> int:
    """Pages one sequence can hold at once: the engine's own reservation (BlockTables.max_pages:
    prompt + max_tokens, capped by a sliding window), no speculative lookahead."""
    return BlockTables(None, spec.block_size, cfg.sliding_window).max_pages(prompt_len, prompt_len + output_len)


def computed_capacity(pool_pages: int, per_sequence: int) -> int:
    """Full-length sequences a pool holds at once (decode_svc admits more while they are short
    and preempts the youngest when they outgrow the pool: kvwire/engine/scheduler.py)."""
    return pool_pages // per_sequence


def plan(cfg: ModelConfig, modes: list[tuple[str, str]], budget_mb: float, prompt_len: int, output_len: int,
         block_size: int = 16) -> list[dict]:
    """Per mode: its page size, pool pages and MiB within the budget, pages per sequence, and the
    sequences the pool holds by arithmetic."""
    rows = []
    for weights, kv in modes:
        spec = page_spec(cfg, kv, block_size)
        pages = pages_for_budget(budget_mb, spec)
        per_seq = pages_per_sequence(cfg, spec, prompt_len, output_len)
        rows.append({"mode": mode_name(weights, kv), "weights": weights, "kv_dtype": kv,
                     "page_bytes": page_bytes(spec), "pool_pages": pages, "pool_mb": pages * page_bytes(spec) / MB,
                     "pages_per_sequence": per_seq, "computed": computed_capacity(pages, per_seq)})
    return rows


def sweep_levels(requested: list[int], capacity: int) -> list[int]:
    """The concurrencies to drive: the requested ones below ``capacity``, and ``capacity`` itself."""
    return sorted({c for c in requested if 1 <= c < capacity} | ({capacity} if capacity >= 1 else set()))


def default_sweep(capacity: int) -> list[int]:
    """1, 2, 4, ... below capacity, then capacity."""
    out, c = [], 1
    while c < capacity:
        out.append(c)
        c *= 2
    return out + [capacity] if capacity >= 1 else []


def held(row: dict) -> int | None:
    """Sequences the pool held: observed (the server's peak running) where the run measured it."""
    return row.get("observed")


def at_capacity(row: dict) -> dict | None:
    """The level driven at concurrency = the sequences held (None if not run)."""
    n = held(row)
    return next((lv for lv in row.get("levels", []) if lv["concurrency"] == n), None)


def tok_s(row: dict | None) -> float | None:
    lv = at_capacity(row) if row else None
    return lv["output_throughput"] if lv and lv["completed"] else None


def _goal(goal: str, measured: float | None, target: float, detail: str) -> dict:
    return {"goal": goal, "measured": measured, "target": target,
            "met": None if measured is None else measured >= target, "detail": detail}


def goals(rows: list[dict]) -> list[dict]:
    """The two goals, met / not met / not measured (None), from the measured (observed) figures."""
    by = {r["mode"]: r for r in rows}
    # Sequences: FP8 against bf16 pages, same weights where both ran (the pool does not depend on the weights).
    pairs = [(by[mode_name(w, KVDtype.FP8_E4M3.value)], by[mode_name(w, KVDtype.BF16.value)])
             for w in dict.fromkeys(r["weights"] for r in rows)
             if mode_name(w, KVDtype.FP8_E4M3.value) in by and mode_name(w, KVDtype.BF16.value) in by]
    if not pairs:
        fp8 = [r for r in rows if r["kv_dtype"] == KVDtype.FP8_E4M3.value]
        bf16 = [r for r in rows if r["kv_dtype"] == KVDtype.BF16.value]
        pairs = [(fp8[0], bf16[0])] if fp8 and bf16 else []
    out = []
    if pairs:
        f, b = pairs[0]
        ratio = held(f) / held(b) if held(f) and held(b) else None
        out.append(_goal(f"FP8 pages hold >= {SEQUENCES_GOAL}x the sequences of bf16 pages", ratio, SEQUENCES_GOAL,
                         f"{f['mode']} held {held(f)}, {b['mode']} held {held(b)} (computed {f['computed']} and "
                         f"{b['computed']}; pages {f['pool_pages']} and {b['pool_pages']})"))
    else:
        out.append(_goal(f"FP8 pages hold >= {SEQUENCES_GOAL}x the sequences of bf16 pages", None, SEQUENCES_GOAL,
                         "needs a bf16-KV and an FP8-KV mode"))
    head, base = by.get(HEADLINE), by.get(BASELINE)
    a, b = tok_s(head), tok_s(base)
    detail = (f"{HEADLINE} {common.fmt(a)} tok/s at {held(head)} sequences, {BASELINE} {common.fmt(b)} tok/s at "
              f"{held(base)}" if head and base else f"needs modes {HEADLINE} and {BASELINE}")
    out.append(_goal(f"int8 weights + FP8 KV serve >= {THROUGHPUT_GOAL}x the output tok/s of bf16 + bf16 KV",
                     a / b if a and b else None, THROUGHPUT_GOAL, detail))
    return out


def verdict(g: dict) -> str:
    return "not measured" if g["met"] is None else "met" if g["met"] else "NOT met"


# ---- the measured part: a stack per mode ------------------------------------------------------------

@dataclass
class Peak:
    """The highest pool statistics GetPoolStats answered while a level ran."""
    running: int = 0
    waiting: int = 0
    used_pages: int = 0
    samples: int = 0
    preemptions: tuple[int, int] | None = None  # the server's count at the first and last sample
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict:
        return {"peak_running": self.running, "peak_waiting": self.waiting, "peak_used_pages": self.used_pages,
                "stats_samples": self.samples, "preemptions": self.preempted}

    @property
    def preempted(self) -> int | None:
        return None if self.preemptions is None else self.preemptions[1] - self.preemptions[0]


async def watch(stub, peak: Peak, stop: asyncio.Event, interval_s: float) -> None:
    while not stop.is_set():
        try:
            s = await stub.GetPoolStats(pb.GetPoolStatsRequest(), timeout=5)
            peak.running, peak.waiting = max(peak.running, s.running), max(peak.waiting, s.waiting)
            peak.used_pages, peak.samples = max(peak.used_pages, s.used_pages), peak.samples + 1
            first = s.num_preemptions if peak.preemptions is None else peak.preemptions[0]
            peak.preemptions = (first, s.num_preemptions)
        except grpc.RpcError as e:  # a missed sample is not a lost run
            peak.errors = peak.errors[-4:] + [f"{e.code().name}: {e.details()}"]
        try:
            await asyncio.wait_for(stop.wait(), interval_s)
        except asyncio.TimeoutError:
            pass


async def one_request(stub, ids: list[int], output_len: int, timeout_s: float) -> RequestRecord:
    rec = RequestRecord(start=time.perf_counter(), prompt_tokens=len(ids))
    try:
        async for msg in stub.GenerateTokens(pb.GenerateTokensRequest(
                prompt_token_ids=ids, sampling=pb.SamplingParams(max_tokens=output_len, ignore_eos=True)),
                timeout=timeout_s):
            if msg.token_ids:
                rec.chunks.append((time.perf_counter(), len(msg.token_ids)))
        rec.end = time.perf_counter()
        rec.output_tokens = sum(n for _, n in rec.chunks)
    except grpc.RpcError as e:
        rec.error = f"{e.code().name}: {e.details()}"
    return rec


async def drive(addr: str, prompts: list[list[int]], output_len: int, concurrency: int, desc: str,
                interval_s: float, timeout_s: float) -> tuple[list[RequestRecord], float, Peak]:
    """``concurrency`` closed-loop clients over ``prompts`` (each sends its next request as its last
    one ends), with decode_svc's pool statistics sampled every ``interval_s`` meanwhile."""
    queue: asyncio.Queue = asyncio.Queue()
    for p in prompts:
        queue.put_nowait(p)
    records: list[RequestRecord] = []
    peak, stop = Peak(), asyncio.Event()
    bar = tqdm(total=len(prompts), desc=desc, unit="req", leave=False)
    async with grpc.aio.insecure_channel(addr) as ch:
        stub = pbg.DecodeServiceStub(ch)

        async def client() -> None:
            while not queue.empty():
                records.append(await one_request(stub, queue.get_nowait(), output_len, timeout_s))
                bar.update()

        watcher = asyncio.create_task(watch(stub, peak, stop, interval_s))
        t0 = time.perf_counter()
        await asyncio.gather(*(client() for _ in range(concurrency)))
        duration = time.perf_counter() - t0
        stop.set()
        await watcher
        await watch(stub, peak, stop, 0)  # a last sample: the preemptions of the whole level
    bar.close()
    return records, duration, peak


def level_summary(records: list[RequestRecord], duration: float, peak: Peak, concurrency: int) -> dict:
    s = summarize(records, duration)
    tpot_s = s["tpot_ms"]["mean"] / 1e3
    keep = ("completed", "failed", "duration_s", "output_tokens", "request_throughput", "output_throughput",
            "total_token_throughput", "ttft_ms", "tpot_ms", "e2el_ms", "errors")
    return {"concurrency": concurrency, "requests": len(records), **{k: s[k] for k in keep}, **peak.as_dict(),
            # concurrency / mean TPOT: the rate while all of them decode, prefills not counted
            "decode_tok_s": concurrency / tpot_s if tpot_s > 0 else None, "load_avg_1m": round(os.getloadavg()[0], 2)}


def make_prompts(cfg: ModelConfig, n: int, length: int, rng: random.Random) -> list[list[int]]:
    """Random token ids (no BOS/EOS), a different prompt per request: the work depends on the
    lengths only (exact: token ids, ignore_eos), and no two prompts share a page."""
    special = set(cfg.eos_token_ids) | ({cfg.bos_token_id} if cfg.bos_token_id is not None else set())
    vocab = [i for i in range(cfg.vocab_size) if i not in special]
    return [[rng.choice(vocab) for _ in range(length)] for _ in range(n)]


async def pool_stats(addr: str) -> pb.GetPoolStatsResponse:
    async with grpc.aio.insecure_channel(addr) as ch:
        return await pbg.DecodeServiceStub(ch).GetPoolStats(pb.GetPoolStatsRequest(), timeout=10)


def log(msg: str) -> None:
    tqdm.write(f"[capacity] {msg}")


def run_mode(row: dict, cfg: ModelConfig, model_path: Path, args: argparse.Namespace, rng: random.Random) -> dict:
    """Start the stack with this mode's pool, probe the sequences it holds, sweep concurrency."""
    name, computed = row["mode"], row["computed"]
    probe_n = max(args.probe_factor * computed, computed + 2)
    prefill_pages = args.prefill_pages or 8 * -(-args.prompt_len // args.block_size) + 8
    max_running = args.max_running or max(16, row["pool_pages"])  # default: the pool, not this cap, bounds admission
    decode_flags = ["--max-running", str(max_running),
                    "--max-waiting", str(max(64, 2 * probe_n)), "--block-size", str(args.block_size),
                    "--speculative", "none", "--draft-model-dir", ""]
    log(f"{name}: starting prefill_svc + decode_svc ({row['pool_pages']} decode pages)")
    stack = Stack(model_dir=model_path, weights=row["weights"], kv_dtype=row["kv_dtype"],
                  decode_pages=row["pool_pages"], prefill_pages=prefill_pages, services=("prefill_svc", "decode_svc"),
                  extra={"decode_svc": decode_flags, "prefill_svc": ["--block-size", str(args.block_size)]},
                  env={"KVWIRE_DRAIN_DELAY_S": "0"}, log_dir=args.log_dir)  # no load balancer to tell at the end
    t_start = time.perf_counter()
    stack.start(timeout_s=args.start_timeout_s)
    try:
        addr = stack.addr("decode_svc")
        s = asyncio.run(pool_stats(addr))
        row["server"] = {"total_pages": s.total_pages, "page_bytes": s.page_bytes,
                         "pool_mb": s.total_pages * s.page_bytes / MB, "start_s": round(time.perf_counter() - t_start, 1)}
        if s.total_pages != row["pool_pages"] or s.page_bytes != row["page_bytes"]:
            raise RuntimeError(f"decode_svc's pool is {s.total_pages} pages of {s.page_bytes} B, the plan "
                               f"{row['pool_pages']} of {row['page_bytes']} B")

        def level(prompts: list[list[int]], c: int, desc: str, output_len: int = args.output_len) -> dict:
            records, duration, peak = asyncio.run(drive(addr, prompts, output_len, c, f"{name} {desc}",
                                                        args.stats_interval_s, args.request_timeout_s))
            return level_summary(records, duration, peak, c)

        # Warm-up: one full-length prompt, a few tokens (the kernels' first calls, not a measurement).
        warm = level(make_prompts(cfg, 1, args.prompt_len, rng), 1, "warm-up", min(8, args.output_len))
        if warm["failed"]:
            raise RuntimeError(f"warm-up request failed: {warm['errors']}")
        # Held: the full-length sequences that ran at once with no preemption (the arithmetic's count,
        # one fewer while the server preempted); then the probe offers more, to show the pool's limit.
        n = computed
        while n >= 1:
            fit = level(make_prompts(cfg, n, args.prompt_len, rng), n, f"{n} at once")
            if fit["preemptions"] == 0 and not fit["failed"]:
                break
            log(f"{name}: {n} sequences at once: {fit['preemptions']} preemptions, {fit['failed']} failed")
            n -= 1
        row["fit"] = fit if n >= 1 else None
        row["observed"] = fit["peak_running"] if n >= 1 else 0
        probe = level(make_prompts(cfg, probe_n, args.prompt_len, rng), probe_n, f"probe ({probe_n} offered)")
        row["probe"] = probe
        log(f"{name}: {n} full-length sequences ran at once with no preemption (peak running {row['observed']}, "
            f"computed {computed}); the probe offered {probe_n}: peak running {probe['peak_running']}, peak waiting "
            f"{probe['peak_waiting']}, {probe['preemptions']} preemptions, peak used pages {probe['peak_used_pages']}/"
            f"{row['pool_pages']}; {probe['completed']} done, {probe['failed']} failed")
        if row["observed"] != computed:
            log(f"{name}: the server held {row['observed']} sequences, the reservation arithmetic says {computed}")
        levels = default_sweep(row["observed"]) if args.sweep is None else sweep_levels(args.sweep, row["observed"])
        row["levels"] = []
        for c in levels:
            lv = level(make_prompts(cfg, args.waves * c, args.prompt_len, rng), c, f"concurrency {c}")
            row["levels"].append(lv)
            log(f"{name}: concurrency {c}: {lv['completed']}/{lv['requests']} done, {lv['output_throughput']:.1f} "
                f"out tok/s, peak running {lv['peak_running']}, TTFT p50 {common.fmt(lv['ttft_ms']['p50'], 0)} ms, "
                f"TPOT p50 {common.fmt(lv['tpot_ms']['p50'])} ms, decode {common.fmt(lv['decode_tok_s'])} tok/s, "
                f"load average {lv['load_avg_1m']}")
    finally:
        stack.stop()
    row["wall_s"] = round(time.perf_counter() - t_start, 1)
    return row


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m bench capacity", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", "--model-dir", dest="model", default="smollm2-135m-instruct",
                    help="a registered model name, a model directory or a .gguf")
    ap.add_argument("--modes", default=DEFAULT_MODES,
                    help="comma list of WEIGHTS/KV (KV: bf16 or fp8); the goals need bf16/bf16 and int8/fp8")
    ap.add_argument("--budget-mb", type=float, default=64.0, help="decode_svc's KV pool in MiB, the same for every mode")
    ap.add_argument("--block-size", type=int, default=16, help="tokens per KV page")
    ap.add_argument("--prompt-len", type=int, default=960)
    ap.add_argument("--output-len", type=int, default=64, help="tokens generated per sequence (ignore_eos)")
    ap.add_argument("--sweep", default="", help="concurrencies below capacity, comma list (default: 1, 2, 4, ...; "
                                                "'none': capacity only); capacity itself is always run")
    ap.add_argument("--waves", type=int, default=3, help="requests per level = waves x concurrency")
    ap.add_argument("--probe-factor", type=int, default=2,
                    help="the probe offers max(this x computed capacity, computed + 2) sequences at once")
    ap.add_argument("--max-running", type=int, default=0,
                    help="decode_svc's --max-running (default 0: the pool's page count, so only the pool bounds admission)")
    ap.add_argument("--prefill-pages", type=int, default=0,
                    help="prefill_svc's pool (outside the budget; default: 8 prompts' pages + 8)")
    ap.add_argument("--stats-interval-s", type=float, default=0.05, help="GetPoolStats sampling period")
    ap.add_argument("--request-timeout-s", type=float, default=600.0)
    ap.add_argument("--start-timeout-s", type=float, default=300.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--log-dir", type=Path, default=None, help="service logs (default: discarded)")
    ap.add_argument("--out", type=Path, default=common.OUT)
    args = ap.parse_args(argv)
    args.sweep = None if not args.sweep.strip() else [] if args.sweep.strip() == "none" else \
        [int(x) for x in args.sweep.split(",") if x.strip()]
    if args.log_dir:
        args.log_dir.mkdir(parents=True, exist_ok=True)

    modes = parse_modes(args.modes)
    model_path = resolve_model_path(args.model)
    model = args.model if args.model in MODELS else Path(args.model).stem
    cfg = load_config(model_path)
    rows = plan(cfg, modes, args.budget_mb, args.prompt_len, args.output_len, args.block_size)
    for r in rows:
        log(f"{r['mode']}: {args.budget_mb:g} MiB -> {r['pool_pages']} pages of {r['page_bytes'] / 1024:.1f} KiB "
            f"({r['pool_mb']:.2f} MiB); {r['pages_per_sequence']} pages per {args.prompt_len}+{args.output_len}-token "
            f"sequence -> {r['computed']} sequences")
    too_small = [r["mode"] for r in rows if r["computed"] < 1]
    if too_small:
        raise SystemExit(f"[capacity] {args.budget_mb:g} MiB holds no whole sequence in {', '.join(too_small)}; "
                         "raise --budget-mb or shorten the sequence")
    facts = machine.facts()
    rng = random.Random(args.seed)
    # SIGTERM (a timeout, a CI kill) unwinds like Ctrl-C, so the services started here are stopped too.
    previous = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        for r in tqdm(rows, desc="modes", unit="mode"):
            try:
                run_mode(r, cfg, model_path, args, rng)
            except Exception as e:  # noqa: BLE001 - one broken mode must not lose the others' numbers
                r["error"] = repr(e)
                log(f"{r['mode']} failed: {e!r}")
    finally:
        signal.signal(signal.SIGTERM, previous)
    report = {"benchmark": "capacity", "model": model, "budget_mb": args.budget_mb, "block_size": args.block_size,
              "prompt_len": args.prompt_len, "output_len": args.output_len, "waves": args.waves,
              "probe_factor": args.probe_factor, "max_running": args.max_running or "pool pages", "machine": facts, "modes": rows, "goals": goals(rows)}
    for g in report["goals"]:
        log(f"goal: {g['goal']}: {verdict(g)} ({common.fmt(g['measured'], 2)}x; {g['detail']})")
    common.save(report, markdown(report), args.out, plot)
    return report


# ---- report --------------------------------------------------------------------------------------

def markdown(report: dict) -> str:
    f = common.fmt
    seq = report["prompt_len"] + report["output_len"]
    head = (f"Model {report['model']}; decode_svc's KV pool: {report['budget_mb']:g} MiB in every mode, as whole pages "
            f"of {report['block_size']} tokens; sequences of {seq} tokens ({report['prompt_len']}-token random prompt "
            f"+ {report['output_len']} generated, ignore_eos) sent as token ids to decode_svc (prefill_svc beside it, "
            f"its default placement). Held = the full-length sequences decode_svc ran at once with no preemption "
            f"(GetPoolStats: peak running, preemption count); a probe then offered {report['probe_factor']}x the computed "
            f"capacity to show the pool's limit; tok/s = output tokens / wall time of "
            f"{report['waves']} x concurrency requests from closed-loop clients.\n"
            f"{machine.describe(report['machine'])}\n")
    rows = []
    for r in report["modes"]:
        if r.get("error"):
            rows.append([r["mode"], r["pool_pages"], f(r["pool_mb"], 2), f(r["page_bytes"] / 1024), r["pages_per_sequence"],
                         r["computed"], f"error: {r['error'][:80]}", "-", "-", "-", "-"])
            continue
        lv = at_capacity(r)
        sweep = ", ".join(f"{x['concurrency']}: {f(x['output_throughput'])}" for x in r.get("levels", []))
        rows.append([r["mode"], r["pool_pages"], f(r["pool_mb"], 2), f(r["page_bytes"] / 1024), r["pages_per_sequence"],
                     r["computed"], r.get("observed", "-"), f(lv["output_throughput"]) if lv else "-",
                     f(lv["decode_tok_s"]) if lv else "-", f(lv["tpot_ms"]["p50"]) if lv else "-", sweep])
    body = common.table(["weights/KV", "pool pages", "pool MiB", "page KiB", "pages per sequence",
                         "sequences (computed)", "sequences held (observed)", "output tok/s at capacity",
                         "decode tok/s at capacity (concurrency / mean TPOT)", "TPOT p50 ms at capacity", "output tok/s by concurrency"], rows)
    g = common.table(["goal", "measured", "target", "verdict", "detail"],
                     [[x["goal"], f"{f(x['measured'], 2)}x" if x["measured"] is not None else "-",
                       f"{x['target']:g}x", f"**{verdict(x)}**", x["detail"]] for x in report["goals"]])
    loads = "; ".join(f"{r['mode']} {lv['load_avg_1m']}" for r in report["modes"]
                      for lv in [at_capacity(r)] if lv and lv.get("load_avg_1m") is not None)
    note = (f"\n1-minute load average after each capacity level ({loads}): the run's own two services and client "
            f"count (about 2 to 3); well above that, other work shared the {report['machine'].get('cores', '?')} "
            "cores and the tok/s there are low and noisy.\n" if loads else "")
    return head + "\n" + body + "\n" + note + "\n" + g + "\n"


def plot(report: dict, out: Path, stem: str) -> list[Path]:
    from bench.plots import _save, plt  # matplotlib only when plotting
    rows = [r for r in report["modes"] if r.get("levels")]
    if not rows:
        return []
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [3, 2]})
    for i, r in enumerate(rows):
        cs = [lv["concurrency"] for lv in r["levels"]]
        ax.plot(cs, [lv["output_throughput"] for lv in r["levels"]], "o-", color=f"C{i}", label=r["mode"])
        lv = at_capacity(r)
        if lv:
            ax.plot([lv["concurrency"]], [lv["output_throughput"]], "*", color=f"C{i}", markersize=14)
    ax.set(xlabel="concurrent sequences", ylabel="output tokens/s",
           title=f"{report['model']}: {report['budget_mb']:g} MiB of KV, "
                 f"{report['prompt_len']}+{report['output_len']}-token sequences (star: capacity)")
    ax.set_ylim(bottom=0)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend()
    names = [r["mode"] for r in report["modes"]]
    xs = range(len(names))
    bx.bar([x - 0.2 for x in xs], [r["computed"] for r in report["modes"]], 0.4, label="computed")
    bx.bar([x + 0.2 for x in xs], [r.get("observed") or 0 for r in report["modes"]], 0.4, label="held (observed)")
    bx.set_xticks(list(xs), names)
    bx.set(ylabel="sequences", title="sequences the pool holds")
    bx.legend()
    return [_save(fig, out / f"{stem}-throughput.png")]


if __name__ == "__main__":
    main()
