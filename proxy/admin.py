"""``/admin/*``: list, add, drain, undrain and remove backends; inspect the queue.

Auth: with ``server.admin_key`` set every admin route needs ``Authorization: Bearer <key>``.
Without it the mutating routes answer 403, and so does everything while client keys
(``server.api_keys``) are set; a proxy with no key at all shows the read-only routes to anyone,
without backend URLs (Proxy.admin_access).

    GET    /admin/backends                 every backend with state, in flight, limit, stats
    GET    /admin/backends/{name}
    POST   /admin/backends                 {"url": ..., "name"?, "parallelism"?, "pp_size"?, ...}
    POST   /admin/backends/{name}/drain    no new requests; streams in flight continue
    POST   /admin/backends/{name}/undrain  back to probing -> healthy
    DELETE /admin/backends/{name}          drain, then forget once its last request ended
    GET    /admin/queue                    the admission queue's state
    GET    /admin/prefix                   prefix routing: the index, hit rates per backend
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import orjson
from aiohttp import web
from pydantic import ValidationError

from proxy.errors import JSON, error_response
from proxy.logs import OPS
from proxy.settings import BackendSettings, _first_error

if TYPE_CHECKING:
    from proxy.app import Proxy
    from proxy.backends import Backend


def _describe(b: Backend) -> dict:
    return b.describe()


def _describe_public(b: Backend) -> dict:
    """What anyone may see of a backend (a proxy without keys): no URL."""
    out = b.describe()
    out.pop("url", None)
    return out


def _json(obj: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=orjson.dumps(obj), content_type=JSON)


class Admin:
    def __init__(self, proxy: Proxy) -> None:
        self.proxy = proxy

    async def handle(self, request: web.BaseRequest) -> web.StreamResponse:
        method = request.method
        parts = [p for p in request.path.split("/") if p][1:]  # after "admin"
        mutating = method not in ("GET", "HEAD")
        access = self.proxy.admin_access(request, mutating)
        if isinstance(access, web.StreamResponse):
            return access
        describe = _describe if access else _describe_public
        pool = self.proxy.pool
        if parts == ["queue"] and method == "GET":
            return _json(self.proxy.admission.snapshot())
        if parts == ["prefix"] and method == "GET":
            return _json(self._prefix())
        if not parts or parts[0] != "backends":
            return error_response(404, f"no admin route {request.path}", "not_found")
        if len(parts) == 1:
            if method == "GET":
                return _json({"backends": [describe(b) for b in pool.all()]})
            if method == "POST":
                return await self._add(request)
            return self._no_method(method)
        name = parts[1]
        if pool.get(name) is None:
            return error_response(404, f"no backend named {name!r}", "backend_not_found")
        if len(parts) == 2:
            if method == "GET":
                return _json(describe(pool.get(name)))  # type: ignore[arg-type]
            if method == "DELETE":
                b = pool.remove(name)
                self._audit(request, "remove", b)
                return _json({"removed": name, "in_flight": b.in_flight}, 202)
            return self._no_method(method)
        if len(parts) == 3 and method == "POST":
            if parts[2] == "drain":
                b = pool.drain(name)
                self._audit(request, "drain", b)
                return _json(b.describe())
            if parts[2] == "undrain":
                b = pool.undrain(name)
                self._audit(request, "undrain", b)
                if self.proxy.health is not None:
                    self.proxy.health.kick()
                return _json(b.describe())
        return error_response(404, f"no admin route {method} {request.path}", "not_found")

    async def _add(self, request: web.BaseRequest) -> web.Response:
        try:
            data = orjson.loads(await request.read())
            settings = BackendSettings.model_validate(data)
        except orjson.JSONDecodeError as e:
            return error_response(400, f"body is not valid JSON: {e}", "invalid_json")
        except ValidationError as e:
            return error_response(400, f"invalid backend: {_first_error(e)}", "invalid_backend")
        try:
            self.proxy.settings.backend_limits(settings)
        except ValueError as e:
            return error_response(400, str(e), "invalid_backend")
        if settings.name in self.proxy.pool:
            return error_response(409, f"backend {settings.name!r} exists", "backend_exists")
        b = self.proxy.pool.add(settings)
        self._audit(request, "add", b)
        return _json(b.describe(), 201)

    def _audit(self, request: web.BaseRequest, action: str, b: Backend) -> None:
        """One line per change made through the admin API: what, to which backend, by whom."""
        rid = request.headers.get(self.proxy.settings.server.request_id_header)
        OPS.info(
            "admin: %s backend %s (%s, %d in flight) from %s, request %s",
            action,
            b.name,
            b.state.value,
            b.in_flight,
            request.remote,
            rid or "-",
            extra={
                "event": "admin",
                "action": action,
                "backend": b.name,
                "state": b.state.value,
                "in_flight": b.in_flight,
                "client": request.remote,
                "request_id": rid,
            },
        )

    def _prefix(self) -> dict:
        """Prefix routing's index (size, per backend the predicted hit rate and the trust in
        its claims) beside each backend's reported hit rate."""
        prefix = self.proxy.prefix
        out: dict = {"enabled": prefix is not None}
        if prefix is not None:
            out["block_chars"] = prefix.block_chars
            out["load_factor"] = prefix.load_factor
            out["lookahead"] = prefix.lookahead
            out["lookahead_age_s"] = prefix.lookahead_age_s
            out["index"] = prefix.index.snapshot()
        out["reported"] = {
            b.name: {
                "prompt_tokens": b.stats.reported_prompt_tokens,
                "cached_tokens": b.stats.cached_tokens,
                "hit_rate": b.stats.cached_hit_rate,
            }
            for b in self.proxy.pool.all()
        }
        return out

    @staticmethod
    def _no_method(method: str) -> web.Response:
        return error_response(405, f"method {method} not allowed here", "method_not_allowed")
