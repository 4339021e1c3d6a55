"""A small byte-level BPE tokenizer, trained in a second, saved as a model dir for ModelTokenizer.

The vocabulary is tiny on purpose: Korean syllables, CJK characters and emoji get split across
several byte-level tokens, which is what the incremental detokenizer must cope with.
"""
from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
                 "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
CORPUS = [
    "Hello world! The quick brown fox jumps over the lazy dog.",
    "안녕하세요, 만나서 반갑습니다. 한국어 텍스트입니다.",
    "你好，世界。今天天气很好。日本語のテキストです。",
    "Emoji: 👩‍👩‍👧 family, 👍🏽 thumbs, 🇰🇷 flag, 😀 smile.",
    "Combining: e\u0301 a\u0300 n\u0303 and Ångström café.",
] * 20


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=330, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    path = tmp_path_factory.mktemp("tiny-tokenizer")
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "bos_token": None, "chat_template": CHAT_TEMPLATE}))
    return path


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from kvwire.tokenizer import ModelTokenizer

    return ModelTokenizer(model_dir)
