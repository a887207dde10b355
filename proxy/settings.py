"""Proxy configuration: a TOML file, ``PIPEFILL_*`` environment variables, then CLI flags.

Precedence (highest first): CLI flags > environment (``PIPEFILL_SERVER__PORT=9000``; nested
sections joined with ``__``; lists such as ``PIPEFILL_BACKENDS`` as JSON) > the TOML file >
defaults. Every section rejects unknown keys so that a typo fails at start-up, naming the field.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import (
    BaseSettings,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
)

from proxy.admission import QueueSettings
from proxy.limits import LimitSettings
from proxy.policies import RoutingSettings
from proxy.scrape import ScrapeSettings
from proxy.sources import Layer, SourceError, env_layer, locate, merge


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid")


class ServerSettings(Section):
    host: str = Field("127.0.0.1", description="listen address")
    port: int = Field(8080, ge=0, le=65535, description="listen port (0 = any free port)")
    max_body_bytes: int = Field(16 * 1024 * 1024, gt=0, description="larger bodies get 413")
    max_header_bytes: int = Field(16 * 1024, gt=0, description="per header line; larger gets 431")
    max_headers: int = Field(128, gt=0, description="header lines per request; more gets 431")
    max_url_bytes: int = Field(8192, gt=0, description="longest request target; longer gets 414")
    header_timeout_s: float = Field(
        10.0, gt=0, description="a request head must arrive this soon after its first byte (408)"
    )
    body_timeout_s: float = Field(
        60.0, gt=0, description="a request body must arrive whole within this (408)"
    )
    keepalive_s: float = Field(
        75.0, gt=0, description="an idle client connection is closed after this"
    )
    max_connections: int = Field(
        4096, ge=0, description="client connections at once; more get 503 (0 = unlimited)"
    )
    api_keys: list[str] = Field(
        default_factory=list, description="client Bearer keys; empty = open"
    )
    admin_key: str | None = Field(
        None,
        description="Bearer key for /admin/* and SGLang's management routes; unset = those are "
        "off (GET /admin/* stays open, without backend URLs, only while api_keys is empty)",
    )
    metrics_public: bool | None = Field(
        None,
        description="serve /metrics without a key; unset = public unless api_keys is set",
    )
    drain_s: float = Field(
        5.0,
        ge=0,
        description="SIGTERM: /health answers 503 this long while the proxy still serves, "
        "before it stops accepting",
    )
    shutdown_grace_s: float = Field(
        30.0,
        ge=0,
        description="SIGTERM: then the time requests in flight may finish; streams still running "
        "end with an SSE error event, and the proxy exits within drain_s + shutdown_grace_s",
    )
    log_prompts: bool = Field(False, description="log request bodies (prompts) at debug level")
    log_level: Literal["debug", "info", "warning", "error"] = Field("info", description="log level")
    log_format: Literal["text", "json"] = Field(
        "text", description="log lines as text, or one JSON object per line (log pipelines)"
    )
    access_log: bool = Field(
        False,
        description="one line per request: id, route, backend, status, TTFT, tokens, duration "
        "(not for /health and /metrics)",
    )
    trust_forwarded_for: bool = Field(
        False,
        description="keep a client's X-Forwarded-For (append its address) and Forwarded: only "
        "behind a proxy that sets them; else they are replaced by the client's address",
    )
    backend_header: str = Field(
        "X-Pipefill-Backend", description="response header naming the backend that served"
    )
    request_id_header: str = Field(
        "X-Request-ID", description="taken from the client or made, and passed upstream"
    )


class TimeoutSettings(Section):
    connect_s: float = Field(5.0, gt=0, description="TCP connect to a backend")
    first_byte_s: float = Field(
        600.0, gt=0, description="request sent -> response headers (covers queueing + prefill)"
    )
    idle_s: float = Field(120.0, gt=0, description="longest gap between two streamed chunks")
    total_s: float = Field(1800.0, gt=0, description="whole upstream exchange")
    write_stall_s: float = Field(
        60.0,
        gt=0,
        description="a client that takes none of a stream's bytes for this long is cut off "
        "(its backend slot freed)",
    )


class RetrySettings(Section):
    max_attempts: int = Field(3, ge=1, description="backends tried per request, first included")
    backoff_base_s: float = Field(0.02, ge=0, description="first retry backoff (jittered)")
    backoff_max_s: float = Field(0.5, ge=0, description="backoff ceiling (doubles per attempt)")
    retry_statuses: list[int] = Field(
        default_factory=lambda: [500, 502, 503, 504],
        description="upstream statuses retried on another backend (never after bytes were sent)",
    )


class UpstreamSettings(Section):
    keepalive_s: float = Field(
        4.0, gt=0, description="idle pooled connection lifetime; SGLang closes at 5 s"
    )
    max_connections: int = Field(0, ge=0, description="0 = unlimited")
    max_connections_per_backend: int = Field(0, ge=0, description="0 = unlimited")
    max_event_bytes: int = Field(
        4 * 1024 * 1024,
        gt=0,
        description="a streamed SSE event larger than this is relayed but not read (no tokens "
        "counted; pipefill_malformed_events_total)",
    )


class HealthSettings(Section):
    path: str = Field("/health", description="/health or /health_generate")
    interval_s: float = Field(5.0, gt=0, description="seconds between active checks")
    timeout_s: float = Field(5.0, gt=0, description="an active check slower than this failed")
    healthy_threshold: int = Field(2, ge=1, description="successes to become healthy again")
    unhealthy_threshold: int = Field(2, ge=1, description="failed checks to become unhealthy")
    passive_failures: int = Field(
        3, ge=1, description="consecutive request failures that eject a backend"
    )
    eject_s: float = Field(10.0, gt=0, description="time ejected before a half-open probe")
    models_refresh_s: float = Field(
        30.0,
        gt=0,
        description="a healthy backend's /v1/models is read again this often (LoRA adapters "
        "loaded later appear; also at once after an adapter load through the proxy)",
    )

    @field_validator("path")
    @classmethod
    def _slash(cls, v: str) -> str:
        if not v.startswith("/"):
            raise ValueError("must start with '/'")
        return v


class BackendSettings(Section):
    name: str | None = Field(None, description="label in metrics and /admin (default host:port)")
    url: str = Field(description="the SGLang server, e.g. http://127.0.0.1:30000")
    parallelism: Literal["pp", "tp", "ep"] | None = Field(
        None, description="deployment hint; a pp backend's limit never goes below pp_size"
    )
    pp_size: int | None = Field(
        None, ge=1, description="pipeline stages (with parallelism pp; else SGLang's /server_info)"
    )
    weight: float = Field(
        1.0, gt=0, description="relative share of traffic (every policy divides by it)"
    )
    api_key: str | None = Field(None, description="Bearer key the backend expects")
    limits: dict[str, Any] = Field(default_factory=dict, description="overrides of [limits]")
    discover: Literal["static", "dns"] = Field(
        "static",
        description='"dns": one backend per address the URL\'s host resolves to (e.g. a '
        "Kubernetes headless Service), named name@address, resolved again every "
        "discover_interval_s; addresses that leave are drained",
    )
    discover_interval_s: float = Field(
        10.0, gt=0, description="seconds between DNS resolutions (discover = dns)"
    )

    @field_validator("url")
    @classmethod
    def _url(cls, v: str) -> str:
        parts = urlsplit(v)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("expected an http(s) URL with a host, e.g. http://127.0.0.1:30000")
        if parts.username is not None or parts.password is not None:
            raise ValueError("no user:password@ in the URL: give the backend's key as api_key")
        if parts.query or parts.fragment or "?" in v or "#" in v:
            raise ValueError("no query or fragment in a backend URL")
        try:
            parts.port  # noqa: B018  (raises on a port that is not a number in range)
        except ValueError:
            raise ValueError("the port is not a number from 0 to 65535") from None
        if parts.path.rstrip("/").rsplit("/", 1)[-1] == "v1":
            raise ValueError(
                "the server's root URL, without /v1 (the proxy appends each route's path, "
                "/v1/chat/completions included), e.g. http://127.0.0.1:30000"
            )
        return v.rstrip("/")

    @field_validator("name")
    @classmethod
    def _name(cls, v: str | None) -> str | None:
        if v is not None and (not v.isprintable() or any(c in v for c in "/ ?#%")):
            raise ValueError(f"a name without '/', spaces, '?', '#' or '%': {v!r}")
        return v

    @model_validator(mode="after")
    def _default_name(self) -> BackendSettings:
        if not self.name:
            parts = urlsplit(self.url)
            self.name = f"{parts.hostname}:{parts.port or (443 if parts.scheme == 'https' else 80)}"
        return self


class Settings(BaseSettings):
    model_config = SettingsConfigDict(extra="forbid")

    server: ServerSettings = Field(default_factory=ServerSettings)
    timeouts: TimeoutSettings = Field(default_factory=TimeoutSettings)
    retries: RetrySettings = Field(default_factory=RetrySettings)
    upstream: UpstreamSettings = Field(default_factory=UpstreamSettings)
    health: HealthSettings = Field(default_factory=HealthSettings)
    routing: RoutingSettings = Field(default_factory=RoutingSettings)
    queue: QueueSettings = Field(default_factory=QueueSettings)
    limits: LimitSettings = Field(default_factory=LimitSettings)
    scrape: ScrapeSettings = Field(default_factory=ScrapeSettings)
    backends: list[BackendSettings] = Field(default_factory=list)

    @model_validator(mode="after")
    def _unique_names(self) -> Settings:
        seen: set[str] = set()
        for b in self.backends:
            if b.name in seen:
                raise ValueError(f"backends: duplicate name {b.name!r}")
            seen.add(b.name)  # type: ignore[arg-type]
        for b in self.backends:
            self.backend_limits(b)  # validates per-backend overrides
        return self

    def backend_limits(self, backend: BackendSettings) -> LimitSettings:
        """``[limits]`` with a backend's own overrides applied (validated)."""
        if not backend.limits:
            return self.limits
        try:
            return LimitSettings.model_validate({**self.limits.model_dump(), **backend.limits})
        except ValidationError as e:
            raise ValueError(f"backends.{backend.name}.limits: {_first_error(e)}") from None

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # The file and the environment are read by load_settings (proxy/sources.py), which
        # keeps them apart until validation so that an error can name where a value came from.
        return (init_settings,)


class ConfigError(Exception):
    """A one-line, user-facing configuration problem."""


#: the command-line flags that set a key (for errors: "flag --port")
FLAGS: dict[tuple[str | int, ...], str] = {
    ("server", "host"): "--host",
    ("server", "port"): "--port",
    ("server", "log_level"): "--log-level",
    ("server", "log_format"): "--log-format",
    ("server", "access_log"): "--access-log",
    ("backends",): "--backend",
    ("routing", "policy"): "--policy",
}


def load_settings(
    config: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    **overrides: Any,
) -> Settings:
    """Build settings from file + ``PIPEFILL_*`` environment + ``overrides`` (CLI values;
    nested dicts merge), highest last.

    Raises ConfigError with a one-line message naming the source (file, variable or flag), the
    offending key, and what was expected.
    """
    layers = [Layer("command line", overrides, {p: f"flag {f}" for p, f in FLAGS.items()})]
    try:
        layers.append(env_layer(os.environ if environ is None else environ, Settings))
    except SourceError as e:
        raise ConfigError(str(e)) from None
    if config is not None:
        path = Path(config)
        if not path.is_file():
            raise ConfigError(f"config file not found: {path}")
        try:
            layers.append(Layer(str(path), tomllib.loads(path.read_text())))
        except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path}: invalid TOML: {e}") from None
    merged: dict[str, Any] = {}
    for layer in reversed(layers):
        merged = merge(merged, layer.data)
    try:
        return Settings(**merged)
    except ValidationError as e:
        raise ConfigError(_first_error(e, layers)) from None


def _first_error(e: ValidationError, layers: list[Layer] | None = None) -> str:
    """One line: where (file, variable, flag), which key, what is wrong and what was given."""
    errors = e.errors()
    err = errors[0]
    loc: tuple[str | int, ...] = tuple(err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if not loc and ": " in msg:  # a model-level check names its key first ("backends.x: ...")
        head, rest = msg.split(": ", 1)
        if head.split(".", 1)[0] in Settings.model_fields:
            loc = tuple(int(p) if p.isdigit() else p for p in head.split("."))
            msg = rest
    if "input" in err and not isinstance(err["input"], dict | list):
        got = repr(err["input"])
        if got not in msg:
            msg += f" (got {got})"
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    key = ".".join(str(p) for p in loc)
    text = f"{key}: {msg}{more}" if key else f"{msg}{more}"
    where = locate(layers, loc) if layers else None
    return f"{where}: {text}" if where else text
