"""DecodeService: a thin gRPC shell over kvwire's AsyncEngine (token ids in, token ids out)."""
from __future__ import annotations

import contextlib
import uuid

from opentelemetry import trace

from kvwire.engine.async_engine import AsyncEngine
from kvwire_serving.server import close_when_rpc_ends, deadline_of
from protos import convert as conv
from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc


class DecodeServicer(kvwire_pb2_grpc.DecodeServiceServicer):
    def __init__(self, engine: AsyncEngine):
        self.engine = engine

    async def GenerateTokens(self, request: pb.GenerateTokensRequest, context):
        prompt = list(request.prompt_token_ids)
        params = conv.sampling_from_pb(request.sampling)
        kv_source = conv.kv_source_from_pb(request.kv_source)
        request_id = request.request_id or uuid.uuid4().hex
        span = trace.get_current_span()
        span.set_attributes({"gen_ai.operation.name": "text_completion", "kvwire.request_id": request_id,
                             "gen_ai.request.model": self.engine.runtime.fingerprint.model_name,
                             "gen_ai.request.max_tokens": params.max_tokens,
                             "gen_ai.request.temperature": params.temperature,
                             "gen_ai.usage.input_tokens": len(prompt)})
        completion: dict[int, int] = {}  # per choice (n > 1: each choice's messages carry its index)
        stream = self.engine.generate(prompt, params, request_id, kv_source, deadline_of(context))
        close_when_rpc_ends(context, stream)  # a cancelled call's pages go back now, not at GC time
        async with contextlib.aclosing(stream):
            async for out in stream:
                completion[out.index] = completion.get(out.index, 0) + len(out.token_ids)
                msg = pb.GenerateTokensResponse(token_ids=out.token_ids, index=out.index)
                if out.logprobs is not None:
                    msg.logprobs.extend(conv.logprobs_to_pb(out.logprobs))
                if out.prompt_logprobs is not None:
                    msg.prompt_logprobs.extend(conv.logprobs_to_pb(out.prompt_logprobs))
                if out.finished:
                    msg.finish_reason = conv.finish_to_pb(out.finish_reason)
                    msg.usage.prompt_tokens, msg.usage.completion_tokens = len(prompt), completion[out.index]
                    span.set_attributes({"gen_ai.usage.output_tokens": sum(completion.values()),
                                         "gen_ai.response.finish_reasons": [out.finish_reason.value]})
                yield msg

    async def GetPoolStats(self, request: pb.GetPoolStatsRequest, context) -> pb.GetPoolStatsResponse:
        s = self.engine.stats()
        spec = self.engine.runtime.spec
        return pb.GetPoolStatsResponse(
            total_pages=s["num_pages"], free_pages=s["free"], used_pages=s["used"], running=s["running"],
            waiting=s["waiting"], spec=conv.spec_to_pb(spec), page_bytes=spec.page_bytes_per_layer * spec.num_layers,
            usage_fraction=s["used"] / s["num_pages"], cached_pages=s["cached_pages"],
            num_preemptions=s["num_preemptions"], shared_pages=s["shared"])
