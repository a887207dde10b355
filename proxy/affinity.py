"""Routing that keeps state where it is: some requests can only be served by one backend.

- **model**: a request naming a ``model`` (or, on ``/generate``, a ``lora_path``) goes only to
  backends whose ``/v1/models`` lists it, LoRA adapters included (the list is read again every
  ``health.models_refresh_s`` and at once after an adapter load or unload through the proxy). A
  model no backend lists restricts nothing: the backend answers it (SGLang serves its one model
  under any name).
- **response**: ``/v1/responses`` stores each response in the memory of the server that made it.
  A request with ``previous_response_id``, and ``GET /v1/responses/{id}`` or ``POST
  /v1/responses/{id}/cancel``, go to that server. The proxy learns the id from the request's own
  ``request_id`` (SGLang's id for it) or from a whole (non-streamed) answer's ``id``.
- **session**: ``/open_session`` opens a session on one server; a request whose
  ``session_params.id`` names it, and ``/close_session``, go there. The id is learned from the
  request's ``session_id`` or from ``/open_session``'s answer (the id, as a JSON string).

Ids are kept in bounded, least-recently-used tables (``MAX_IDS`` each): an id the proxy does not
know restricts nothing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from typing import Any, Protocol

import orjson

#: response and session ids remembered (each table), least recently used dropped first
MAX_IDS = 100_000

RESPONSES = "/v1/responses"
OPEN_SESSION = "/open_session"
CLOSE_SESSION = "/close_session"


class ServesModels(Protocol):
    @property
    def name(self) -> str: ...
    @property
    def models(self) -> list[dict]: ...


class _Table:
    def __init__(self, cap: int) -> None:
        self._cap = cap
        self._d: OrderedDict[str, str] = OrderedDict()

    def put(self, key: str, backend: str) -> None:
        self._d[key] = backend
        self._d.move_to_end(key)
        while len(self._d) > self._cap:
            self._d.popitem(last=False)

    def get(self, key: Any) -> str | None:
        if not isinstance(key, str):
            return None
        backend = self._d.get(key)
        if backend is not None:
            self._d.move_to_end(key)
        return backend

    def pop(self, key: Any) -> None:
        if isinstance(key, str):
            self._d.pop(key, None)

    def __len__(self) -> int:
        return len(self._d)


class Affinity:
    def __init__(self, max_ids: int = MAX_IDS) -> None:
        self.responses = _Table(max_ids)
        self.sessions = _Table(max_ids)

    # ---- where a request must go ----------------------------------------------------------

    def pinned(self, path: str, obj: dict[str, Any] | None) -> str | None:
        """The one backend holding this request's state, if the proxy knows it."""
        if path.startswith(RESPONSES + "/"):
            return self.responses.get(path[len(RESPONSES) + 1 :].partition("/")[0])
        if path == CLOSE_SESSION and obj is not None:
            return self.sessions.get(obj.get("session_id"))
        if obj is None:
            return None
        if path == RESPONSES and obj.get("previous_response_id"):
            return self.responses.get(obj["previous_response_id"])
        params = obj.get("session_params")
        if isinstance(params, dict):
            return self.sessions.get(params.get("id"))
        return None

    @staticmethod
    def serving(obj: dict[str, Any] | None, backends: Iterable[ServesModels]) -> set[str] | None:
        """Names of the backends that list the model (or LoRA adapter) the request names; None
        when it names none, or none lists it."""
        if obj is None:
            return None
        wanted = obj.get("model")
        if not isinstance(wanted, str) or not wanted:
            wanted = obj.get("lora_path")
        if not isinstance(wanted, str) or not wanted:
            return None
        names = {b.name for b in backends if any(m.get("id") == wanted for m in b.models)}
        return names or None

    # ---- learning where state was made ---------------------------------------------------

    def learn(self, path: str, obj: dict[str, Any] | None, answer: bytes | None, backend: str):
        """After a 2xx answer from ``backend``: remember the response or session it made."""
        if path == RESPONSES:
            rid = obj.get("request_id") if obj else None
            if not isinstance(rid, str):
                rid = _field(answer, "id")
            if isinstance(rid, str) and rid:
                self.responses.put(rid, backend)
        elif path == OPEN_SESSION:
            sid = obj.get("session_id") if obj else None
            if not isinstance(sid, str) and answer:
                try:
                    sid = orjson.loads(answer)
                except orjson.JSONDecodeError:
                    sid = None
            if isinstance(sid, str) and sid:
                self.sessions.put(sid, backend)
        elif path == CLOSE_SESSION and obj is not None:
            self.sessions.pop(obj.get("session_id"))


def _field(answer: bytes | None, key: str) -> Any:
    if not answer or answer[:1] != b"{":
        return None
    try:
        obj = orjson.loads(answer)
    except orjson.JSONDecodeError:
        return None
    return obj.get(key) if isinstance(obj, dict) else None
