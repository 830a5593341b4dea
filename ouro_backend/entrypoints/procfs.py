"""What ouro-serve reads about processes from /proc: a process's state and command line, the members of a
process group, the Python backend stubs of a tritonserver, and who listens on a TCP port. Linux only; a
process that is gone (or not readable) reads as None or is left out."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable
from pathlib import Path

STUB = "triton_python_backend_stub"  # the Python backend stub's executable name


def _stat_fields(pid: int) -> list[bytes] | None:
    """The fields of /proc/<pid>/stat after the command name (state first), or None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read()
    except OSError:
        return None
    return data[data.rindex(b")") + 2 :].split()


def _proc_stat(pid: int) -> tuple[str, int, int, int] | None:
    """(state, ppid, start time, process group) of process `pid` from /proc, or None if it is gone."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    return fields[0].decode(), int(fields[1]), int(fields[19]), int(fields[2])


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU seconds process `pid` (all its threads) has used, or None if it is gone."""
    fields = _stat_fields(pid)
    return None if fields is None else (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def descendants(root: int) -> set[int]:
    """`root` and every live process below it."""
    children: dict[int, list[int]] = {}
    for pid in _pids():
        st = _proc_stat(pid)
        if st is not None:
            children.setdefault(st[1], []).append(pid)
    family, frontier = {root}, [root]
    while frontier:
        for child in children.get(frontier.pop(), []):
            if child not in family:
                family.add(child)
                frontier.append(child)
    return family


def stub_model(argv: list[bytes]) -> str | None:
    """The model a Python backend stub serves, from its argv (`triton_python_backend_stub
    <repository>/<model>/<version>/model.py <shm region> ...`); None if `argv` is not a stub's."""
    if not argv or os.path.basename(argv[0].decode(errors="replace")) != STUB:
        return None
    parts = Path(argv[1].decode(errors="replace")).parts if len(argv) > 1 else ()
    return parts[-3] if len(parts) >= 3 else "?"


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
        model = stub_model(process_argv(entry) or [])
        if model is not None:
            out[entry] = (st[2], model)
    return out


# ------------------------------------------------------------------------------------------ TCP listeners
WILDCARDS = ("0.0.0.0", "::")


def _address(hex_addr: str) -> str:
    """An address of /proc/net/tcp{,6} (32-bit words in host order, little-endian here) as text; an IPv4
    address mapped into IPv6 (::ffff:a.b.c.d) as the IPv4 one."""
    raw = bytes.fromhex(hex_addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1])
    text = socket.inet_ntop(socket.AF_INET6, b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4)))
    return text[7:] if text.startswith("::ffff:") and "." in text else text


def tcp_listeners(ports: Iterable[int]) -> dict[int, list[tuple[str, int]]] | None:
    """{port: [(local address, socket inode), ...]} of the listening TCP sockets on `ports` in this network
    namespace (IPv4 and IPv6), from /proc/net/tcp and tcp6; None where neither can be read."""
    found: dict[int, list[tuple[str, int]]] = {port: [] for port in ports}
    read = False
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/net/{name}") as f:
                lines = f.read().splitlines()[1:]
        except OSError:
            continue
        read = True
        for line in lines:
            fields = line.split()
            if len(fields) < 10 or fields[3] != "0A":  # 0A: TCP_LISTEN
                continue
            addr, _, hex_port = fields[1].partition(":")
            port = int(hex_port, 16)
            if port in found:
                found[port].append((_address(addr), int(fields[9])))
    return found if read else None


def addresses_overlap(a: str, b: str) -> bool:
    """Whether listening on `a` and on `b` (same port) conflict: the same address, or either is a wildcard."""
    return a == b or a in WILDCARDS or b in WILDCARDS


def socket_inodes(pid: int) -> set[int] | None:
    """The inodes of the sockets process `pid` has open (its /proc/<pid>/fd), or None if they cannot be
    read (it is gone, or another user's)."""
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    out = set()
    for name in names:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:["):
            out.add(int(link[8:-1]))
    return out


def socket_owner(inode: int) -> int | None:
    """A process that holds the socket with `inode` open, among those this user may inspect; None if none is."""
    for pid in _pids():
        inodes = socket_inodes(pid)
        if inodes and inode in inodes:
            return pid
    return None


def describe_process(pid: int) -> str:
    """`pid 123 (tritonserver)` or, for a Python program, `pid 123 (python -m ouro_backend...)`: what `ps`
    would name it by."""
    argv = process_argv(pid) or []
    words = [a.decode(errors="replace") for a in argv if a]
    if not words:
        return f"pid {pid}"
    name = os.path.basename(words[0])
    if name.startswith("python") and len(words) > 1:
        name = " ".join([name] + words[1:3]).splitlines()[0][:80]
    return f"pid {pid} ({name})"
