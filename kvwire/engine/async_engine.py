"""AsyncEngine: the engine under an event loop, for servers (decode_svc is a gRPC shell over it).

One asyncio task runs the step loop: ``schedule()`` admits requests (their ``generate`` call then
fills their KV through the KV sources, in the request's own trace context) and names the running
ones; one decode step over those runs in the worker thread; ``update()`` hands each request its
tokens. Requests join (after their KV is filled) and leave (finished, failed or cancelled) between
steps. Every runner call goes through one single-thread executor in submission order, so a
request's pages are freed only after any step, prefill or import already queued for it:
cancellation at any moment never leaks or reuses a page. With a ``CoreLender`` (decode_svc's
``--share-cores``) every runner call (steps, local prefills, imports) computes on every usable
core while a co-located prefill is idle; decode counts as busy while a call runs or a request decodes.
"""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from opentelemetry import trace

from kvwire.engine.core import EngineCore
from kvwire.engine.kv_source import KVSources
from kvwire.engine.request import RequestOutput, RequestStatus
from kvwire.sampling_params import KVSourceChoice, SamplingParams
from kvwire.spec.state import report
from kvwire.threads import use_threads

tracer = trace.get_tracer("kvwire.engine")


class CoreLender(Protocol):
    """Threads lent by a co-located service (decode_svc's ``--share-cores``: kvwire_serving.cores.CoreShare)."""

    def busy(self) -> int:
        """Mark this role computing; returns the threads to compute on."""
        ...

    def idle(self) -> None:
        """Mark this role idle: the other may use every core."""
        ...


def merge_queued(first: RequestOutput | BaseException, queue: asyncio.Queue
                 ) -> tuple[RequestOutput | None, BaseException | None]:
    """``first`` and every output already queued behind it as one output (their tokens in order,
    the last one's finish reason), so a reader that fell behind catches up in one message; and the
    failure that ended the queue, if one did. Never waits."""
    if isinstance(first, BaseException):
        return None, first
    tokens, last = None, first
    while not last.finished and not queue.empty():
        item = queue.get_nowait()
        if isinstance(item, BaseException):
            return _joined(first, tokens, last), item
        if tokens is None:
            tokens = list(first.token_ids)
        tokens += item.token_ids
        last = item
    return _joined(first, tokens, last), None


def _joined(first: RequestOutput, tokens: list[int] | None, last: RequestOutput) -> RequestOutput:
    if tokens is None:  # nothing was queued behind it
        return first
    return RequestOutput(first.request_id, tokens, last.finish_reason)


class AsyncEngine:
    def __init__(self, core: EngineCore, sources: KVSources, cores: CoreLender | None = None,
                 executor: ThreadPoolExecutor | None = None):
        self.core, self.sources, self.cores = core, sources, cores
        self._inflight = 0  # runner calls submitted and not finished (with lent cores)
        # the runner's thread; pass the one the model was loaded on (kvwire_serving.cores.compute_executor)
        self.executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._admitted: dict[str, asyncio.Event] = {}
        self._outputs: dict[str, asyncio.Queue] = {}
        self._work = asyncio.Event()
        self._task: asyncio.Task | None = None

    @property
    def runtime(self):
        return self.core.runner.runtime

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._loop(), name="engine-loop")

    async def run(self, fn, *args):
        """Run ``fn(*args)`` on the runner's thread, after everything already queued there (lent
        cores: on as many threads as a co-located prefill leaves it, decided when it starts)."""
        loop = asyncio.get_running_loop()
        if self.cores is None:
            return await loop.run_in_executor(self.executor, fn, *args)
        self._inflight += 1
        try:
            return await loop.run_in_executor(self.executor, self._lent, fn, args)
        finally:
            self._inflight -= 1
            self._idle_if_nothing_to_compute()

    def _lent(self, fn, args: tuple):
        use_threads(self.cores.busy())
        return fn(*args)

    def _idle_if_nothing_to_compute(self) -> None:
        """No runner call in flight and no request decoding: a co-located prefill may use every core."""
        if self.cores is not None and not self._inflight and not any(
                r.status is RequestStatus.RUNNING for r in self.core.scheduler.running.values()):
            self.cores.idle()

    async def generate(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
                       kv_source: KVSourceChoice = KVSourceChoice.AUTO,
                       deadline: float | None = None) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; the last one carries the finish reason. Closing the
        iterator (or cancelling the task reading it) aborts the request and frees its pages.
        ``deadline`` (``time.monotonic()`` seconds): the caller's, which bounds the KV pull."""
        req = self.core.add_request(request_id or uuid.uuid4().hex, prompt, params, kv_source)
        admitted, outputs = asyncio.Event(), asyncio.Queue()
        self._admitted[req.request_id], self._outputs[req.request_id] = admitted, outputs
        decode_span = None
        try:
            self._work.set()
            await admitted.wait()
            decoding = sum(r.status is RequestStatus.RUNNING for r in self.core.scheduler.running.values())
            first = self.core.start(req, await self.sources.fill(req, self.run, deadline, decoding))
            self._work.set()  # its first decode step starts now, not once the reader took this token
            if not first.finished:
                decode_span = tracer.start_span("decode", attributes={"kvwire.kv.source": req.kv_source_used})
            yield first
            if first.finished:
                return
            while True:
                item, failure = merge_queued(await outputs.get(), outputs)
                if item is not None:
                    yield item
                    if item.finished:
                        return
                if failure is not None:
                    raise failure
        finally:
            self._admitted.pop(req.request_id, None)
            self._outputs.pop(req.request_id, None)
            self.core.release(req)
            self.executor.submit(self.core.runner.free, req.seq)  # after anything queued for it
            if decode_span is not None:
                decode_span.set_attributes({"gen_ai.usage.output_tokens": req.generated,
                                            "kvwire.decode.steps": req.steps, **report(req)})
                decode_span.end()
            self._work.set()  # its reservation is back: admission may proceed

    async def _loop(self) -> None:
        while True:
            batch = self.core.schedule()
            for req in batch.admitted:
                event = self._admitted.get(req.request_id)
                if event is not None:
                    event.set()
            if not batch.decode:
                self._idle_if_nothing_to_compute()
                self._work.clear()
                await self._work.wait()
                continue
            try:
                results = await self.run(self.core.execute, batch)
            except Exception as e:  # noqa: BLE001 - the requests in the step fail, the loop goes on
                for req in batch.decode:
                    req.status = RequestStatus.FINISHED
                    queue = self._outputs.get(req.request_id)
                    if queue is not None:
                        queue.put_nowait(e)
                continue
            for out in self.core.update(batch, results):
                queue = self._outputs.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)

    def stats(self) -> dict[str, int]:
        return self.core.stats()

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
        self.executor.shutdown(wait=False, cancel_futures=False)
