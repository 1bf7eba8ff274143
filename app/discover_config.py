"""``[[discover]]``: a DNS name whose records are replicas (docs/design.md §16).

One table each: ``name`` (A/AAAA records, with ``port``; or SRV records with ``srv =
true``, whose records carry the port), ``kind`` (``worker`` or ``openai``), ``models``
(each ``NAME`` or ``NAME=REVISION``; none: every configured model), ``every_s`` (how
often the name is resolved again), ``nameserver`` (``host:port``: a resolver other than
the system's) and ``drain_s`` (how long a replica whose address disappeared may finish
its attempts). Checked here, as a whole; app/replicas/discovery.py resolves them.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any

KINDS = ("worker", "openai")
DEFAULT_EVERY_S = 5.0
DEFAULT_DRAIN_S = 30.0
DNS_PORT = 53
# a DNS name as Kubernetes and dnsmasq write them; "_" for SRV's _service._proto labels
_NAME = re.compile(
    r"(?=.{1,253}\.?$)([A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9])?\.)*[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9])?\.?"
)
_KEYS = ("name", "port", "srv", "kind", "models", "every_s", "nameserver", "drain_s")


class DiscoverError(ValueError):
    """A ``[[discover]]`` table that cannot be used; the message names it and the setting."""


@dataclass(frozen=True, slots=True)
class DiscoverConfig:
    name: str
    port: int | None = None  # A/AAAA: the replicas' port; SRV: None (each record has its own)
    srv: bool = False
    kind: str = "worker"
    models: tuple[tuple[str, str | None], ...] = ()  # (name, revision or None); empty: every configured model
    every_s: float = DEFAULT_EVERY_S
    nameserver: tuple[str, int] | None = None  # (address, port); None: the system's resolver
    drain_s: float = DEFAULT_DRAIN_S

    @property
    def model_names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.models)


def parse_discover(tables: Any) -> tuple[DiscoverConfig, ...]:
    """``[[discover]]``'s tables, each checked; raises :class:`DiscoverError` naming the first fault."""
    if isinstance(tables, dict) or not isinstance(tables, (list, tuple)):
        raise DiscoverError("discover: one [[discover]] table per name")
    found: list[DiscoverConfig] = []
    for number, table in enumerate(tables, start=1):
        entry = table if isinstance(table, DiscoverConfig) else _entry(number, table)
        if any(other.name == entry.name for other in found):
            raise DiscoverError(f"discover: {entry.name!r} is named twice")
        found.append(entry)
    return tuple(found)


def _entry(number: int, table: Any) -> DiscoverConfig:
    if not isinstance(table, dict):
        raise DiscoverError(f"discover #{number}: a table of settings")
    where = f"discover #{number}" + (f" ({table['name']})" if isinstance(table.get("name"), str) else "")
    unknown = sorted(set(table) - set(_KEYS))
    if unknown:
        raise DiscoverError(f"{where}: unknown settings: {', '.join(unknown)}")
    name = table.get("name")
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise DiscoverError(f"{where}: name must be a DNS name, e.g. vllm.default.svc.cluster.local")
    srv = table.get("srv", False)
    if not isinstance(srv, bool):
        raise DiscoverError(f"{where}: srv must be true or false")
    port = table.get("port")
    if srv and port is not None:
        raise DiscoverError(f"{where}: port is not set with srv = true: each SRV record names its port")
    if not srv and (port is None or not _is_port(port)):
        raise DiscoverError(f"{where}: port must be a port number (1-65535): the replicas' port for A/AAAA records")
    kind = table.get("kind", "worker")
    if kind not in KINDS:
        raise DiscoverError(f"{where}: kind must be one of {', '.join(KINDS)}")
    every_s = _seconds(where, "every_s", table.get("every_s", DEFAULT_EVERY_S), least=0.1)
    drain_s = _seconds(where, "drain_s", table.get("drain_s", DEFAULT_DRAIN_S), least=0.0)
    return DiscoverConfig(
        name=name.rstrip(".").lower(),
        port=port,
        srv=srv,
        kind=kind,
        models=_models(where, table.get("models", [])),
        every_s=every_s,
        nameserver=_nameserver(where, table.get("nameserver")),
        drain_s=drain_s,
    )


def _is_port(value: Any) -> bool:
    return type(value) is int and 1 <= value <= 65535


def _seconds(where: str, key: str, value: Any, *, least: float) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= least or value > 86400:
        raise DiscoverError(f"{where}: {key} must be a number of seconds, at least {least:g}")
    return float(value)


def _models(where: str, values: Any) -> tuple[tuple[str, str | None], ...]:
    if isinstance(values, str) or not isinstance(values, list) or not all(isinstance(v, str) for v in values):
        raise DiscoverError(f'{where}: models must be a list of "NAME" or "NAME=REVISION"')
    models = []
    for value in values:
        model, has_revision, revision = value.partition("=")
        if not model or (has_revision and not revision):
            raise DiscoverError(f'{where}: models: {value!r} is not "NAME" or "NAME=REVISION"')
        models.append((model, revision or None))
    names = [model for model, _ in models]
    if len(set(names)) != len(names):
        raise DiscoverError(f"{where}: models: a model is named twice")
    return tuple(models)


def _nameserver(where: str, value: Any) -> tuple[str, int] | None:
    """``"10.96.0.10:53"``, ``"[fd00::10]:53"``, or an address alone (port 53)."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise DiscoverError(f'{where}: nameserver must be "ADDRESS:PORT", e.g. "10.96.0.10:53"')
    bracketed = re.fullmatch(r"\[([^\]]+)\](?::(\d+))?", value)
    if bracketed:
        host, port_text = bracketed.group(1), bracketed.group(2)
    elif value.count(":") == 1:
        host, port_text = value.split(":")
    else:
        host, port_text = value, None
    try:
        address = str(ipaddress.ip_address(host))
    except ValueError:
        raise DiscoverError(f"{where}: nameserver {value!r}: an IP address (and port), not a host name") from None
    port = int(port_text) if port_text and port_text.isdigit() else (DNS_PORT if port_text is None else 0)
    if not _is_port(port):
        raise DiscoverError(f"{where}: nameserver {value!r}: the port must be 1-65535")
    return address, port
