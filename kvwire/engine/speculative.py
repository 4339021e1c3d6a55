"""Speculative decoding: n-gram proposals, the acceptance rule, adapting k, and the decode step.

The rules are pure functions (gpt-fast's ``speculative_decode`` split); ``decode_step`` drives
them over a ModelRunner: proposals (n-gram lookup, or the draft model batched over the requests
that use it), one target forward over ``[pending token] + proposals`` for every request of the
batch at once, then ``accept_greedy`` / ``accept_sampled`` say which tokens come out (1..k + 1).
Requests with and without speculation, and with different k, share that forward.

Reproducibility: every random draw is derived from (seed, index of the generated token), as in
``kvwire.sampler``: the acceptance uniform and the residual sample for generated token i come from
``step_generator(seed, i)``, the draft's proposal for token i from ``draft_generator(seed, i)``. So a
seeded request gives the same tokens whatever it was batched with.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvwire import metrics
from kvwire.engine.ngram import best_length, lookup_length, ngram_match, ngram_propose  # noqa: F401 - re-exported
from kvwire.sampler import argmax, draw, probabilities, sample, step_generator
from kvwire.sampling_params import SamplingParams, SpeculativeMode

_DRAFT_SALT = 0x5EC0_D4AF_7000  # separates the draft's proposal draws from the target's draws


def draft_generator(seed: int | None, step: int) -> torch.Generator:
    """The generator the draft samples its proposal for generated token ``step`` with."""
    return step_generator(None if seed is None else seed ^ _DRAFT_SALT, step)


# ---- the acceptance rule -------------------------------------------------------------------------
#
# The target scores [t, d_1 .. d_k] in one forward pass: row i of its logits is p_i, the target's
# distribution for the token after d_i (row 0: after t). For i = 1..k in order:
#
#   greedy:   accept d_i while d_i == argmax p_{i-1}; at the first mismatch emit argmax p_{i-1}
#             and stop. Every emitted token is the target's argmax given exactly the tokens before
#             it, so the output equals non-speculative greedy decoding token for token.
#   sampling: draw u ~ U[0, 1); accept d_i if u < min(1, p_{i-1}(d_i) / q_{i-1}(d_i)), where q is
#             the distribution d_i was drawn from. On rejection emit a sample from the residual
#             max(0, p_{i-1} - q_{i-1}) / sum(max(0, p_{i-1} - q_{i-1})) and stop.
#             (Leviathan et al. 2023, Chen et al. 2023: the emitted token is then distributed
#             exactly as p_{i-1}, whatever q is.) For n-gram proposals q is a point mass on d_i:
#             accept with probability p_{i-1}(d_i); the residual is p_{i-1} with d_i removed,
#             renormalised.
#   all k accepted: emit a bonus token from p_k (argmax when greedy).
#
# So a step emits between 1 and k + 1 tokens, and p, q are the *processed* distributions
# (temperature, top-k, top-p applied, as ``kvwire.sampler.probabilities``), the ones
# non-speculative sampling draws from.


def accept_greedy(target_logits: torch.Tensor, proposed: Sequence[int]) -> list[int]:
    """target_logits: [k + 1, vocab] for [t, d_1..d_k] -> the emitted tokens (1..k + 1)."""
    out = []
    for d, best in zip([*proposed, None], argmax(target_logits)):  # the very argmax plain decoding takes
        out.append(best)
        if best != d:
            return out
    return out


def accept_sampled(target_logits: torch.Tensor, proposed: Sequence[int], draft_probs: torch.Tensor | None,
                   params: SamplingParams, first_step: int) -> list[int]:
    """The sampling rule above. target_logits: [k + 1, vocab]; draft_probs: [k, vocab] (the q each
    d_i was drawn from) or None for point-mass (n-gram) proposals; ``first_step``: the generated-token
    index of d_1 (seeds the draws). Returns the emitted tokens (1..k + 1)."""
    out = []
    for i, d in enumerate(proposed):
        p = probabilities(target_logits[i], params)  # [vocab]
        g = step_generator(params.seed, first_step + i)
        u = float(torch.rand((), generator=g))
        q_d = 1.0 if draft_probs is None else float(draft_probs[i, d])
        if u * q_d < float(p[d]):  # u < p/q without dividing; q_d > 0 since d was drawn from q
            out.append(d)
            continue
        if draft_probs is None:
            residual = p.clone()
            residual[d] = 0.0
        else:
            residual = (p - draft_probs[i]).clamp_min(0.0)
        total = float(residual.sum())
        # Rejection has probability sum(residual); a zero residual means rounding rejected a sure
        # acceptance, and p itself is then the right distribution.
        residual = residual / total if total > 0 else p
        out.append(draw(residual, g))
        return out
    out.append(sample(target_logits[len(proposed)], params, first_step + len(proposed)))
    return out


def draft_sample(draft_logits: torch.Tensor, params: SamplingParams, step: int,
                 support: torch.Tensor | None = None, vocab: int = 0) -> tuple[int, torch.Tensor | None]:
    """The draft's proposal for generated token ``step`` and the distribution q it came from
    (None when greedy: the target then checks argmax equality and needs no q). ``support``: the
    token ids of ``draft_logits``'s entries when the draft scores part of the vocabulary (a draft
    head's 8,191 of SmolLM2's 49,152): temperature, top-k, top-p and the draw then run over that
    part only, the distribution every other token would get (zero) left out, and q is returned
    over the whole ``vocab``, zero outside it (what verification reads)."""
    if params.greedy:
        best = argmax(draft_logits)
        return (best if support is None else int(support[best])), None
    q = probabilities(draft_logits, params)  # [len(draft_logits)]
    i = draw(q, draft_generator(params.seed, step))
    if support is None:
        return i, q
    full = torch.zeros(vocab, dtype=q.dtype, device=q.device)
    full[support] = q
    return int(support[i]), full


def adapt_k(k: int, proposed: int, accepted: int, k_max: int) -> int:
    """Next step's k from this step's outcome (Hugging Face assisted generation's heuristic):
    all accepted -> k + 2, any rejected -> k - 1, kept in [1, k_max]. Per request, so a seeded
    request's output does not depend on what it was batched with."""
    if proposed == 0:
        return k
    return max(1, min(k_max, k + 2 if accepted == proposed else k - 1))


@dataclass(frozen=True)
class SpecConfig:
    """The engine's speculative decoding defaults (built once, e.g. in decode_svc's ``__main__``).

    Cost: a verification step costs more than a plain decode step, by about ``*_cost`` plain
    steps per proposed token (n-gram: the extra rows of the target forward; draft: those plus one
    draft step each). With ``measure_cost`` a batch-aware n-gram request (greedy, or sampled
    without a seed: ``SamplingParams.batch_aware``) uses what the runner measured instead
    (``StepCost``: this CPU, these kernels, this batch size, this many rows) where it has.

    How many (``adaptive``): an n-gram request proposes, of the tokens that followed the longest
    earlier match of its context's suffix (``ngram_max`` .. ``ngram_min`` tokens), as many as make
    the most tokens per unit of time (``ngram.lookup_length``: more after longer matches, fewer
    when rows cost more), at most its k; a draft request adapts k to its acceptance
    (``adapt_k``), starting at ``first_k``. Without ``adaptive`` both propose k every step.

    Turning off (``auto_off``): a step's gain is the tokens it emits over what it cost, in plain
    steps (1 + the cost of its proposals). A request keeps a running mean of both (weight ``ema``
    for the newest); once it has ``probe_steps`` verifications and the tokens fall below the cost,
    it decodes plainly (k = 0). A draft request probes again after ``off_steps`` plain steps (0:
    never). An n-gram request needs no probe: while off, each step it looks up the proposal it
    would have made (no model involved), scores it against the tokens then generated and keeps
    the same running means; when, after ``probe_steps`` such proposals, the tokens exceed the cost
    by ``on_gain`` (hysteresis), speculation is back on. Per request, from its own tokens only
    (and, batch-aware only, the measured price), so a seeded request's output never depends on its batch.

    Batch (``greedy_max_batch``): in a step of b requests every verification row costs about what
    a whole request's row does, so the break-even rises with b; batch-aware requests (greedy, whose
    output is the plain output either way, and unseeded sampled ones) do not speculate in steps of
    more than ``greedy_max_batch`` requests (0: no limit). A seeded sampled request keeps its own
    policy, so its tokens do not depend on its batch, and can lose there (bench speculative
    --temperature 0.7 --seeded, 6 prompts in one step: n-gram 0.91-0.93x, draft head 0.66-0.83x).
    """

    mode: SpeculativeMode = SpeculativeMode.NONE  # what a request's speculative=None means
    num_tokens: int = 4  # k when a request does not set num_speculative_tokens
    adaptive: bool = True  # n-gram: lookup_length per step; draft: adapt_k (both at most the requested k)
    first_k: int = 2  # adaptive draft: k of a request's first verification (cheap to probe; adapt_k grows it)
    ngram_max: int = 16  # n-gram lookup tries suffixes of ngram_max .. ngram_min tokens
    ngram_min: int = 1
    # lookup_length: after an n-token match each next token is right with probability ~ 1 - ngram_miss / n
    ngram_miss: float = 1.0  # (fit: 0.6-0.8; 1.0 is the cautious side, where wrong proposals cost most)
    auto_off: bool = True  # stop speculating where it does not pay (see above)
    probe_steps: int = 8  # verifications (real or shadow) before deciding to turn off or on
    ema: float = 0.125  # weight of the newest verification in the running means of tokens and cost
    on_gain: float = 1.1  # shadow tokens over cost needed to turn n-gram speculation back on
    off_steps: int = 32  # plain steps before a draft request probes again (0: never again for this request)
    # Cost per proposed token, in plain steps: a verification step of k + 1 tokens cost about 1 + 0.3 k
    # plain steps (SmolLM2-135M, int8, FP8 KV, 2-core AVX-512 CPU, fused decode kernels); a draft step adds its own.
    ngram_cost: float = 0.3  # n-gram proposals (one-call verification only)
    draft_cost: float = 0.6  # draft proposals (verification + drafting)
    # A draft head's proposal, on top of its row, until the runner has measured it (batch-aware requests; SmolLM2's
    # head: 0.15 ms per token, int8, 1 thread, drafting in one C call, against a 6.5 ms plain step)
    head_cost: float = 0.025
    # adaptive, a draft head's request whose context ends with an earlier match of at least this many tokens
    # proposes the lookup's continuation without drafting (quoting: s >= 0.75 per token, above the head's)
    head_skip_match: int = 4
    measure_cost: bool = True  # batch-aware n-gram requests use the runner's measured price (StepCost) when it has one
    # Measured (bench speculative --batches 2,3,4, SmolLM2 int8, 1 and 2 threads, 2-core AMD EPYC): with
    # speculation, steps of 2 requests 1.22-1.32x plain on grounded prompts, 0.93-1.02x on chat; of 3, 1.03-1.11x /
    # 0.86-1.00x; of 4, 0.91-0.96x / 0.91-0.96x. Each request prices its rows as if the others proposed none.
    greedy_max_batch: int = 2  # batch-aware (greedy, unseeded) requests speculate in steps of at most this many (0: any)

    def break_even(self, mode: SpeculativeMode) -> float:
        return self.draft_cost if mode is SpeculativeMode.DRAFT else self.ngram_cost


# ---- the engine's decode step ---------------------------------------------------------------------

def num_proposals(req, draft_max_positions: int) -> int:
    """Proposals for ``req`` this step at most. Never past max_tokens: the step's last token
    (correction or bonus) is the last one allowed, so the sequence never outgrows its page reservation."""
    if req.steps < req.off_until:
        return 0  # turned off for now (low acceptance)
    k = min(req.k, req.params.max_tokens - req.generated - 1)
    if req.mode is SpeculativeMode.DRAFT and len(req.context) + k > draft_max_positions:
        return 0
    return max(0, k)


def row_costs(runner, req, batch_size: int, cfg: SpecConfig) -> list[float]:
    """What 0..k_max proposals of ``req`` add to a step of ``batch_size`` requests, in its plain
    steps: measured (batch-aware n-gram requests: StepCost, where it has measured) or the config's."""
    per_row = cfg.break_even(req.mode)
    if cfg.measure_cost and req.mode is SpeculativeMode.NGRAM and req.params.batch_aware:
        return runner.step_cost.extras(batch_size, req.k_max, per_row)
    if req.by_confidence:  # rows as measured (batch-aware) plus the head's own cost per proposal
        measured = cfg.measure_cost and req.params.batch_aware
        rows = runner.step_cost.extras(batch_size, req.k_max, cfg.ngram_cost) if measured \
            else [cfg.ngram_cost * i for i in range(req.k_max + 1)]
        head = (runner.head_cost(batch_size) if measured else None) or cfg.head_cost
        return [c + head * i for i, c in enumerate(rows)]
    return [per_row * i for i in range(req.k_max + 1)]


def lookup(req, cfg: SpecConfig) -> tuple[int, int]:
    """``ngram_match`` over ``req``'s context, computed once per context (its length: the context
    only grows) however often a step asks (a draft head's request: up to three times, ~0.1 ms each)."""
    key = (len(req.context), cfg.ngram_max, cfg.ngram_min)
    if req.lookup is None or req.lookup[0] != key:
        req.lookup = (key, ngram_match(req.context, cfg.ngram_max, cfg.ngram_min))
    return req.lookup[1]


def ngram_proposal(req, k: int, cfg: SpecConfig) -> list[int]:
    """The n-gram lookup's proposal for ``req``: at most ``k`` tokens, as many as pay (adaptive)."""
    n, start = lookup(req, cfg)
    if cfg.adaptive:
        k = lookup_length(n, req.costs[:k + 1], cfg.ngram_miss)
    return req.context[start:start + k] if n and k > 0 else []


def head_proposal(req, tokens: list[int], q, conf: list[float], limit: int, cfg: SpecConfig):
    """What a draft head's request proposes (at most ``limit`` tokens): as many of the head's
    tokens as make the most tokens per unit of time, the head's confidences taken as acceptance
    chances (``best_length``); or, adaptive, the n-gram lookup's proposal where that expects more
    (quoting the prompt). Returns (tokens, q or None)."""
    costs = req.costs[:limit + 1]
    k, rate = best_length(conf, costs) if cfg.adaptive else (min(len(tokens), limit), 0.0)
    if cfg.adaptive:
        n, start = lookup(req, cfg)
        if n:
            kn, rate_n = best_length([1.0 - cfg.ngram_miss / n] * limit, costs)
            if kn and rate_n > rate:
                return req.context[start:start + kn], None
    return tokens[:k], (q[:k] if q is not None and k else None)


def decode_step(runner, batch, cfg: SpecConfig) -> list[tuple[list[int], int]]:
    """One decode iteration over ``batch`` (requests with their KV in place): proposals, one
    batched target forward that verifies them, acceptance, rollback. Runs where the runner lives
    (one thread). Returns (tokens to emit, number proposed) per request."""
    crowded = 0 < cfg.greedy_max_batch < len(batch)
    ks = [0 if crowded and r.params.batch_aware else num_proposals(r, runner.draft_positions) for r in batch]
    props: list[list[int]] = [[] for _ in batch]
    qs: list = [None] * len(batch)
    for i, r in enumerate(batch):
        if r.mode is not SpeculativeMode.NONE:
            r.costs = row_costs(runner, r, len(batch), cfg)  # what record() and observe() charge
        if r.mode is SpeculativeMode.NGRAM and ks[i]:
            props[i] = ngram_proposal(r, ks[i], cfg)
    drafting = [i for i, r in enumerate(batch) if r.mode is SpeculativeMode.DRAFT and ks[i] and runner.can_propose(r.seq)]
    if runner.head is not None and cfg.adaptive:  # a long quote: the lookup, and no drafting
        quoting = [i for i in drafting if lookup(batch[i], cfg)[0] >= cfg.head_skip_match]
        for i in quoting:
            props[i] = ngram_proposal(batch[i], ks[i], cfg)
        drafting = [i for i in drafting if i not in quoting]
    if drafting:
        drafts = runner.propose([batch[i].seq for i in drafting], [batch[i].context for i in drafting],
                                [ks[i] for i in drafting], [batch[i].params for i in drafting],
                                [batch[i].generated for i in drafting])
        for i, (tokens, q, conf) in zip(drafting, drafts):
            props[i], qs[i] = head_proposal(batch[i], tokens, q, conf, ks[i], cfg) if conf is not None else (tokens, q)
    logits = runner.step([r.seq for r in batch], [[r.context[-1], *p] for r, p in zip(batch, props)])
    results = []
    for r, p, q, rows in zip(batch, props, qs, logits):
        if not p:
            tokens = [sample(rows[-1], r.params, r.generated)]
        elif r.params.greedy:
            tokens = accept_greedy(rows, p)
        else:
            tokens = accept_sampled(rows, p, q, r.params, r.generated)
        if p:
            runner.keep(r.seq, len(tokens))  # the fed token + the accepted proposals
        if r.mode is SpeculativeMode.DRAFT:
            runner.draft_truncate(r.seq, len(r.context) + len(tokens) - 1)
            runner.advance(r.seq, len(tokens) - 1)
        results.append((tokens, len(p)))
    return results


def _gain(req, proposed: int, accepted: int, cfg: SpecConfig) -> float | None:
    """Add one (real or shadow) verification to ``req``'s running means of tokens emitted and
    cost (plain steps); their ratio once ``probe_steps`` were seen since the last switch, else None."""
    tokens, cost, n = req.meter
    n += 1
    w = max(cfg.ema, 1.0 / n)  # a plain mean over the first 1 / ema
    tokens += w * (accepted + 1 - tokens)
    cost += w * (1.0 + req.costs[min(proposed, len(req.costs) - 1)] - cost)
    req.meter = (tokens, cost, n)
    return tokens / cost if n >= cfg.probe_steps else None


def record(req, proposed: int, accepted: int, cfg: SpecConfig) -> None:
    """Count one verification step of ``req`` (adapt a draft's k; turn speculation off when it
    does not pay, see SpecConfig)."""
    req.spec_steps += 1
    req.drafted += proposed
    req.accepted += accepted
    if cfg.adaptive and req.mode is SpeculativeMode.DRAFT and not req.by_confidence:
        req.k = adapt_k(req.k, proposed, accepted, req.k_max)
    if cfg.auto_off:
        gain = _gain(req, proposed, accepted, cfg)
        if gain is not None and gain < 1.0:
            req.turned_off += 1
            req.meter = (0.0, 0.0, 0)
            # req.steps counts this step once the scheduler applies it: plain from the next one on
            probe_again = req.mode is SpeculativeMode.DRAFT and cfg.off_steps
            req.off_until = req.steps + 1 + cfg.off_steps if probe_again else 1 << 62
    mode = req.mode.value
    metrics.SPEC_DRAFTS.labels(mode).inc()
    metrics.SPEC_DRAFT_TOKENS.labels(mode).inc(proposed)
    metrics.SPEC_ACCEPTED_TOKENS.labels(mode).inc(accepted)
    metrics.SPEC_EMITTED_TOKENS.labels(mode).inc(accepted + 1)


def observe(req, cfg: SpecConfig) -> None:
    """After a step (its tokens appended to ``req.context``): an n-gram request whose speculation
    is off scores the proposal lookup would have made against the tokens generated since (no
    model involved), and turns speculation back on when that pays by ``on_gain`` (see SpecConfig)."""
    if req.mode is not SpeculativeMode.NGRAM or req.steps >= req.off_until or req.finished:
        req.shadow = None
        return
    if req.shadow is not None:
        props, at = req.shadow
        seen = req.context[at:at + len(props)]
        hit = next((i for i, (a, b) in enumerate(zip(props, seen)) if a != b), len(seen))
        if hit == len(seen) < len(props):
            return  # every token so far matches: wait for the rest
        req.shadow = None
        gain = _gain(req, len(props), hit, cfg)
        if gain is not None and gain >= cfg.on_gain:
            req.off_until, req.meter = 0, (0.0, 0.0, 0)
            req.turned_on += 1
            return
    props = ngram_proposal(req, req.k_max, cfg)
    if props:
        req.shadow = (props, len(req.context))  # proposals for context[at:], after the pending token


def report(req) -> dict:
    """The decode span's speculative attributes (and the per-request histograms)."""
    attrs = {"kvwire.spec.mode": req.mode.value}
    if req.mode is SpeculativeMode.NONE:
        return attrs
    rate = req.accepted / req.drafted if req.drafted else 0.0
    per_step = req.accepted / req.spec_steps if req.spec_steps else 0.0
    if req.drafted:
        metrics.SPEC_REQ_ACCEPTANCE.labels(req.mode.value).observe(rate)
        metrics.SPEC_REQ_ACCEPTED_PER_STEP.labels(req.mode.value).observe(per_step)
    return {**attrs, "kvwire.spec.num_speculative_tokens": req.k_max, "kvwire.spec.steps": req.spec_steps,
            "kvwire.spec.num_draft_tokens": req.drafted, "kvwire.spec.num_accepted_tokens": req.accepted,
            "kvwire.spec.acceptance_rate": round(rate, 4),
            "kvwire.spec.mean_accepted_tokens_per_step": round(per_step, 4),
            "kvwire.spec.turned_off": req.turned_off, "kvwire.spec.turned_on": req.turned_on,
            "kvwire.spec.mean_tokens_per_step": round((req.generated - 1) / req.steps, 4) if req.steps else 0.0}
