"""PagePool and BlockTables: plain ints, no tensors."""
from __future__ import annotations

import pytest

from kvwire.kv.pool import RELEASED, BlockTables, OutOfPages, PageError, PagePool


def test_allocate_free_and_stats():
    pool = PagePool(8)
    a = pool.allocate(3)
    b = pool.allocate(5)
    assert len(set(a + b)) == 8 and pool.num_free == 0 and pool.num_used == 8
    pool.free(a)
    assert pool.num_free == 3
    assert sorted(pool.allocate(3)) == sorted(a)
    assert pool.stats() == {"num_pages": 8, "used": 8, "free": 0, "peak_used": 8, "shared": 0}


def test_out_of_pages_allocates_nothing():
    pool = PagePool(4)
    pool.allocate(3)
    with pytest.raises(OutOfPages) as e:
        pool.allocate(2)
    assert (e.value.needed, e.value.free) == (2, 1)
    assert pool.num_free == 1  # no partial allocation
    assert len(pool.allocate(1)) == 1


def test_double_free_and_foreign_ids_raise_without_freeing_anything():
    pool = PagePool(4)
    pages = pool.allocate(2)
    pool.free(pages[:1])
    with pytest.raises(PageError):
        pool.free(pages)  # pages[0] is already free
    assert pool.num_used == 1  # pages[1] was not freed by the failed call
    with pytest.raises(PageError):
        pool.free([pages[1], pages[1]])
    with pytest.raises(PageError):
        pool.free([99])
    pool.free(pages[1:])
    assert pool.num_free == 4


def test_tables_grow_by_page_and_all_or_nothing():
    pool = PagePool(5)
    bt = BlockTables(pool, block_size=4)
    bt.add(0)
    bt.add(1)
    bt.append([(0, 5), (1, 4)])  # 2 + 1 pages
    assert (len(bt.table(0)), len(bt.table(1)), pool.num_used) == (2, 1, 3)
    bt.append([(0, 3)])  # fills page 2 of seq 0, no new page
    assert pool.num_used == 3 and bt.length(0) == 8
    with pytest.raises(OutOfPages):
        bt.append([(1, 4), (0, 5)])  # needs 1 + 2 > 2 free
    assert (bt.length(0), bt.length(1), pool.num_used) == (8, 4, 3)  # unchanged
    with pytest.raises(ValueError):
        bt.add(0)


def test_truncate_returns_emptied_pages():
    pool = PagePool(8)
    bt = BlockTables(pool, block_size=4)
    bt.add(7)
    bt.append([(7, 10)])  # 3 pages
    first = bt.table(7)[0]
    bt.truncate(7, 5)  # speculative rollback: page 3 is empty now
    assert bt.length(7) == 5 and len(bt.table(7)) == 2 and pool.num_used == 2
    bt.truncate(7, 4)
    assert len(bt.table(7)) == 1 and bt.table(7)[0] == first
    with pytest.raises(ValueError):
        bt.truncate(7, 6)  # cannot grow by truncating
    bt.free(7)
    assert pool.num_used == 0 and 7 not in bt


def test_window_release_keeps_memory_flat():
    pool = PagePool(16)
    bt = BlockTables(pool, block_size=4, window=6)
    bt.add(0)
    bt.append([(0, 3)])
    used = []
    for _ in range(40):  # decode one token at a time, releasing before each step
        bt.release_outside_window(0)
        bt.append([(0, 1)])
        used.append(pool.num_used)
    # A query at p sees p-5..p: at most 3 pages of 4 (released at the start of the next step).
    assert max(used) <= 3
    table = bt.table(0)
    assert table[0] == RELEASED and table[-1] != RELEASED
    # Everything a future query at position `length` can see is still there.
    first_visible = bt.length(0) - 6 + 1
    assert all(p != RELEASED for p in table[first_visible // 4:])
    with pytest.raises(ValueError):
        bt.truncate(0, 10)  # would need pages given back long ago
    bt.free(0)  # released pages are not freed twice
    assert pool.num_used == 0


def test_no_release_without_window():
    pool = PagePool(16)
    bt = BlockTables(pool, block_size=4)
    bt.add(0)
    bt.append([(0, 30)])
    assert bt.release_outside_window(0) == 0 and pool.num_used == 8
