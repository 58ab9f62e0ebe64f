"""The router's replicas: which exist (given, added by the admin endpoints, or discovered from a file or a
DNS name), which are healthy (GET /health every interval, and at once when a request cannot reach one),
and what each can cache (its KV pool, from /get_server_info). Healthy replicas are the ones routed to.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from dataclasses import dataclass, field
from typing import Any, Callable
from urllib.parse import urlsplit

import httpx

from radixlm.server.router.args import RouterArgs

logger = logging.getLogger("radixlm.router")

# What the meta tree assumes a replica caches until it says (its KV pool in tokens).
_DEFAULT_CAPACITY = 1 << 16
STATIC, ADMIN, FILE, DNS = "static", "admin", "file", "dns"


def normalize_url(url: str) -> str:
    """http(s)://host:port with no trailing slash; a bare host:port gets http://. ValueError if not a URL."""
    url = url.strip().rstrip("/")
    if "://" not in url:
        url = "http://" + url
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname or parts.path or parts.query:
        raise ValueError(f"not a replica base URL: {url!r} (expected http://host:port)")
    parts.port  # noqa: B018  (raises ValueError on a bad port)
    return url


@dataclass
class Replica:
    url: str
    source: str  # how it joined: static, admin, file or dns (discovery removes only what it added)
    healthy: bool = False
    capacity: int = _DEFAULT_CAPACITY
    info: dict[str, Any] = field(default_factory=dict)  # its /get_server_info, once read
    fails: int = 0  # consecutive failed health checks
    passes: int = 0  # consecutive passed ones
    requests_total: int = 0
    failures_total: int = 0  # times it was taken out of routing


class ReplicaSet:
    """The replicas and their health. `on_change(url, event)` tells the routing policy: "up" (routable,
    its cache possibly gone), "down", "removed"."""

    def __init__(self, args: RouterArgs, http: httpx.AsyncClient, on_change: Callable[[Replica, str], None]) -> None:
        self.args = args
        self.http = http
        self.on_change = on_change
        self.replicas: dict[str, Replica] = {}

    def healthy(self) -> list[str]:
        return [url for url, r in self.replicas.items() if r.healthy]

    async def add(self, url: str, source: str) -> Replica:
        """Adds a replica and checks it at once (it stays out of routing until a check passes)."""
        url = normalize_url(url)
        if url in self.replicas:
            return self.replicas[url]
        replica = self.replicas[url] = Replica(url, source)
        logger.info("replica %s added (%s)", url, source)
        await self.check(replica)
        return replica

    def remove(self, url: str) -> bool:
        replica = self.replicas.pop(normalize_url(url), None)
        if replica is None:
            return False
        logger.info("replica %s removed", replica.url)
        self.on_change(replica, "removed")
        return True

    def mark_failed(self, url: str, why: str) -> None:
        """A request could not reach the replica: out of routing now, back when a health check passes."""
        replica = self.replicas.get(url)
        if replica is not None and replica.healthy:
            self._set_down(replica, why)

    def _set_down(self, replica: Replica, why: str) -> None:
        replica.healthy, replica.passes = False, 0
        replica.failures_total += 1
        logger.warning("replica %s taken out of routing: %s", replica.url, why)
        self.on_change(replica, "down")

    async def check(self, replica: Replica) -> None:
        """One health check; on the way up, reads the replica's server info (its KV pool size)."""
        try:
            reply = await self.http.get(replica.url + "/health", timeout=self.args.health_check_timeout_secs)
            ok, why = reply.status_code == 200, f"/health answered {reply.status_code}"
            if ok and not replica.healthy and replica.passes + 1 >= self.args.health_success_threshold:
                info = await self.http.get(replica.url + "/get_server_info",
                                           timeout=self.args.health_check_timeout_secs)
                info.raise_for_status()
                replica.info = info.json()
                states = replica.info.get("internal_states") or [{}]
                replica.capacity = int(states[0].get("kv_slots_total") or _DEFAULT_CAPACITY)
        except (httpx.HTTPError, ValueError) as exc:
            ok, why = False, f"{type(exc).__name__}: {exc}"
        if replica.url not in self.replicas:  # removed while we waited
            return
        if ok:
            replica.fails, replica.passes = 0, replica.passes + 1
            if not replica.healthy and replica.passes >= self.args.health_success_threshold:
                replica.healthy = True
                logger.info("replica %s is healthy (KV pool %d tokens)", replica.url, replica.capacity)
                self.on_change(replica, "up")
        else:
            replica.passes, replica.fails = 0, replica.fails + 1
            if replica.healthy and replica.fails >= self.args.health_failure_threshold:
                self._set_down(replica, why)

    async def check_all(self) -> None:
        await asyncio.gather(*(self.check(r) for r in list(self.replicas.values())))

    async def discover(self) -> None:
        """Makes the replicas from the file and the DNS name those listed there now."""
        for source, read in ((FILE, self._read_file), (DNS, self._resolve)):
            try:
                urls = await read()
            except (OSError, ValueError) as exc:
                logger.warning("replica discovery (%s) failed, keeping the replicas it found before: %s", source, exc)
                continue
            if urls is None:
                continue
            known = {url for url, r in self.replicas.items() if r.source == source}
            for url in known - urls:
                self.remove(url)
            await asyncio.gather(*(self.add(url, source) for url in urls - set(self.replicas)))

    async def _read_file(self) -> set[str] | None:
        path = self.args.worker_urls_file
        if path is None:
            return None
        with open(path) as f:
            lines = [line.split("#", 1)[0].strip() for line in f]
        return {normalize_url(line) for line in lines if line}

    async def _resolve(self) -> set[str] | None:
        name = self.args.worker_dns
        if name is None:
            return None
        host, _, port = name.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"--worker-dns {name!r}: expected NAME:PORT")
        infos = await asyncio.get_running_loop().getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
        return {f"http://[{a[0]}]:{a[1]}" if ":" in a[0] else f"http://{a[0]}:{a[1]}" for *_, a in infos}

    async def run(self) -> None:
        """Health checks and discovery, each at its own interval, until cancelled."""

        async def every(seconds: float, work: Callable[[], Any]) -> None:
            while True:
                await asyncio.sleep(seconds)
                await work()

        loops = [every(self.args.health_check_interval_secs, self.check_all)]
        if self.args.worker_urls_file or self.args.worker_dns:
            loops.append(every(self.args.discovery_interval_secs, self.discover))
        await asyncio.gather(*loops)
