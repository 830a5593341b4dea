"""Host -> device transfers of a launch's small inputs, and its record's way back (docs/engine.md).

On CUDA, pinning fresh tensors every round is slow (page-locked allocations); instead each launch
bump-allocates from one of two pinned halves, and an event guards a half until the copies that use it
have run. A half also holds the launch's read-back, which the engine collects before the half comes round
again. On the CPU, transfers are plain tensors.
"""

from __future__ import annotations

import numpy as np
import torch


class Staging:
    def __init__(self, device: torch.device, size: int = 1 << 20):
        self.device = device
        self.pinned = device.type == "cuda"
        if not self.pinned:
            return
        self.halves = [torch.empty(size, dtype=torch.int64, pin_memory=True) for _ in range(2)]
        self.views = [h.numpy() for h in self.halves]
        self.back = [torch.empty(size // 8, dtype=torch.float32, pin_memory=True) for _ in range(2)]
        self.events: list[torch.cuda.Event | None] = [None, None]
        self.cur, self.off, self.back_off = 0, 0, 0

    def next_launch(self) -> None:
        """Start a launch's transfers: switch halves, waiting until the copies of the launch before the
        previous one have run."""
        if not self.pinned:
            return
        ev = torch.cuda.Event()
        ev.record()
        self.events[self.cur] = ev
        self.cur ^= 1
        self.off = self.back_off = 0
        prev = self.events[self.cur]
        if prev is not None:
            prev.synchronize()

    def to_device(self, data: list | np.ndarray, dtype: torch.dtype) -> torch.Tensor:
        """A flat host list on the device, without a device sync."""
        if not self.pinned:
            return torch.tensor(data, dtype=dtype)
        n = len(data)
        if self.off + n > self.views[self.cur].shape[0]:
            return torch.tensor(data, dtype=dtype).to(self.device)  # oversized: plain (synchronous) copy
        if dtype == torch.float64:  # staged as its bit pattern
            data = np.asarray(data, dtype=np.float64).view(np.int64)
        self.views[self.cur][self.off : self.off + n] = data
        host = self.halves[self.cur][self.off : self.off + n]
        self.off += n
        dev = host.to(self.device, non_blocking=True)
        if dtype == torch.float64:
            return dev.view(torch.float64)
        return dev if dtype == torch.int64 else dev.to(dtype)

    def readback(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying fp32 device tensor t to host memory; returns the host tensor and an event that
        fires once it is filled (None on the CPU: t itself, ready now)."""
        if not self.pinned:
            return t, None
        n = t.numel()
        if self.back_off + n > self.back[self.cur].shape[0]:
            host = torch.empty(t.shape, dtype=torch.float32, pin_memory=True)  # oversized
        else:
            host = self.back[self.cur][self.back_off : self.back_off + n].view(t.shape)
            self.back_off += n
        host.copy_(t, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return host, ready
