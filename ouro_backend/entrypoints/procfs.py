"""What ouro-serve reads about processes from /proc: a process's state and command line, the members of a
process group, and the Python backend stubs of a tritonserver. Linux only; a process that is gone (or
not readable) reads as None or is left out."""

from __future__ import annotations

import os
from pathlib import Path

STUB = "triton_python_backend_stub"  # the Python backend stub's executable name


def _proc_stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, start time, process group) of process `pid` from /proc, or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    fields = data[data.rindex(b")") + 2 :].split()
    return fields[0].decode(), int(fields[1]), int(fields[19]), int(fields[2])


def _pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


def group_members(pgid: int) -> list[int]:
    """The processes of process group `pgid` that are not zombies (dead ones wait for init to reap them)."""
    return [pid for pid in _pids() if (st := _proc_stat(pid)) is not None and st[3] == pgid and st[0] != "Z"]


def process_argv(pid: int) -> list[bytes] | None:
    """The command line of process `pid` from /proc, or None if it is gone (or not readable)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")
    except OSError:
        return None


def child_stubs(server_pid: int) -> dict[int, tuple[int, str]]:
    """The live Python backend stubs of tritonserver `server_pid`: {pid: (start time, model)}, from /proc.
    A stub's argv is `triton_python_backend_stub <repository>/<model>/<version>/model.py <shm region> ...`;
    the engine processes are the stubs' children, not the server's, so they are not here."""
    out = {}
    for entry in _pids():
        st = _proc_stat(entry)
        if st is None or st[1] != server_pid or st[0] == "Z":
            continue
        argv = process_argv(entry)
        if argv is None:
            continue
        if os.path.basename(argv[0].decode(errors="replace")) == STUB:
            parts = Path(argv[1].decode(errors="replace")).parts if len(argv) > 1 else ()
            out[entry] = (st[2], parts[-3] if len(parts) >= 3 else "?")
    return out
