"""`ShmGuard` (entrypoints/private_shm.py) on a directory of its own: no server, no model."""

from __future__ import annotations

import os
import stat
import time

import pytest

from ouro_backend.entrypoints.private_shm import ShmGuard, _Inotify

PREFIX = "ouro_shm_test_"


def mode(path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


def make(path, m: int) -> None:
    with open(path, "w") as f:
        f.write("tensors")
    os.chmod(path, m)


def wait_for(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.01)
    return cond()


def test_a_region_seen_private_and_then_made_readable_is_secured_again(tmp_path):
    """Triton's backend creates a region (0600 under tritonserver's umask 077) and only then fchmods it to
    0644: a sweep that saw it private must not take it as done."""
    guard = ShmGuard(PREFIX, str(tmp_path))
    region = tmp_path / f"{PREFIX}stub_0"
    make(region, 0o600)
    guard.sweep()
    assert mode(region) == 0o600
    os.chmod(region, 0o644)  # the backend's fchmod, after the sweep saw the region
    guard.sweep()
    assert mode(region) == 0o600


def test_sweep_leaves_other_names_links_and_their_targets_alone(tmp_path):
    guard = ShmGuard(PREFIX, str(tmp_path))
    other = tmp_path / "someone_elses_region"
    make(other, 0o644)
    target = tmp_path / "target"
    make(target, 0o644)
    (tmp_path / f"{PREFIX}link").symlink_to(target)
    guard.sweep()
    assert mode(other) == 0o644 and mode(target) == 0o644


@pytest.mark.skipif(_Inotify.open("/tmp") is None, reason="no inotify here")
def test_inotify_secures_regions_between_sweeps(tmp_path):
    """With sweeps a minute apart, a new region and a region made readable again are secured all the same:
    inotify reports them. stop() ends the thread at once."""
    guard = ShmGuard(PREFIX, str(tmp_path))
    guard.interval = 60.0
    first = tmp_path / f"{PREFIX}first"
    make(first, 0o644)
    guard.start()
    try:
        assert wait_for(lambda: mode(first) == 0o600), "the first sweep did not run"
        late = tmp_path / f"{PREFIX}late"
        make(late, 0o644)
        assert wait_for(lambda: mode(late) == 0o600), "a region created after the sweep stayed readable"
        os.chmod(first, 0o644)
        assert wait_for(lambda: mode(first) == 0o600), "a region made readable again stayed readable"
    finally:
        guard.stop()
        guard.join(10)
    assert not guard.is_alive()
