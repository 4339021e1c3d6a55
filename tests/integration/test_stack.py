"""The three services as separate processes on loopback, with the embedded model.

One stack per module (starting it is the slow part); an in-test OTLP receiver collects the traces
the three processes export.
"""
from __future__ import annotations

import asyncio
import os
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from kvwire.config import DEFAULT_MODEL_DIR
from kvwire.generate import generate
from kvwire.runtime import EngineConfig, load_engine
from kvwire.sampling_params import SamplingParams
from kvwire.tokenizer import ModelTokenizer
from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc as pbg
from kvwire.threads import usable_cpus
from tools.stack import Stack, split_cpus

PROMPTS = ["The for statement", "The while statement is used for", "A class definition",
           "Exceptions can be raised", "The import statement", "Lambda expressions",
           "The return statement", "Comparisons in Python", "The with statement", "Integer literals"]


@pytest.fixture(scope="module")
def stack(otlp_env, tmp_path_factory):
    env = otlp_env
    s = Stack(decode_pages=512, prefill_pages=512, env=env, log_dir=tmp_path_factory.mktemp("logs"))
    with s:
        yield s


async def stream_text(addr: str, request: pb.GenerateTextRequest) -> tuple[str, list[int], pb.GenerateTextResponse]:
    async with grpc.aio.insecure_channel(addr) as ch:
        text, ids, last = "", [], None
        async for msg in pbg.TokenizerServiceStub(ch).GenerateText(request):
            text += msg.text
            ids += msg.token_ids
            last = msg
        return text, ids, last


def test_health_and_reflection_on_every_service(stack):
    expected = {"tokenizer_svc": "kvwire.v1.TokenizerService", "decode_svc": "kvwire.v1.DecodeService",
                "prefill_svc": "kvwire.v1.PrefillService"}
    for name, service in expected.items():
        with grpc.insecure_channel(stack.addr(name)) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            assert health.Check(health_pb2.HealthCheckRequest(service=service)).status == \
                health_pb2.HealthCheckResponse.SERVING
            assert service in ProtoReflectionDescriptorDatabase(ch).get_services()


@pytest.mark.skipif("OMP_NUM_THREADS" in os.environ, reason="OMP_NUM_THREADS set: the stack leaves threads to it")
def test_prefill_and_decode_split_the_cores(stack):
    for name, n in split_cpus(usable_cpus()).items():
        assert f"{n} compute threads" in (stack.log_dir / f"{name}.log").read_text(), name


@pytest.mark.skipif("OMP_NUM_THREADS" in os.environ, reason="OMP_NUM_THREADS set: the stack leaves threads to it")
def test_prefill_and_decode_lend_each_other_cores_and_end_idle(stack):
    split = split_cpus(usable_cpus())
    for name in ("prefill_svc", "decode_svc"):
        log = (stack.log_dir / f"{name}.log").read_text()
        assert f"{usable_cpus()} compute threads while the other role is idle, {split[name]} while both" in log, name
    asyncio.run(stream_text(stack.addr("tokenizer_svc"), pb.GenerateTextRequest(
        text="hello", sampling=pb.SamplingParams(max_tokens=4, ignore_eos=True))))
    deadline = time.monotonic() + 10
    while stack.cores_file.read_bytes() != b"\x00\x00" and time.monotonic() < deadline:
        time.sleep(0.05)  # decode marks itself idle when its loop finds nothing to step
    assert stack.cores_file.read_bytes() == b"\x00\x00"


def test_greedy_through_three_services_equals_in_process(stack):
    """10 prompts from 4 concurrent clients, token for token the in-process output (same model,
    weights and FP8 KV settings)."""
    engine = load_engine(EngineConfig(model_dir=DEFAULT_MODEL_DIR))
    tok = ModelTokenizer(DEFAULT_MODEL_DIR)

    async def clients():
        queue: asyncio.Queue = asyncio.Queue()
        for p in PROMPTS:
            queue.put_nowait(p)
        results = {}

        async def client():
            while not queue.empty():
                prompt = queue.get_nowait()
                results[prompt] = await stream_text(stack.addr("tokenizer_svc"), pb.GenerateTextRequest(
                    text=prompt, sampling=pb.SamplingParams(max_tokens=40)))
        await asyncio.gather(*[client() for _ in range(4)])
        return results

    results = asyncio.run(clients())
    for prompt in PROMPTS:
        text, ids, last = results[prompt]
        expected = generate(engine.model, tok.encode(prompt), SamplingParams(max_tokens=40),
                            eos_ids=tok.eos_ids, cache=engine.new_cache(64))
        assert ids == expected, prompt
        assert text == tok.decode(ids)
        assert last.usage.completion_tokens == len(ids)
        assert "\ufffd" not in text


def test_one_trace_across_three_services(stack, receiver):
    receiver.clear()
    # A prompt this short would prefill inside decode_svc (--local-prefill-max-tokens): ask for prefill_svc.
    asyncio.run(stream_text(stack.addr("tokenizer_svc"), pb.GenerateTextRequest(
        text="The for statement", sampling=pb.SamplingParams(max_tokens=8), kv_source=pb.KV_SOURCE_REMOTE)))
    wanted = {"prefill.forward", "kv_transfer", "decode", "tokenize", "detokenize"}

    def complete(ss):  # every wanted span arrived, and every span's parent too (spans export as they end)
        ids = {s.span_id for s in ss}
        return wanted <= {s.name for s in ss} and all(not s.parent_span_id or s.parent_span_id in ids for s in ss)
    spans = receiver.wait_for(complete, timeout=20)
    front = [s for s in spans if s.name.endswith("TokenizerService/GenerateText") and s.kind == 2]
    assert len(front) == 1
    trace_id = front[0].trace_id
    in_trace = [s for s in spans if s.trace_id == trace_id]
    by_id = {s.span_id: s for s in in_trace}
    assert {s.service_name for s in in_trace} == {"kvwire-tokenizer", "kvwire-decode", "kvwire-prefill"}
    assert wanted <= {s.name for s in in_trace}
    assert not any("Health" in s.name for s in spans)

    def parent(s):
        return by_id.get(s.parent_span_id)

    decode_server = next(s for s in in_trace if s.name.endswith("DecodeService/GenerateTokens") and s.kind == 2)
    prefill_server = next(s for s in in_trace if s.name.endswith("PrefillService/Prefill") and s.kind == 2)
    # client span of each hop sits between the two servers
    assert parent(decode_server).service_name == "kvwire-tokenizer" and parent(decode_server).kind == 3
    assert parent(prefill_server).service_name == "kvwire-decode" and parent(prefill_server).kind == 3
    transfer = next(s for s in in_trace if s.name == "kv_transfer")
    assert transfer.attributes["kvwire.kv.dtype"] == "fp8_e4m3"
    assert transfer.attributes["kvwire.kv.compression_vs_bf16"] > 1.8
    assert transfer.attributes["kvwire.kv.checksums_verified"] >= 1
    assert parent(transfer).span_id == decode_server.span_id
    decode = next(s for s in in_trace if s.name == "decode")
    assert decode.attributes["gen_ai.usage.output_tokens"] == 8
    assert front[0].attributes["gen_ai.usage.output_tokens"] == 8
    assert front[0].attributes["gen_ai.request.model"] == "kvwire-tiny"


def test_a_short_prompt_prefills_inside_decode_by_default(stack, receiver):
    receiver.clear()
    asyncio.run(stream_text(stack.addr("tokenizer_svc"), pb.GenerateTextRequest(
        text="The for statement", sampling=pb.SamplingParams(max_tokens=4))))
    spans = receiver.wait_for(lambda ss: {"prefill.local", "decode", "detokenize"} <= {s.name for s in ss}, timeout=20)
    decode = next(s for s in spans if s.name == "decode")
    assert decode.attributes["kvwire.kv.source"] == "local"
    assert not any(s.name in ("kv_transfer", "prefill.forward") for s in spans)


def test_client_cancel_frees_decode_pages(stack):
    async def run():
        async with grpc.aio.insecure_channel(stack.addr("decode_svc")) as dch:
            decode = pbg.DecodeServiceStub(dch)
            baseline = (await decode.GetPoolStats(pb.GetPoolStatsRequest())).free_pages
            async with grpc.aio.insecure_channel(stack.addr("tokenizer_svc")) as ch:
                call = pbg.TokenizerServiceStub(ch).GenerateText(pb.GenerateTextRequest(
                    text="The for statement " * 20, sampling=pb.SamplingParams(max_tokens=1000)))
                for _ in range(3):
                    await call.read()
                assert (await decode.GetPoolStats(pb.GetPoolStatsRequest())).free_pages < baseline
                call.cancel()
            for _ in range(100):
                stats = await decode.GetPoolStats(pb.GetPoolStatsRequest())
                if stats.free_pages == baseline and stats.running == 0:
                    return True
                await asyncio.sleep(0.1)
            return False
    assert asyncio.run(run())


@pytest.mark.parametrize("request_kwargs, match", [
    (dict(text=""), "empty"),
    (dict(text="The for statement", sampling=pb.SamplingParams(max_tokens=5000)), "context"),
    (dict(text="x", sampling=pb.SamplingParams(max_tokens=0)), "max_tokens"),
])
def test_invalid_requests_through_the_front_door(stack, request_kwargs, match):
    with pytest.raises(grpc.aio.AioRpcError) as e:
        asyncio.run(stream_text(stack.addr("tokenizer_svc"), pb.GenerateTextRequest(**request_kwargs)))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert match in e.value.details()


def test_sigterm_drains_and_exits_cleanly(stack):
    codes = stack.stop()
    assert codes == {"prefill_svc": 0, "decode_svc": 0, "tokenizer_svc": 0}


UNICODE_TEXT = "안녕하세요 세계! 👩‍👩‍👧 🧑‍🚀 漢字と仮名 cafe\u0301 naïve ạ̀"


@pytest.fixture(scope="module")
def echo_stack(tmp_path_factory):
    from tests.integration.echo_model import build_echo_model
    tok = ModelTokenizer(DEFAULT_MODEL_DIR)
    period = len(tok.encode(UNICODE_TEXT, add_special_tokens=False))
    model = build_echo_model(tmp_path_factory.mktemp("echo"), DEFAULT_MODEL_DIR, period)
    with Stack(model_dir=model, decode_pages=64, prefill_pages=64,
               log_dir=tmp_path_factory.mktemp("echo-logs")) as s:
        yield s, tok.encode(UNICODE_TEXT, add_special_tokens=False)


def test_generated_korean_emoji_cjk_and_combining_marks_stream_without_replacement_chars(echo_stack):
    """A model built to repeat its prompt generates multi-byte characters split across byte-level
    tokens; every streamed delta must be whole characters."""
    stack, expected_ids = echo_stack

    async def run():
        async with grpc.aio.insecure_channel(stack.addr("tokenizer_svc")) as ch:
            deltas, ids = [], []
            async for msg in pbg.TokenizerServiceStub(ch).GenerateText(pb.GenerateTextRequest(
                    text=UNICODE_TEXT, sampling=pb.SamplingParams(max_tokens=len(expected_ids)))):
                deltas.append(msg.text)
                ids += msg.token_ids
            return deltas, ids

    deltas, ids = asyncio.run(run())
    assert ids == expected_ids  # the model really generated the text, token by token
    assert "".join(deltas) == UNICODE_TEXT
    assert not any("\ufffd" in d for d in deltas)
    assert sum(1 for d in deltas if d) > 10  # streamed as it was generated, not at the end
