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
  pages from every arena (milliseconds, next to the ~2 s a 1 MiB prompt takes to tokenize).

See docs/decisions/050-front-door-memory.md for the measurements. A no-op where libc is not glibc.
"""
from __future__ import annotations

import ctypes
import functools
import os

M_MMAP_THRESHOLD, M_ARENA_MAX = -3, -8  # glibc's mallopt parameters
MMAP_THRESHOLD = 128 << 10  # glibc's initial value, kept fixed (not raised adaptively)
ARENA_MAX = 2
LARGE_PROMPT_BYTES = 256 << 10


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
    if os.environ.get("KVWIRE_MALLOC", "auto").lower() in ("0", "off", "false", "no"):
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_ARENA_MAX" in os.environ:
        return False
    libc = _libc()
    if libc is None:
        return False
    return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(libc.mallopt(M_ARENA_MAX, ARENA_MAX))


def after_prompt(nbytes: int) -> None:
    """Called once a prompt of ``nbytes`` is tokenized (or refused) and its buffers are freed."""
    if nbytes >= LARGE_PROMPT_BYTES and return_freed_memory() and (libc := _libc()) is not None:
        libc.malloc_trim(0)
