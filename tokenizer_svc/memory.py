"""The front door gives a large prompt's memory back to the kernel (glibc malloc settings).

A 1 MiB prompt costs the front door far more than 1 MiB while it is tokenized: the request
message and its str copies, the Rust tokenizer's work buffers on its worker threads, and an
Encoding of ~10^5-10^6 tokens (ids, offsets, token strings). Measured (tokenizer_svc process,
embedded tokenizer, 1 MiB prompts refused by --max-prompt-tokens, sequential): resident memory
80 -> 891 MB after 12 prompts, never returned. glibc keeps freed memory in per-thread arenas and
raises its mmap threshold after the first large free, so later 1 MiB buffers come from (and stay
in) the heap. Here, unlike the engine (kvwire/malloc.py keeps freed memory for forward speed):

- the mmap threshold is fixed at ``MMAP_THRESHOLD``: large buffers are mmapped and unmapped on free;
- at most ``ARENA_MAX`` arenas: the tokenizer's threads share the freed memory instead of each
  keeping its own;
- after a prompt of at least ``LARGE_PROMPT_BYTES`` is tokenized, ``malloc_trim(0)`` returns free
  pages from every arena (milliseconds, next to the ~2 s a 1 MiB prompt takes to tokenize);
- ``RECLAIM_DELAY_S`` after such a request, a full garbage collection and another trim
  (``Reclaimer``; at most one per delay): a failed call leaves its request, tracebacks and gRPC call
  state in reference cycles (asyncio futures, grpc's RPC state and its AbortError), which otherwise
  wait for a generation-2 collection, minutes apart in this process (~12 ms per collection).

See docs/decisions/050-front-door-memory.md for the measurements. A no-op where libc is not glibc.
"""
from __future__ import annotations

import asyncio
import ctypes
import functools
import gc

from kvwire import envs

M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8  # glibc's mallopt parameters
MMAP_THRESHOLD = 128 << 10  # glibc's initial value, kept fixed (not raised adaptively)
ARENA_MAX = 2
LARGE_PROMPT_BYTES = 256 << 10
RECLAIM_DELAY_S = 0.25  # after the request: its call has ended and its cycles are garbage by then


@functools.cache
def _libc():
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt.argtypes, libc.mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
        libc.malloc_trim.argtypes, libc.malloc_trim.restype = [ctypes.c_size_t], ctypes.c_int
        return libc
    except (OSError, AttributeError):
        return None


@functools.cache
def return_freed_memory() -> bool:
    """Set the front door's malloc policy (once per process); True when set. The environment's
    own ``MALLOC_MMAP_THRESHOLD_`` / ``MALLOC_ARENA_MAX`` or ``KVWIRE_MALLOC=0`` leave it alone."""
    if envs.switched_off("KVWIRE_MALLOC"):
        return False
    if envs.is_set("MALLOC_MMAP_THRESHOLD_") or envs.is_set("MALLOC_ARENA_MAX"):
        return False  # the user's own settings win
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_ARENA_MAX, ARENA_MAX))


def after_prompt(nbytes: int) -> None:
    """Called once a prompt of ``nbytes`` is tokenized (or refused) and its buffers are freed."""
    if nbytes >= LARGE_PROMPT_BYTES:
        trim()


def trim() -> None:
    if return_freed_memory() and (libc := _libc()) is not None:
        libc.malloc_trim(0)


class Reclaimer:
    """``soon()`` (event loop): one full collection and trim ``RECLAIM_DELAY_S`` later; calls in
    the meantime join it. Memory a large request left is back within the delay, even when idle."""

    def __init__(self, delay_s: float = RECLAIM_DELAY_S):
        self.delay_s = delay_s
        self._pending: asyncio.TimerHandle | None = None
        self.runs = 0

    def soon(self) -> None:
        if self._pending is None:
            self._pending = asyncio.get_running_loop().call_later(self.delay_s, self._run)

    def _run(self) -> None:
        self._pending = None
        self.runs += 1
        gc.collect()  # needs the GIL either way (~12 ms); the trim (madvise of every arena) does not:
        asyncio.get_running_loop().run_in_executor(None, trim)  # off the loop, so health is not held up
