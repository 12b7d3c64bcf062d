"""Who may watch: ZMQ CURVE for the pool stream (``--publish``, the vLLM plugin, ``--attach``).

Why: the pool stream carries every conversation's token ids, that is the users' prompts, and a publisher bound to
``tcp://*:PORT`` hands them to anyone who can reach the port. With CURVE (pyzmq's ``zmq.auth``) only a watcher
holding an authorized client key is let in, and the traffic is encrypted.

One key directory serves both ends (``python main.py --make-keys DIR`` makes it)::

    DIR/server.key          the publisher's public key (the watcher needs it to know it talks to the right server)
    DIR/server.key_secret   the publisher's secret key (only the publishing machine)
    DIR/client.key          a watcher's public key, also kept in DIR/authorized/ (what the publisher lets in)
    DIR/client.key_secret   that watcher's secret key (only the watching machine)

A publisher reads ``server.key_secret`` and authorizes every public key in ``DIR/authorized/``; a watcher reads
``client.key_secret`` and ``server.key``. More watchers: make more client pairs (``zmq.auth.create_certificates``)
and drop their public keys into ``authorized/``.

The engine's own KV events (``--kv-events ENDPOINT,curve=DIR``, ``--attach-kv-events ENDPOINT,curve=DIR``) use the
same keys: their ``BlockStored`` events carry the tokens too. vLLM's KV events have no such option: vLLM publishes
them in the clear, and its consumers (vLLM's own, Dynamo's router, llm-d's indexer) cannot speak CURVE, so a stream
published with keys is for this app's watchers only.
"""
from __future__ import annotations

import logging
import os
import shutil

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from .endpoints import EndpointError, is_local

logger = logging.getLogger("kvstream.curve")
_warned: set[tuple[str, str]] = set()  # (what, endpoint) already warned about: once per endpoint and process


class CurveError(EndpointError):
    """A key directory that cannot be used (missing, incomplete, unreadable), or a pyzmq without CURVE."""


def make_keys(directory: str | os.PathLike) -> dict[str, str]:
    """Make a server key pair and a client key pair in ``directory`` (created; existing keys are never replaced),
    with the client's public key authorized. Returns the paths by role."""
    if not zmq.has("curve"):
        raise CurveError("this pyzmq was built without CURVE (libsodium): keys would be of no use")
    directory = os.fspath(directory)
    for name in ("server.key", "server.key_secret", "client.key", "client.key_secret"):
        if os.path.exists(os.path.join(directory, name)):
            raise CurveError(f"{directory} already holds keys ({name}); pick an empty or new directory")
    os.makedirs(directory, mode=0o700, exist_ok=True)
    authorized = os.path.join(directory, "authorized")
    os.makedirs(authorized, mode=0o700, exist_ok=True)
    zmq.auth.create_certificates(directory, "server")
    client_public, _ = zmq.auth.create_certificates(directory, "client")
    shutil.copy(client_public, os.path.join(authorized, "client.key"))
    for name in ("server.key_secret", "client.key_secret"):
        os.chmod(os.path.join(directory, name), 0o600)
    return {"directory": directory, "server_public": os.path.join(directory, "server.key"),
            "server_secret": os.path.join(directory, "server.key_secret"),
            "client_public": os.path.join(directory, "client.key"),
            "client_secret": os.path.join(directory, "client.key_secret"), "authorized": authorized}


def _load(directory: str, name: str, secret: bool) -> tuple[bytes, bytes | None]:
    path = os.path.join(directory, name)
    if not os.path.isfile(path):
        raise CurveError(f"the key directory {directory} has no {name} (make one with: python main.py --make-keys "
                         "DIR)")
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise CurveError(f"cannot read the key {path}: {exc}") from None
    if secret and secret_key is None:
        raise CurveError(f"{path} holds no secret key")
    return public, secret_key


def check_directory(directory: str, *, server: bool) -> str:
    """``directory`` if it holds what a publisher (``server``) or a watcher needs; CurveError otherwise."""
    if not zmq.has("curve"):
        raise CurveError("this pyzmq was built without CURVE (libsodium): curve= cannot be used")
    if not os.path.isdir(directory):
        raise CurveError(f"the key directory {directory} does not exist (make one with: python main.py --make-keys "
                         "DIR)")
    if server:
        _load(directory, "server.key_secret", True)
        authorized = os.path.join(directory, "authorized")
        if not os.path.isdir(authorized) or not any(n.endswith(".key") for n in os.listdir(authorized)):
            raise CurveError(f"{authorized} holds no authorized public key: nobody could watch")
    else:
        _load(directory, "client.key_secret", True)
        _load(directory, "server.key", False)
    return directory


class CurveServer:
    """Makes a socket a CURVE server that lets in only the keys in ``DIR/authorized``. It needs a context of its
    own (ZMQ runs one authenticator per context), which it owns and closes."""

    def __init__(self, directory: str, context: zmq.Context | None = None):
        """``context``: a fresh context to own instead of a default one (a caller that sets its options first)."""
        check_directory(directory, server=True)
        self.directory = directory
        self.context = context if context is not None else zmq.Context()
        self._auth = ThreadAuthenticator(self.context, log=logging.getLogger("kvstream.curve.auth"))
        self._auth.start()
        self._auth.configure_curve(domain="*", location=os.path.join(directory, "authorized"))

    def apply(self, socket: zmq.Socket) -> None:
        public, secret = _load(self.directory, "server.key_secret", True)
        socket.curve_secretkey = secret
        socket.curve_publickey = public
        socket.curve_server = True

    def close(self) -> None:
        try:
            self._auth.stop()
        finally:
            self.context.term()


def apply_client(socket: zmq.Socket, directory: str) -> None:
    """Make ``socket`` a CURVE client with the watcher's key pair and the server's public key of ``directory``."""
    check_directory(directory, server=False)
    public, secret = _load(directory, "client.key_secret", True)
    server_public, _ = _load(directory, "server.key", False)
    socket.curve_secretkey = secret
    socket.curve_publickey = public
    socket.curve_serverkey = server_public


def warn_if_open(endpoint: str, bound: str, curve: str | None, log: logging.Logger | None = None,
                 what: str = "the pool stream", note: str = "") -> bool:
    """Say once that anyone who can reach ``bound`` can read the prompts, when ``what`` is bound beyond this machine
    without CURVE. True when it warned."""
    if curve or is_local(endpoint) or (what, endpoint) in _warned:
        return False
    _warned.add((what, endpoint))
    (log or logger).warning(
        "publishing %s on %s without CURVE: anyone who can reach this port can read every conversation's tokens "
        "(the prompts). Restrict it with curve=DIR (python main.py --make-keys DIR) or bind 127.0.0.1.%s", what,
        bound, note)
    return True
