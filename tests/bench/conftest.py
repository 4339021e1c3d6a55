"""A tiny model directory with a tokenizer (for the serve / tokenizer / kv smoke runs) and a tiny
random-weight shape (for the engine smoke run), built once per session in tmp."""
from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tests.decode_svc.harness import tiny_model
from tests.tokenizer_svc.conftest import CORPUS, SPECIALS


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("bench-tiny")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=SPECIALS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tiny_model(path, vocab_size=max(300, tok.get_vocab_size()), num_layers=2)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "bos_token": None}))
    return path
