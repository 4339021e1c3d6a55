"""StructuredOutput (SamplingParams field 18) through the gRPC front door on the real services
(embedded model): a regex and a choice are obeyed; a constraint decode cannot compile is
INVALID_ARGUMENT naming the problem; kv_source remote with a constraint is INVALID_ARGUMENT."""
from __future__ import annotations

import asyncio
import re

import grpc
import pytest

from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc as pbg
from tools.stack import Stack

pytest.importorskip("xgrammar")


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    with Stack(decode_pages=256, prefill_pages=256, log_dir=tmp_path_factory.mktemp("logs")) as s:
        yield s


def generate(stack, structured: pb.StructuredOutput, **kw) -> str:
    async def run():
        async with grpc.aio.insecure_channel(stack.addr("tokenizer_svc")) as ch:
            text = ""
            request = pb.GenerateTextRequest(text="The for statement", **kw, sampling=pb.SamplingParams(
                max_tokens=24, structured=structured))
            async for msg in pbg.TokenizerServiceStub(ch).GenerateText(request):
                text += msg.text
            return text
    return asyncio.run(run())


def test_regex_and_choice_are_obeyed(stack):
    assert re.fullmatch(r"[0-9]{2}:[0-9]{2}", generate(stack, pb.StructuredOutput(regex=r"[0-9]{2}:[0-9]{2}")))
    choices = ["alpha", "beta gamma"]
    assert generate(stack, pb.StructuredOutput(choice=pb.StructuredOutput.Choices(choices=choices))) in choices


@pytest.mark.parametrize("structured, kw, words", [
    (pb.StructuredOutput(regex="(["), {}, "regex cannot be compiled"),
    (pb.StructuredOutput(json_schema='{"type": "nope"}'), {}, "json_schema cannot be compiled"),
    (pb.StructuredOutput(), {}, "kind must be one of"),
    (pb.StructuredOutput(regex="a+"), {"kv_source": pb.KV_SOURCE_REMOTE}, "kv_source local"),
])
def test_bad_constraints_are_invalid_argument(stack, structured, kw, words):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        generate(stack, structured, **kw)
    assert e.value.code() is grpc.StatusCode.INVALID_ARGUMENT and words in e.value.details()
