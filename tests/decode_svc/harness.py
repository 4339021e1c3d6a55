"""prefill_svc and decode_svc as real gRPC servers on loopback, in this process, over a tiny model.

In-process so that a test can wrap the real PrefillServicer (slow it down, damage a chunk) and read
both pools directly; the real-process path is covered by tests/integration.
"""
from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import torch
import transformers

from kvwire_serving.lazy import Lazy
from kvwire.runtime import EngineConfig, load_engine
from kvwire_serving.server import GrpcServer, build_channel
from kvwire.engine.async_engine import AsyncEngine
from kvwire.engine.core import EngineCore
from decode_svc.remote_prefill import DEFAULT_TRANSFER_TIMEOUT_S, RemotePrefill
from kvwire.engine.kv_source import KVSourcePolicy, KVSources, LocalPrefill
from kvwire.engine.runner import ModelRunner
from kvwire.engine.scheduler import SchedulerConfig
from kvwire.spec import SpecConfig, attach_draft
from decode_svc.server import DecodeServicer
from prefill_svc.runner import PrefillRunner
from prefill_svc.server import PrefillServicer
from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc as pbg


def tiny_model(path: Path, seed: int = 0, vocab_size: int = 300, hidden_size: int = 64,
               num_layers: int = 3) -> Path:
    torch.manual_seed(seed)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        eos_token_id=None, bos_token_id=None)).save_pretrained(path)
    return path


class _WrapperOver:
    """A test's servicer wrapper, with the RPCs it does not define answered by the real servicer."""

    def __init__(self, wrapper, inner):
        self._wrapper, self._inner = wrapper, inner

    def __getattr__(self, name: str):
        try:
            return getattr(self._wrapper, name)
        except AttributeError:
            return getattr(self._inner, name)


class Harness:
    """``async with Harness(cfg) as h``: h.decode (stub), h.prefill_runner, h.engine (AsyncEngine).

    ``prefill_addr=""``: decode has no prefill replica (every prompt prefills locally)."""

    def __init__(self, cfg: EngineConfig, prefill_cfg: EngineConfig | None = None, decode_pages: int = 64,
                 prefill_wrapper=None, max_waiting: int = 8, prefill_addr: str | None = None,
                 draft_cfg: EngineConfig | None = None, spec_config: SpecConfig = SpecConfig(),
                 policy: KVSourcePolicy = KVSourcePolicy(local_max_tokens=0), prefix_caching: bool = False,
                 transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S, prefill_pages: int = 128):
        self.cfg, self.prefill_cfg = cfg, prefill_cfg or cfg
        self.draft_cfg, self.spec_config, self.policy = draft_cfg, spec_config, policy
        self.decode_pages, self.prefill_wrapper = decode_pages, prefill_wrapper
        self.max_waiting, self.prefill_addr, self.prefix_caching = max_waiting, prefill_addr, prefix_caching
        self.transfer_timeout_s, self.prefill_pages = transfer_timeout_s, prefill_pages

    async def __aenter__(self) -> "Harness":
        self.prefill_engine = load_engine(self.prefill_cfg)
        self.prefill_runner = PrefillRunner(self.prefill_engine, self.prefill_pages, prefix_caching=self.prefix_caching)
        servicer = PrefillServicer(self.prefill_runner)
        if self.prefill_wrapper is not None:
            servicer = _WrapperOver(self.prefill_wrapper(servicer), servicer)
        self.prefill_server = GrpcServer(tracing=False)
        self.prefill_server.add_service(pbg.add_PrefillServiceServicer_to_server, servicer, "kvwire.v1.PrefillService")
        port = await self.prefill_server.start("127.0.0.1:0")
        engine = load_engine(dataclasses.replace(self.cfg, num_pages=self.decode_pages))
        draft = load_engine(self.draft_cfg) if self.draft_cfg is not None else None
        runner = ModelRunner(engine, self.decode_pages, prefix_caching=self.prefix_caching)
        drafter = attach_draft(runner, draft)
        runner.warm_up()
        addr = f"127.0.0.1:{port}" if self.prefill_addr is None else self.prefill_addr
        self.channel = build_channel(addr, tracing=False) if addr else None
        self.remote = RemotePrefill(runner, pbg.PrefillServiceStub(self.channel), self.channel,
                                    transfer_timeout_s=self.transfer_timeout_s) if addr else None
        core = EngineCore(runner, SchedulerConfig(self.decode_pages, max_waiting=self.max_waiting),
                          self.spec_config, draft=drafter)
        self.engine = AsyncEngine(core, KVSources(LocalPrefill(runner), self.remote, self.policy))
        self.engine.start()
        lazy = Lazy(DecodeServicer, "decode_svc")
        lazy.set(DecodeServicer(self.engine))
        self.decode_server = GrpcServer(tracing=False)
        self.decode_server.add_service(pbg.add_DecodeServiceServicer_to_server, lazy, "kvwire.v1.DecodeService")
        dport = await self.decode_server.start("127.0.0.1:0")
        self.decode_channel = build_channel(f"127.0.0.1:{dport}", tracing=False)
        self.decode = pbg.DecodeServiceStub(self.decode_channel)
        self.prefill = pbg.PrefillServiceStub(self.channel) if self.channel is not None else None
        return self

    async def __aexit__(self, *exc) -> None:
        await self.decode_channel.close()
        await self.decode_server.stop(0)
        await self.engine.close()
        if self.channel is not None:
            await self.channel.close()
        await self.prefill_server.stop(0)

    async def generate(self, prompt: list[int], kv_source: int = pb.KV_SOURCE_UNSPECIFIED, **sampling) -> list[int]:
        tokens = []
        async for m in self.decode.GenerateTokens(pb.GenerateTokensRequest(
                prompt_token_ids=prompt, sampling=pb.SamplingParams(**sampling), kv_source=kv_source)):
            tokens += m.token_ids
        return tokens

    async def pools_back_to(self, decode_free: int, prefill_free: int, timeout_s: float = 10.0) -> bool:
        """Poll until both pools are back to the given free counts (frees are queued, not instant)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while loop.time() < deadline:
            stats = await self.decode.GetPoolStats(pb.GetPoolStatsRequest())
            if stats.free_pages == decode_free and self.prefill_runner.stats()["free"] == prefill_free \
                    and stats.running == 0:
                return True
            await asyncio.sleep(0.05)
        print(f"pools not back: decode free {stats.free_pages}/{decode_free} running {stats.running}, "
              f"prefill {self.prefill_runner.stats()} (want free {prefill_free})")
        return False
