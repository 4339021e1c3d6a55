"""The errors a kvwire component raises on purpose, one class per outcome a caller can act on.

grpc-free: the scheduler, runner and codecs raise these; ``kvwire_serving.server`` maps them to gRPC status
codes in one place. Bad user input is ``InvalidRequest`` (INVALID_ARGUMENT); any other exception,
a bare ``ValueError`` from our own code included, is a bug and becomes INTERNAL. The message is
sent to the caller verbatim, so make it say what to change.
"""
from __future__ import annotations


class KvwireError(Exception):
    """Base class; a bare KvwireError maps to INTERNAL."""


class InvalidRequest(KvwireError, ValueError):
    """The request itself is wrong (empty prompt, bad sampling values, token id out of range).

    A ValueError too, so in-process callers (``LLM``, the OpenAI door) may catch either."""



class NotFound(KvwireError):
    """A named thing (model, request id) does not exist."""


class ResourceExhausted(KvwireError):
    """Not enough capacity now (pool pages, queue slots): retrying later may succeed. The message
    says "retry later"."""


class NeverFits(InvalidRequest, ResourceExhausted):
    """The request can never run here, however long the caller waits: its prompt (+ max_tokens)
    needs more than a pool holds or than the model's context. INVALID_ARGUMENT, so that no client
    retries it; a ResourceExhausted too, for in-process callers. Build it with :func:`never_fits`
    so every service words it the same ("can never fit")."""


def never_fits(reason: str, fix: str = "lower max_tokens or shorten the prompt") -> NeverFits:
    """``NeverFits("<reason>: it can never fit; <fix>")``: the one wording of every service."""
    return NeverFits(f"{reason}: it can never fit; {fix}")


class FailedPrecondition(KvwireError):
    """The system is not in a state to serve this (model or KV layout mismatch, no chat template)."""


class DataLoss(KvwireError):
    """Bytes arrived corrupted or incomplete (a KV chunk failed its checksum or size check, held
    non-finite numbers; a peer sent a token outside the vocabulary)."""


class Unavailable(KvwireError):
    """A dependency is down or the server is shutting down; retrying elsewhere may succeed."""


class DeadlineExceeded(KvwireError):
    """The work did not finish in the time the caller allowed."""
