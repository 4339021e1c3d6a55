"""A draft head as a ``Proposer`` (``kvwire.model.draft_head``): proposals from the target's own
hidden state, no KV cache of its own.

Per sequence it keeps the target's final normed hidden state at the position before the pending
token (its "feature"): from a local prefill, else from the sequence's first decode step (a prompt
whose KV came over the wire has none before, and that step is plain). Greedy requests draft in one
C call per step (``kvwire.model.fast_head``); sampled ones draw each proposal here. Adaptive, the
head's confidences size each proposal (``best_length``), and a context that ends with a long
earlier match proposes the lookup's continuation instead: see docs/decisions/023-draft-head.md.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvwire.model.draft_head import DraftHead
from kvwire.model.fast_head import FastHead
from kvwire.sampling_params import SamplingParams
from kvwire.spec.ngram import best_length, lookup, ngram_proposal
from kvwire.spec.proposer import NONE, Proposal
from kvwire.spec.verify import draft_sample

if TYPE_CHECKING:
    from kvwire.engine.request import Request
    from kvwire.engine.runner import ModelRunner
    from kvwire.spec.config import SpecConfig

# a chain stops once the product of its confidences is below this: the next proposal would add at
# most this fraction of a token (see docs/decisions/023-draft-head.md)
STOP_BELOW = 0.25


class HeadProposer:
    by_confidence = True  # its confidences size each proposal; k stays k_max
    max_positions = 1 << 62

    def __init__(self, head: DraftHead, runner: ModelRunner):
        self.head = head
        self.step_cost = runner.step_cost  # the runner's row prices: a proposal's price is read against them
        self.fast_head = FastHead.build(head)  # None where the C kernels do not read its layers
        self.features: dict[int, torch.Tensor] = {}  # seq -> [hidden]: what the head continues from
        self._rows: dict[int, torch.Tensor] = {}  # seq -> the last step's hidden rows [n, hidden]
        self._seconds: tuple[float, int] = (0.0, 0)  # running mean of one chained head call, calls
        runner.attach(self)

    def propose(self, reqs: Sequence[Request], ks: Sequence[int], cfg: SpecConfig) -> list[Proposal]:
        out = [NONE] * len(reqs)
        drafting = []
        for i, r in enumerate(reqs):
            if r.seq not in self.features:
                continue  # its prompt KV came over the wire: no feature until its first (plain) step
            if cfg.adaptive and lookup(r, cfg)[0] >= cfg.tuned.head_skip_match:  # a long quote: no drafting
                out[i] = Proposal(ngram_proposal(r, ks[i], cfg))
            else:
                drafting.append(i)
        if drafting:
            drafts = self.draft([reqs[i].seq for i in drafting], [reqs[i].context for i in drafting],
                                [ks[i] for i in drafting], [reqs[i].params for i in drafting],
                                [reqs[i].generated for i in drafting])
            for i, (tokens, q, conf) in zip(drafting, drafts):
                out[i] = head_proposal(reqs[i], tokens, q, conf, ks[i], cfg)
        return out

    def cost(self, batch: int) -> float | None:
        """What one proposal adds to a step of ``batch`` requests, in plain steps of a request
        (StepCost's unit), as if its chained head call served that request alone; None until
        both were measured."""
        plain = self.step_cost.plain(batch)
        mean, n = self._seconds
        return mean / plain * batch if plain is not None and n >= self.step_cost.min_steps else None

    def draft(self, seqs: Sequence[int], contexts: Sequence[Sequence[int]], ks: Sequence[int],
              params: Sequence[SamplingParams], first_steps: Sequence[int], stop_below: float = STOP_BELOW):
        """Chained from each sequence's feature and pending token, batched over the sequences still
        drafting; a sequence stops once the product of its confidences (the head's probability of
        its top token) is below ``stop_below``. Returns (tokens, q [k_i, vocab] or None when
        greedy, confidences) per sequence. All greedy: the whole chain in one C call."""
        feats = torch.stack([self.features[s] for s in seqs])  # [S, hidden]
        if self.fast_head is not None and all(p.greedy for p in params):
            t0 = time.perf_counter()
            props, confs, calls = self.fast_head(feats, [ctx[-1] for ctx in contexts], list(ks), stop_below)
            if calls:
                self._time((time.perf_counter() - t0) / calls)
            return [(p, None, c) for p, c in zip(props, confs)]
        toks = torch.tensor([ctx[-1] for ctx in contexts])  # [S]
        props: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        confs: list[list[float]] = [[] for _ in seqs]
        reach = [1.0] * len(seqs)
        active = list(range(len(seqs)))
        head = self.head if self.fast_head is None else self.fast_head.forward
        while active:
            t0 = time.perf_counter()
            feats, small = head(feats, toks)  # [A, hidden], [A, head_vocab]
            self._time(time.perf_counter() - t0)
            top, arg = torch.softmax(small, dim=-1).max(-1)
            best = self.head.head_vocab[arg].tolist()  # greedy proposals: no full-vocab row
            for j, i in enumerate(active):
                confs[i].append(float(top[j]))
                reach[i] *= confs[i][-1]
                if params[i].greedy:
                    props[i].append(best[j])
                    continue
                tok, q = draft_sample(small[j], params[i], first_steps[i] + len(props[i]),  # over its vocabulary
                                      self.head.head_vocab, self.head.cfg.vocab_size)
                props[i].append(tok)
                qs[i].append(q)
            more = [j for j, i in enumerate(active) if len(props[i]) < ks[i] and reach[i] >= stop_below]
            active = [active[j] for j in more]
            feats, toks = feats[more], torch.tensor([props[i][-1] for i in active], dtype=torch.int64)
        return [(p, torch.stack(q) if q else None, c) for p, q, c in zip(props, qs, confs)]

    def _time(self, seconds: float) -> None:
        mean, n = self._seconds
        n += 1
        self._seconds = (mean + max(self.step_cost.weight, 1.0 / n) * (seconds - mean), n)

    def verified(self, req: Request, emitted: int) -> None:
        """The pending token was chosen from the logits of the step's row ``emitted - 1`` (0: a
        plain step), so that row's hidden state is what the head continues from."""
        rows = self._rows.get(req.seq)
        if rows is not None:
            self.features[req.seq] = rows[emitted - 1]

    # ---- the runner's attachment: told of its forwards, warm-up and frees ----------------------

    def prefilled(self, seq: int, hidden: torch.Tensor) -> None:
        self.features[seq] = hidden

    def stepped(self, seqs: Sequence[int], hidden: Sequence[torch.Tensor]) -> None:
        self._rows = dict(zip(seqs, hidden))

    def warm_up(self, seq: int) -> None:
        """Price a proposal (``cost``) before the first request."""
        self.features[seq] = self._rows[seq][0]
        for _ in range(self.step_cost.min_steps):
            self.draft([seq], [[0] * 12], [3], [SamplingParams()], [0])

    def free(self, seq: int) -> None:
        self.features.pop(seq, None)
        self._rows.pop(seq, None)


def head_proposal(req: Request, tokens: list[int], q: torch.Tensor | None, conf: list[float], limit: int,
                  cfg: SpecConfig) -> Proposal:
    """What a draft head's request proposes (at most ``limit`` tokens): as many of the head's
    tokens as make the most tokens per unit of time, its confidences taken as acceptance chances
    (``best_length``); or, adaptive, the lookup's proposal where that expects more (quoting)."""
    costs = req.spec.costs[:limit + 1]
    k, rate = best_length(conf, costs) if cfg.adaptive else (min(len(tokens), limit), 0.0)
    if cfg.adaptive:
        n, start = lookup(req, cfg)
        if n:
            kn, rate_n = best_length([1.0 - cfg.tuned.ngram_miss / n] * limit, costs)
            if kn and rate_n > rate:
                return Proposal(req.context[start:start + kn])
    return Proposal(tokens[:k], q[:k] if q is not None and k else None)
