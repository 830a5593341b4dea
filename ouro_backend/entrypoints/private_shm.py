"""Keeping the Python backend's shared-memory regions from the other users of this host.

Triton makes each region between the server and a stub mode 0644 in /dev/shm whatever the umask, so any
local user could read a stub's tensors. Two ways to stop that, for TritonServer's `private_shm`:
* a private /dev/shm: tritonserver runs in a mount namespace of its own with a fresh tmpfs there
  (`private_shm_wrapper`: as root, or in an unprivileged user namespace), so no other user sees the
  regions. Clients' system shared-memory regions in the host's /dev/shm are out of its sight too;
* chmod: the regions are chmod 0600 as soon as they appear (`ShmGuard`: inotify, and a polled sweep), which a
  local user can race.
`on` insists on the first, `off` takes the second, `auto` the first where it works, else the second.
"""

from __future__ import annotations

import ctypes
import functools
import os
import select
import shutil
import stat
import struct
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
    """Without a private /dev/shm: keep each region named `<prefix>*` in `directory` mode 0600 (Triton's
    Python backend makes them 0644 whatever the umask). Where the kernel offers inotify, a region is secured
    as soon as its creation or a change of its mode is reported; a sweep of every region also runs every 20
    ms until `relax()` (the server is ready; later regions are rare), then every 0.5 s, for what inotify
    cannot report (none, or a full event queue). A local user who opens a region between its creation and
    the chmod keeps that access: that race is the residual risk.

    NOTE a region is never taken as done: the backend (Boost.Interprocess) creates it with mode 0644, which
    tritonserver's umask 077 makes 0600, and only then `fchmod`s it to 0644, so a region seen private may
    turn readable a moment later. Every sweep looks at every region's mode again, and inotify reports that
    `fchmod`."""

    def __init__(self, prefix: str, directory: str = SHM_DIR):
        super().__init__(name="ouro-shm-guard", daemon=True)
        self.prefix = prefix
        self.directory = directory
        self.interval = 0.02
        self._stop_event = threading.Event()
        # stop() wakes a thread waiting on inotify through this pipe; run() closes it when it ends
        self._wake_r, self._wake_w = os.pipe()
        self._wake_lock = threading.Lock()
        self._wake_open = True

    def relax(self) -> None:
        self.interval = 0.5

    def stop(self) -> None:
        with self._wake_lock:
            self._stop_event.set()
            if self._wake_open:
                os.write(self._wake_w, b"x")

    def run(self) -> None:
        notify = _Inotify.open(self.directory)
        try:
            while not self._stop_event.is_set():
                self.sweep()
                if notify is None:
                    self._stop_event.wait(self.interval)
                    continue
                for name in notify.names(self.interval, self._wake_r):
                    if name.startswith(self.prefix):
                        self.secure(name)
        finally:
            if notify is not None:
                notify.close()
            with self._wake_lock:
                self._wake_open = False
                os.close(self._wake_r)
                os.close(self._wake_w)

    def sweep(self) -> None:
        """Secure every region of the prefix that others may read now."""
        try:
            entries = [e for e in os.scandir(self.directory) if e.name.startswith(self.prefix)]
        except OSError:
            return
        for entry in entries:
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_mode & 0o077:
                self.secure(entry.name)

    def secure(self, name: str) -> None:
        """chmod 0600 the region `name` if it is this user's regular file that others may read; through an
        fd opened without following links, so never what a link points to."""
        try:
            fd = os.open(os.path.join(self.directory, name), os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            return
        try:
            st = os.fstat(fd)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid() and st.st_mode & 0o077:
                os.fchmod(fd, 0o600)
        except OSError:
            pass
        finally:
            os.close(fd)


class _Inotify:
    """The names of the entries created, moved in or changed in mode in one directory (Linux inotify through
    libc; `open` returns None where it is not available)."""

    _EVENTS = 0x00000004 | 0x00000080 | 0x00000100  # IN_ATTRIB | IN_MOVED_TO | IN_CREATE
    _HEADER = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len (then len bytes of name)

    def __init__(self, fd: int):
        self.fd = fd

    @classmethod
    def open(cls, directory: str) -> _Inotify | None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        except (OSError, AttributeError):
            return None
        if fd < 0:
            return None
        if libc.inotify_add_watch(fd, os.fsencode(directory), cls._EVENTS) < 0:
            os.close(fd)
            return None
        return cls(fd)

    def names(self, timeout_s: float, wake_fd: int) -> list[str]:
        """The names reported within `timeout_s` (empty when none, or when `wake_fd` turns readable)."""
        ready, _, _ = select.select([self.fd, wake_fd], [], [], timeout_s)
        if self.fd not in ready:
            return []
        try:
            data = os.read(self.fd, 64 * 1024)
        except BlockingIOError:
            return []
        names, i = [], 0
        while i + self._HEADER.size <= len(data):
            _, _, _, length = self._HEADER.unpack_from(data, i)
            i += self._HEADER.size
            names.append(os.fsdecode(data[i : i + length].rstrip(b"\0")))
            i += length
        return [n for n in names if n]

    def close(self) -> None:
        os.close(self.fd)
