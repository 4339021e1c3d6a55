"""On the embedded model, through the three services as real processes: sampled generations that
max_tokens cuts inside a multi-byte character (a curly quote, 3 bytes over 2 tokens) never send
half of it. Each case's seed and max_tokens were found by generating with ``kvwire.LLM``; the
premise (at least one cut mid-character) is asserted, so a model change cannot make this pass
vacuously."""
from __future__ import annotations

import grpc
import pytest

from kvwire.config import DEFAULT_MODEL_DIR
from kvwire.tokenizer import ModelTokenizer
from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc as pbg
from tools.stack import Stack

REPLACEMENT = "\ufffd"
PROMPT = "The curly quote ’ and “this” — em dash"
CASES = [(3, 24), (48, 26), (58, 32), (62, 32), (0, 32)]  # (seed, max_tokens)


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with Stack(decode_pages=256, prefill_pages=256, log_dir=tmp_path_factory.mktemp("partial-logs")) as s:
        yield s


def test_no_delta_ends_in_half_a_character_on_the_embedded_model(stack):
    tok = ModelTokenizer(DEFAULT_MODEL_DIR)
    dropped = 0
    with grpc.insecure_channel(stack.addr("tokenizer_svc")) as ch:
        stub = pbg.TokenizerServiceStub(ch)
        for seed, max_tokens in CASES:
            msgs = list(stub.GenerateText(pb.GenerateTextRequest(text=PROMPT, sampling=pb.SamplingParams(
                max_tokens=max_tokens, temperature=1.5, seed=seed)), timeout=120))
            ids = [t for m in msgs for t in m.token_ids]
            full = tok.decode(ids, skip_special_tokens=True)
            assert not any(m.text.endswith(REPLACEMENT) for m in msgs), (seed, [m.text for m in msgs])
            assert msgs[-1].partial_character_dropped == full.endswith(REPLACEMENT), seed
            assert "".join(m.text for m in msgs) == full.rstrip(REPLACEMENT), seed
            dropped += msgs[-1].partial_character_dropped
    assert dropped >= 1  # the premise: some generation really stopped inside a character
