"""Where a KV-event stream comes from, and how ``--attach-kv-events`` spells it.

One spec names one instance, or the data-parallel ranks of one server (vLLM and SGLang publish rank r on the base
port + r, replay socket too)::

    tcp://host:5557                               live stream only
    tcp://host:5557,tcp://host:5558               with its replay socket
    tcp://host:5557,replay=tcp://host:5558,topic=kv,dp=4,name=node-a
    tcp://host:5557,curve=DIR                     this app's engine publishing with CURVE keys (--make-keys DIR)

A wildcard host (``tcp://*:5557``, as written in a server's own config) is read as this machine (127.0.0.1).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from kvstream.endpoints import EndpointError, check_endpoint, split_spec
from kvstream.endpoints import endpoint_for_rank as _endpoint_for_rank
from kvstream.kv_events.codec import KVEventError


@dataclass(frozen=True)
class KVEventEndpoint:
    """One publisher to follow: its PUB address, its replay ROUTER if any, the topic, and a label."""

    endpoint: str  # ZMQ address of the PUB socket, to connect to
    replay_endpoint: str | None = None  # ZMQ address of its replay ROUTER socket; None: no catch-up, gaps are lost
    topic: str = ""  # topic prefix to subscribe to ("" = everything, vLLM's default)
    name: str = ""  # label in the window; the endpoint when empty
    curve: str | None = None  # CURVE key directory (kvstream.curve) of a publisher that asks for keys; None: clear

    @property
    def label(self) -> str:
        """What the window calls this instance."""
        return self.name or self.endpoint


def endpoint_for_rank(endpoint: str, rank: int) -> str:
    """The address data-parallel rank ``rank`` publishes on: the project's one rule (:mod:`kvstream.endpoints`: tcp
    port + rank, as vLLM and SGLang do; ipc/inproc + ``_dp<rank>``), so the plugin and the KV-event reader agree."""
    if rank == 0:
        return endpoint  # as given: a watcher reports an address it cannot use per endpoint, and goes on
    try:
        return _endpoint_for_rank(endpoint, rank)
    except EndpointError as exc:
        raise KVEventError(str(exc)) from None


def _connectable(address: str, what: str) -> str:
    """``address`` with a wildcard host read as this machine. Only its form is checked here: a library watcher
    reports an address it cannot use per endpoint and goes on (see :func:`usable`); the command line refuses one."""
    if not isinstance(address, str) or not re.fullmatch(r"(tcp|ipc|inproc)://.+", address):
        raise KVEventError(f"{what} must be a ZMQ address such as tcp://host:5557 or ipc:///path, not {address!r}")
    return re.sub(r"^tcp://(\*|0\.0\.0\.0):", "tcp://127.0.0.1:", address)


def usable(endpoint: KVEventEndpoint) -> None:
    """EndpointError unless both addresses can be connected to by the project's one rule
    (:func:`kvstream.endpoints.check_endpoint`): a port from 1 to 65535, never wrapped (ZMQ would connect to 34463
    for 99999) and never 0 (nothing listens there)."""
    check_endpoint(endpoint.endpoint, bind=False, what="the KV-event endpoint")
    if endpoint.replay_endpoint is not None:
        check_endpoint(endpoint.replay_endpoint, bind=False, what="the replay endpoint")


def checked_endpoint(endpoint: KVEventEndpoint) -> KVEventEndpoint:
    """``endpoint`` with its addresses checked and wildcard hosts read as this machine."""
    if not isinstance(endpoint.topic, str) or not isinstance(endpoint.name, str):
        raise KVEventError(f"topic and name must be strings in {endpoint!r}")
    replay = endpoint.replay_endpoint
    return KVEventEndpoint(endpoint=_connectable(endpoint.endpoint, "the KV-event endpoint"),
                           replay_endpoint=_connectable(replay, "the replay endpoint") if replay is not None else None,
                           topic=endpoint.topic, name=endpoint.name, curve=endpoint.curve)


def parse_endpoint_spec(spec: str) -> tuple[KVEventEndpoint, ...]:
    """The endpoints one ``--attach-kv-events`` value names (several for ``dp=N``); a bad spec raises KVEventError."""
    if not isinstance(spec, str) or not spec.strip():
        raise KVEventError("a KV-event endpoint spec must be a non-empty string such as tcp://host:5557")
    try:
        first, options = split_spec(spec, {"replay": None, "topic": "", "dp": "1", "name": "", "curve": None},
                                    "use replay=ADDR, topic=T, dp=N, name=X or curve=DIR", bare="replay")
    except EndpointError as exc:
        raise KVEventError(str(exc)) from None
    endpoint = _connectable(first, "the KV-event endpoint")
    replay = _connectable(options["replay"], "the replay endpoint") if options["replay"] else None
    if not options["dp"].isdigit() or not 1 <= int(options["dp"]) <= 1024:
        raise KVEventError(f"dp must be a number of ranks from 1 to 1024, not {options['dp']!r}")
    ranks = int(options["dp"])
    base = options["name"]
    out = []
    for rank in range(ranks):
        name = base if ranks == 1 else f"{base or endpoint} dp{rank}"
        out.append(KVEventEndpoint(endpoint=endpoint_for_rank(endpoint, rank),
                                   replay_endpoint=endpoint_for_rank(replay, rank) if replay else None,
                                   topic=options["topic"], name=name, curve=options["curve"] or None))
    return tuple(out)
