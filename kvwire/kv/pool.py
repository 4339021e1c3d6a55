"""The KV page pool and per-sequence block tables: plain Python over ints, no tensors.

``PagePool`` hands out page ids from a fixed set; ``BlockTables`` maps each sequence's token
positions to pages (position p lives in page ``table[p // block_size]`` at offset
``p % block_size``), grows tables as tokens are appended, rolls them back for rejected speculative
tokens, forks a sequence into choices that share its full pages (``fork``) and, for sliding-window models, gives back pages that no future query can see
(their table entries become ``RELEASED``), so a long sequence holds about window/block_size pages.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

RELEASED = -1  # block-table entry of a page given back because it fell behind the window


class OutOfPages(RuntimeError):
    """Not enough free pages for a request; nothing was allocated."""

    def __init__(self, needed: int, free: int):
        super().__init__(f"need {needed} KV pages, only {free} free")
        self.needed, self.free = needed, free


class PageError(ValueError):
    """A page id that is not currently allocated was freed (double free or foreign id)."""


class PagePool:
    def __init__(self, num_pages: int):
        if num_pages <= 0:
            raise ValueError(f"num_pages must be positive, got {num_pages}")
        self.num_pages = num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pop() hands out 0, 1, 2, ...
        self._refs = [0] * num_pages  # holders of each page: sequences, and the prefix cache
        self._peak = 0
        # Called with the number of pages missing before an allocation fails (the prefix cache
        # evicts unreferenced pages there); None = nothing to reclaim.
        self.reclaim: Callable[[int], None] | None = None

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_pages - len(self._free)

    def allocate(self, n: int) -> list[int]:
        """n distinct free pages, or OutOfPages and no change at all."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} pages")
        if n > len(self._free) and self.reclaim is not None:
            self.reclaim(n - len(self._free))
        if n > len(self._free):
            raise OutOfPages(n, len(self._free))
        pages = [self._free.pop() for _ in range(n)]
        for p in pages:
            self._refs[p] = 1
        self._peak = max(self._peak, self.num_used)
        return pages

    def free(self, pages: Iterable[int]) -> None:
        """Drop one holder of each page; a page with no holder left returns to the pool. All are
        checked before any is freed."""
        pages = list(pages)
        if len(set(pages)) != len(pages):
            raise PageError(f"page ids freed twice in one call: {sorted(pages)}")
        bad = [p for p in pages if not (0 <= p < self.num_pages and self._refs[p])]
        if bad:
            raise PageError(f"pages {bad} are not allocated (double free?)")
        for p in pages:
            self._refs[p] -= 1
        self._free.extend(p for p in reversed(pages) if not self._refs[p])

    def share(self, pages: Iterable[int]) -> None:
        """Add one holder to each allocated page (a shared prefix page: read-only once full)."""
        pages = list(pages)
        bad = [p for p in pages if not (0 <= p < self.num_pages and self._refs[p])]
        if bad:
            raise PageError(f"pages {bad} are not allocated; only a held page can be shared")
        for p in pages:
            self._refs[p] += 1

    def refcount(self, page: int) -> int:
        return self._refs[page]

    def stats(self) -> dict[str, int]:
        return {"num_pages": self.num_pages, "used": self.num_used, "free": self.num_free,
                "peak_used": self._peak, "shared": sum(r > 1 for r in self._refs)}


class BlockTables:
    """Block tables of all live sequences, over one pool.

    ``window``: the sliding window every layer uses (None if any layer attends to everything);
    a query at position p sees keys j > p - window.
    """

    def __init__(self, pool: PagePool, block_size: int, window: int | None = None):
        self.pool, self.block_size, self.window = pool, block_size, window
        self._tables: dict[int, list[int]] = {}
        self._lengths: dict[int, int] = {}

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self._tables

    def add(self, seq_id: int) -> None:
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already exists")
        self._tables[seq_id], self._lengths[seq_id] = [], 0

    def attach(self, seq_id: int, pages: Sequence[int]) -> None:
        """Start a sequence on already-filled full pages (a cached prefix): it holds them too."""
        self.add(seq_id)
        self.pool.share(pages)
        self._tables[seq_id].extend(pages)
        self._lengths[seq_id] = len(pages) * self.block_size

    def fork(self, src: int, dst: int) -> tuple[int, int] | None:
        """Start ``dst`` as a copy of ``src`` (another choice of the same prompt): its full pages
        are shared (one more holder each: full pages never change), its last page, when partial,
        is a new page for ``dst`` alone (copy on write: ``src`` appends into its own). Returns
        (``src``'s partial page, ``dst``'s copy) for the caller to copy the bytes, or None."""
        if dst in self._tables:
            raise ValueError(f"sequence {dst} already exists")
        table, length = self._tables[src], self._lengths[src]
        partial = length % self.block_size != 0
        full = table[:-1] if partial else list(table)
        copy = self.pool.allocate(1) if partial else []  # raises OutOfPages before anything changes
        self.pool.share([p for p in full if p != RELEASED])
        self._tables[dst], self._lengths[dst] = full + copy, length
        return (table[-1], copy[0]) if partial else None

    def table(self, seq_id: int) -> list[int]:
        """Page ids by block index (RELEASED for pages behind the window). Do not mutate."""
        return self._tables[seq_id]

    def length(self, seq_id: int) -> int:
        return self._lengths[seq_id]

    def max_pages(self, prompt_len: int, total_len: int, lookahead: int = 0) -> int:
        """The most pages one sequence can hold at once: what a scheduler reserves for it.

        ``total_len``: prompt + every token it may generate (a step's speculative proposals are
        capped so the sequence never grows past it); ``lookahead``: tokens fed beyond the last
        accepted one in one step (proposals, rolled back after). The whole prompt is written at
        once (nothing is behind the window yet); later, with a window W,
        ``release_outside_window`` keeps the live positions to W - 1 + the step's 1 + lookahead
        tokens, which straddle at most ceil((W + lookahead) / block_size) + 1 pages.
        """
        bs = self.block_size
        pages = -(-total_len // bs)
        if self.window is not None:
            pages = min(pages, max(-(-prompt_len // bs), -(-(self.window + lookahead) // bs) + 1))
        return pages

    def pages_needed(self, seq_id: int, num_new: int) -> int:
        have = len(self._tables[seq_id])
        return max(0, -(-(self._lengths[seq_id] + num_new) // self.block_size) - have)

    def append(self, requests: Sequence[tuple[int, int]]) -> list[int]:
        """Grow each (seq_id, num_new); all or nothing. Returns the newly allocated pages."""
        needs = [self.pages_needed(s, n) for s, n in requests]
        new = self.pool.allocate(sum(needs))  # raises OutOfPages before anything changes
        i = 0
        for (seq_id, num_new), k in zip(requests, needs):
            self._tables[seq_id].extend(new[i:i + k])
            self._lengths[seq_id] += num_new
            i += k
        return new

    def release_outside_window(self, seq_id: int) -> int:
        """Give back pages no future query can see; returns how many were released.

        The next query sits at position >= length and sees keys j >= length - window + 1, so a
        page whose last position is below that is dead. Called at the start of a step (not at
        the end) so a speculative rollback (``truncate``) never needs a page already given back.
        """
        if self.window is None:
            return 0
        table, bs = self._tables[seq_id], self.block_size
        dead_blocks = max(0, self._lengths[seq_id] - self.window + 1) // bs
        released = [table[b] for b in range(dead_blocks) if table[b] != RELEASED]
        for b in range(dead_blocks):
            table[b] = RELEASED
        if released:
            self.pool.free(released)
        return len(released)

    def truncate(self, seq_id: int, length: int) -> None:
        """Keep the first ``length`` tokens; pages left empty go back to the pool."""
        cur = self._lengths[seq_id]
        if length > cur or length < 0:
            raise ValueError(f"sequence {seq_id}: cannot truncate {cur} tokens to {length}")
        table = self._tables[seq_id]
        keep = -(-length // self.block_size)
        first_needed = 0 if self.window is None else max(0, length - self.window + 1) // self.block_size
        if any(table[b] == RELEASED for b in range(first_needed, keep)):
            raise ValueError(f"sequence {seq_id}: truncating to {length} needs pages already "
                             "released behind the sliding window")
        dropped = [p for p in table[keep:] if p != RELEASED]
        del table[keep:]
        self._lengths[seq_id] = length
        self.pool.free(dropped)

    def free(self, seq_id: int) -> None:
        """Finish a sequence: all its pages go back to the pool."""
        table = self._tables.pop(seq_id)
        del self._lengths[seq_id]
        self.pool.free(p for p in table if p != RELEASED)

    def live_pages(self, seq_id: int) -> list[int]:
        return [p for p in self._tables[seq_id] if p != RELEASED]
