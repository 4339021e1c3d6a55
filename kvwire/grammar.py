"""Structured output: a request's constraint (``StructuredOutput``) compiled to a grammar, and the
per-request matcher that masks its logits row each step (xgrammar; docs/decisions/063-structured-output.md).

    Grammars(model_dir)               the model's tokenizer read lazily (decode loads no tokenizer otherwise)
      .compile(structured)            -> CompiledGrammar, LRU-cached per constraint, thread-safe
      .matcher(structured, stops)     -> Matcher: one request's state
    Matcher.mask(logits)              logits [vocab] -> a masked copy (tokens the grammar forbids at -inf)
    Matcher.accept(token)             advance past a sampled token; ``terminated`` once a stop token ended it

The mask for a request's next token depends only on the tokens it accepted, so decode fills it while
the step's forward runs (``fill`` on another thread, then ``apply``). Requests without a grammar
are never touched. A schema, regex or grammar the engine cannot compile is an InvalidRequest
naming the problem. The grammar's stop tokens are the request's (EOS unless ignore_eos, plus
stop_token_ids): once the constraint is complete only they are allowed, so generation ends there.
"""
from __future__ import annotations

import functools
import json
import re
import threading
from collections.abc import Collection, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import torch

from kvwire.errors import FailedPrecondition, InvalidRequest
from kvwire.sampling_params import StructuredKind, StructuredOutput

_FILLER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
_SOURCE_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[hh:mm:ss] file.cc:line: " before a reason
CACHE_SIZE = 256  # compiled grammars kept (one per distinct constraint)
JSON_OBJECT_SCHEMA = '{"type": "object"}'


def _xgrammar():
    try:
        import xgrammar
    except ImportError as e:  # an optional dependency: kvwire[structured]
        raise FailedPrecondition("structured output needs xgrammar on the decode service "
                                 "(pip install 'kvwire[structured]')") from e
    return xgrammar


def vocab_type(tokenizer_json: dict[str, Any]) -> str:
    """How the tokenizer's token strings map to bytes: "BYTE_LEVEL" (GPT-2's byte alphabet),
    "BYTE_FALLBACK" (sentencepiece pieces with <0xNN> byte tokens) or "RAW" (the strings are the text)."""
    dec = tokenizer_json.get("decoder") or {}
    kinds = {dec.get("type")} | {d.get("type") for d in dec.get("decoders", []) if isinstance(d, dict)}
    if "ByteLevel" in kinds:
        return "BYTE_LEVEL"
    if "ByteFallback" in kinds:
        return "BYTE_FALLBACK"
    return "RAW"


class Grammars:
    """The compiler for one model's vocabulary (``vocab_size``: the model's logits width)."""

    def __init__(self, model_dir: str | Path, vocab_size: int, eos_ids: Collection[int] = (), threads: int = 1):
        self.model_dir, self.vocab_size, self.eos_ids, self.threads = model_dir, vocab_size, sorted(eos_ids), threads
        self._lock = threading.Lock()
        self._compiler = None
        self.compile = functools.lru_cache(maxsize=CACHE_SIZE)(self._compile)

    def compiler(self):
        with self._lock:
            if self._compiler is None:
                xgr = _xgrammar()
                from kvwire.tokenizer import ModelTokenizer

                tok = ModelTokenizer(self.model_dir)
                # Empty strings are xgrammar's special tokens, never allowed inside a constraint: ids past
                # the tokenizer's (padding rows) and its special tokens, whose text (e.g. "<|im_start|>")
                # the detokenizer drops, so the text would not be what the grammar accepted.
                vocab = [""] * self.vocab_size
                special = {i for i, t in tok.tok.get_added_tokens_decoder().items() if t.special}
                for text, i in tok.tok.get_vocab(with_added_tokens=True).items():
                    if i < self.vocab_size and i not in special:
                        vocab[i] = text
                kind = vocab_type(json.loads(tok.tok.to_str()))
                info = xgr.TokenizerInfo(vocab, getattr(xgr.VocabType, kind), vocab_size=self.vocab_size,
                                         stop_token_ids=self.eos_ids or sorted(tok.eos_ids),
                                         add_prefix_space=kind == "BYTE_FALLBACK")
                self._compiler = xgr.GrammarCompiler(info, max_threads=self.threads, cache_enabled=False)
            return self._compiler

    def _compile(self, s: StructuredOutput):
        """``s`` -> xgrammar's CompiledGrammar (cached by ``compile``); InvalidRequest if it cannot be."""
        s.validate()
        c = self.compiler()
        try:
            if s.kind is StructuredKind.JSON_SCHEMA:
                # compact separators (no free whitespace: the model cannot loop on spaces), and no
                # properties beyond the schema's unless it allows them
                return c.compile_json_schema(s.spec, any_whitespace=False, strict_mode=True)
            if s.kind is StructuredKind.JSON_OBJECT:
                return c.compile_json_schema(JSON_OBJECT_SCHEMA, any_whitespace=False, strict_mode=False)
            if s.kind is StructuredKind.REGEX:
                return c.compile_regex(s.spec)
            if s.kind is StructuredKind.CHOICE:
                alts = " | ".join(json.dumps(choice, ensure_ascii=False) for choice in s.choices)
                return c.compile_grammar(f"root ::= {alts}")
            return c.compile_grammar(s.spec, root_rule_name="root")
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError / its own types with the reason
            lines = str(e).strip().splitlines()
            reason = _SOURCE_PREFIX.sub("", lines[0]) if lines else type(e).__name__
            # a user's message: control characters escaped, and no "Unexpected ..." that reads as our
            # own unexpected failure (the fuzz tests hold every detail to that)
            reason = "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in reason).replace("Unexpected", "unexpected")
            raise InvalidRequest(f"structured output {s.kind.value} cannot be compiled: {reason}") from e

    def matcher(self, s: StructuredOutput, stops: Collection[int]) -> "Matcher":
        return Matcher(self.compile(s), stops, self.vocab_size)


class Matcher:
    """One request's grammar state; used on the runner's thread only (``fill`` may run on a helper
    thread while that thread waits on the forward: never both at once)."""

    def __init__(self, compiled, stops: Collection[int], vocab_size: int):
        xgr = _xgrammar()
        self._m = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(stops) or None)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(vocab / 32)] int32, bit i of word j: token 32j + i
        self.vocab_size = vocab_size
        self._filled = False

    @property
    def terminated(self) -> bool:
        """A stop token was accepted: the constrained output is complete."""
        return self._m.is_terminated()

    def fill(self) -> None:
        """Compute the next token's mask (from the tokens accepted so far)."""
        self._m.fill_next_token_bitmask(self._bitmask, 0)
        self._filled = True

    def mask(self, logits: torch.Tensor) -> torch.Tensor:
        """logits [vocab] -> a float32 copy with every token the grammar forbids next at -inf."""
        if not self._filled:
            self.fill()
        # unpacked to one bool per token (little-endian bits, xgrammar's order); half the time of
        # xgrammar's own CPU apply at a 49k vocabulary (bench structured)
        bits = np.unpackbits(self._bitmask.numpy().view(np.uint8), bitorder="little")[:self.vocab_size]
        allowed = torch.from_numpy(bits.view(np.bool_))  # [vocab]
        self._filled = False
        return logits.float().masked_fill(~allowed, float("-inf"))

    def accept(self, token: int) -> None:
        """Advance past ``token`` (sampled from a masked row, so the grammar allows it)."""
        if not self._m.accept_token(token):
            raise RuntimeError(f"the grammar refused token {token}, which its own mask allowed")


def fill_masks(matchers: Sequence[Matcher]) -> Future:
    """Fill every matcher's next mask on a helper thread (decode runs the step's forward meanwhile);
    the future's ``result()`` is the barrier before ``Matcher.mask``."""
    return _FILLER.submit(lambda: [m.fill() for m in matchers])
