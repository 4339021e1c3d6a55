"""decode_svc's readiness follows prefill_svc, as real processes: started while its prefill replica is
down, kvwire.v1.DecodeService reports NOT_SERVING (the overall "" health stays SERVING: alive);
once prefill is up it turns SERVING and remote pulls work; when prefill goes away, NOT_SERVING again."""
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


def status(health, service: str = "") -> int:
    return health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def wait_for(health, want: int, timeout_s: float = 60.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (got := status(health, DECODE)) != want and time.monotonic() < deadline:
        time.sleep(0.1)
    return got


def test_decode_readiness_follows_prefill(tmp_path):
    prefill_port = free_port()
    model = ["--model-dir", str(DEFAULT_MODEL_DIR), "--num-pages", "64"]
    decode = Service("decode_svc", [*model, "--prefill-addr", f"127.0.0.1:{prefill_port}",
                                    "--prefill-health-interval-s", "0.3"], tmp_path / "decode.log").start()
    prefill = Service("prefill_svc", model, tmp_path / "prefill.log", port=prefill_port)
    try:
        decode.wait_serving()  # the overall status: the process is alive and loaded
        with grpc.insecure_channel(f"127.0.0.1:{decode.health_port}") as ch:
            health = health_pb2_grpc.HealthStub(ch)
            assert status(health, DECODE) == NOT_SERVING  # from the first probe on: prefill is down
            assert status(health) == SERVING
            prefill.start().wait_serving()
            assert wait_for(health, SERVING) == SERVING
            with grpc.insecure_channel(decode.addr) as dch:
                out = [t for m in pbg.DecodeServiceStub(dch).GenerateTokens(pb.GenerateTokensRequest(
                    prompt_token_ids=[1, 2, 3], sampling=pb.SamplingParams(max_tokens=3),
                    kv_source=pb.KV_SOURCE_REMOTE), timeout=60) for t in m.token_ids]
            assert len(out) == 3
            assert prefill.stop() == 0
            assert wait_for(health, NOT_SERVING) == NOT_SERVING
            assert status(health) == SERVING
        assert decode.stop() == 0
    finally:
        prefill.stop()
        decode.stop()
