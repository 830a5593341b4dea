"""Where an engine process listens, and who may talk to it.

What crosses the engine's socket is pickled, so a peer that gets in could run code as the server's user.
Two guards:
* the socket lives in `<tmp>/ouro-triton-<uid>/`, which must be a directory of this user that no one else
  can enter (`private_dir` refuses anything else);
* every connection must prove it holds the engine's secret key (multiprocessing's HMAC challenge, both
  ways: `connect` on the client's side, `authenticate` on the engine's) before a single message is
  unpickled. The owner draws the key (`write_key`), hands it to the engine over the owner channel and
  leaves it, readable by this user only, in `<address>.key`, where the other models of the same server
  read it (`read_key`).
"""

from __future__ import annotations

import os
import secrets
import socket
import stat
import tempfile
import threading
from multiprocessing.connection import Client, Connection, Listener, answer_challenge, deliver_challenge

from .engine_errors import EngineProcessError

HANDSHAKE_TIMEOUT_S = 5.0  # a peer that connects and does not answer the challenge is cut off after this


def private_dir() -> str:
    """`<tmp>/ouro-triton-<uid>`, created 0700 if missing. Refused unless it is a real directory owned by
    this user that no one else can enter: another user who made it first (or can write to it) could put
    their own socket in the engine's place or connect to it."""
    uid = os.getuid()
    directory = os.path.join(tempfile.gettempdir(), f"ouro-triton-{uid}")
    try:
        os.mkdir(directory, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(directory)
    if not stat.S_ISDIR(st.st_mode):
        raise EngineProcessError(
            f"{directory} is not a directory (a link or a file is in its place); "
            f"remove it, or set TMPDIR to another directory"
        )
    if st.st_uid != uid:
        raise EngineProcessError(
            f"{directory} belongs to uid {st.st_uid}, not to this user (uid {uid}): another "
            f"user could control the engine's socket; remove it, or set TMPDIR"
        )
    if st.st_mode & 0o077:
        raise EngineProcessError(
            f"{directory} is accessible by other users (mode {stat.S_IMODE(st.st_mode):o}); "
            f"run 'chmod 700 {directory}' or remove it"
        )
    return directory


def engine_address(engine_model: str, server_pid: int) -> str:
    """The socket of the engine owned by model `engine_model` in the tritonserver with pid `server_pid`:
    deterministic, so another model of the same server finds it; in `private_dir()`."""
    return os.path.join(private_dir(), f"engine-{server_pid}-{engine_model}.sock")


def key_path(address: str) -> str:
    return address + ".key"


def write_key(address: str) -> bytes:
    """A fresh secret for the engine at `address`, left in `<address>.key` (0600, this user's)."""
    key = secrets.token_bytes(32)
    path = key_path(address)
    remove_file(path)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(key)
    return key


def read_key(address: str) -> bytes:
    """The secret of the engine at `address`; OSError while there is none (the owner may be starting it)."""
    fd = os.open(key_path(address), os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise EngineProcessError(f"{key_path(address)} is not private to this user; refusing to use it")
        return f.read()


def remove_file(path: str) -> None:
    """Unlink `path` (a socket, a key) if anything is there; never follows a link."""
    if os.path.lexists(path):
        os.unlink(path)


def listen(address: str) -> Listener:
    """The engine's socket at `address`, replacing a stale one (a previous engine of the same server pid and
    model name). It takes no key: each connection is authenticated on its own thread (`authenticate`), so
    a silent peer holds up no one."""
    remove_file(address)
    return Listener(address, family="AF_UNIX", backlog=64)


def authenticate(conn: Connection, authkey: bytes) -> None:
    """The engine's side of the handshake on a new connection: challenge the peer, then answer its
    challenge. Raises AuthenticationError, EOFError or OSError if the peer fails, or stays silent for
    HANDSHAKE_TIMEOUT_S (the connection is shut down then). Nothing the peer sent is unpickled here."""
    timer = threading.Timer(HANDSHAKE_TIMEOUT_S, shutdown, args=(conn,))
    timer.start()
    try:
        deliver_challenge(conn, authkey)
        answer_challenge(conn, authkey)
    finally:
        timer.cancel()


def connect(address: str, authkey: bytes | None = None) -> Connection:
    """A connection to the engine at `address` that passed the handshake with `authkey`, else with the key
    in `<address>.key`. Raises OSError (nothing there yet), AuthenticationError or EngineProcessError."""
    return Client(address, family="AF_UNIX", authkey=authkey if authkey is not None else read_key(address))


def shutdown(conn: Connection) -> None:
    """Wake a thread blocked reading `conn` (closing the fd alone would not)."""
    try:
        sock = socket.socket(fileno=conn.fileno())
        sock.shutdown(socket.SHUT_RDWR)
        sock.detach()
    except (OSError, ValueError):
        pass
