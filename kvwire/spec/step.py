"""The engine's decode step with speculation: propose -> step -> verify -> update.

Requests with and without speculation, and with different k, share the one target forward over
``[pending token] + proposals`` of every request of the batch; ``verify`` says which tokens come
out (1..k + 1); the proposers roll back what was rejected. Runs on the runner's thread.
"""
from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from kvwire.grammar import fill_masks
from kvwire.logits_process import RowContext, apply
from kvwire.logprobs import token_logprobs
from kvwire.sampling_params import SpeculativeMode, TokenLogprobs
from kvwire.spec.config import SpecConfig
from kvwire.spec.ngram import NgramProposer
from kvwire.spec.proposer import NONE, Proposal, Proposer
from kvwire.spec.state import num_proposals, row_costs
from kvwire.spec.verify import verify_batch

if TYPE_CHECKING:
    from kvwire.engine.request import Request
    from kvwire.engine.runner import ModelRunner


@dataclass(frozen=True)
class Proposers:
    ngram: Proposer = NgramProposer()
    draft: Proposer | None = None  # a DraftModelProposer or a HeadProposer (attached to the runner)

    def of(self, mode: SpeculativeMode) -> Proposer:
        proposer = self.ngram if mode is SpeculativeMode.NGRAM else self.draft if mode is SpeculativeMode.DRAFT else None
        if proposer is None:
            raise ValueError(f"no proposer for speculative={mode.value}")
        return proposer


def decode_step(runner: ModelRunner, proposers: Proposers, batch: Sequence[Request], cfg: SpecConfig,
                chunks: Sequence[tuple[int, list[int], bool]] = ()) -> list[tuple[list[int], int, list[TokenLogprobs] | None]]:
    """One decode iteration over ``batch`` (requests with their KV in place). Returns (tokens to
    emit, number proposed, their logprobs if the request asked) per request; the policy's update
    (``record``, ``observe``) follows once the scheduler has applied them (``EngineCore.update``).
    ``chunks``: prompt chunks computed in the same forward (``ModelRunner.step``)."""
    props = propose(runner, proposers, batch, cfg)
    grammars = [r.grammar for r in batch if r.grammar is not None]
    masks = fill_masks(grammars) if grammars else None  # while the forward runs: they need only past tokens
    raw = runner.step([r.seq for r in batch], [[r.context[-1], *p.tokens] for r, p in zip(batch, props)], chunks)
    logits = processed(batch, props, raw)
    if masks is not None:
        logits = constrained(batch, logits, masks)
    emitted = verify_batch(logits, [p.tokens for p in props], [p.q for p in props], [r.params for r in batch],
                           [r.generated for r in batch])
    for r, tokens in zip(batch, emitted):
        if r.grammar is not None:  # one token: constrained requests propose nothing
            r.grammar.accept(tokens[0])
    for r, p, tokens in zip(batch, props, emitted):
        rollback(runner, proposers, r, len(p.tokens), len(tokens))
    # emitted token j was chosen from row j (the row after the pending token and j proposals)
    return [(tokens, len(p.tokens),
             None if r.params.logprobs is None else token_logprobs(rows, tokens, r.params.logprobs))
            for r, p, tokens, rows in zip(batch, props, emitted, raw)]


def processed(batch: Sequence[Request], props: Sequence[Proposal], logits: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each request's rows [n_i, vocab] as its sampler reads them: processed (kvwire.logits_process)
    where its params ask, in one batch; row j's history ends with the first j proposals (row j
    samples the token after them), so verification compares against the distribution plain
    decoding would sample from. Other requests' rows are returned as they are."""
    which = [i for i, r in enumerate(batch) if r.params.processed]
    if not which:
        return logits
    ctx = [RowContext(batch[i].params, batch[i].prompt, [*batch[i].output_ids, *props[i].tokens[:j]], batch[i].stops)
           for i in which for j in range(len(props[i].tokens) + 1)]
    done = apply(torch.cat([logits[i] for i in which]), ctx).split([len(props[i].tokens) + 1 for i in which])
    out = list(logits)
    for i, rows in zip(which, done):
        out[i] = rows
    return out


def constrained(batch: Sequence[Request], logits: list[torch.Tensor], masks: Future) -> list[torch.Tensor]:
    """The constrained requests' rows [1, vocab] masked by their grammars (a copy: the raw rows
    stay for logprobs); the others' untouched. ``masks``: ``fill_masks``'s, waited for here."""
    masks.result()
    return [rows if r.grammar is None else r.grammar.mask(rows[0])[None] for r, rows in zip(batch, logits)]


def rollback(runner: ModelRunner, proposers: Proposers, req: Request, proposed: int, emitted: int) -> None:
    """Keep the fed token and the accepted proposals in the target's cache and the proposer's
    state (the draft's cache, the head's feature); drop the rest."""
    if proposed:
        runner.keep(req.seq, emitted)
    if req.spec is not None:
        proposers.of(req.spec.mode).verified(req, emitted)


def propose(runner: ModelRunner, proposers: Proposers, batch: Sequence[Request], cfg: SpecConfig) -> list[Proposal]:
    """Each request's proposal this step (batched per proposer); prices its rows first
    (``SpecState.costs``, what the proposers and ``record`` read). In a step of more than
    ``greedy_max_batch`` requests, batch-aware ones propose nothing (docs/decisions/024-greedy-max-batch.md)."""
    crowded = 0 < cfg.greedy_max_batch < len(batch)
    wanted: dict[SpeculativeMode, list[tuple[int, int]]] = {}  # mode -> (index in batch, k)
    for i, r in enumerate(batch):
        if r.spec is None:
            continue
        proposer = proposers.of(r.spec.mode)
        r.spec.costs = row_costs(r, len(batch), cfg, runner.step_cost, proposer.cost(len(batch)))
        k = 0 if crowded and r.params.batch_aware else num_proposals(r, proposer.max_positions)
        if k:
            wanted.setdefault(r.spec.mode, []).append((i, k))
    props = [NONE] * len(batch)
    for mode, items in wanted.items():
        made = proposers.of(mode).propose([batch[i] for i, _ in items], [k for _, k in items], cfg)
        for (i, _), p in zip(items, made):
            props[i] = p
    return props
