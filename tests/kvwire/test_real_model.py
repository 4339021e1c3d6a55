"""The real pretrained model (SmolLM2-135M-Instruct, GGUF Q4_1) against transformers' own GGUF loading.

Runs when the model is in the cache (``python -m tools.fetch_model smollm2-135m-instruct``; tools/test.sh
fetches it first) and is skipped with the reason otherwise.
"""
from __future__ import annotations

import pytest
import torch
import transformers

from kvwire.generate import generate
from kvwire.kv.dense import DenseKVCache
from kvwire.model import registry
from kvwire.model.loader import load_model
from kvwire.model.source import eos_token_ids
from kvwire.sampling_params import SamplingParams
from kvwire.tokenizer import ChatMessage, ModelTokenizer

NAME = "smollm2-135m-instruct"
pytestmark = [pytest.mark.real_model,
              pytest.mark.skipif(not registry.is_cached(NAME),
                                 reason=f"{NAME} is not fetched (python -m tools.fetch_model {NAME})")]
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def path():
    return registry.cached_path(NAME)


@pytest.fixture(scope="module")
def ours(path):
    return load_model(NAME)  # the registered name resolves to the cached file


@pytest.fixture(scope="module")
def tok(path):
    return ModelTokenizer(NAME)


def test_logits_match_transformers_gguf_loading(path, ours, tok):
    theirs = transformers.AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                               dtype=torch.float32).eval()
    ids = tok.encode("The for statement in Python iterates over the items of a sequence")
    cache = DenseKVCache(ours.config, 1, len(ids))
    got = ours.model(torch.tensor(ids), cache.prepare([0], [len(ids)]), cache)
    with torch.no_grad():
        expected = theirs(torch.tensor([ids])).logits[0]
    # Same dequantized weights, fp32 on both sides: differences are summation order over 30 layers.
    assert (got - expected).abs().max().item() < 5e-4  # measured: 3.7e-5 with logits up to 34
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


def test_tokenizer_matches_transformers(path, tok):
    theirs = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    for text in ("The for statement", "12345 + 678 = 13023", "naïve café 你好 👍\n\n  indented"):
        assert tok.encode(text) == theirs(text).input_ids, text
    chat = theirs.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True,
                                      tokenize=True)
    chat = chat["input_ids"] if hasattr(chat, "keys") else chat
    assert tok.encode_chat([ChatMessage("user", QUESTION)]) == list(chat)


def test_greedy_chat_answer_names_paris(ours, tok):
    prompt = tok.encode_chat([ChatMessage("user", QUESTION)])
    eos = eos_token_ids(NAME)
    assert tok.tok.token_to_id("<|im_end|>") in eos
    out = generate(ours.model, prompt, SamplingParams(max_tokens=24), eos_ids=eos)
    answer = tok.decode(out)
    assert "Paris" in answer, answer
    assert out[-1] in eos  # stops by itself at <|im_end|>
