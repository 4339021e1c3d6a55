"""A request's speculative state (``SpecState``, ``Request.spec``) and the per-request policy
acting on it: how many to propose (``num_proposals``, ``adapt_k``), at what price (``row_costs``),
when to stop and start again (``record``, ``observe``), and what to report (``report``).

Per request, from its own tokens only (and, batch-aware requests only, the measured row price), so
a seeded request's output never depends on its batch. Auto-off: a step's gain is the tokens it
emits over what it cost in plain steps (1 + its proposals' price); once ``probe_steps``
verifications were seen and tokens fall below cost, the request decodes plainly. A draft request
probes again after ``off_steps``; an n-gram one scores the proposal it would have made against the
tokens then generated (a shadow verification, no model) and comes back on above ``on_gain``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvwire import metrics
from kvwire.sampling_params import SpeculativeMode
from kvwire.spec.config import SpecConfig
from kvwire.spec.ngram import ngram_proposal

if TYPE_CHECKING:
    from kvwire.engine.request import Request
    from kvwire.engine.step_cost import StepCost

NEVER = 1 << 62


@dataclass(eq=False)
class SpecState:
    mode: SpeculativeMode  # resolved: the request's or the engine's default (never NONE here)
    k_max: int  # proposals per step at most (the page reservation's lookahead)
    k: int  # proposals next step (adapt_k: a draft model's request; else k_max)
    by_confidence: bool = False  # a draft head's request: its confidence sizes each proposal, k stays k_max
    costs: list[float] = field(default_factory=lambda: [0.0])  # what 0, 1, .. proposals add to this step (plain steps)
    # running means of tokens per verification and its cost (plain steps), verifications counted; since the last switch
    meter: tuple[float, float, int] = (0.0, 0.0, 0)
    off_until: int = 0  # no proposals while the request's steps < off_until
    shadow: tuple[list[int], int] | None = None  # while off (n-gram): (lookup's proposal, its context index)
    # the n-gram lookup's last answer: ((context length, max_n, min_n), (n, start)); a step asks up to three times
    lookup: tuple[tuple[int, int, int], tuple[int, int]] | None = None
    spec_steps: int = 0  # steps that verified at least one proposal
    drafted: int = 0
    accepted: int = 0
    turned_off: int = 0  # times speculation was turned off for low acceptance
    turned_on: int = 0  # times it was turned back on (n-gram: shadow acceptance reached break-even)


def new_state(mode: SpeculativeMode, k_max: int, cfg: SpecConfig, by_confidence: bool = False) -> SpecState | None:
    """A new request's state: None without speculation. An adaptive draft model starts at
    ``first_k`` (adapt_k grows it); n-gram and a draft head size each proposal themselves."""
    if mode is SpeculativeMode.NONE:
        return None
    small = cfg.adaptive and mode is SpeculativeMode.DRAFT and not by_confidence
    return SpecState(mode, k_max, min(k_max, cfg.tuned.first_k) if small else k_max, by_confidence)


def adapt_k(k: int, proposed: int, accepted: int, k_max: int) -> int:
    """Next step's k from this step's outcome (Hugging Face assisted generation's heuristic):
    all accepted -> k + 2, any rejected -> k - 1, kept in [1, k_max]."""
    if proposed == 0:
        return k
    return max(1, min(k_max, k + 2 if accepted == proposed else k - 1))


def num_proposals(req: Request, max_positions: int) -> int:
    """Proposals for ``req`` this step at most. Never past max_tokens: the step's last token
    (correction or bonus) is the last one allowed, so the sequence never outgrows its page
    reservation; never past ``max_positions``, what the proposer can draft after."""
    s = req.spec
    if s is None or req.steps < s.off_until:
        return 0
    k = min(s.k, req.params.max_tokens - req.generated - 1)
    if len(req.context) + k > max_positions:
        return 0
    return max(0, k)


def row_costs(req: Request, batch_size: int, cfg: SpecConfig, step_cost: StepCost,
              head_cost: float | None = None) -> list[float]:
    """What 0..k_max proposals of ``req`` add to a step of ``batch_size`` requests, in its plain
    steps: measured (batch-aware requests: ``step_cost``, where it has measured) or configured.
    ``head_cost``: a draft head's measured price per proposal, if any."""
    s, t = req.spec, cfg.tuned
    per_row = cfg.break_even(s.mode)
    if t.measure_cost and s.mode is SpeculativeMode.NGRAM and req.params.batch_aware:
        return step_cost.extras(batch_size, s.k_max, per_row)
    if s.by_confidence:  # rows as measured (batch-aware) plus the head's own cost per proposal
        measured = t.measure_cost and req.params.batch_aware
        rows = step_cost.extras(batch_size, s.k_max, t.ngram_cost) if measured \
            else [t.ngram_cost * i for i in range(s.k_max + 1)]
        head = (head_cost if measured else None) or t.head_cost
        return [c + head * i for i, c in enumerate(rows)]
    return [per_row * i for i in range(s.k_max + 1)]


def _gain(s: SpecState, proposed: int, accepted: int, cfg: SpecConfig) -> float | None:
    """Add one (real or shadow) verification to the running means of tokens emitted and cost
    (plain steps); their ratio once ``probe_steps`` were seen since the last switch, else None."""
    tokens, cost, n = s.meter
    n += 1
    w = max(cfg.tuned.ema, 1.0 / n)  # a plain mean over the first 1 / ema
    tokens += w * (accepted + 1 - tokens)
    cost += w * (1.0 + s.costs[min(proposed, len(s.costs) - 1)] - cost)
    s.meter = (tokens, cost, n)
    return tokens / cost if n >= cfg.tuned.probe_steps else None


def record(req: Request, proposed: int, accepted: int, cfg: SpecConfig) -> None:
    """Count one verification step of ``req``: adapt a draft model's k; turn speculation off when
    it does not pay."""
    s, t = req.spec, cfg.tuned
    s.spec_steps += 1
    s.drafted += proposed
    s.accepted += accepted
    if cfg.adaptive and s.mode is SpeculativeMode.DRAFT and not s.by_confidence:
        s.k = adapt_k(s.k, proposed, accepted, s.k_max)
    if cfg.auto_off:
        gain = _gain(s, proposed, accepted, cfg)
        if gain is not None and gain < 1.0:
            s.turned_off += 1
            s.meter = (0.0, 0.0, 0)
            # req.steps counts this step once the scheduler applies it: plain from the next one on
            probe_again = s.mode is SpeculativeMode.DRAFT and t.off_steps
            s.off_until = req.steps + 1 + t.off_steps if probe_again else NEVER
    mode = s.mode.value
    metrics.SPEC_DRAFTS.labels(mode).inc()
    metrics.SPEC_DRAFT_TOKENS.labels(mode).inc(proposed)
    metrics.SPEC_ACCEPTED_TOKENS.labels(mode).inc(accepted)
    metrics.SPEC_EMITTED_TOKENS.labels(mode).inc(accepted + 1)


def observe(req: Request, cfg: SpecConfig) -> None:
    """After a step (its tokens appended to ``req.context``): an n-gram request whose speculation
    is off scores the proposal lookup would have made against the tokens generated since, and
    turns speculation back on when that pays by ``on_gain``."""
    s = req.spec
    if s is None:
        return
    if s.mode is not SpeculativeMode.NGRAM or req.steps >= s.off_until or req.finished:
        s.shadow = None
        return
    if s.shadow is not None:
        props, at = s.shadow
        seen = req.context[at:at + len(props)]
        hit = next((i for i, (a, b) in enumerate(zip(props, seen)) if a != b), len(seen))
        if hit == len(seen) < len(props):
            return  # every token so far matches: wait for the rest
        s.shadow = None
        gain = _gain(s, len(props), hit, cfg)
        if gain is not None and gain >= cfg.tuned.on_gain:
            s.off_until, s.meter = 0, (0.0, 0.0, 0)
            s.turned_on += 1
            return
    props = ngram_proposal(req, s.k_max, cfg)
    if props:
        s.shadow = (props, len(req.context))  # proposals for context[at:], after the pending token


def report(req: Request) -> dict:
    """The decode span's speculative attributes (and the per-request histograms)."""
    s = req.spec
    if s is None:
        return {"kvwire.spec.mode": SpeculativeMode.NONE.value}
    mode = s.mode.value
    rate = s.accepted / s.drafted if s.drafted else 0.0
    per_step = s.accepted / s.spec_steps if s.spec_steps else 0.0
    if s.drafted:
        metrics.SPEC_REQ_ACCEPTANCE.labels(mode).observe(rate)
        metrics.SPEC_REQ_ACCEPTED_PER_STEP.labels(mode).observe(per_step)
    return {"kvwire.spec.mode": mode, "kvwire.spec.num_speculative_tokens": s.k_max,
            "kvwire.spec.steps": s.spec_steps, "kvwire.spec.num_draft_tokens": s.drafted,
            "kvwire.spec.num_accepted_tokens": s.accepted, "kvwire.spec.acceptance_rate": round(rate, 4),
            "kvwire.spec.mean_accepted_tokens_per_step": round(per_step, 4),
            "kvwire.spec.turned_off": s.turned_off, "kvwire.spec.turned_on": s.turned_on,
            "kvwire.spec.mean_tokens_per_step": round((req.generated - 1) / req.steps, 4) if req.steps else 0.0}
