"""Log-probabilities in OpenAI's two response shapes, as vLLM's OpenAI server writes them.

    chat:        {"content": [{"token", "logprob", "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}]}
    completions: {"tokens", "token_logprobs", "top_logprobs": [{token: logprob}], "text_offset"}

A token's text is its own decoding (a byte-level token holding part of a character decodes to
U+FFFD, as in vLLM; ``bytes`` then says so). Values are the decode service's: log_softmax of the
model's raw logits (before penalties, logit_bias and temperature), vLLM's default.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from protos.kvwire.v1 import kvwire_pb2 as pb

TokenText = Callable[[int], str]  # token id -> its text


def chat_logprobs(text_of: TokenText, entries: Sequence[pb.TokenLogprob]) -> dict[str, Any]:
    """The ``logprobs`` of a chat choice (or of a streamed chunk's tokens)."""
    def one(token_id: int, logprob: float) -> dict[str, Any]:
        t = text_of(token_id)
        return {"token": t, "logprob": logprob, "bytes": list(t.encode("utf-8"))}
    return {"content": [{**one(e.token_id, e.logprob), "top_logprobs": [one(x.token_id, x.logprob)
                                                                         for x in e.top_logprobs]}
                        for e in entries], "refusal": None}


class CompletionLogprobs:
    """The ``logprobs`` of a completions choice; streamed, each chunk's offsets follow the last's."""

    def __init__(self, text_of: TokenText):
        self.text_of = text_of
        self.offset = 0  # characters of the tokens formatted so far

    def prompt(self, ids: Sequence[int], entries: Sequence[pb.TokenLogprob]) -> dict[str, Any]:
        """The echoed prompt's part: ``entries`` score ``ids[1:]``; the first token has no logprob (None)."""
        out = self([pb.TokenLogprob(token_id=ids[0])] + list(entries)) if ids else self([])
        if ids:
            out["token_logprobs"][0] = out["top_logprobs"][0] = None
        return out

    @staticmethod
    def joined(*parts: dict[str, Any]) -> dict[str, Any]:
        """Parts one after the other (the prompt's, then the completion's)."""
        return {key: [v for p in parts for v in p[key]] for key in parts[0]}

    def __call__(self, entries: Sequence[pb.TokenLogprob]) -> dict[str, Any]:
        tokens, offsets, tops = [], [], []
        for e in entries:
            t = self.text_of(e.token_id)
            tokens.append(t)
            offsets.append(self.offset)
            self.offset += len(t)
            # the k most likely, and the sampled token always (OpenAI: "up to logprobs + 1 elements")
            top = {self.text_of(x.token_id): x.logprob for x in e.top_logprobs}
            top.setdefault(t, e.logprob)
            tops.append(top)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
                "text_offset": offsets}
