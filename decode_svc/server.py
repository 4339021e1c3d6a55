"""DecodeService: a thin async adapter over DecodeEngine (token ids in, token ids out)."""
from __future__ import annotations

import uuid

from opentelemetry import trace

from decode_svc.engine import DecodeEngine
from protos import convert as conv
from protos import kvwire_pb2 as pb
from protos import kvwire_pb2_grpc

_FINISH = {"stop": pb.FINISH_REASON_STOP, "length": pb.FINISH_REASON_LENGTH}


class DecodeServicer(kvwire_pb2_grpc.DecodeServiceServicer):
    def __init__(self, engine: DecodeEngine):
        self.engine = engine

    async def Generate(self, request: pb.GenerateTokensRequest, context):
        prompt = list(request.prompt_token_ids)
        params = conv.sampling_from_pb(request.sampling)
        request_id = request.request_id or uuid.uuid4().hex
        span = trace.get_current_span()
        span.set_attributes({"gen_ai.operation.name": "text_completion", "kvwire.request_id": request_id,
                             "gen_ai.request.model": self.engine.engine.fingerprint.model_name,
                             "gen_ai.request.max_tokens": params.max_tokens,
                             "gen_ai.request.temperature": params.temperature,
                             "gen_ai.usage.input_tokens": len(prompt)})
        completion = 0
        async for out in self.engine.generate(request_id, prompt, params):
            completion += len(out.tokens)
            msg = pb.GenerateTokensResponse(token_ids=out.tokens)
            if out.finish_reason:
                msg.finish_reason = _FINISH[out.finish_reason]
                msg.usage.prompt_tokens, msg.usage.completion_tokens = len(prompt), completion
                span.set_attributes({"gen_ai.usage.output_tokens": completion,
                                     "gen_ai.response.finish_reasons": [out.finish_reason]})
            yield msg

    async def GetPoolStats(self, request: pb.PoolStatsRequest, context) -> pb.PoolStats:
        s = self.engine.pool_stats()
        spec = self.engine.engine.spec
        return pb.PoolStats(total_pages=s["num_pages"], free_pages=s["free"], used_pages=s["used"],
                            running=s["running"], waiting=s["waiting"], spec=conv.spec_to_pb(spec),
                            page_bytes=spec.page_bytes_per_layer * spec.num_layers,
                            usage_fraction=s["used"] / s["num_pages"])
