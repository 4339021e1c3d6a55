"""What the served-mode tests share: greedy tokens from decode_svc for a prompt prefilled by
prefill_svc (KV_SOURCE_REMOTE) or by decode_svc itself (KV_SOURCE_LOCAL)."""
from __future__ import annotations

import grpc

from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc as pbg


async def generate(addr: str, ids: list[int], source: int, max_tokens: int) -> list[int]:
    async with grpc.aio.insecure_channel(addr) as ch:
        out = []
        async for msg in pbg.DecodeServiceStub(ch).GenerateTokens(pb.GenerateTokensRequest(
                prompt_token_ids=ids, sampling=pb.SamplingParams(max_tokens=max_tokens), kv_source=source)):
            out += msg.token_ids
        return out
