"""prefill_svc's tensor work runs on its worker thread, between the forward's layers: each layer's
page copy and encoding and the first token's sampling (the event loop only builds and sends messages)."""
from __future__ import annotations

import threading

import pytest

import prefill_svc.server as server
from kvwire.runtime import EngineConfig
from protos.kvwire.v1 import kvwire_pb2 as pb
from tests.decode_svc.harness import Harness, tiny_model


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return EngineConfig(model_dir=tiny_model(tmp_path_factory.mktemp("tiny")), num_pages=128)


async def test_pages_and_first_token_are_computed_on_the_worker_not_the_event_loop(cfg, monkeypatch):
    threads: dict[str, set[str]] = {"layer_pages": set(), "sample": set()}
    sample = server.sample_first

    def recorded_sample(*args):
        threads["sample"].add(threading.current_thread().name)
        return sample(*args)

    monkeypatch.setattr(server, "sample_first", recorded_sample)
    async with Harness(cfg) as h:
        layer_pages = h.prefill_runner.layer_pages

        def recorded_pages(*args):
            threads["layer_pages"].add(threading.current_thread().name)
            return layer_pages(*args)

        h.prefill_runner.layer_pages = recorded_pages
        kinds = [m.WhichOneof("kind") async for m in h.prefill.Prefill(pb.PrefillRequest(token_ids=list(range(5, 60))))]
        assert kinds[0] == "header" and kinds[-1] == "done" and kinds.count("chunk") >= cfg_layers(h)
        # The same tokens as decode's own prefill of the prompt: the stream is whole.
        local = await h.generate(list(range(5, 60)), kv_source=pb.KV_SOURCE_LOCAL, max_tokens=3)
        remote = await h.generate(list(range(5, 60)), kv_source=pb.KV_SOURCE_REMOTE, max_tokens=3)
        assert local == remote
    loop_thread = threading.current_thread().name
    assert threads["layer_pages"] and threads["sample"]
    assert len(threads["layer_pages"] | threads["sample"]) == 1  # the forward's worker, for both
    assert loop_thread not in threads["layer_pages"] | threads["sample"]


def cfg_layers(h: Harness) -> int:
    return h.prefill_engine.spec.num_layers
