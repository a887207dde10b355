"""The proxy's HTTP front: routes, auth, body limits, and the server around them.

One catch-all handler dispatches on the path with a dict lookup (no router, no middlewares
on the hot path). SGLang's generation routes go through admission (the queue and the
per-backend limits); every other SGLang route passes through to one routable backend.
The proxy's own routes: ``/health``, ``/metrics``, ``/v1/models`` and ``/admin/*``.
Errors the proxy produces itself, including malformed HTTP, are OpenAI-shaped JSON.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import itertools
import logging
import os
import socket
import time
from typing import Any
from urllib.parse import quote

import aiohttp
import orjson
from aiohttp import http_exceptions, web
from aiohttp.web_protocol import RequestHandler

from proxy import logs, routes, sequences
from proxy.admission import Admission, NoHealthyBackend, QueueBytesFull, QueueFull, QueueTimeout
from proxy.affinity import CLOSE_SESSION, OPEN_SESSION, RESPONSES, Affinity
from proxy.backends import Backend, BackendPool, State, default_limit_factory
from proxy.discovery import Discovery, Resolver, system_resolver
from proxy.errors import JSON, error_body, error_response
from proxy.forward import Forwarder
from proxy.health import Health
from proxy.holders import Aborted, Holders, rids
from proxy.logs import ACCESS, OPS, OUTCOME, Outcome
from proxy.metrics import (
    CONTENT_TYPE,
    Metrics,
    register_adapt_metrics,
    register_prefix_metrics,
)
from proxy.policies import make_policy, make_prefix_routing
from proxy.reload import ReloadPlan, plan
from proxy.routes import ADMITTED, Access
from proxy.scrape import Scraper
from proxy.settings import BackendSettings, Settings
from proxy.tasks import stop_task
from proxy.upstream import UpstreamPool

log = logging.getLogger("pipefill")

OWN = frozenset({"/health", "/metrics", "/v1/models"})
ABORT = "/abort_request"
#: routes whose answer (or body) says which backend now holds a response or session
_LEARNS = frozenset({RESPONSES, OPEN_SESSION, CLOSE_SESSION})
_RESPONSE_PREFIX = RESPONSES + "/"
#: admin calls after which the backends' model lists are read again
_ADAPTERS = frozenset({"/load_lora_adapter", "/unload_lora_adapter"})
#: polled by load balancers and Prometheus: not in the access log
_NOT_ACCESS_LOGGED = frozenset({"/health", "/metrics"})


class _DirectLease:
    """Passed and admin routes (model info, server info, ...) bypass the queue, hold no slot."""

    __slots__ = ("backend",)

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    def release(self) -> None:
        pass

    def reported(self, prompt_tokens: int | None, cached_tokens: int) -> None:
        pass


class Proxy:
    """State and request handling of one proxy instance (no sockets: see ProxyServer)."""

    def __init__(self, settings: Settings, *, resolver: Resolver = system_resolver) -> None:
        self.settings = settings
        srv = settings.server
        self.pool = BackendPool(lambda b: default_limit_factory(self.settings.backend_limits(b), b))
        self.metrics = Metrics(self.pool.all)
        self.policy = make_policy(settings.routing)
        self.prefix = make_prefix_routing(settings.routing, self.policy)
        self.admission = Admission.from_settings(
            self.pool,
            self.policy,
            settings.queue,
            probe_in_flight=settings.routing.probe_in_flight,
            prefix=self.prefix,
        )
        self.pool.listeners.append(lambda _b: self.admission.wake())
        register_adapt_metrics(self.metrics, self.pool.all, self.admission)
        register_prefix_metrics(
            self.metrics, self.pool.all, self.prefix.index if self.prefix else None
        )
        for b in settings.backends:
            if b.discover == "static":
                self.pool.add(b)
        self.discovery = Discovery(
            self.pool, [b for b in settings.backends if b.discover == "dns"], resolver
        )
        self.session: aiohttp.ClientSession | None = None
        self.upstream: UpstreamPool | None = None
        self.health: Health | None = None
        self.scraper: Scraper | None = None
        self.forwarder: Forwarder | None = None
        self.holders = Holders()  # which backend holds each request named by an SGLang rid
        self.affinity = Affinity()  # where responses, sessions and models live
        self.draining = False
        self.active = 0  # requests being handled (a stream: until its end)
        self._idle: asyncio.Event | None = None  # set when active falls to 0 (wait_idle)
        self._tasks: list[asyncio.Task] = []
        self._rr = itertools.count()
        self._apply_keys()
        self._priority_header = settings.queue.priority_header
        self._rid_header = srv.request_id_header
        self._max_body = srv.max_body_bytes
        self._body_timeout = srv.body_timeout_s
        from proxy.admin import Admin

        self.admin = Admin(self)

    def _apply_keys(self) -> None:
        """Client, batch, admin and metrics keys from the settings (at start and on reload)."""
        srv = self.settings.server
        self._api_keys = [k.encode() for k in srv.api_keys]
        self._batch_keys = [k.encode() for k in self.settings.queue.batch_api_keys]
        self._admin_key = srv.admin_key.encode() if srv.admin_key else None
        # /metrics: a client key or the admin key opens it; public when metrics_public is
        # true, or unset and no client key is set, or when there is no key to ask for
        self._metrics_keys = [*self._api_keys, *([self._admin_key] if self._admin_key else [])]
        public = srv.metrics_public if srv.metrics_public is not None else not srv.api_keys
        self._metrics_public = public or not self._metrics_keys

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self) -> None:
        s = self.settings
        connector = aiohttp.TCPConnector(
            limit=s.upstream.max_connections,
            limit_per_host=s.upstream.max_connections_per_backend,
            keepalive_timeout=s.upstream.keepalive_s,
            ttl_dns_cache=300,
        )
        self.session = aiohttp.ClientSession(
            connector=connector,
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=s.timeouts.connect_s),
            auto_decompress=False,
            cookie_jar=aiohttp.DummyCookieJar(),
            skip_auto_headers=("User-Agent",),
        )
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(s.health.timeout_s):
                await self.discovery.resolve_all()  # the first addresses, before serving
        self.discovery.start()
        self.health = Health(self.pool, s.health, self.session, self.metrics)
        self.pool.listeners.append(lambda b: b is not None and self.health.kick())  # type: ignore[union-attr]
        self.upstream = UpstreamPool(
            keepalive_s=s.upstream.keepalive_s,
            per_origin=s.upstream.max_connections_per_backend,
            total=s.upstream.max_connections,
        )
        self.forwarder = Forwarder(
            s, self.pool, self.health, self.metrics, self.session, self.upstream
        )
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(s.health.timeout_s):
                await self.health.check_all()
        self.health.start()
        self.admission.start()
        # ADAPT: scrape each backend's SGLang gauges (the limits' confirming signal).
        self.scraper = Scraper(
            self.pool, s.scrape, session=self.session, on_scrape=lambda _b: self.admission.wake()
        )
        if s.scrape.enabled:
            # Before the first request: each server's own max_running_requests is where its
            # limit starts (proxy/limits.py), so a cold start needs no windows of growth.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(s.scrape.timeout_s):
                    await self.scraper.scrape_all()
        self.scraper.start()
        self._tasks.append(asyncio.create_task(self._lag_loop(), name="pipefill-lag"))

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            await stop_task(t)
        self._tasks.clear()
        await self.discovery.close()
        if self.health is not None:
            await self.health.stop()
        await self.admission.close()
        if self.scraper is not None:
            await self.scraper.close()
        if self.upstream is not None:
            self.upstream.close()
        if self.session is not None:
            await self.session.close()

    async def _lag_loop(self) -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.25)
            self.metrics.loop_lag.observe(max(time.monotonic() - t - 0.25, 0.0))

    def reload(self, new: Settings) -> ReloadPlan:
        """SIGHUP: apply ``new``'s backend list and every setting that can change while
        running (proxy/reload.py); the others are returned (and logged) as needing a restart."""
        p = plan(self.settings, new)
        for section, update in p.section_updates(new).items():
            # In place: every component holds this same Settings object.
            current = getattr(self.settings, section)
            setattr(self.settings, section, current.model_copy(update=update))
        if p.live:
            self._apply_keys()
            if self.forwarder is not None:
                self.forwarder.keys_changed()
            logs.set_level(self.settings.server.log_level)
        backends = self.reload_backends(new.backends)
        OPS.info(
            "SIGHUP: applied %s; backends added %s, removed %s, changed %s; not applied, need a "
            "restart: %s",
            ", ".join(p.live) or "no setting",
            backends["added"],
            backends["removed"],
            backends["changed"],
            ", ".join(p.restart) or "none",
            extra={"event": "reload", "applied": p.live, "restart_needed": p.restart, **backends},
        )
        return p

    def reload_backends(self, backends: list[BackendSettings]) -> dict[str, list[str]]:
        """Make the pool match ``backends`` (SIGHUP): new ones are added, missing ones drain
        and leave when idle, changed ones are replaced. Streams in flight are not touched."""
        wanted = {b.name: b for b in backends if b.discover == "static"}
        self.discovery.templates = [b for b in backends if b.discover == "dns"]
        added, removed, changed = [], [], []
        for name in self.pool.names():
            if self.discovery.owns(name):
                continue  # discovery's: it follows its templates on its next round
            current = self.pool.get(name)
            want = wanted.get(name)
            if want is None:
                self.pool.remove(name)
                removed.append(name)
            elif current is not None and current.settings != want:
                self.pool.remove(name)
                self.pool.add(want)
                changed.append(name)
        for name, want in wanted.items():
            if name not in self.pool:
                self.pool.add(want)
                added.append(name)
        return {"added": added, "removed": removed, "changed": changed}

    # ---- request handling ------------------------------------------------------------

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        self.active += 1
        try:
            if self.settings.server.access_log and request.path not in _NOT_ACCESS_LOGGED:
                return await self._handle_logged(request)
            return await self._handle(request)
        finally:
            self.active -= 1
            if not self.active and self._idle is not None:
                self._idle.set()

    async def _handle_logged(self, request: web.BaseRequest) -> web.StreamResponse:
        """``_handle`` and one access-log line: id, route, backend, status, TTFT, tokens,
        duration (a client that left before its answer ended: status 499, as nginx logs it)."""
        t0 = time.monotonic()
        outcome = request[OUTCOME] = Outcome()
        status, rid = 499, request.headers.get(self._rid_header)
        try:
            resp = await self._handle(request)
            status, rid = resp.status, resp.headers.get(self._rid_header, rid)
            return resp
        finally:
            duration = time.monotonic() - t0
            ttft = outcome.ttft
            ACCESS.info(
                "%s %s %s backend=%s status=%d ttft_ms=%s tokens=%s duration_ms=%.1f",
                rid or "-",
                request.method,
                request.path[:200],
                outcome.backend or "-",
                status,
                "-" if ttft is None else f"{ttft * 1000:.1f}",
                "-" if outcome.tokens is None else outcome.tokens,
                duration * 1000,
                extra={
                    "event": "access",
                    "request_id": rid,
                    "method": request.method,
                    "route": request.path[:200],
                    "backend": outcome.backend,
                    "status": status,
                    "ttft_s": ttft,
                    "tokens": outcome.tokens,
                    "duration_s": duration,
                },
            )

    async def wait_idle(self, within: float) -> bool:
        """Wait up to ``within`` s for no request to be in progress; whether none is."""
        if self.active:
            self._idle = asyncio.Event()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(within):
                    await self._idle.wait()
            self._idle = None
        return not self.active

    async def _handle(self, request: web.BaseRequest) -> web.StreamResponse:
        t_arrive = time.monotonic()
        path = request.path
        target = _origin_target(request.raw_path, path)
        if target is None:
            return self._reject(
                400,
                "the request target must be a path (origin-form), e.g. /v1/chat/completions",
                "invalid_target",
                "other",
                os.urandom(12).hex(),
            )
        bad = _undecodable_header(request.headers)
        if bad is not None:  # before any header is read as text
            rid = os.urandom(12).hex()
            if bad == "authorization":
                message = "the Authorization header is not valid UTF-8"
                return self._reject(401, message, "invalid_api_key", "other", rid)
            return self._reject(400, "a header is not valid UTF-8", "invalid_header", "other", rid)
        route = ADMITTED.get(path)
        if route is None:
            if path in OWN:
                resp = await self._own(request, path)
                if resp is not None:
                    return resp  # else: /v1/models not known yet, ask a backend
            if path.startswith("/admin/") or path == "/admin":
                return await self.admin.handle(request)
            route = routes.lookup(path)
        rid = request.headers.get(self._rid_header) or os.urandom(12).hex()
        if route is None:
            return self._reject(404, f"no such route: {path[:200]}", "not_found", "other", rid)
        label = path if route.admitted else "other"
        method = request.method
        if method not in route.methods:
            return self._reject(
                405,
                f"method {method} not allowed on {path}",
                "method_not_allowed",
                label,
                rid,
                allow=", ".join(sorted(route.methods)),
            )
        key = self._client_key(request)
        if route.access is Access.ADMIN:
            if self._admin_key is None:
                return self._reject(
                    403,
                    "admin routes are disabled: set server.admin_key",
                    "admin_disabled",
                    label,
                    rid,
                )
            if key is None or not hmac.compare_digest(key, self._admin_key):
                return self._reject(
                    401, "invalid or missing admin key", "invalid_admin_key", label, rid
                )
        elif self._api_keys and not _key_in(key, self._api_keys):
            return self._reject(
                401,
                "invalid or missing API key (Authorization: Bearer ...)",
                "invalid_api_key",
                label,
                rid,
            )
        body: bytes | None = None
        obj: dict | None = None
        streamed = False
        seqs = 1
        if request.body_exists:
            length = request.content_length
            if length is not None and length > self._max_body:
                return self._too_large(label, rid)
            if request.headers.get("Expect", "").lower() == "100-continue":
                await _continue(request)
            try:
                body = await self._read_body(request)
            except web.HTTPRequestEntityTooLarge:
                return self._too_large(label, rid)
            except TimeoutError:
                resp = self._reject(
                    408, "request body not received in time", "request_timeout", label, rid
                )
                # answer, then close at once: no lingering read of a body that does not come
                await resp.prepare(request)
                await resp.write_eof()
                request.protocol.force_close()
                return resp
            if route.admitted and body:
                obj, bad = _json_object(body)
                if obj is None:
                    return self._reject(400, str(bad), "invalid_json", label, rid)
                streamed = (
                    route.api is not None
                    and route.streamable
                    and _truthy(obj.get("stream", route.stream_default))
                )
                seqs = sequences.count(route.body, obj)
        if route.admitted and not body:
            return self._reject(
                400, "request body must be a JSON object", "invalid_json", label, rid
            )
        if self.settings.server.log_prompts and body:
            log.info(
                "request %s %s %s body=%s", rid, method, path, body[:4096].decode(errors="replace")
            )
        held = None
        learns = path in _LEARNS  # answers that say where state was made
        if learns and obj is None and body:
            obj, _bad = _json_object(body)  # the backend answers a bad body itself
        by_id = path.startswith(_RESPONSE_PREFIX)
        pinned = self.affinity.pinned(path, obj) if obj is not None or by_id else None
        if pinned is not None and pinned not in self.pool:
            pinned = None  # gone, and its state with it: any backend answers
        if route.access is Access.ADMIN:
            named = request.headers.get(self.settings.server.backend_header)
            if named is not None and named not in self.pool:
                return self._reject(404, "no backend of that name", "backend_not_found", label, rid)
            if path == ABORT and named is None:
                return await self._abort(request, body, target, rid)
            if route.fanout:
                backends = [
                    b for b in self.pool.all() if not b.removing and named in (None, b.name)
                ]
                answer = await self.forwarder.fan_out(  # type: ignore[union-attr]
                    request, body, target=target, backends=backends, request_id=rid
                )
                if path in _ADAPTERS and self.health is not None:
                    await self.health.refresh_models(backends)  # route to the adapter at once
                return answer
            if named is not None:
                acquire = self._named_acquire(named)
            else:
                acquire = self._direct_acquire
        elif route.admitted:
            priority = self._priority(request, key)
            size = len(body or b"")
            names = rids(obj) if obj is not None else []
            held = self.holders.track(names) if names else None
            prompt = self.prefix.prompt(obj) if self.prefix is not None else None
            allowed = {pinned} if pinned is not None else Affinity.serving(obj, self.pool.all())
            elsewhere = (
                frozenset(b.name for b in self.pool.all() if b.name not in allowed)
                if allowed
                else frozenset()
            )

            def acquire(exclude: frozenset[str], recalled: bool = False) -> Any:
                deadline = None
                if recalled:  # its time in the backend's queue counts against the deadline
                    waited = time.monotonic() - t_arrive
                    deadline = self.admission.queue_deadline_s - waited
                acquiring = self.admission.acquire(
                    priority,
                    exclude | elsewhere,
                    deadline,
                    front=recalled,
                    size=size,
                    seqs=seqs,
                    prompt=prompt,
                )
                if held is None:
                    return acquiring
                return self.holders.acquire(held, acquiring)
        elif pinned is not None:
            acquire = self._named_acquire(pinned)
        else:
            acquire = self._direct_acquire
        try:
            resp = await self.forwarder.forward(  # type: ignore[union-attr]
                request,
                body,
                target=target,
                route=label,
                api=route.api,
                streamed=streamed,
                acquire=acquire,
                request_id=rid,
                t_arrive=t_arrive,
                on_reject=self._admission_error,
            )
        finally:
            if held is not None:
                self.holders.forget(held)
        if learns and 200 <= resp.status < 300:
            served = resp.headers.get(self.settings.server.backend_header)
            if served is not None:
                whole = resp.body if isinstance(resp, web.Response) else None
                self.affinity.learn(path, obj, whole if isinstance(whole, bytes) else None, served)
        return resp

    async def _abort(
        self, request: web.BaseRequest, body: bytes | None, target: str, rid: str
    ) -> web.Response:
        """``/abort_request``: a request the proxy tracks (by its ``rid``) is taken out of the
        queue if it waits there, else the abort goes to the backend holding it alone; an
        unknown rid, or ``abort_all``, goes to every backend (``abort_all`` also empties the
        queue of tracked requests)."""
        obj, _bad = _json_object(body or b"{}")
        obj = obj or {}
        held = None
        if isinstance(obj.get("rid"), str) and not _truthy(obj.get("abort_all")):
            held = self.holders.find(obj["rid"])
        if held is not None and self.holders.abort_queued(held):
            out = {"ok": True, "rid": obj["rid"], "cancelled_in_queue": True, "backends": {}}
            return web.Response(
                body=orjson.dumps(out), content_type=JSON, headers={self._rid_header: rid}
            )
        cancelled = self.holders.abort_all_queued() if _truthy(obj.get("abort_all")) else 0
        backends = [b for b in self.pool.all() if not b.removing]
        if held is not None and held.backend is not None:
            backends = [b for b in backends if b.name == held.backend] or backends
        resp = await self.forwarder.fan_out(  # type: ignore[union-attr]
            request, body, target=target, backends=backends, request_id=rid
        )
        if cancelled:
            resp.headers["X-Pipefill-Cancelled-In-Queue"] = str(cancelled)
        return resp

    async def _direct_acquire(
        self, exclude: frozenset[str], recalled: bool = False
    ) -> _DirectLease:
        cands = [b for b in self.pool.routable() if b.name not in exclude]
        healthy = [b for b in cands if b.state is State.HEALTHY] or cands
        if not healthy:
            raise NoHealthyBackend()
        return _DirectLease(healthy[next(self._rr) % len(healthy)])

    def _named_acquire(self, name: str) -> Any:
        """Admin routes sent to the backend named in the request's backend header."""

        async def acquire(exclude: frozenset[str], recalled: bool = False) -> _DirectLease:
            b = self.pool.get(name)
            if b is None or name in exclude:
                raise NoHealthyBackend()
            return _DirectLease(b)

        return acquire

    async def _read_body(self, request: web.BaseRequest) -> bytes:
        """The request's body, within ``body_timeout_s`` while it is still arriving (a JSON body
        usually came whole with the head: then there is nothing to time)."""
        if request.content.is_eof():
            return await request.read()
        async with asyncio.timeout(self._body_timeout):
            return await request.read()

    def _admission_error(self, e: BaseException) -> web.Response | None:
        if isinstance(e, QueueBytesFull):
            self.metrics.rejections.labels("queue_bytes_full").inc()
            return error_response(
                429,
                "the proxy's queue holds too many request bytes; retry later",
                "queue_bytes_full",
                headers={"Retry-After": str(e.retry_after)},
            )
        if isinstance(e, QueueFull):
            self.metrics.rejections.labels("queue_full").inc()
            return error_response(
                429,
                "the proxy's queue is full; retry later",
                "queue_full",
                headers={"Retry-After": str(e.retry_after)},
            )
        if isinstance(e, QueueTimeout):
            self.metrics.rejections.labels("queue_timeout").inc()
            return error_response(503, "timed out waiting for a free backend slot", "queue_timeout")
        if isinstance(e, Aborted):
            self.metrics.rejections.labels("request_aborted").inc()
            return error_response(
                400,
                "aborted (/abort_request) while waiting in the proxy's queue",
                "request_aborted",
            )
        if isinstance(e, NoHealthyBackend):
            self.metrics.rejections.labels("no_healthy_backend").inc()
            return error_response(503, "no healthy backend", "no_healthy_backend")
        return None

    def _client_key(self, request: web.BaseRequest) -> bytes | None:
        auth = request.headers.get("Authorization")
        if auth and auth[:7].lower() == "bearer ":
            return auth[7:].strip().encode("utf-8", "surrogateescape")
        return None

    def _priority(self, request: web.BaseRequest, key: bytes | None) -> str:
        """``batch`` for a key in ``queue.batch_api_keys`` or a ``batch`` priority header: the
        header may only lower a request's priority, never lift a batch key's."""
        if key is not None and self._batch_keys and _key_in(key, self._batch_keys):
            return "batch"
        value = request.headers.get(self._priority_header)
        if value and value.strip().lower() == "batch":
            return "batch"
        return "interactive"

    def _reject(
        self,
        status: int,
        message: str,
        code: str,
        route: str,
        rid: str,
        *,
        allow: str | None = None,
    ) -> web.Response:
        headers = {self._rid_header: rid}
        if allow:
            headers["Allow"] = allow
        self.metrics.rejections.labels(code).inc()
        self.metrics.requests.labels("none", route, str(status)).inc()
        return error_response(status, message, code, headers=headers)

    def _too_large(self, route: str, rid: str) -> web.Response:
        resp = self._reject(
            413, f"request body larger than {self._max_body} bytes", "body_too_large", route, rid
        )
        resp.force_close()  # the rest of the body is not read
        return resp

    # ---- the proxy's own routes ------------------------------------------------------

    async def _own(self, request: web.BaseRequest, path: str) -> web.StreamResponse | None:
        if request.method not in ("GET", "HEAD"):
            return error_response(
                405,
                f"method {request.method} not allowed on {path}",
                "method_not_allowed",
                headers={"Allow": "GET, HEAD"},
            )
        if path == "/health":
            return self._health()
        if path == "/metrics":
            key = self._client_key(request)
            if not self._metrics_public and not _key_in(key, self._metrics_keys):
                return error_response(401, "invalid or missing API key", "invalid_api_key")
            return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})
        if self._api_keys and not _key_in(self._client_key(request), self._api_keys):
            return error_response(401, "invalid or missing API key", "invalid_api_key")
        return await self._models(request)

    def _health(self) -> web.Response:
        backends = self.pool.all()
        healthy = sum(1 for b in backends if b.state is State.HEALTHY)
        body = {"status": "ok", "healthy_backends": healthy, "backends": len(backends)}
        if self.draining:
            return error_response(503, "shutting down", "shutting_down")
        if healthy == 0:
            return error_response(503, "no healthy backend", "no_healthy_backend")
        return web.Response(body=orjson.dumps(body), content_type=JSON)

    async def _models(self, request: web.BaseRequest) -> web.StreamResponse | None:
        models: dict[str, dict] = {}
        for b in self.pool.all():
            if b.state is State.HEALTHY:
                for m in b.models:
                    models.setdefault(m["id"], m)
        if not models:
            return None
        return web.Response(
            body=orjson.dumps({"object": "list", "data": list(models.values())}), content_type=JSON
        )

    def admin_access(self, request: web.BaseRequest, mutating: bool) -> bool | web.Response:
        """Who calls ``/admin/*``: True for the admin (``server.admin_key``); False for anyone,
        read-only and shown no backend URL, which only a proxy without any key allows; else
        the error to answer (401 wrong admin key; 403 no admin key while other keys are set,
        or a change without an admin key)."""
        if self._admin_key is not None:
            key = self._client_key(request)
            if key is not None and hmac.compare_digest(key, self._admin_key):
                return True
            return error_response(401, "invalid or missing admin key", "invalid_admin_key")
        if mutating or self._api_keys:
            return error_response(
                403, "the admin API needs an admin key: set server.admin_key", "admin_disabled"
            )
        return False


def _key_in(key: bytes | None, keys: list[bytes]) -> bool:
    if key is None:
        return False
    found = False
    for k in keys:
        found |= hmac.compare_digest(key, k)
    return found


def _undecodable_header(headers: Any) -> str | None:
    """The lower-cased name of the first header whose value is not valid UTF-8 (aiohttp keeps
    such bytes as surrogates, which cannot be compared as a key nor sent upstream), or None."""
    for name, value in headers.items():
        if not value.isascii():
            try:
                value.encode()
            except UnicodeEncodeError:
                return name.lower()
    return None


#: characters left unescaped when a decoded path is quoted again (RFC 3986 pchar and "/")
_PATH_SAFE = "/!$&'()*+,;=:@-._~"


def _origin_target(raw: str, path: str) -> str | None:
    """What is sent upstream: the path and query of an origin-form request target, or None.

    Absolute-form (``http://host/...``), authority-form (``host:443``), asterisk-form (``*``),
    a path starting ``//``, dot segments, fragments and non-ASCII bytes are refused. The path
    forwarded is the one the proxy matched its routes against (decoded, quoted again), so a
    backend never routes on a different path than the proxy checked.
    """
    if not raw.startswith("/") or raw.startswith("//") or not raw.isascii() or "#" in raw:
        return None
    raw_path, sep, query = raw.partition("?")
    if "%" not in raw_path and "/." not in raw_path:
        return raw  # nothing encoded, no dot segment: already what was matched
    if not path.startswith("/") or path.startswith("//"):
        return None
    segments = path.split("/")
    if "." in segments or ".." in segments:
        return None
    return quote(path, safe=_PATH_SAFE) + sep + query


async def _continue(request: web.BaseRequest) -> None:
    """Ask for the body of an ``Expect: 100-continue`` request (aiohttp's low-level server
    does not): once the request was accepted, before its body is read."""
    if request.version >= (1, 1) and request.writer.output_size == 0:
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0


_TRUE = frozenset({True, "1", "on", "t", "true", "y", "yes"})  # True == 1 == 1.0


def _truthy(value: Any) -> bool:
    """``stream`` as SGLang's pydantic reads it (lax bool: true, 1, "yes", "on", ...)."""
    if isinstance(value, str):
        value = value.strip().lower()
    try:
        return value in _TRUE
    except TypeError:  # unhashable
        return False


def _json_object(body: bytes) -> tuple[dict, None] | tuple[None, str]:
    """The request body as a JSON object, or what is wrong with it."""
    try:
        obj = orjson.loads(body)
    except orjson.JSONDecodeError as e:
        return None, f"request body is not valid JSON (line {e.lineno}, column {e.colno})"
    if not isinstance(obj, dict):
        return None, "request body must be a JSON object"
    return obj, None


# ---- the server ---------------------------------------------------------------------------


def _raw_error(status: int, reason: str, message: str, code: str) -> bytes:
    """A complete HTTP/1.1 error response, for where no request object exists yet."""
    body = error_body(message, status=status, code=code)
    return (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: {JSON}\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode() + body


_HEAD_TIMEOUT = _raw_error(
    408, "Request Timeout", "request head not received in time", "request_timeout"
)
_TOO_MANY = _raw_error(
    503,
    "Service Unavailable",
    "too many connections to the proxy; retry later",
    "too_many_connections",
)


class _Handler(RequestHandler):
    """aiohttp's protocol handler, answering malformed HTTP with OpenAI-shaped errors, closing a
    connection whose request head does not arrive within ``head_timeout`` of its first byte
    (408), and refusing connections beyond the server's cap (503)."""

    def __init__(self, manager: _Server, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._server = manager
        self._head_timer: asyncio.TimerHandle | None = None
        self._counted = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        server = self._server
        if server.max_connections and server.open_connections >= server.max_connections:
            self._force_close = True  # never parsed, never handled
            transport.write(_TOO_MANY)  # type: ignore[attr-defined]
            transport.close()
            server.on_refused()
            return
        self._counted = True
        server.open_connections += 1
        super().connection_made(transport)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self._counted:
            self._counted = False
            self._server.open_connections -= 1
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        parsed = self._request_count
        super().data_received(data)
        if self._request_count != parsed:  # a request head completed
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
        elif (
            data
            and self._head_timer is None
            and not self._request_in_progress
            and not self._force_close
        ):  # the first bytes of a new head
            self._head_timer = self._loop.call_later(self._server.head_timeout, self._head_expired)

    def _head_expired(self) -> None:
        self._head_timer = None
        if self._request_in_progress or self._messages or self.transport is None:
            return  # not waiting for a head after all
        self.transport.write(_HEAD_TIMEOUT)
        self.force_close()

    def handle_error(self, request, status=500, exc=None, message=None):  # type: ignore[override]
        if request.writer.output_size > 0:
            raise ConnectionError("response already started")
        if status >= 500:
            self.log_exception("error handling request", exc_info=exc)
            resp = error_response(500, "internal proxy error", "internal_error")
        else:
            text = "malformed request"
            code = "bad_request"
            if (
                isinstance(exc, http_exceptions.LineTooLong)
                and len(exc.args) > 1
                and exc.args[1] == self._server.max_url
                and self._server.max_url != self.max_field_size
            ):  # the request line (its URL) is what was too long
                status, text, code = 414, "request target too long", "uri_too_long"
            elif (
                isinstance(exc, http_exceptions.LineTooLong)
                or "too many headers" in str(message or exc).lower()
                or "too long" in str(message or exc).lower()
            ):
                status, text, code = 431, "request headers too large", "headers_too_large"
            elif isinstance(exc, http_exceptions.BadHttpMethod):
                status, text, code = 405, "unsupported HTTP method", "method_not_allowed"
            resp = error_response(status, text, code)
        resp.force_close()
        return resp


class _Server(web.Server):
    def __init__(
        self,
        handler: Any,
        *,
        max_body: int,
        head_timeout: float,
        max_connections: int,
        on_refused: Any = lambda: None,
        **kwargs: Any,
    ) -> None:
        super().__init__(handler, **kwargs)
        self._max_body = max_body
        self.head_timeout = head_timeout
        self.max_connections = max_connections
        self.max_url = kwargs.get("max_line_size", 8190)
        self.open_connections = 0
        self.on_refused = on_refused

    def __call__(self) -> RequestHandler:
        return _Handler(self, loop=self._loop, **self._kwargs)

    def _make_request(self, message, payload, protocol, writer, task):  # type: ignore[override]
        return web.BaseRequest(
            message, payload, protocol, writer, task, self._loop, client_max_size=self._max_body
        )


#: the end of the shutdown grace period kept for ending what still runs (at most half of it)
SHUTDOWN_TAIL_S = 0.5
#: the least time a request still running at the end of the grace gets to be cancelled
MIN_CANCEL_S = 0.01


class ProxyServer:
    """A Proxy bound to a socket. ``await start()``, then ``await stop(grace)``."""

    def __init__(self, settings: Settings, *, resolver: Resolver = system_resolver) -> None:
        self.settings = settings
        self.proxy = Proxy(settings, resolver=resolver)
        self._runner: web.ServerRunner | None = None
        self._stopped = False
        self.port: int | None = None

    async def start(self) -> None:
        s = self.settings.server
        # Bind first: a port in use fails before anything else started.
        sock = socket.socket(socket.AF_INET6 if ":" in s.host else socket.AF_INET)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((s.host, s.port))
        except OSError:
            sock.close()
            raise
        await self.proxy.start()
        server = _Server(
            self.proxy.handle,
            max_body=s.max_body_bytes,
            handler_cancellation=True,  # a client that leaves cancels its upstream at once
            max_line_size=s.max_url_bytes,
            max_field_size=s.max_header_bytes,
            max_headers=s.max_headers,
            keepalive_timeout=s.keepalive_s,
            head_timeout=s.header_timeout_s,
            max_connections=s.max_connections,
            on_refused=lambda: self.proxy.metrics.rejections.labels("too_many_connections").inc(),
            access_log=None,
        )
        self._runner = web.ServerRunner(server, shutdown_timeout=s.shutdown_grace_s)
        await self._runner.setup()
        site = web.SockSite(self._runner, sock, backlog=2048)
        await site.start()
        self.port = sock.getsockname()[1]

    async def stop(self, grace: float | None = None, pre_stop: float = 0.0) -> None:
        """The drain: ``/health`` answers 503 at once while the proxy still serves for
        ``pre_stop`` s (a load balancer sees it and stops sending), then the listener closes,
        requests in flight get up to ``grace`` s (default ``server.shutdown_grace_s``) to
        finish, streams still running end with an SSE error event, and the rest is closed."""
        if self._stopped:
            return
        self._stopped = True
        proxy = self.proxy
        proxy.draining = True
        runner, self._runner = self._runner, None
        if runner is not None:
            if pre_stop > 0:
                await asyncio.sleep(pre_stop)
            for site in list(runner.sites):
                await site.stop()
            if grace is None:
                grace = self.settings.server.shutdown_grace_s
            # The whole stop fits in ``grace``: its last SHUTDOWN_TAIL_S (at most half) is kept
            # to end what is still running, so that the exit comes when the docs say it does.
            deadline = time.monotonic() + grace
            tail = min(SHUTDOWN_TAIL_S, grace / 2)
            await proxy.wait_idle(grace - tail)
            if proxy.forwarder is not None and proxy.forwarder.cut_streams():
                # their SSE error event and [DONE] go out
                await proxy.wait_idle(max(0.0, deadline - time.monotonic()) / 2)
            # What is left (requests still waiting for a backend's answer) is cancelled: aiohttp
            # waits up to this for each handler to end, then as long again once cancelled.
            left = max(0.0, deadline - time.monotonic())
            runner._shutdown_timeout = max(left / 2, MIN_CANCEL_S)
            await runner.cleanup()
        await proxy.stop()

    @property
    def url(self) -> str:
        return f"http://{self.settings.server.host}:{self.port}"
