"""DNS discovery: a ``[[discover]]`` name resolved every ``every_s`` into the set of
(address, port) it declares (docs/design.md §16).

How this works: A and AAAA records give addresses, each with the configured port (a
Kubernetes headless Service: one record per ready pod); SRV records (``srv = true``)
give targets and ports, each target resolved to its addresses in turn (priority and
weight are not used: every record is a replica). The resolution uses dnspython, against
the system's resolver or the configured ``nameserver`` (address and port), which the
standard library cannot target, nor can it read SRV records.

An answer is the set: a name that does not exist, or has no such records, declares no
replica (a Deployment scaled to zero). Anything else that goes wrong (no answer in time,
a refused query, a server that fails, a server that is down) is a failure: the last
known set stays, the failure is logged and counted (``on_failure``), and the name is
asked again at the next turn. A blip never empties the fleet. Each set that differs from
the last is handed to ``on_set``.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections.abc import Callable

import dns.asyncresolver
import dns.exception
import dns.resolver

from app.discover_config import DiscoverConfig
from app.tasks import ended

log = logging.getLogger("phasegate.discovery")

Address = tuple[str, int]  # (IP address, port)


class ResolutionFailed(Exception):
    """The name could not be resolved now (not: it has no records); the message says why."""


def resolver_for(entry: DiscoverConfig) -> dns.asyncresolver.Resolver:
    """A resolver for ``entry``: its nameserver's, else the system's (/etc/resolv.conf)."""
    if entry.nameserver is None:
        resolver = dns.asyncresolver.Resolver()
    else:
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = [entry.nameserver[0]]
        resolver.port = entry.nameserver[1]
    # one resolution takes at most a turn: a slow server never stacks resolutions up
    resolver.lifetime = min(entry.every_s, 5.0)
    resolver.timeout = min(entry.every_s, 2.0)
    resolver.cache = None  # the server's TTLs are its own business; every turn asks it
    return resolver


async def resolve(entry: DiscoverConfig, resolver: dns.asyncresolver.Resolver) -> frozenset[Address]:
    """The (address, port) set ``entry``'s name declares now; raises :class:`ResolutionFailed`."""
    if not entry.srv:
        assert entry.port is not None, "checked by app/discover_config.py"
        port = entry.port
        return frozenset((address, port) for address in await _addresses(resolver, entry.name))
    found: set[Address] = set()
    for target, port in await _srv(resolver, entry.name):
        found.update((address, port) for address in await _addresses(resolver, target))
    return frozenset(found)


async def _addresses(resolver: dns.asyncresolver.Resolver, name: str) -> set[str]:
    """A's and AAAA's addresses of ``name`` (a literal address is itself)."""
    try:
        return {str(ipaddress.ip_address(name))}
    except ValueError:
        pass
    found: set[str] = set()
    for record_type in ("A", "AAAA"):
        answer = await _query(resolver, name, record_type)
        found.update(str(ipaddress.ip_address(record.to_text())) for record in answer)
    return found


async def _srv(resolver: dns.asyncresolver.Resolver, name: str) -> list[tuple[str, int]]:
    answer = await _query(resolver, name, "SRV")
    return [(str(record.target.to_text(omit_final_dot=True)), int(record.port)) for record in answer]  # type: ignore[attr-defined]


async def _query(resolver: dns.asyncresolver.Resolver, name: str, record_type: str) -> list[dns.rdata.Rdata]:
    """The records; none for a name that does not exist or has none of this type."""
    try:
        # search: a short name (``vllm``, ``vllm.ns``) is tried with the resolver's search
        # domains first, as the C library does (a pod's: ``NS.svc.cluster.local`` …)
        answer = await resolver.resolve(name, record_type, raise_on_no_answer=False, search=True)
    except dns.resolver.NXDOMAIN:
        return []
    except dns.exception.Timeout:
        raise ResolutionFailed(f"no answer for {name} {record_type} within {resolver.lifetime:g}s") from None
    except dns.resolver.NoNameservers as exc:  # every server refused or failed (SERVFAIL, REFUSED, down)
        raise ResolutionFailed(f"{name} {record_type}: {exc}") from None
    except (dns.exception.DNSException, OSError) as exc:
        raise ResolutionFailed(f"{name} {record_type}: {type(exc).__name__}: {exc}") from None
    return list(answer.rrset or ())


class Discovery:
    """One ``[[discover]]`` name, resolved every ``every_s`` for as long as :meth:`run` runs.

    ``known`` is the last set resolved (None until one was); ``on_set`` gets each set that
    differs from it, ``on_failure`` each failure, with its reason. ``active``: whether this
    process resolves now (the one holding the fleet's lock does, docs/design.md §16); an
    inactive turn forgets ``known``, so the first set resolved once active is handed on."""

    def __init__(
        self,
        entry: DiscoverConfig,
        on_set: Callable[[DiscoverConfig, frozenset[Address]], None],
        on_failure: Callable[[DiscoverConfig, str], None],
        active: Callable[[], bool] = lambda: True,
    ) -> None:
        self.entry = entry
        self.on_set, self.on_failure, self.active = on_set, on_failure, active
        self.known: frozenset[Address] | None = None
        self.resolutions = 0  # answered
        self.failures = 0
        # its name's settings changed or went: its loop ends (app/tasks.py: why a cancel may not)
        self.retired = False
        self._resolver: dns.asyncresolver.Resolver | None = None

    async def resolve_once(self) -> None:
        """One turn: the set now, handed on when it changed; a failure keeps the last."""
        try:
            if self._resolver is None:
                try:
                    self._resolver = resolver_for(self.entry)
                except dns.resolver.NoResolverConfiguration as exc:  # no usable /etc/resolv.conf
                    raise ResolutionFailed(f"no resolver configured: {exc}") from None
            found = await resolve(self.entry, self._resolver)
            if self.retired:
                return  # its loop was cancelled as the answer came: nothing of it is handed on
        except ResolutionFailed as reason:
            self.failures += 1
            kept = "none known yet" if self.known is None else f"{len(self.known)} address(es) kept"
            log.warning("discover %s: resolution failed (%s); %s", self.entry.name, reason, kept)
            self.on_failure(self.entry, str(reason))
            return
        self.resolutions += 1
        if found != self.known:
            log.info(
                "discover %s: %d address(es): %s",
                self.entry.name,
                len(found),
                ", ".join(sorted(f"{host}:{port}" for host, port in found)) or "none",
            )
            self.known = found
            self.on_set(self.entry, found)

    async def run(self) -> None:
        while not self.retired:
            if not self.active():
                self.known = None
                await asyncio.sleep(min(self.entry.every_s, 1.0))
                continue
            try:
                await self.resolve_once()
            except Exception:  # a fault of this loop must not end discovery for good
                log.exception("discover %s: resolution raised", self.entry.name)
            await asyncio.sleep(self.entry.every_s)


class DiscoveryLoops:
    """A :class:`Discovery` running for each ``[[discover]]`` name of the configuration,
    started, restarted and stopped as reloads change them. ``make`` builds one; ``forget``
    is told of a name no longer configured (what it declared leaves with it). A name whose
    settings changed keeps what it declared until its new loop's first answer."""

    def __init__(self, make: Callable[[DiscoverConfig], Discovery], forget: Callable[[str], None]) -> None:
        self.make, self.forget = make, forget
        self.running: dict[str, tuple[Discovery, asyncio.Task[None]]] = {}

    def follow(self, entries: tuple[DiscoverConfig, ...]) -> None:
        wanted = {entry.name: entry for entry in entries}
        for name, (discovery, task) in list(self.running.items()):
            if wanted.get(name) != discovery.entry:
                discovery.retired = True
                task.cancel()
                del self.running[name]
                if name not in wanted:
                    self.forget(name)
        for name, entry in wanted.items():
            if name not in self.running:
                discovery = self.make(entry)
                task = asyncio.get_running_loop().create_task(discovery.run(), name=f"discover {name}")
                self.running[name] = (discovery, task)

    async def stop(self) -> None:
        tasks = [task for _, task in self.running.values()]
        self.running.clear()
        await ended(*tasks)
