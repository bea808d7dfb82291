"""Authentication and encryption of every ZeroMQ socket of a run (ZeroMQ CURVE + a ZAP allow-list).

Threat model (docs/security.md): other users' processes on a shared cluster can reach our TCP ports. They
must not be able to pull weights, register as a rollout instance, inject tokens, or steer the trainer.
Every run gets fresh key pairs: one for its servers (manager, weight server) and one for its clients (rollout
jobs, the trainer's own client sockets). Servers accept only connections that prove the run's client key
(CURVE handshake + ZAP callback), and all traffic is encrypted. Keys live in ``RUN_DIR/keys/keys.json``
(directory 0700, file 0600, owner only) — they never appear on a command line, in the environment or in logs;
rollout jobs read them from the shared run directory.

Invariant: ``secure_server`` must be applied before ``bind`` and ``secure_client`` before ``connect``; a
server socket is only secured on a context that has an authenticator (:func:`authenticator`), so an
unauthenticated or wrong-key client never completes the handshake.
"""
from __future__ import annotations

import json
import logging
import os
import stat
import threading
from dataclasses import dataclass
from pathlib import Path

import zmq

log = logging.getLogger("rlboost.auth")


class AuthError(RuntimeError):
    """Keys are missing, malformed or readable by others; the message names the file and the fix."""


@dataclass(frozen=True)
class RunKeys:
    """Z85-encoded CURVE key pairs (bytes of 40 characters each)."""

    server_public: bytes
    server_secret: bytes
    client_public: bytes
    client_secret: bytes

    @classmethod
    def generate(cls) -> "RunKeys":
        sp, ss = zmq.curve_keypair()
        cp, cs = zmq.curve_keypair()
        return cls(sp, ss, cp, cs)

    def save(self, run_dir: str | os.PathLike[str]) -> Path:
        """Write ``RUN_DIR/keys/keys.json`` with owner-only permissions; returns its path."""
        d = Path(run_dir) / "keys"
        d.mkdir(parents=True, exist_ok=True)
        os.chmod(d, 0o700)
        path = d / "keys.json"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump({k: getattr(self, k).decode() for k in ("server_public", "server_secret",
                                                               "client_public", "client_secret")}, f)
        os.chmod(path, 0o600)
        return path

    @classmethod
    def load(cls, run_dir: str | os.PathLike[str]) -> "RunKeys":
        """Read the run's keys. Raises AuthError (missing, group/other-readable, malformed)."""
        path = Path(run_dir) / "keys" / "keys.json"
        if not path.exists():
            raise AuthError(f"{path} not found: the trainer writes it at start; is {run_dir} the run directory?")
        mode = stat.S_IMODE(path.stat().st_mode)
        if mode & 0o077:
            raise AuthError(f"{path} has mode {mode:o}; keys must be readable by their owner only (chmod 600)")
        try:
            d = json.loads(path.read_text())
            keys = cls(*(d[k].encode() for k in ("server_public", "server_secret", "client_public", "client_secret")))
        except (ValueError, KeyError, AttributeError) as e:
            raise AuthError(f"{path} is malformed: {e}") from None
        if any(len(k) != 40 for k in (keys.server_public, keys.server_secret, keys.client_public, keys.client_secret)):
            raise AuthError(f"{path}: every key must be 40 Z85 characters")
        return keys

    def client_view(self) -> "RunKeys":
        """What a client needs (no server secret)."""
        return RunKeys(self.server_public, b"", self.client_public, self.client_secret)


ZAP_DOMAIN = b"rlboost"
_auth_lock = threading.Lock()
_authenticators: dict[int, object] = {}


def authenticator(ctx: zmq.Context, keys: RunKeys) -> None:
    """Start (once per context) a ZAP handler that admits only CURVE clients presenting ``keys.client_public``.
    Rejections are logged, one line per offending key."""
    from zmq.auth.thread import ThreadAuthenticator

    with _auth_lock:
        if id(ctx) in _authenticators:
            return
        auth = ThreadAuthenticator(ctx, log=logging.getLogger("rlboost.auth.zap"))
        auth.start()
        allowed = keys.client_public  # ZAP hands the callback the client's key Z85-encoded
        seen: set[bytes] = set()

        class _Provider:
            def callback(self, domain: str, key: bytes) -> bool:
                ok = key == allowed
                if not ok and key not in seen:
                    seen.add(key)
                    log.warning("rejected a CURVE client with an unknown key (not this run's client key)")
                return ok

        auth.configure_curve_callback(domain=ZAP_DOMAIN.decode(), credentials_provider=_Provider())
        _authenticators[id(ctx)] = auth


def stop_authenticator(ctx: zmq.Context) -> None:
    """Stop the ZAP handler of ``ctx`` (before ``ctx.term()``); no-op if none was started."""
    with _auth_lock:
        auth = _authenticators.pop(id(ctx), None)
    if auth is not None:
        auth.stop()


def secure_server(sock: zmq.Socket, keys: RunKeys | None) -> None:
    """Make ``sock`` a CURVE server with the run's server key (call before bind; no-op for ``None``)."""
    if keys is None:
        return
    authenticator(sock.context, keys)
    sock.curve_secretkey = keys.server_secret
    sock.curve_publickey = keys.server_public
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN


# A CURVE MESSAGE command wraps each frame: command name (8) + nonce (8) + flags (1) + Poly1305 MAC (16) bytes.
# libzmq applies MAXMSGSIZE to that wire size, so a limit equal to the payload size rejects full-size payloads
# (and drops the connection) only when CURVE is on. Use :func:`max_msg_size` for every limit.
CURVE_OVERHEAD_BYTES = 64


def max_msg_size(payload_limit: int, keys: "RunKeys | None") -> int:
    """The ``zmq.MAXMSGSIZE`` that admits payloads up to ``payload_limit`` bytes (plus CURVE's framing)."""
    return payload_limit + (CURVE_OVERHEAD_BYTES if keys is not None else 0)


def secure_client(sock: zmq.Socket, keys: RunKeys | None) -> None:
    """Make ``sock`` a CURVE client of the run's servers (call before connect; no-op for ``None``)."""
    if keys is None:
        return
    sock.curve_serverkey = keys.server_public
    sock.curve_publickey = keys.client_public
    sock.curve_secretkey = keys.client_secret
