"""Which SGLang routes the proxy forwards, and how: an allow-list, checked against SGLang's
``http_server.py`` (see docs/proxy.md, "Security model").

- **admitted**: inference, every route SGLang generates (or embeds, scores) on. The body must be
  a JSON object; the request waits in the proxy's queue for as many backend slots as it has
  sequences (proxy/sequences.py) and its stream is peeked at for tokens in its own format
  (proxy/sse.py: OpenAI, native, Anthropic, Responses, Ollama's NDJSON).
- **passed**: read-only information and cheap CPU-side helpers (model info, tokenize). A client
  key opens them (when keys are set); they go to one healthy backend and hold no slot.
- **admin**: what changes or exposes a server (cache, weights, profiling, adapters, pausing,
  the full server configuration). The admin key opens them; ``fanout`` routes go to every
  backend (or the one named in the backend header) with one combined answer, the others to
  one backend, passed through unchanged.

Everything else is a 404 from the proxy, never forwarded.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from proxy.sequences import Body
from proxy.sse import Api


class Access(enum.StrEnum):
    ADMITTED = "admitted"
    PASSED = "passed"
    ADMIN = "admin"


@dataclass(frozen=True, slots=True)
class Route:
    api: Api | None  # how to read its SSE events (None: relay only)
    methods: frozenset[str]
    access: Access = Access.ADMITTED
    fanout: bool = False  # admin: sent to every backend, answered per backend
    body: Body = "single"  # admitted: how its sequences are counted
    stream_default: bool = False  # admitted: streamed when the body says nothing (Ollama's)
    streamable: bool = True  # admitted: False where SGLang answers whole whatever "stream" says

    @property
    def admitted(self) -> bool:
        return self.access is Access.ADMITTED


GET = frozenset({"GET"})
POST = frozenset({"POST"})
POST_PUT = frozenset({"POST", "PUT"})
GET_POST = frozenset({"GET", "POST"})


def _passed(methods: frozenset[str]) -> Route:
    return Route(None, methods, Access.PASSED)


def _admin(methods: frozenset[str], *, fanout: bool = False) -> Route:
    return Route(None, methods, Access.ADMIN, fanout)


#: Inference: through the queue and the limits.
ADMITTED: dict[str, Route] = {
    "/v1/chat/completions": Route("chat", POST, body="chat"),
    "/v1/completions": Route("completions", POST, body="completions"),
    "/generate": Route("generate", POST_PUT, body="generate"),
    "/v1/messages": Route("messages", POST),  # Anthropic Messages
    "/v1/responses": Route("responses", POST),  # OpenAI Responses (state kept on the server)
    "/api/chat": Route("ollama_chat", POST, stream_default=True),  # Ollama: streams by default
    "/api/generate": Route("ollama_generate", POST, stream_default=True),
    "/invocations": Route("chat", POST, body="chat"),  # SageMaker: a chat completion
    # Vertex AI: one /generate output per instance under "predictions", always answered whole
    "/vertex_generate": Route("generate", POST, body="vertex", streamable=False),
    "/v1/embeddings": Route(None, POST, body="embeddings"),
    "/v1/rerank": Route(None, POST_PUT),
    "/v1/score": Route(None, POST),
    "/v1/classify": Route(None, POST),
    "/encode": Route(None, POST_PUT),
    "/classify": Route(None, POST_PUT),
}

#: Everything else the proxy forwards, by exact path.
OTHER: dict[str, Route] = {
    # read-only information
    "/v1/models": _passed(GET),  # answered by the proxy once it knows the backends' models
    "/get_model_info": _passed(GET),
    "/model_info": _passed(GET),
    "/get_weight_version": _passed(GET),
    "/health_generate": _passed(GET),
    "/ping": _passed(GET),
    "/get_load": _passed(GET),
    "/v1/loads": _passed(GET),
    # CPU-side helpers: no generation
    "/v1/tokenize": _passed(POST),
    "/tokenize": _passed(POST),
    "/v1/detokenize": _passed(POST),
    "/detokenize": _passed(POST),
    "/parse_function_call": _passed(POST),
    "/separate_reasoning": _passed(POST),
    # sessions live on one server: sent to the one that opened them (proxy/affinity.py)
    "/open_session": _passed(GET_POST),
    "/close_session": _passed(GET_POST),
    # the server's whole configuration (server_args, including its --api-key): admin only
    "/get_server_info": _admin(GET),
    "/server_info": _admin(GET),
    "/get_weights_by_name": _admin(GET_POST),
    # weight sync with per-server process groups: one backend (name it in the backend header)
    "/update_weights_from_tensor": _admin(POST),
    "/update_weights_from_distributed": _admin(POST),
    "/update_weights_from_ipc": _admin(POST),
    "/init_weights_update_group": _admin(POST),
    "/destroy_weights_update_group": _admin(POST),
    "/init_weights_send_group_for_remote_instance": _admin(POST),
    "/send_weights_to_remote_instance": _admin(POST),
    # what an operator means for the whole fleet: every backend, one answer per backend
    "/flush_cache": _admin(GET_POST, fanout=True),
    "/clear_hicache_storage_backend": _admin(GET_POST, fanout=True),
    "/abort_request": _admin(POST, fanout=True),
    "/pause_generation": _admin(POST, fanout=True),
    "/continue_generation": _admin(POST, fanout=True),
    "/update_weights_from_disk": _admin(POST, fanout=True),
    "/update_weight_version": _admin(POST, fanout=True),
    "/load_lora_adapter": _admin(POST, fanout=True),
    "/unload_lora_adapter": _admin(POST, fanout=True),
    "/start_profile": _admin(GET_POST, fanout=True),
    "/stop_profile": _admin(GET_POST, fanout=True),
    "/freeze_gc": _admin(GET_POST, fanout=True),
    "/start_expert_distribution_record": _admin(GET_POST, fanout=True),
    "/stop_expert_distribution_record": _admin(GET_POST, fanout=True),
    "/dump_expert_distribution_record": _admin(GET_POST, fanout=True),
    "/release_memory_occupation": _admin(GET_POST, fanout=True),
    "/resume_memory_occupation": _admin(GET_POST, fanout=True),
    "/slow_down": _admin(GET_POST, fanout=True),
    "/configure_logging": _admin(GET_POST, fanout=True),
    "/set_internal_state": _admin(POST_PUT, fanout=True),
}

_MODEL = _passed(GET)
_RESPONSE = _passed(GET)
_CANCEL = _passed(POST)


def lookup(path: str) -> Route | None:
    """The route a non-admitted path takes, or None (404)."""
    route = OTHER.get(path)
    if route is not None:
        return route
    if path.startswith("/v1/models/") and len(path) > 11:
        return _MODEL  # GET /v1/models/{model:path}
    if path.startswith("/v1/responses/"):
        rest = path[14:]
        if rest and "/" not in rest:
            return _RESPONSE  # GET /v1/responses/{id}
        rid, _, tail = rest.partition("/")
        if rid and tail == "cancel":
            return _CANCEL  # POST /v1/responses/{id}/cancel
    return None
