"""Speculative decoding: proposers (n-gram lookup, draft model, draft head), verification, the
per-request policy and the decode step that ties them (propose -> step -> verify -> update)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from kvwire.model.draft_head import DraftHead
from kvwire.spec.config import SpecConfig
from kvwire.spec.draft_model import DraftModelProposer
from kvwire.spec.head import HeadProposer
from kvwire.spec.ngram import NgramProposer
from kvwire.spec.proposer import Proposal, Proposer
from kvwire.spec.state import SpecState
from kvwire.spec.step import Proposers, decode_step
from kvwire.spec.tuned import Tuned

if TYPE_CHECKING:
    from kvwire.engine.runner import ModelRunner
    from kvwire.runtime import Runtime

DraftProposer = DraftModelProposer | HeadProposer


def attach_draft(runner: ModelRunner, draft: Runtime | DraftHead | None) -> DraftProposer | None:
    """The proposer for a loaded draft model or draft head, attached to ``runner`` (it follows the
    runner's sequences: their hidden states, warm-up and frees); None without a draft."""
    if draft is None:
        return None
    return HeadProposer(draft, runner) if isinstance(draft, DraftHead) else DraftModelProposer(draft, runner)


__all__ = ["DraftModelProposer", "DraftProposer", "HeadProposer", "NgramProposer", "Proposal", "Proposer",
           "Proposers", "SpecConfig", "SpecState", "Tuned", "attach_draft", "decode_step"]
