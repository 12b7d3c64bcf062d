"""ZMQ endpoints, checked in one place: what ``--publish``, ``--attach``, the library's publishers and subscribers
and the vLLM plugin accept, and where a data-parallel rank publishes.

Why one place: ZMQ itself checks little. Given ``tcp://*:99999`` it binds port 34463 (99999 modulo 65536) and the
log names the port it was given, so a watcher connects to a port nobody serves. Each front door used to check in its
own way (or not at all), and the plugin and the KV-event reader disagreed on the data-parallel rule. Every endpoint
now goes through :func:`check_endpoint` and every rank through :func:`endpoint_for_rank`.

The data-parallel rule (vLLM's and SGLang's for tcp and inproc, extended to ipc): rank r of a server configured
with ``tcp://host:P`` uses ``tcp://host:P+r``; a path (``ipc://``, ``inproc://``) gets ``_dp<r>`` appended. Rank 0
uses the endpoint as given. A tcp port of 0 or ``*`` (bind any free port) stays so for every rank.
"""
from __future__ import annotations

import ipaddress
import re

_TCP = re.compile(r"tcp://(?P<host>\*|[A-Za-z0-9_.\-]+|\[[0-9A-Fa-f:.]+\]):(?P<port>\*|\d{1,5})")
_PATH = re.compile(r"(ipc|inproc)://.+")
ANY_PORT = ("0", "*")  # ports that ask the system for a free one (binding only; the bound one is logged)


class EndpointError(ValueError):
    """An endpoint that cannot be used: malformed, a port out of 1-65535, or a wildcard where one must connect."""


def check_endpoint(endpoint, *, bind: bool, what: str = "endpoint") -> str:
    """``endpoint`` if it is a usable ``tcp://host:port``, ``ipc://path`` or ``inproc://name``; EndpointError naming
    ``what`` otherwise. ``bind``: the host may be ``*`` and the port 0 or ``*`` (any free port); a connection needs
    a host and a port from 1 to 65535."""
    if not isinstance(endpoint, str):
        raise EndpointError(f"{what} needs a ZMQ endpoint such as tcp://127.0.0.1:5560 or ipc:///tmp/pool.sock, "
                            f"got {type(endpoint).__name__}")
    if _PATH.fullmatch(endpoint):
        return endpoint
    match = _TCP.fullmatch(endpoint)
    if match is None:
        raise EndpointError(f"{what} needs a ZMQ endpoint such as tcp://127.0.0.1:5560 or ipc:///tmp/pool.sock, "
                            f"got {endpoint!r}")
    port = match.group("port")
    if port in ANY_PORT:
        if not bind:
            raise EndpointError(f"{what} {endpoint!r} connects to a server: give the port it listens on (1-65535)")
    elif not 1 <= int(port) <= 65535:
        raise EndpointError(f"{what} {endpoint!r}: port {int(port)} is out of range (1-65535)")
    if match.group("host") == "*" and not bind:
        raise EndpointError(f"{what} {endpoint!r} connects to a server: give its host (tcp://127.0.0.1:{port}), "
                            "not '*'")
    return endpoint


def endpoint_for_rank(endpoint: str, rank: int) -> str:
    """The endpoint data-parallel rank ``rank`` uses (see the module's rule); EndpointError when there is none
    (a malformed endpoint, a negative rank, a port past 65535)."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 0:
        raise EndpointError(f"a data-parallel rank is a whole number from 0, not {rank!r}")
    endpoint = check_endpoint(endpoint, bind=True)
    if rank == 0:
        return endpoint
    match = _TCP.fullmatch(endpoint)
    if match is None:  # ipc:// or inproc://
        return f"{endpoint}_dp{rank}"
    port = match.group("port")
    if port in ANY_PORT:
        return endpoint
    if int(port) + rank > 65535:
        raise EndpointError(f"data-parallel rank {rank} of {endpoint!r} would use port {int(port) + rank}, past "
                            "65535: pick a lower base port")
    return f"tcp://{match.group('host')}:{int(port) + rank}"


def is_local(endpoint: str) -> bool:
    """Whether only this machine can reach ``endpoint`` (ipc, inproc, or tcp on a loopback address)."""
    match = _TCP.fullmatch(endpoint)
    if match is None:
        return bool(_PATH.fullmatch(endpoint))
    host = match.group("host").strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # "*", an interface or a host name: reachable from elsewhere, as far as we can tell


CURVE_USAGE = "the only option is curve=DIR (a key directory made by python main.py --make-keys DIR)"


def split_spec(spec: str, options: dict[str, str | None], usage: str, *, what: str = "",
               bare: str | None = None) -> tuple[str, dict[str, str | None]]:
    """``ENDPOINT[,KEY=VALUE]...``, the one spelling of an endpoint with options (``--publish``, ``--attach``,
    ``--kv-events``, ``--attach-kv-events``, the plugin's variable) -> (ENDPOINT, ``options`` updated with the ones
    given). ``bare``: the option that an address right after the endpoint fills (``tcp://h:5557,tcp://h:5558``: its
    replay socket). EndpointError names an option ``options`` does not have, with ``usage`` (and ``what``, the flag
    or variable)."""
    first, *rest = [part.strip() for part in spec.split(",")]
    given = dict(options)
    for i, part in enumerate(rest):
        key, sep, value = part.partition("=")
        if not sep and i == 0 and bare is not None and "://" in part:
            key, sep, value = bare, "=", part
        if not sep or key not in given:
            raise EndpointError(_unknown_option(part, spec, usage, what))
        given[key] = value
    return first, given


def _unknown_option(part: str, spec: str, usage: str, what: str) -> str:
    return f"unknown option {part!r} in {what + ' ' if what else ''}{spec!r}: {usage}"


def stream_spec(spec, *, bind: bool, what: str = "endpoint") -> tuple[str, str | None]:
    """``ENDPOINT[,curve=DIR]`` (how ``--publish``, ``--attach`` and the plugin's variable spell a stream) ->
    (the endpoint, checked; the CURVE key directory or None). EndpointError for anything else."""
    if not isinstance(spec, str):
        return check_endpoint(spec, bind=bind, what=what), None
    endpoint, options = split_spec(spec, {"curve": None}, CURVE_USAGE, what=what)
    if options["curve"] == "":
        raise EndpointError(_unknown_option("curve=", spec, CURVE_USAGE, what))
    return check_endpoint(endpoint, bind=bind, what=what), options["curve"]
