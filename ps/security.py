"""CurveZMQ keys of the parameter server: make them, load them. Text files only, no pickle.

A key directory, as make_keys writes it (ZeroMQ's own certificate format):

    DIR/server.key            the server's public key (give it to every worker host)
    DIR/server.key_secret     the server's keypair (keep it on the server hosts only)
    DIR/<name>.key            a client's public key
    DIR/<name>.key_secret     a client's keypair (keep it on that client's hosts only)
    DIR/allowed/<name>.key    public keys of the clients the server lets in

The server authenticates clients against allowed/ (remove a file there and restart the
server to revoke a client); clients authenticate the server by its public key; everything
after the handshake is encrypted. A worker host needs only server.key and its own
<name>.key_secret. CURVE protects tcp:// (and ipc://) connections; inproc:// peers are in
the same process and are not checked.
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import stat
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable

import zmq.auth

log = logging.getLogger("psar.ps.security")

SERVER = "server"
ALLOWED = "allowed"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class ServerKeys:
    """What a server socket needs: its keypair (z85 bytes) and the folder of allowed client keys."""

    public: bytes
    secret: bytes = field(repr=False)
    allowed_dir: str


@dataclass(frozen=True)
class ClientKeys:
    """What a client socket needs: its keypair and the server's public key (z85 bytes)."""

    public: bytes
    secret: bytes = field(repr=False)
    server_public: bytes


def _check_name(name: str) -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name) or name in (SERVER, ALLOWED):
        raise ValueError(f"client key name {name!r}: use 1-64 letters, digits, '_', '.', '-' "
                         f"(not starting with a punctuation mark), other than {SERVER!r} and {ALLOWED!r}")
    return name


def _create(directory: Path, name: str) -> Path:
    """A new keypair name.key / name.key_secret, unless name.key_secret already exists.
    Written in a private (0700) scratch folder, then moved in: the secret is never readable
    by others, whatever the mode of directory."""
    secret = directory / f"{name}.key_secret"
    if not secret.exists():
        scratch = Path(tempfile.mkdtemp(prefix=".keys-", dir=directory))
        try:
            public_file, secret_file = map(Path, zmq.auth.create_certificates(scratch, name))
            Path(secret_file).chmod(0o600)
            os.replace(public_file, directory / public_file.name)
            os.replace(secret_file, secret)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
    return secret


def make_keys(directory: str | os.PathLike, workers: Iterable[str] = ("worker",)) -> dict[str, Path]:
    """Write a server keypair and one keypair per client name, and allow those clients.

    Args:
        directory: created (mode 0700) if missing; secret files are mode 0600. Keys already
            there are kept, never overwritten, so calling it again with more names adds clients.
        workers: client key names (default one shared "worker" key); every one is allowed.
    Returns {"server": server keypair file, "server_public": server public key file,
    "allowed": the allowed folder, name: that client's keypair file for every name}.
    """
    names = [_check_name(n) for n in ([workers] if isinstance(workers, str) else list(workers))]
    if not names:
        raise ValueError("make_keys needs at least one client name")
    root = Path(directory)
    root.mkdir(mode=0o700, parents=True, exist_ok=True)
    allowed = root / ALLOWED
    allowed.mkdir(mode=0o700, exist_ok=True)
    paths = {"server": _create(root, SERVER), "server_public": root / f"{SERVER}.key", "allowed": allowed}
    for name in names:
        paths[name] = _create(root, name)
        shutil.copyfile(root / f"{name}.key", allowed / f"{name}.key")
    return paths


def _load(path: Path, what: str, need_secret: bool) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        raise FileNotFoundError(f"{what}: no key file {path}; write the keys with make_keys "
                                f"(psar keys DIR) and copy the files this host needs")
    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"{what}: {path} is not a ZeroMQ certificate file: {e}") from e
    if need_secret:
        if not secret:
            raise ValueError(f"{what}: {path} holds no secret key; expected the .key_secret file")
        if path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
            log.warning("%s: %s is readable by other users; chmod 600 it", what, path)
    return public, secret


def load_server_keys(directory: str | os.PathLike) -> ServerKeys:
    """The server keypair and allowed folder of a key directory (FileNotFoundError naming the
    missing file). An empty allowed/ lets no client in; that is logged."""
    root = Path(directory)
    public, secret = _load(root / f"{SERVER}.key_secret", "server keys", need_secret=True)
    allowed = root / ALLOWED
    if not allowed.is_dir():
        raise FileNotFoundError(f"server keys: no folder {allowed} of allowed client keys; run make_keys")
    if not any(allowed.glob("*.key")):
        log.warning("server keys: %s holds no client key: every client will be refused", allowed)
    return ServerKeys(public, secret, str(allowed.resolve()))


def load_client_keys(directory: str | os.PathLike, name: str = "worker") -> ClientKeys:
    """Client `name`'s keypair and the server's public key from a key directory."""
    root = Path(directory)
    public, secret = _load(root / f"{_check_name(name)}.key_secret", f"client keys {name!r}", need_secret=True)
    server_public, _ = _load(root / f"{SERVER}.key", "server public key", need_secret=False)
    return ClientKeys(public, secret, server_public)
