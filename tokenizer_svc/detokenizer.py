"""Streaming token ids -> text without ever emitting half a character, and stop-string matching.

Byte-level BPE splits one Korean syllable, CJK character or emoji over several tokens; decoding
those tokens one at a time yields U+FFFD. ``IncrementalDetokenizer`` uses the prefix/read offset
technique of vLLM and TGI: decode a small window of recent tokens twice, without and with the new
ones, and emit the difference only when it does not end in U+FFFD (an incomplete UTF-8 sequence).
"""
from __future__ import annotations

from typing import Callable, Sequence

REPLACEMENT = "\ufffd"
# Prompt tokens kept as left context, so decoders that treat the first token of a decode specially
# (SentencePiece's leading-space strip) see the generated text in context, as in TGI/vLLM.
CONTEXT_TOKENS = 5
_TRIM_AT = 1024  # drop fully emitted ids from the window buffer once this many pile up


class IncrementalDetokenizer:
    """Feed token ids as they arrive; get back text that is final.

    Contract: concatenating every ``add()`` result and ``flush()`` equals ``decode(all ids)`` (for
    byte-level tokenizers), and no ``add()`` result contains U+FFFD unless the model generated
    genuinely invalid bytes. ``flush()`` releases whatever is still pending, U+FFFD included when
    generation ended in the middle of a character; ``finish()`` (what the services use) drops that
    incomplete tail instead and says so.
    """

    def __init__(self, decode: Callable[[Sequence[int]], str], context_ids: Sequence[int] = ()):
        self._decode = decode
        self._ids: list[int] = list(context_ids[-CONTEXT_TOKENS:]) if context_ids else []
        # ids[prefix_offset:read_offset] was already emitted and is re-decoded as context;
        # ids[read_offset:] is pending.
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def add(self, token_ids: Sequence[int]) -> str:
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        return self._advance(final=True)

    def finish(self) -> tuple[str, bool]:
        """The pending text at the end of generation, less an incomplete character at its very end
        (generation stopped inside it): ``(text, dropped)``. What a client is sent, so that no
        delta ever ends in U+FFFD; ``dropped`` says the tail was cut."""
        text = self.flush()
        kept = text.rstrip(REPLACEMENT)
        return kept, len(kept) != len(text)

    def _advance(self, final: bool) -> str:
        if self._read_offset == len(self._ids):
            return ""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) <= len(prefix_text) and not final:
            return ""  # only special tokens (skipped) or bytes that don't form a character yet
        if new_text.endswith(REPLACEMENT) and not final:
            return ""  # the last character is still incomplete: wait for more bytes
        delta = new_text[len(prefix_text):]
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        if self._prefix_offset > _TRIM_AT:
            del self._ids[:self._prefix_offset]
            self._read_offset -= self._prefix_offset
            self._prefix_offset = 0
        return delta


class StopStringMatcher:
    """Finds the first stop string in streamed text, holding back text that might start one.

    ``feed(text)`` returns ``(safe_text, matched)``: ``safe_text`` can be sent now; ``matched`` is
    the stop string found (then ``safe_text`` ends right before it and nothing more may be fed).
    Text is held back while a suffix of it is a proper prefix of some stop string, so a stop
    string split across tokens is still caught and never partly sent.
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = tuple(stops)
        self._held = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        if not self.stops:
            return text, None
        buf = self._held + text
        hits = [(buf.find(s), -len(s), s) for s in self.stops if s in buf]
        if hits:
            index, _, stop = min(hits)  # earliest match; the longest one if several start there
            self._held = ""
            return buf[:index], stop
        hold = self._longest_partial_suffix(buf)
        self._held = buf[len(buf) - hold:] if hold else ""
        return buf[:len(buf) - hold], None

    def flush(self) -> str:
        """Release the held-back text (generation ended without a match)."""
        held, self._held = self._held, ""
        return held

    def _longest_partial_suffix(self, buf: str) -> int:
        longest = max(len(s) for s in self.stops) - 1
        for k in range(min(longest, len(buf)), 0, -1):
            tail = buf[-k:]
            if any(len(s) > k and s.startswith(tail) for s in self.stops):
                return k
        return 0
