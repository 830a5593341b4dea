"""Noticing that a client went away.

`response_sender.is_cancelled()` is a synchronous round trip to the server in the Python backend, so it is
asked from one watcher thread every `interval_s`, never from a thread that sends responses: asking for every
open request on every token would put one server round trip per request in front of each send.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class CancelWatcher:
    """Every `interval_s`: `on_expired(s)` for each stream of `streams()` past its `deadline` (a monotonic
    time, or None), else `on_cancel(s)` if its client is gone. A stream has `sender`, `send_lock`, `done`
    (FINAL sent) and `deadline`."""

    def __init__(
        self,
        interval_s: float,
        streams: Callable[[], list],
        on_cancel: Callable[[Any], None],
        on_expired: Callable[[Any], None],
    ):
        self.interval_s = interval_s
        self._streams = streams
        self._on_cancel = on_cancel
        self._on_expired = on_expired
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ouro-cancel-watcher", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                now = time.monotonic()
                for s in self._streams():
                    if s.deadline is not None and now >= s.deadline:
                        self._on_expired(s)
                    elif self._client_cancelled(s):
                        self._on_cancel(s)
            except Exception:
                log.exception("cancellation check failed")

    @staticmethod
    def _client_cancelled(s: Any) -> bool:
        """Asked under the stream's `send_lock` (the one its FINAL send takes), and never once FINAL is
        out: asking a released sender crashes tritonserver 2.51, so `done` is read under the lock."""
        with s.send_lock:
            if s.done:
                return False
            try:
                return bool(s.sender.is_cancelled())
            except Exception:
                return False

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)
