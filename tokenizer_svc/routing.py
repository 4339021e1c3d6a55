"""Which decode replica serves a request: gRPC round_robin (default) or prefix-aware routing.

``round_robin``: one channel to the whole decode target; gRPC spreads calls over the addresses it
resolves to and retries calls that failed before any response (``kvwire_serving.server``).

``prefix`` (``--decode-routing prefix``): one channel per decode replica, and bounded-load
consistent hashing on the prompt's first KV page name (the sha256 chain of
``kvwire.engine.prefix_cache.page_hashes`` over its first ``block_size`` tokens), so prompts that
share a first page go to the replica whose prefix cache holds it, and prefix caching keeps paying
with several replicas. The salt is the router's own, not the model's: the name is only a ring key,
and equal first pages still give equal keys. A replica already carrying more than ``load_factor``
x the mean in-flight load (and more than ``min_bound``) is skipped for the next one on the ring
(bounded loads: a hot prefix cannot pile every request on one replica). Prompts shorter than a
page, and requests whose preferred replicas are all down, go to the least-loaded reachable
replica. A call that fails UNAVAILABLE before its first message moves to the next replica.
Decisions and figures: see docs/decisions/055-prefix-routing.md.
"""
from __future__ import annotations

import asyncio
import bisect
import dataclasses
import hashlib
import logging
import math
import socket
import time
from dataclasses import dataclass
from typing import Callable, Sequence

import grpc

from kvwire.engine.prefix_cache import page_hashes
from kvwire_serving.security import ClientSecurity
from protos.kvwire.v1 import kvwire_pb2 as pb
from protos.kvwire.v1 import kvwire_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)

POLICIES = ("round_robin", "prefix")
ROUTING_SALT = b"kvwire-decode-routing"
VIRTUAL_NODES = 64  # ring points per replica: keys spread within a few percent of even


@dataclass(frozen=True)
class RoutingConfig:
    policy: str = "round_robin"  # POLICIES
    load_factor: float = 1.25  # prefix: a replica takes at most this x the mean in-flight load ...
    min_bound: int = 4  # ... or this many, whichever is more: a decode step batches a few requests anyway
    block_size: int = 16  # prefix: tokens per page until decode's GetPoolStats tells the real size
    resolve_interval_s: float = 30.0  # prefix: how often a dns:/// target is resolved again


def resolve(target: str) -> list[str]:
    """The ``host:port`` addresses behind a gRPC target: ``ipv4:a:p,b:p`` (or ``ipv6:``) lists,
    ``dns:///name:port`` (every A/AAAA record, sorted) and a plain ``host:port``."""
    for scheme in ("ipv4:", "ipv6:"):
        if target.startswith(scheme):
            return [a for a in target[len(scheme):].split(",") if a]
    name = target.removeprefix("dns:").lstrip("/") if target.startswith("dns:") else target
    if not target.startswith("dns:"):
        return [name]
    host, _, port = name.rpartition(":")
    infos = socket.getaddrinfo(host.strip("[]"), int(port), type=socket.SOCK_STREAM)
    return sorted({f"[{i[4][0]}]:{port}" if i[0] == socket.AF_INET6 else f"{i[4][0]}:{port}" for i in infos})


def replica_security(target: str, security: ClientSecurity) -> ClientSecurity:
    """The security of a channel to one resolved address of ``target``: with TLS, a replica found
    through ``dns:///name:port`` is still verified as ``name`` (its certificate's), not its IP."""
    if security.ca_file is None or security.server_name or not target.startswith("dns:"):
        return security
    host = target.removeprefix("dns:").lstrip("/").rpartition(":")[0].strip("[]")
    return dataclasses.replace(security, server_name=host)


class HashRing:
    """Consistent hashing: each address owns VIRTUAL_NODES points; a key belongs to the first point
    at or after it. Adding or removing a replica moves only the keys of its own points."""

    def __init__(self, addrs: Sequence[str], virtual_nodes: int = VIRTUAL_NODES):
        points = sorted((int.from_bytes(hashlib.sha256(f"{a}#{i}".encode()).digest()[:8], "big"), a)
                        for a in addrs for i in range(virtual_nodes))
        self._keys = [k for k, _ in points]
        self._addrs = [a for _, a in points]
        self.size = len(set(addrs))

    def walk(self, key: bytes) -> list[str]:
        """Every address once, in ring order from ``key``'s owner on."""
        if not self._keys:
            return []
        start = bisect.bisect_left(self._keys, int.from_bytes(key[:8], "big"))
        seen: dict[str, None] = {}
        for i in range(len(self._keys)):
            seen.setdefault(self._addrs[(start + i) % len(self._keys)])
            if len(seen) == self.size:
                break
        return list(seen)


def first_page_key(prompt: Sequence[int], block_size: int) -> bytes | None:
    """The ring key of the prompt's first full page; None when it has none."""
    names = page_hashes(prompt[:block_size], block_size, ROUTING_SALT)
    return names[0] if names else None


class Lease:
    """One request's decode replica: ``stub`` to call, ``release()`` once the call has ended."""

    def __init__(self, stub, release: Callable[[], None] = lambda: None, addr: str | None = ""):
        self.stub, self._release, self.addr = stub, release, addr

    def release(self) -> None:
        release, self._release = self._release, lambda: None
        release()


class RoundRobinRouter:
    """Every request on the one channel (gRPC's round_robin picks the replica)."""

    def __init__(self, stub: pb_grpc.DecodeServiceStub):
        self.stub = stub

    def lease(self, prompt: Sequence[int]) -> Lease:
        return Lease(self.stub)

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass


class PrefixRouter:
    """Bounded-load consistent hashing over one channel per decode replica (see the module doc).

    ``channel_for(addr)`` builds a channel to one replica (the front door's ``build_channel`` with
    its security). ``inflight`` counts this door's open calls per replica (the load it bounds)."""

    def __init__(self, target: str, channel_for: Callable[[str], grpc.aio.Channel],
                 cfg: RoutingConfig = RoutingConfig()):
        self.target, self.channel_for, self.cfg = target, channel_for, cfg
        self.block_size = cfg.block_size
        self.channels: dict[str, grpc.aio.Channel] = {}
        self.stubs: dict[str, pb_grpc.DecodeServiceStub] = {}
        self.inflight: dict[str, int] = {}
        self.routed: dict[str, int] = {}  # requests sent to each replica, since start
        self.ring = HashRing([])
        self._task: asyncio.Task | None = None
        self.update(resolve(target))

    def update(self, addrs: Sequence[str]) -> list[grpc.aio.Channel]:
        """Route over ``addrs`` from now on; returns the channels of replicas that left (to close)."""
        gone = [self.channels.pop(a) for a in list(self.channels) if a not in addrs]
        for a in list(self.stubs):
            if a not in addrs:
                del self.stubs[a]
        for a in addrs:
            if a not in self.channels:
                self.channels[a] = self.channel_for(a)
                self.stubs[a] = pb_grpc.DecodeServiceStub(self.channels[a])
                self.inflight.setdefault(a, 0)
                self.routed.setdefault(a, 0)
        if set(addrs) != set(self.ring._addrs):
            log.info("prefix routing over %d decode replica(s): %s", len(addrs), ", ".join(addrs))
        self.ring = HashRing(list(addrs))
        return gone

    def _up(self, addr: str) -> bool:
        state = self.channels[addr].get_state(try_to_connect=True)
        return state not in (grpc.ChannelConnectivity.TRANSIENT_FAILURE, grpc.ChannelConnectivity.SHUTDOWN)

    def pick(self, prompt: Sequence[int], exclude: frozenset[str] = frozenset()) -> str | None:
        """The replica for ``prompt``: its first page's owner on the ring unless that one is down
        or over the load bound, then the next on the ring; the least-loaded one otherwise (None:
        every replica is in ``exclude``)."""
        left = [a for a in self.channels if a not in exclude]
        if not left:
            return None
        up = [a for a in left if self._up(a)] or left
        key = first_page_key(prompt, self.block_size)
        if key is not None:
            total = sum(self.inflight[a] for a in up) + 1  # this request included
            bound = max(self.cfg.min_bound, math.ceil(self.cfg.load_factor * total / len(up)))
            for addr in self.ring.walk(key):
                if addr in up and self.inflight[addr] + 1 <= bound:
                    return addr
        return min(up, key=lambda a: (self.inflight[a], self.routed[a]))

    def lease(self, prompt: Sequence[int]) -> Lease:
        lease = Lease(None, addr=self.pick(prompt))
        lease.stub = _RetryingStub(self, lease, prompt)
        self._take(lease, lease.addr)
        return lease

    def _take(self, lease: Lease, addr: str) -> None:
        lease.release()  # the replica it held before, if any
        self.inflight[addr] += 1
        self.routed[addr] += 1
        lease.addr = addr

        def release() -> None:
            if addr in self.inflight:
                self.inflight[addr] -= 1
        lease._release = release

    async def start(self) -> None:
        """Learn the page size from a replica and keep re-resolving a dns:/// target."""
        self._task = asyncio.get_running_loop().create_task(self._refresh(), name="decode-routing")

    async def _learn_block_size(self) -> bool:
        for stub in list(self.stubs.values()):
            try:
                stats = await stub.GetPoolStats(pb.GetPoolStatsRequest(), timeout=2)
            except grpc.aio.AioRpcError:
                continue
            if stats.spec.block_size:
                self.block_size = stats.spec.block_size
                return True
        return False

    async def _refresh(self) -> None:
        learned = False
        while True:
            learned = learned or await self._learn_block_size()
            if learned and not self.target.startswith("dns:"):
                return  # a fixed address list: nothing more to learn
            await asyncio.sleep(1.0 if not learned else self.cfg.resolve_interval_s)
            if self.target.startswith("dns:"):
                try:
                    addrs = await asyncio.get_running_loop().run_in_executor(None, resolve, self.target)
                except OSError as e:
                    log.warning("could not resolve %s: %s; routing over the last addresses", self.target, e)
                    continue
                for channel in self.update(addrs):
                    await channel.close(grace=30)

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        for channel in self.channels.values():
            await channel.close()


class _RetryingStub:
    """``GenerateTokens`` on the leased replica, and on the next one when a call fails UNAVAILABLE
    before its first message: each replica has its own channel here, so gRPC's retries (same
    channel) cannot move a call off a dead replica. A call that produced a message is never
    retried (its tokens reached the client)."""

    def __init__(self, router: PrefixRouter, lease: Lease, prompt: Sequence[int]):
        self.router, self.lease, self.prompt = router, lease, prompt

    def GenerateTokens(self, request: pb.GenerateTokensRequest, timeout: float | None = None) -> "_RetryingCall":
        return _RetryingCall(self, request, timeout)


class _RetryingCall:
    def __init__(self, stub: _RetryingStub, request: pb.GenerateTokensRequest, timeout: float | None):
        self.stub, self.request = stub, request
        self.deadline = None if timeout is None else time.monotonic() + timeout
        self.call: grpc.aio.UnaryStreamCall | None = None
        self.cancelled = False

    def __aiter__(self):
        return self._run()

    async def _run(self):
        router, lease, tried = self.stub.router, self.stub.lease, set()
        while True:
            tried.add(lease.addr)
            timeout = None if self.deadline is None else max(0.0, self.deadline - time.monotonic())
            self.call = router.stubs[lease.addr].GenerateTokens(self.request, timeout=timeout)
            answered = False
            try:
                async for msg in self.call:
                    answered = True
                    yield msg
                return
            except grpc.aio.AioRpcError as e:
                if answered or self.cancelled or e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                nxt = router.pick(self.stub.prompt, exclude=frozenset(tried))
                if nxt is None:
                    raise
                log.info("decode replica %s unavailable before answering (%s); retrying on %s",
                         lease.addr, e.details(), nxt)
                router._take(lease, nxt)

    def cancel(self) -> bool:
        self.cancelled = True
        return self.call.cancel() if self.call is not None else False
