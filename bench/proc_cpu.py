"""CPU seconds of process trees, from /proc/<pid>/stat (Linux): where the cores go during a benchmark.

A tree's CPU time is the sum, over the process and every live descendant (found by walking the
``ppid`` of every /proc/<pid>/stat), of utime + stime (its threads' time so far) + cutime + cstime
(the time of its children that have exited and been waited for). A child that exits between two
samples keeps counting: its whole time moves into its parent's cutime/cstime when reaped, and
its time up to the first sample was in the tree then, so the difference is what it used between
them. Sample before and after a measured window; ``delta`` is CPU seconds per group.
"""
from __future__ import annotations

import os
from pathlib import Path

PROC = Path("/proc")


def clock_ticks() -> int:
    return os.sysconf("SC_CLK_TCK")


def read_stat(pid: int, proc: Path = PROC) -> tuple[int, int] | None:
    """(ppid, utime + stime + cutime + cstime in clock ticks) of one process; None when it is gone.
    The command name (field 2) may hold spaces and parentheses, so fields are counted after the last ')'."""
    try:
        text = (proc / str(pid) / "stat").read_text()
    except (OSError, ValueError):
        return None
    fields = text[text.rindex(")") + 2:].split()
    # fields[0] is field 3 (state): ppid is field 4, utime..cstime are fields 14..17
    return int(fields[1]), sum(int(x) for x in fields[11:15])


def process_table(proc: Path = PROC) -> dict[int, tuple[int, int]]:
    """{pid: (ppid, ticks)} of every process visible now."""
    table = {}
    for d in proc.iterdir():
        if d.name.isdigit() and (st := read_stat(int(d.name), proc)) is not None:
            table[int(d.name)] = st
    return table


def tree(root: int, table: dict[int, tuple[int, int]]) -> list[int]:
    """``root`` and its live descendants in ``table`` (root first; [] when root is gone)."""
    if root not in table:
        return []
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def tree_ticks(root: int, table: dict[int, tuple[int, int]]) -> int:
    return sum(table[p][1] for p in tree(root, table))


def sample(groups: dict[str, list[int]], proc: Path = PROC) -> dict[str, float]:
    """CPU seconds so far of each group (the trees of its root pids together), from one snapshot of /proc."""
    table, hz = process_table(proc), clock_ticks()
    return {name: sum(tree_ticks(pid, table) for pid in pids) / hz for name, pids in groups.items()}


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """CPU seconds used between two samples, per group present in both."""
    return {k: round(after[k] - before[k], 3) for k in before if k in after}


def rusage_s(ru) -> float:
    """User + system seconds of an ``os.wait4`` / ``resource.getrusage`` result."""
    return ru.ru_utime + ru.ru_stime
