"""A draft model as a ``Proposer``: a small model with its own paged KV cache in the decode process.

The draft first catches up on the context it has not seen (the whole prompt the first time: no
draft pages cross the wire), then drafts token by token, batched over the requests that use it.
Rejected proposals are cut from its cache by truncation; a freed sequence frees its draft pages.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from kvwire.sampling_params import SamplingParams
from kvwire.spec.proposer import Proposal
from kvwire.spec.verify import draft_sample

if TYPE_CHECKING:
    from kvwire.engine.request import Request
    from kvwire.engine.runner import ModelRunner
    from kvwire.runtime import Runtime
    from kvwire.spec.config import SpecConfig


class DraftModelProposer:
    by_confidence = False  # adapt_k sizes its proposals

    def __init__(self, runtime: Runtime, runner: ModelRunner, num_pages: int | None = None):
        self.runtime = runtime
        # The draft holds at most as many tokens per sequence as the target, so a pool as large as
        # the target's never runs out under the scheduler's reservations.
        self.cache = runtime.new_cache(num_pages or runner.cache.pool.num_pages)
        runner.attach(self)

    @property
    def max_positions(self) -> int:
        return self.runtime.model_config.max_position_embeddings

    def propose(self, reqs: Sequence[Request], ks: Sequence[int], cfg: SpecConfig) -> list[Proposal]:
        drafts = self.draft([r.seq for r in reqs], [r.context for r in reqs], ks, [r.params for r in reqs],
                            [r.generated for r in reqs])
        return [Proposal(tokens, q) for tokens, q, _ in drafts]

    def draft(self, seqs: Sequence[int], contexts: Sequence[Sequence[int]], ks: Sequence[int],
              params: Sequence[SamplingParams], first_steps: Sequence[int]):
        """Draft ``ks[i]`` tokens after ``contexts[i]`` (ending with the pending token) for each
        sequence. Returns (tokens [k_i], q [k_i, vocab] or None when greedy, None) per sequence."""
        dc, model = self.cache, self.runtime.model
        feeds = [list(ctx[dc.length(s) if s in dc.tables else 0:]) for s, ctx in zip(seqs, contexts)]
        ends = torch.tensor([len(f) for f in feeds]).cumsum(0) - 1
        positions = dc.prepare(seqs, [len(f) for f in feeds])
        logits = model(torch.tensor([t for f in feeds for t in f]), positions, dc, logits_rows=ends)  # [S, vocab]
        props: list[list[int]] = [[] for _ in seqs]
        qs: list[list[torch.Tensor]] = [[] for _ in seqs]
        active = list(range(len(seqs)))
        while True:
            for i, row in zip(active, logits):
                tok, q = draft_sample(row, params[i], first_steps[i] + len(props[i]))
                props[i].append(tok)
                if q is not None:
                    qs[i].append(q)
            active = [i for i in active if len(props[i]) < ks[i]]
            if not active:
                break
            positions = dc.prepare([seqs[i] for i in active], [1] * len(active))
            logits = model(torch.tensor([props[i][-1] for i in active]), positions, dc)
        return [(p, torch.stack(q) if q else None, None) for p, q in zip(props, qs)]

    def cost(self, batch: int) -> float | None:
        return None

    def verified(self, req: Request, emitted: int) -> None:
        self.truncate(req.seq, len(req.context) + emitted - 1)

    def truncate(self, seq: int, length: int) -> None:
        """Keep at most ``length`` tokens of the draft's KV for ``seq`` (rejected proposals go)."""
        if seq in self.cache.tables:
            self.cache.truncate(seq, min(length, self.cache.length(seq)))

    # ---- the runner's attachment: told of its forwards, warm-up and frees ----------------------

    def prefilled(self, seq: int, hidden: torch.Tensor) -> None:
        pass

    def stepped(self, seqs: Sequence[int], hidden: Sequence[torch.Tensor]) -> None:
        pass

    def warm_up(self, seq: int) -> None:
        self.draft([seq], [[0] * 12], [3], [SamplingParams()], [0])

    def free(self, seq: int) -> None:
        self.cache.reset(seq)
