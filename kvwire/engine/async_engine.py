"""AsyncEngine: the engine under an event loop, for servers (decode_svc is a gRPC shell over it).

One asyncio task runs the step loop: ``admit()`` admits requests (their ``generate`` call then
picks a KV source, in the request's own trace context: a remote import, or the local prefill, which
queues the prompt for the steps' chunks); ``plan()`` names the running requests and the prompt
chunks that fit the step's token budget; the step (one decode step, one forward over the chunks)
runs in the worker thread; ``update()`` hands each request its tokens, or its first token once its
prompt is complete. Requests join (after their KV is filled) and leave (finished, failed or cancelled) between
steps. Every runner call goes through one single-thread executor in submission order, so a
request's pages are freed only after any step, prefill or import already queued for it:
cancellation at any moment never leaks or reuses a page. With a ``CoreLender`` (decode_svc's
``--share-cores``) every runner call (steps, local prefills, imports) computes on every usable
core while a co-located prefill is idle; decode counts as busy while a call runs or a request decodes.
"""
from __future__ import annotations

import asyncio
import threading
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

# How long the event loop waits, blocked, for the runner's thread to start a step it was handed.
# Waiting releases the GIL, which the runner's thread needs to begin; otherwise it waited for the
# loop's next pause (streaming, bookkeeping), about 4 ms between steps at 32 streams
# (docs/decisions/071-hand-the-gil-to-the-step.md).
STEP_HANDOVER_S = 0.001


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
    failure that ended the queue, if one did. Never waits. (One choice: ``merge_choices``.)"""
    merged, failure = merge_choices(first, queue)
    return (merged[0] if merged else None), failure


def merge_choices(first: RequestOutput | BaseException, queue: asyncio.Queue
                  ) -> tuple[list[RequestOutput], BaseException | None]:
    """``first`` and the outputs queued behind it up to the first finished one, joined per choice
    (its request id), in the order the choices first appear; and the failure that ended the queue,
    if one did. Never waits."""
    if isinstance(first, BaseException):
        return [], first
    groups: dict[str, list[RequestOutput]] = {first.request_id: [first]}
    last = first
    while not last.finished and not queue.empty():  # nothing past a finish is taken
        item = queue.get_nowait()
        if isinstance(item, BaseException):
            return [_joined(g) for g in groups.values()], item
        groups.setdefault(item.request_id, []).append(item)
        last = item
    return [_joined(g) for g in groups.values()], None


def _joined(outputs: list[RequestOutput]) -> RequestOutput:
    """One output: the tokens (and logprobs, when asked) of ``outputs`` in order, the last's finish reason."""
    if len(outputs) == 1:  # nothing was queued behind it
        return outputs[0]
    logprobs = None if outputs[0].logprobs is None else [lp for o in outputs for lp in o.logprobs or ()]
    return RequestOutput(outputs[0].request_id, [t for o in outputs for t in o.token_ids], outputs[-1].finish_reason,
                         logprobs, outputs[0].prompt_logprobs, outputs[0].index)


class AsyncEngine:
    def __init__(self, core: EngineCore, sources: KVSources, cores: CoreLender | None = None,
                 executor: ThreadPoolExecutor | None = None):
        self.core, self.sources, self.cores = core, sources, cores
        self._inflight = 0  # runner calls submitted and not finished (with lent cores)
        # the runner's thread; pass the one the model was loaded on (kvwire_serving.cores.compute_executor)
        self.executor = executor or ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._admitted: dict[str, asyncio.Event] = {}
        self._outputs: dict[str, asyncio.Queue] = {}
        self._first: dict[str, asyncio.Future] = {}  # requests prefilling here in chunks -> their first token
        sources.local.chunked = self._prefill_in_steps
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
        return await self._submit(fn, *args)

    def _submit(self, fn, *args) -> asyncio.Future:
        """``run``, queued now: the future resolves to ``fn(*args)``."""
        loop = asyncio.get_running_loop()
        if self.cores is None:
            return loop.run_in_executor(self.executor, fn, *args)
        future = loop.run_in_executor(self.executor, self._lent, fn, args)
        self._inflight += 1  # counted once queued (no await between: nothing reads it before)
        future.add_done_callback(self._call_done)
        return future

    def _call_done(self, _future: asyncio.Future) -> None:
        self._inflight -= 1
        self._idle_if_nothing_to_compute()

    def _step(self, plan) -> asyncio.Future:
        """Queue ``plan``'s step on the runner's thread and give that thread the GIL to start it
        (waiting at most STEP_HANDOVER_S, if earlier calls are still queued there)."""
        started = threading.Event()

        def execute():
            started.set()
            return self.core.execute(plan)

        future = self._submit(execute)
        started.wait(STEP_HANDOVER_S)
        return future

    def _lent(self, fn, args: tuple):
        use_threads(self.cores.busy())
        return fn(*args)

    def _idle_if_nothing_to_compute(self) -> None:
        """No runner call in flight and no request decoding: a co-located prefill may use every core."""
        if self.cores is not None and not self._inflight and not any(
                r.status is RequestStatus.RUNNING for r in self.core.scheduler.running.values()):
            self.cores.idle()

    def _prefill_in_steps(self, req) -> asyncio.Future:
        """The local KV source, bound: ``req``'s prompt is computed in the coming steps' chunks; the
        future resolves to its first token."""
        first = asyncio.get_running_loop().create_future()
        self._first[req.request_id] = first
        self.core.prefill_locally(req)
        self._work.set()
        return first

    async def generate(self, prompt: list[int], params: SamplingParams, request_id: str | None = None,
                       kv_source: KVSourceChoice = KVSourceChoice.AUTO,
                       deadline: float | None = None) -> AsyncIterator[RequestOutput]:
        """Stream one request's outputs; each choice's last one carries its finish reason (n > 1:
        ``RequestOutput.index`` names the choice; the prompt is prefilled once, then forked).
        Closing the iterator (or cancelling the task reading it) aborts the request and frees its
        pages. ``deadline`` (``time.monotonic()`` seconds): the caller's, which bounds the KV pull."""
        if params.structured is not None and self.core.grammars is not None:  # compiled off the event loop (cached)
            await asyncio.get_running_loop().run_in_executor(None, self.core.grammars.compile, params.structured)
        req = self.core.add_request(request_id or uuid.uuid4().hex, prompt, params, kv_source)
        admitted, outputs = asyncio.Event(), asyncio.Queue()
        self._admitted[req.request_id], self._outputs[req.request_id] = admitted, outputs
        choices, released = [req], set()  # every choice's request; the choices already released
        decode_span = None
        try:
            self._work.set()
            await admitted.wait()
            decoding = sum(r.status is RequestStatus.RUNNING for r in self.core.scheduler.running.values())
            first_token = await self.sources.fill(req, self.run, deadline, decoding)
            if req.params.n > 1:  # choice 0 and n - 1 children on the one prompt's pages
                children = self.core.fork(req)
                choices += children
                for child in children:
                    self._outputs[child.request_id] = outputs
                await self.run(self.core.runner.fork, req.seq, [c.seq for c in children])
                firsts = [self.core.start(req, first_token), *self.core.start_children(req)]
            else:
                firsts = [self.core.start(req, first_token)]
            self._work.set()  # its first decode step starts now, not once the reader took this token
            live = {o.index for o in firsts if not o.finished}
            if live:
                decode_span = tracer.start_span("decode", attributes={"kvwire.kv.source": req.kv_source_used})
            pending: list[RequestOutput] = firsts
            while True:
                for item in pending:
                    if item.finished:  # this choice's pages go back now; the others run on
                        live.discard(item.index)
                        self._release(choices[item.index], released)
                    yield item
                if not live:
                    return
                pending, failure = merge_choices(await outputs.get(), outputs)
                if failure is not None:
                    for item in pending:
                        yield item
                    raise failure
        finally:
            for choice in choices:
                self._admitted.pop(choice.request_id, None)
                self._outputs.pop(choice.request_id, None)
                self._release(choice, released)
            self._first.pop(req.request_id, None)
            if decode_span is not None:
                decode_span.set_attributes({"gen_ai.usage.output_tokens": sum(c.generated for c in choices),
                                            "kvwire.decode.steps": req.steps, **report(req)})
                decode_span.end()
            self._work.set()  # its reservation is back: admission may proceed

    def _release(self, req, released: set[int]) -> None:
        """Forget one choice: its reservation now, its pages after anything queued for it (once)."""
        if req.seq in released:
            return
        released.add(req.seq)
        self.core.release(req)
        self.executor.submit(self.core.runner.free, req.seq)

    async def _loop(self) -> None:
        while True:
            admitted = self.core.admit()
            for req in admitted:
                event = self._admitted.get(req.request_id)
                if event is not None:
                    event.set()
            if admitted:
                await asyncio.sleep(0)  # their generate() picks a source: local prompts join this step
            plan = self.core.plan()
            if not plan:
                self._idle_if_nothing_to_compute()
                self._work.clear()
                await self._work.wait()
                continue
            try:
                result = await self._step(plan)
            except Exception as e:  # noqa: BLE001 - the requests in the step fail, the loop goes on
                self._fail(plan, e)
                continue
            outputs, firsts = self.core.update(plan, result)
            for out in outputs:
                queue = self._outputs.get(out.request_id)
                if queue is not None:
                    queue.put_nowait(out)
            for req, token in firsts:
                first = self._first.pop(req.request_id, None)
                if first is not None and not first.done():
                    first.set_result(token)

    def _fail(self, plan, error: Exception) -> None:
        """A step raised: each of its requests ends with that error (the generate() reading it
        raises it and releases the request)."""
        for req in (*plan.decode, *(c.req for c in plan.chunks)):
            req.status = RequestStatus.FINISHED
            first = self._first.pop(req.request_id, None)
            if first is not None and not first.done():
                first.set_exception(error)
                continue
            queue = self._outputs.get(req.request_id)
            if queue is not None:
                queue.put_nowait(error)

    def stats(self) -> dict[str, int]:
        return self.core.stats()

    async def close(self) -> None:
        if self._task:
            self._task.cancel()
        self.executor.shutdown(wait=False, cancel_futures=False)
