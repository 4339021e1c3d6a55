"""decode_svc's readiness and prefill_svc's outages, as real processes.

By default decode stays ready while prefill is down: it serves every request that does not force
KV_SOURCE_REMOTE through its local prefill, so ``kvwire.v1.DecodeService`` (the readiness probe's
service) stays SERVING before, during and after a prefill outage, and remote pulls resume when prefill
is back. With ``--readiness-follows-prefill`` (opt-in) the old behaviour holds: started while its
prefill replica is down, DecodeService reports NOT_SERVING (the overall "" health stays SERVING:
alive); once prefill is up it turns SERVING and remote pulls work; when prefill goes away, NOT_SERVING."""
from __future__ import annotations

import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvwire.config import DEFAULT_MODEL_DIR
from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc as pbg
from tests.hardening.procs import Service
from tools.stack import free_port

SERVING, NOT_SERVING = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
DECODE = "kvwire.v1.DecodeService"
MODEL = ["--model-dir", str(DEFAULT_MODEL_DIR), "--num-pages", "64"]


def status(health, service: str = "") -> int:
    return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def wait_for(health, want: int, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (got := status(health, DECODE)) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


def generate(addr: str, kv_source: int) -> tuple[grpc.StatusCode, int]:
    with grpc.insecure_channel(addr) as ch:
        try:
            out = [t for m in pbg.DecodeServiceStub(ch).GenerateTokens(pb.GenerateTokensRequest(
                prompt_token_ids=[1, 2, 3], sampling=pb.SamplingParams(max_tokens=3), kv_source=kv_source),
                timeout=60) for t in m.token_ids]
            return grpc.StatusCode.OK, len(out)
        except grpc.RpcError as e:
            return e.code(), 0


def test_decode_stays_ready_and_serves_while_prefill_is_down(tmp_path):
    prefill_port = free_port()
    decode = Service("decode_svc", [*MODEL, "--prefill-addr", f"127.0.0.1:{prefill_port}",
                                    "--prefill-health-interval-s", "0.3"], tmp_path / "decode.log").start()
    prefill = Service("prefill_svc", MODEL, tmp_path / "prefill.log", port=prefill_port)
    try:
        decode.wait_serving()
        with grpc.insecure_channel(f"127.0.0.1:{decode.health_port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            # Inverted from the opt-in test below: prefill is down, yet decode is ready, because it serves.
            assert status(health, DECODE) == SERVING and status(health) == SERVING
            assert generate(decode.addr, pb.KV_SOURCE_UNSPECIFIED) == (grpc.StatusCode.OK, 3)  # AUTO: local prefill
            assert generate(decode.addr, pb.KV_SOURCE_LOCAL) == (grpc.StatusCode.OK, 3)
            assert generate(decode.addr, pb.KV_SOURCE_REMOTE)[0] == grpc.StatusCode.UNAVAILABLE  # documented
            prefill.start().wait_serving()
            deadline = time.monotonic() + 30  # the watch looks every 0.3 s; reconnects within 5 s
            while (got := generate(decode.addr, pb.KV_SOURCE_REMOTE)) != (grpc.StatusCode.OK, 3) and \
                    time.monotonic() < deadline:
                time.sleep(0.2)
            assert got == (grpc.StatusCode.OK, 3)  # remote pulls resume
            assert prefill.stop() == 0
            for _ in range(15):  # 3 s: ten watch intervals, and the readiness probe never fails
                assert status(health, DECODE) == SERVING
                time.sleep(0.2)
            assert generate(decode.addr, pb.KV_SOURCE_UNSPECIFIED) == (grpc.StatusCode.OK, 3)
            assert status(health) == SERVING
        assert decode.stop() == 0
    finally:
        prefill.stop()
        decode.stop()


def test_opt_in_readiness_follows_prefill(tmp_path):
    prefill_port = free_port()
    decode = Service("decode_svc", [*MODEL, "--prefill-addr", f"127.0.0.1:{prefill_port}",
                                    "--prefill-health-interval-s", "0.3", "--readiness-follows-prefill"],
                     tmp_path / "decode.log").start()
    prefill = Service("prefill_svc", MODEL, tmp_path / "prefill.log", port=prefill_port)
    try:
        decode.wait_serving()  # the overall status: the process is alive and loaded
        with grpc.insecure_channel(f"127.0.0.1:{decode.health_port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            assert status(health, DECODE) == NOT_SERVING  # from the first probe on: prefill is down
            assert status(health) == SERVING
            prefill.start().wait_serving()
            assert wait_for(health, SERVING) == SERVING
            assert generate(decode.addr, pb.KV_SOURCE_REMOTE) == (grpc.StatusCode.OK, 3)
            assert prefill.stop() == 0
            assert wait_for(health, NOT_SERVING) == NOT_SERVING
            assert status(health) == SERVING
        assert decode.stop() == 0
    finally:
        prefill.stop()
        decode.stop()
