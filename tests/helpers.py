"""Small helpers several test modules share (imported as `helpers`: pytest puts tests/ on sys.path)."""
from __future__ import annotations

import os
import time
from typing import Iterator


def wait_for(predicate, timeout: float = 15.0, interval: float = 0.1):
    """Poll `predicate` until it returns something true or `timeout` passes; returns its last value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    return predicate()


def processes() -> Iterator[tuple[int, list[bytes]]]:
    """(pid, argv) of every process this user can see, from /proc."""
    from ouro_backend.entrypoints.serve import process_argv

    for entry in os.listdir("/proc"):
        if entry.isdigit() and (argv := process_argv(int(entry))) is not None:
            yield int(entry), argv


def find_engine_process(address_part: str, known=frozenset()) -> int:
    """The pid of an engine process (`python -m ouro_backend.serving.engine_process`) whose --address
    contains `address_part`, other than those in `known`; 0 when there is none."""
    for pid, argv in processes():
        if pid not in known and b"ouro_backend.serving.engine_process" in argv and \
                any(address_part.encode() in a for a in argv):
            return pid
    return 0
