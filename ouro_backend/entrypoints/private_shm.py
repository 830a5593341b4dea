"""Keeping the Python backend's shared-memory regions from the other users of this host.

Triton makes each region between the server and a stub mode 0644 in /dev/shm whatever the umask, so any
local user could read a stub's tensors. Two ways to stop that, for TritonServer's `private_shm`:
* a private /dev/shm: tritonserver runs in a mount namespace of its own with a fresh tmpfs there
  (`private_shm_wrapper`: as root, or in an unprivileged user namespace), so no other user sees the
  regions. Clients' system shared-memory regions in the host's /dev/shm are out of its sight too;
* chmod: the regions are chmod 0600 as soon as they appear (`ShmGuard`, polled), which a local user can race.
`on` insists on the first, `off` takes the second, `auto` the first where it works, else the second.
"""

from __future__ import annotations

import functools
import os
import shutil
import stat
import subprocess
import threading

SHM_DIR = "/dev/shm"
PRIVATE_SHM_MODES = ("auto", "on", "off")


def _shm_size() -> int | None:
    try:
        st = os.statvfs(SHM_DIR)
        return st.f_blocks * st.f_frsize or None
    except OSError:
        return None


@functools.cache
def private_shm_wrapper() -> tuple[tuple[str, ...] | None, str]:
    """(argv prefix that runs a command in a mount namespace of its own with a fresh tmpfs on /dev/shm, the
    size of this one's; None and why when this process cannot). As root: unshare --mount. Otherwise in a
    user namespace (root inside only for the mount, then a nested one maps this uid back), if the kernel
    allows unprivileged user namespaces. The command keeps its pid (unshare and sh exec it). Probed once:
    the probe must see this uid and an empty /dev/shm."""
    unshare, mount = shutil.which("unshare"), shutil.which("mount")
    if not unshare or not mount:
        return None, "no unshare/mount on PATH (util-linux)"
    size = _shm_size()
    opts = "nosuid,nodev,mode=1777" + (f",size={size}" if size else "")
    mount_cmd = f"{mount} -t tmpfs -o {opts} ouro-shm {SHM_DIR}"
    uid, gid = os.getuid(), os.getgid()
    if uid == 0:
        wrapper = (unshare, "--mount", "--propagation", "private", "--", "sh", "-c", f'{mount_cmd} && exec "$@"', "sh")
    else:
        wrapper = (
            unshare,
            "--user",
            "--map-root-user",
            "--mount",
            "--propagation",
            "private",
            "--",
            "sh",
            "-c",
            f'{mount_cmd} && exec {unshare} --user --map-user={uid} --map-group={gid} -- "$@"',
            "sh",
        )
    try:
        r = subprocess.run(
            list(wrapper) + ["sh", "-c", f"id -u; ls -A {SHM_DIR} | wc -l"],
            capture_output=True,
            text=True,
            timeout=20,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"unshare failed: {e}"
    if r.returncode != 0 or r.stdout.split() != [str(uid), "0"]:
        why = (r.stderr.strip().splitlines() or [f"exit code {r.returncode}, output {r.stdout.split()}"])[-1]
        return None, f"no private mount namespace here ({why})"
    return wrapper, ""


class ShmGuard(threading.Thread):
    """Without a private /dev/shm: chmod 0600 each region named `<prefix>*` as soon as it appears (Triton's
    Python backend makes them 0644 whatever the umask). Polls every 20 ms until `relax()` (the server is
    ready; later regions are rare), then every 0.5 s. A local user who opens a region between its creation
    and the chmod keeps that access: that race is the residual risk."""

    def __init__(self, prefix: str):
        super().__init__(name="ouro-shm-guard", daemon=True)
        self.prefix = prefix
        self.interval = 0.02
        self._stop_event = threading.Event()

    def relax(self) -> None:
        self.interval = 0.5

    def stop(self) -> None:
        self._stop_event.set()

    def run(self) -> None:
        done: set = set()
        while True:
            self.sweep(done)
            if self._stop_event.wait(self.interval):
                return

    def sweep(self, done: set) -> None:
        try:
            names = [n for n in os.listdir(SHM_DIR) if n.startswith(self.prefix) and n not in done]
        except OSError:
            return
        for name in names:
            try:  # through an fd opened without following links: never chmod what a link points to
                fd = os.open(os.path.join(SHM_DIR, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
                    if st.st_mode & 0o077:
                        os.fchmod(fd, 0o600)
                    done.add(name)
            except OSError:
                pass
            finally:
                os.close(fd)
