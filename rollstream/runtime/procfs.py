"""Linux /proc reads shared by the run's tools: a process's stat fields, its descendants (elsewhere: none)."""

from __future__ import annotations

from pathlib import Path

PROC = Path("/proc")


def stat_fields(pid: int | str, proc: Path = PROC) -> list[str] | None:
    """/proc/<pid>/stat's fields after `pid (comm)` — state, ppid, … (utime is [11], stime [12]) — or None
    when the process is gone or there is no /proc."""
    try:
        return (proc / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def descendants(pid: int, proc: Path = PROC) -> list[int]:
    """Every process descended from `pid` (children first, then theirs)."""
    children: dict[int, list[int]] = {}
    for entry in proc.glob("[0-9]*"):
        fields = stat_fields(entry.name, proc)
        if fields is not None and len(fields) > 1 and fields[1].isdigit():
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    out, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def is_running(pid: int, proc: Path = PROC) -> bool:
    """True while `pid` exists and is not a zombie."""
    fields = stat_fields(pid, proc)
    return fields is not None and fields[:1] != ["Z"]
