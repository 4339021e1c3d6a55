"""decode_svc's view of prefill_svc: a background health check of the prefill replica(s).

Every ``interval_s`` (every 0.5 s while it is unreachable) the watch asks prefill's
``grpc.health.v1`` for ``kvwire.v1.PrefillService`` over decode's own prefill channel (so TLS, the
peer's name and the route are the ones pulls use), waiting at most ``min(interval_s, 2 s)``.
Prefill answering SERVING turns ``RemotePrefill.healthy`` on (AUTO requests may prefill
remotely); anything else (down, stalled, NOT_SERVING, draining) turns it off (AUTO requests
prefill in this process). Changes are logged once each.

Decode's readiness (``kvwire.v1.DecodeService``) does not follow prefill by default: decode serves
every request that does not force KV_SOURCE_REMOTE through its local prefill, so a prefill outage
must not take every decode pod out of its Service (no endpoints, blocked node drains). Only with a
``server`` given (``--readiness-follows-prefill``, opt-in) does DecodeService report NOT_SERVING
while prefill is unreachable. The overall status ("") is liveness and never follows prefill.

At startup ``first_check`` waits for a prefill replica that answers but is still loading (up to
``STARTUP_WAIT_S``), so services started together are ready with the remote path on; one that
does not answer delays decode's readiness by ``DOWN_WAIT_S`` only.
"""
from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_svc.remote_prefill import RemotePrefill
from kvwire_serving.server import GrpcServer

log = logging.getLogger(__name__)

PREFILL_SERVICE = "kvwire.v1.PrefillService"
DECODE_SERVICE = "kvwire.v1.DecodeService"
MAX_CHECK_TIMEOUT_S = 2.0
UNREACHABLE_INTERVAL_S = 0.5
# At startup: how long decode waits for a prefill replica that answers but is still loading, and
# for one that does not answer at all (down). Both well inside decode's 5-minute startup probe.
STARTUP_WAIT_S = 60.0
DOWN_WAIT_S = 2.0
STARTUP_POLL_S = 0.2


class PrefillWatch:
    def __init__(self, channel: grpc.aio.Channel, remote: RemotePrefill, server: GrpcServer | None,
                 interval_s: float = 5.0):
        """``server``: decode's server, whose DecodeService status then follows prefill (opt-in);
        None (the default) = only ``remote.healthy`` does, readiness does not depend on prefill."""
        self.health = health_pb2_grpc.HealthStub(channel)
        self.remote, self.server, self.interval_s = remote, server, interval_s
        self.reachable: bool | None = None  # None until the first check answered
        self._task: asyncio.Task | None = None

    async def status(self) -> int | None:
        """One check: prefill's status for its service, or None when it did not answer in time."""
        try:
            reply = await self.health.Check(health_pb2.HealthCheckRequest(service=PREFILL_SERVICE),
                                            timeout=min(self.interval_s, MAX_CHECK_TIMEOUT_S))
        except grpc.aio.AioRpcError as e:
            if self.reachable is not False:
                log.warning("prefill_svc health check failed: %s %s", e.code().name, e.details())
            return None
        return reply.status

    async def check(self) -> bool:
        """One check: True when prefill says SERVING within the timeout."""
        return await self.status() == health_pb2.HealthCheckResponse.SERVING

    async def first_check(self, loading_wait_s: float = STARTUP_WAIT_S, down_wait_s: float = DOWN_WAIT_S) -> bool:
        """Checks until prefill says SERVING, for at most ``loading_wait_s`` while it answers (it is
        loading beside decode) and ``down_wait_s`` while it does not (down: decode serves locally)."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        while (st := await self.status()) != health_pb2.HealthCheckResponse.SERVING:
            if loop.time() - start > (down_wait_s if st is None else loading_wait_s):
                return False
            await asyncio.sleep(STARTUP_POLL_S)
        return True

    async def apply(self, reachable: bool) -> None:
        if reachable != self.reachable:
            log.info("prefill_svc %s: %s", "reachable" if reachable else "unreachable",
                     "remote prefill on" if reachable else
                     "AUTO requests prefill locally" + (", DecodeService NOT_SERVING" if self.server else ""))
        self.reachable = self.remote.healthy = reachable
        if self.server is not None:  # ignored once the server is shutting down (health stays NOT_SERVING)
            await self.server.health.set(DECODE_SERVICE, health_pb2.HealthCheckResponse.SERVING if reachable
                                         else health_pb2.HealthCheckResponse.NOT_SERVING)

    async def start(self, first: bool) -> None:
        """Apply ``first`` (a ``check()`` made before decode said SERVING, so readiness is right
        from the first probe), then check every ``interval_s``."""
        await self.apply(first)
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="prefill-watch")

    async def _loop(self) -> None:
        while True:  # while prefill is unreachable, look more often: readiness returns sooner
            await asyncio.sleep(self.interval_s if self.reachable else min(self.interval_s, UNREACHABLE_INTERVAL_S))
            await self.apply(await self.check())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
