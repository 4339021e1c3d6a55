"""The proposer seam: what the decode step asks of n-gram lookup, a draft model and a draft head."""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple, Protocol

import torch

if TYPE_CHECKING:
    from kvwire.engine.request import Request
    from kvwire.spec.config import SpecConfig


class Proposal(NamedTuple):
    tokens: list[int]  # proposed after the pending token, at most the step's k
    # [len(tokens), vocab]: the distributions they were drawn from (None: greedy, or a lookup's point mass)
    q: torch.Tensor | None = None


NONE = Proposal([])


class Proposer(Protocol):
    max_positions: int  # a sequence may hold this many tokens for it to propose after

    def propose(self, reqs: Sequence[Request], ks: Sequence[int], cfg: SpecConfig) -> list[Proposal]:
        """At most ``ks[i]`` tokens after ``reqs[i]``'s context (ending with its pending token),
        batched; ``req.spec.costs`` holds this step's row prices."""
        ...

    def cost(self, batch: int) -> float | None:
        """What one proposal adds to a step of ``batch`` requests beyond its row, in plain steps,
        as measured here; None: not measured (the configured price applies)."""
        ...

    def verified(self, req: Request, emitted: int) -> None:
        """``req``'s step emitted ``emitted`` tokens (its context not yet extended): roll back
        what was drafted past them, continue from the last accepted one."""
        ...

    def free(self, seq: int) -> None:
        """Forget sequence ``seq`` (finished, failed or aborted)."""
        ...
