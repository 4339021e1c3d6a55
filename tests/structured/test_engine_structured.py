"""Structured output in the engine (kvwire.grammar, embedded model): every kind of constraint is
obeyed from the first token on and ends generation when complete; requests without one, batched
beside constrained ones, get exactly the tokens they get alone; what cannot be compiled is an
InvalidRequest naming the problem; the compiled grammar is cached per constraint."""
from __future__ import annotations

import json
import re

import pytest

from kvwire import LLM, SamplingParams
from kvwire.config import DEFAULT_MODEL_DIR
from kvwire.errors import InvalidRequest
from kvwire.sampling_params import FinishReason, KVSourceChoice, StructuredKind, StructuredOutput
from kvwire.tokenizer import ChatMessage

pytest.importorskip("xgrammar")

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "pattern": "^[a-z]{1,8}$"},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                           "ok": {"type": "boolean"}},
          "required": ["name", "n", "ok"], "additionalProperties": False}
JSON = StructuredOutput(StructuredKind.JSON_SCHEMA, json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def llm():
    return LLM(str(DEFAULT_MODEL_DIR), num_pages=256)


@pytest.fixture(scope="module")
def prompt(llm):
    return llm.tokenizer.apply_chat_template([ChatMessage("user", "Describe a thing.")])


@pytest.mark.parametrize("params", [SamplingParams(max_tokens=64), SamplingParams(max_tokens=64, temperature=1.0, seed=5),
                                    SamplingParams(max_tokens=64, temperature=0.8, top_p=0.9, repetition_penalty=1.3,
                                                   speculative="ngram")])
def test_json_schema_output_parses_and_ends_at_the_schema(llm, prompt, params):
    import dataclasses
    [out] = llm.generate(prompt, dataclasses.replace(params, structured=JSON))
    assert out.finish_reason is FinishReason.STOP, out.text
    value = json.loads(out.text)
    assert set(value) == {"name", "n", "ok"} and re.fullmatch("[a-z]{1,8}", value["name"]) and 0 <= value["n"] <= 99


@pytest.mark.parametrize("structured, check", [
    (StructuredOutput(StructuredKind.JSON_OBJECT), lambda t: isinstance(json.loads(t), dict)),
    (StructuredOutput(StructuredKind.REGEX, r"[0-9]{3}-[a-z]{2,4}"), lambda t: re.fullmatch(r"[0-9]{3}-[a-z]{2,4}", t)),
    (StructuredOutput(StructuredKind.CHOICE, choices=("yes", "no way", "maybe \"so\"")),
     lambda t: t in ("yes", "no way", "maybe \"so\"")),
    (StructuredOutput(StructuredKind.GRAMMAR, 'root ::= "a" ("b" | "c")+ "."'), lambda t: re.fullmatch(r"a[bc]+\.", t)),
])
def test_each_kind_is_obeyed(llm, prompt, structured, check):
    [out] = llm.generate(prompt, SamplingParams(max_tokens=40, structured=structured))
    if out.finish_reason is FinishReason.STOP:
        assert check(out.text), out.text
    else:  # an unbounded constraint may run out of tokens; the text so far still follows it
        assert structured.kind in (StructuredKind.JSON_OBJECT, StructuredKind.GRAMMAR) and out.text[0] in "{a"


def test_unconstrained_requests_in_the_batch_are_unaffected(llm, prompt):
    plain = [SamplingParams(max_tokens=20), SamplingParams(max_tokens=20, temperature=0.9, seed=11),
             SamplingParams(max_tokens=20, speculative="ngram", num_speculative_tokens=3)]  # verifying several rows
    alone = [llm.generate(prompt, p)[0].token_ids for p in plain]
    mixed = llm.generate([prompt] * 4, [*plain, SamplingParams(max_tokens=64, structured=JSON)])
    assert [o.token_ids for o in mixed[:3]] == alone
    json.loads(mixed[3].text)
    assert llm.stats()["used"] == 0


@pytest.mark.parametrize("structured, words", [
    (StructuredOutput(StructuredKind.JSON_SCHEMA, '{"type": "nope"}'), "json_schema cannot be compiled: Unsupported type"),
    (StructuredOutput(StructuredKind.JSON_SCHEMA, '{"type": '), "json_schema is not valid JSON"),
    (StructuredOutput(StructuredKind.REGEX, "(["), "regex cannot be compiled"),
    (StructuredOutput(StructuredKind.GRAMMAR, "root ::= foo"), 'Rule "foo" is not defined'),
    (StructuredOutput(StructuredKind.CHOICE, choices=()), "choice needs"),
    (StructuredOutput("xml", "x"), "kind must be one of"),
])
def test_what_cannot_be_compiled_is_refused_by_name(llm, prompt, structured, words):
    with pytest.raises(InvalidRequest, match=re.escape(words)):
        llm.generate(prompt, SamplingParams(structured=structured))
    assert llm.stats()["used"] == 0 and not llm.has_unfinished()


def test_min_tokens_n_and_remote_prefill_are_refused(llm, prompt):
    with pytest.raises(InvalidRequest, match="min_tokens cannot be combined"):
        llm.generate(prompt, SamplingParams(min_tokens=2, structured=JSON))
    with pytest.raises(InvalidRequest, match="n must be 1 with structured output"):
        llm.generate(prompt, SamplingParams(n=2, structured=JSON))
    req = llm.core.add_request("remote", list(llm.encode(prompt)), SamplingParams(structured=JSON),
                               KVSourceChoice.REMOTE)
    from kvwire.engine.kv_source import KVSources, LocalPrefill
    with pytest.raises(InvalidRequest, match="kv_source local"):
        KVSources(LocalPrefill(llm.core.runner)).choose(req)
    llm.abort("remote")


def test_compiled_once_per_constraint(llm):
    grammars = llm.core.grammars
    before = grammars.compile.cache_info()
    for _ in range(3):
        grammars.matcher(StructuredOutput(StructuredKind.REGEX, "cached[0-9]"), {0})
    after = grammars.compile.cache_info()
    assert after.misses - before.misses == 1 and after.hits - before.hits == 2


def test_special_tokens_never_spell_constrained_text(llm):
    """"<|im_start|>" would match this regex as text, but the detokenizer drops special tokens: the
    mask never allows one (only as a stop token, once the constraint is complete)."""
    import torch

    tok = llm.tokenizer.tok
    special = [i for i, t in tok.get_added_tokens_decoder().items() if t.special]
    assert special
    m = llm.core.grammars.matcher(StructuredOutput(StructuredKind.REGEX, r"[<|a-z_>]+"), llm.core.eos_ids)
    row = m.mask(torch.zeros(llm.core.grammars.vocab_size))
    assert all(row[i] == float("-inf") for i in special)
    assert row[tok.token_to_id("a")] == 0.0
