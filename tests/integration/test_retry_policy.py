"""build_channel's retry rule, on real gRPC servers on loopback: a call that failed UNAVAILABLE
before any response is retried (on another replica when there is one); a stream that already
produced a message is never retried, so tokens are never duplicated."""
from __future__ import annotations

import asyncio
import json

import grpc
import pytest

from kvwire import errors
from kvwire_serving.server import GrpcServer, build_channel, channel_options
from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc as pbg


class Replica(pbg.DecodeServiceServicer):
    """A decode replica whose failure mode the test picks: ``tokens_before_failure`` messages, then
    UNAVAILABLE (None: never fails)."""

    def __init__(self, tokens_before_failure: int | None):
        self.tokens_before_failure = tokens_before_failure
        self.calls = 0

    async def GenerateTokens(self, request, context):
        self.calls += 1
        for i in range(3):
            if self.tokens_before_failure is not None and i == self.tokens_before_failure:
                raise errors.Unavailable("replica going away")
            await asyncio.sleep(0.01)
            yield pb.GenerateTokensResponse(token_ids=[i])


async def serve(replicas: list[Replica]) -> tuple[list[GrpcServer], str]:
    servers, addrs = [], []
    for r in replicas:
        s = GrpcServer(tracing=False, reflection=False)
        s.add_service(pbg.add_DecodeServiceServicer_to_server, r, "kvwire.v1.DecodeService")
        addrs.append(f"127.0.0.1:{await s.start('127.0.0.1:0')}")
        await s.set_serving()
        servers.append(s)
    return servers, "ipv4:" + ",".join(addrs)


async def collect(target: str, n: int) -> list[tuple[list[int], grpc.StatusCode]]:
    out = []
    async with build_channel(target, tracing=False) as ch:
        stub = pbg.DecodeServiceStub(ch)
        for _ in range(n):
            ids, code = [], grpc.StatusCode.OK
            try:
                async for msg in stub.GenerateTokens(pb.GenerateTokensRequest(prompt_token_ids=[1]), timeout=10):
                    ids += msg.token_ids
            except grpc.aio.AioRpcError as e:
                code = e.code()
            out.append((ids, code))
    return out


def run(replicas: list[Replica], n: int) -> list[tuple[list[int], grpc.StatusCode]]:
    async def main():
        servers, target = await serve(replicas)
        try:
            return await collect(target, n)
        finally:
            for s in servers:
                await s.stop(0)
    return asyncio.run(main())


def test_unavailable_before_any_response_is_retried_on_the_other_replica():
    down, up = Replica(tokens_before_failure=0), Replica(tokens_before_failure=None)
    results = run([down, up], 8)
    assert results == [([0, 1, 2], grpc.StatusCode.OK)] * 8
    assert down.calls > 0  # round_robin did send calls there: each one was retried on `up`
    assert up.calls == 8


def test_unavailable_before_any_response_is_retried_up_to_max_attempts():
    down = Replica(tokens_before_failure=0)
    assert run([down], 1) == [([], grpc.StatusCode.UNAVAILABLE)]
    assert down.calls == 3  # RETRY_POLICY maxAttempts


@pytest.mark.parametrize("sent", [1, 2])
def test_a_stream_that_produced_tokens_is_never_retried(sent):
    """The second replica would answer in full: were the failed stream retried there, the client
    would see the first tokens twice (or the call would succeed)."""
    flaky, up = Replica(tokens_before_failure=sent), Replica(tokens_before_failure=None)
    results = run([flaky, up], 6)
    failed = [r for r in results if r[1] != grpc.StatusCode.OK]
    assert failed and all(r == (list(range(sent)), grpc.StatusCode.UNAVAILABLE) for r in failed)
    assert flaky.calls == len(failed) and up.calls == len(results) - len(failed)


def test_service_config_retries_only_unavailable_and_never_hedges():
    config = json.loads(dict(channel_options())["grpc.service_config"])
    assert config["loadBalancingConfig"] == [{"round_robin": {}}]
    [method] = config["methodConfig"]
    assert "hedgingPolicy" not in method
    assert method["retryPolicy"]["retryableStatusCodes"] == ["UNAVAILABLE"]


@pytest.mark.parametrize("sent, retried", [(0, True), (1, False)])
def test_prefix_routing_moves_a_call_off_a_replica_only_before_its_first_token(sent, retried):
    """--decode-routing prefix has a channel per replica (gRPC's retries stay on it): its own retry
    moves a call that failed UNAVAILABLE before any message to the next replica, and no other."""
    from tokenizer_svc.routing import PrefixRouter, RoutingConfig, first_page_key

    async def main():
        flaky, up = Replica(tokens_before_failure=sent), Replica(tokens_before_failure=None)
        servers, target = await serve([flaky, up])
        router = PrefixRouter(target, lambda a: build_channel(a, tracing=False), RoutingConfig("prefix"))
        flaky_addr = target.removeprefix("ipv4:").split(",")[0]
        prompt = next(list(range(i, i + 16)) for i in range(1000)
                      if router.ring.walk(first_page_key(list(range(i, i + 16)), 16))[0] == flaky_addr)
        lease = router.lease(prompt)
        assert lease.addr == flaky_addr
        ids, code = [], grpc.StatusCode.OK
        try:
            async for msg in lease.stub.GenerateTokens(pb.GenerateTokensRequest(prompt_token_ids=prompt), timeout=10):
                ids += msg.token_ids
        except grpc.aio.AioRpcError as e:
            code = e.code()
        lease.release()
        await router.close()
        for s in servers:
            await s.stop(0)
        return ids, code, lease.addr != flaky_addr, flaky.calls, up.calls, sum(router.inflight.values())

    ids, code, moved, flaky_calls, up_calls, inflight = asyncio.run(main())
    if retried:
        assert (ids, code, moved, up_calls) == ([0, 1, 2], grpc.StatusCode.OK, True, 1)
        assert flaky_calls == 3  # gRPC's own attempts on that channel first
    else:
        assert (ids, code, moved, flaky_calls, up_calls) == ([0], grpc.StatusCode.UNAVAILABLE, False, 1, 0)
    assert inflight == 0
