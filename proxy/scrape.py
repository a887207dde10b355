"""Scrape each backend's SGLang gauges: the confirming signal for the limits.

Every ``interval_s`` each backend's ``/metrics`` is fetched and reduced to four numbers, landed in
``backend.stats.observe_scrape`` (and once, and after each restart, the server's word from
``/server_info``: ``max_running_requests``, the most requests it runs at once, and ``pp_size``,
its pipeline's stages). A backend that
answers 404 for ``/metrics`` (SGLang's default: metrics need ``--enable-metrics``) is read from
its load report instead (``/v1/loads``: queue and running counts, no restarts or retractions),
and its ``/server_info`` is still asked; one without either gives the limit only its word.

How the series are combined follows SGLang's metrics collector (the label sets its schedulers
write, see docs/limits-and-routing.md):

- a series with a ``pid`` label is a per-process value (a gauge in prometheus-client's "all"
  multiprocess mode, e.g. ``sglang:num_retracted_reqs``), not the server's state: skipped;
- with ``--enable-priority-scheduling`` the running/queue gauges are written as a total under
  ``priority=""`` and again per priority: only the total (or a series without the label) counts;
- every pipeline stage writes the same requests: only ``pp_rank="0"`` counts;
- each DP rank (``dp_rank``; with DP attention ``tp_rank`` and ``moe_ep_rank`` equal it) has its
  own scheduler: ranks are summed. Within one DP rank, the copies that
  ``--enable-metrics-for-all-schedulers`` adds for the other TP ranks repeat the same state: the
  lowest rank is kept;
- ``sglang:token_usage`` is a ratio of one rank's KV pool: the fullest rank, never a sum;
- ``sglang:generation_tokens_total``: summed; when it goes backwards the backend restarted;
- ``sglang:num_retracted_requests_total``: summed; running requests SGLang pushed back to its
  queue because its KV pool ran out (it admitted more than the pool holds).

With ``use_loads`` the queue and running counts come from the server's load report instead
(fresher: it asks the scheduler, while SGLang's gauges refresh only every 40 decode steps and keep
their value when idle): ``/v1/loads``, or the deprecated ``/get_load`` on a server without it. A
scrape that fails or times out leaves the last values in place and ages them;
:class:`proxy.stats.BackendStats` counts a backend whose last success is older than
``stale_after_intervals`` intervals as saturated.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import aiohttp
import orjson
from pydantic import AliasChoices, BaseModel, ConfigDict, Field

from proxy import __version__
from proxy.routed import Scraped
from proxy.tasks import stop_task

log = logging.getLogger("proxy.scrape")

_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([A-Za-z_][A-Za-z0-9_]*)="((?:[^"\\]|\\.)*)"')
#: labels of the TP ranks that repeat one DP rank's scheduler state (the lowest is kept)
_REPEAT_LABELS = ("attn_tp_rank", "tp_rank", "moe_ep_rank")
#: gauges that are a ratio of one rank's pool: the fullest rank is taken, never a sum
_RATIOS = frozenset({"sglang:token_usage"})
WANTED = (
    "sglang:num_queue_reqs",
    "sglang:num_running_reqs",
    "sglang:token_usage",
    "sglang:generation_tokens_total",
    "sglang:num_retracted_requests_total",
)


#: the scraper names itself to the servers it asks (their access logs, and test fakes)
USER_AGENT = f"pipefill/{__version__} scrape"


class _NotServed(Exception):
    pass


class ScrapeSettings(BaseModel):
    """``[scrape]``."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = True
    interval_s: float = Field(1.0, gt=0, description="seconds between scrapes of one backend")
    timeout_s: float = Field(1.0, gt=0, description="one scrape's timeout")
    stale_after_intervals: float = Field(
        3.0,
        gt=0,
        description="a last success older than this many intervals (and than interval + 2 x "
        "timeout) = saturated",
    )
    path: str = Field("/metrics", description="the backend's Prometheus endpoint")
    use_loads: bool = Field(
        False,
        validation_alias=AliasChoices("use_loads", "use_get_load"),
        description="queue/running counts from /v1/loads (or /get_load on older SGLang) even "
        "where /metrics is served (without it they come from /v1/loads anyway); use_get_load "
        "is an older name for it",
    )


def parse_metrics(text: str) -> dict[str, float | None]:
    """Reduce a Prometheus text page to the numbers we use (None when absent), combining the
    series as the module docstring says."""
    # (name, dp_rank) -> (repeat rank, value): one value per DP rank, its lowest TP rank's
    kept: dict[tuple[str, str], tuple[tuple[int, ...], float]] = {}
    for line in text.splitlines():
        if not line.startswith("sglang:"):
            continue
        m = _LINE.match(line)
        if m is None:
            continue
        name = m.group(1)
        if name not in WANTED:
            continue
        labels = dict(_LABEL.findall(m.group(3) or ""))
        if "pid" in labels or labels.get("priority", "") or labels.get("pp_rank", "0") != "0":
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        if value != value:  # NaN
            continue
        rank = _repeat_rank(labels)
        if rank is None:
            continue
        key = (name, labels.get("dp_rank", ""))
        seen = kept.get(key)
        if seen is None or rank < seen[0]:
            kept[key] = (rank, value)
    sums: dict[str, float] = {}
    for (name, _dp), (_rank, value) in kept.items():
        if name in _RATIOS:
            sums[name] = max(sums.get(name, 0.0), value)
        else:
            sums[name] = sums.get(name, 0.0) + value
    return {
        "queue_reqs": sums.get("sglang:num_queue_reqs"),
        "running_reqs": sums.get("sglang:num_running_reqs"),
        "token_usage": sums.get("sglang:token_usage"),
        "generation_tokens_total": sums.get("sglang:generation_tokens_total"),
        "retractions_total": sums.get("sglang:num_retracted_requests_total"),
    }


def _repeat_rank(labels: dict[str, str]) -> tuple[int, ...] | None:
    """Where a series stands among the TP ranks repeating one DP rank (lower is kept); None
    for a rank label that is not a number."""
    try:
        return tuple(int(labels.get(k) or 0) for k in _REPEAT_LABELS)
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class ServerWord:
    """What a server says of itself: the most requests it runs at once, and its pipeline
    stages (each None when not said)."""

    max_running_requests: int | None = None
    pp_size: int | None = None


def _count(info: Any, key: str) -> int | None:
    """``info[key]`` when it is a positive whole number, else None."""
    value = info.get(key) if isinstance(info, dict) else None
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    return None


def parse_server_info(body: bytes) -> ServerWord:
    """``/server_info``'s ``max_running_requests`` and ``pp_size`` (SGLang's server arguments;
    each None when unset or not a positive whole number)."""
    info = orjson.loads(body)
    return ServerWord(_count(info, "max_running_requests"), _count(info, "pp_size"))


#: a load report's row has at least one of these
_LOAD_COUNTS = frozenset({"num_waiting_reqs", "num_running_reqs", "num_reqs"})


def parse_loads(body: bytes) -> dict[str, float | None]:
    """``/v1/loads`` (``{"loads": [{dp_rank, num_running_reqs, num_waiting_reqs, token_usage,
    ...}]}``) or the older ``/get_load`` (one row per DP rank with ``num_reqs`` = running +
    waiting, and ``num_waiting_reqs``): queue and running summed over DP ranks, and
    ``token_usage`` (the fullest rank) when the report has it. ValueError for a body that is
    not such a report (not JSON, or no row with a count: a server that answers any path)."""
    rows = orjson.loads(body)
    if isinstance(rows, dict):
        rows = rows.get("loads") or [rows]
    if not isinstance(rows, list):
        raise ValueError("not a load report")
    rows = [r for r in rows if isinstance(r, dict) and not _LOAD_COUNTS.isdisjoint(r)]
    if not rows:
        raise ValueError("not a load report: no row counts requests")
    queue = running = 0.0
    usage: float | None = None
    for row in rows:
        waiting = float(row.get("num_waiting_reqs", 0) or 0)
        queue += waiting
        if "num_running_reqs" in row:
            running += float(row.get("num_running_reqs") or 0)
        else:
            running += max(0.0, float(row.get("num_reqs", waiting) or 0) - waiting)
        ratio = row.get("token_usage")
        if isinstance(ratio, int | float) and not isinstance(ratio, bool):
            usage = max(usage or 0.0, float(ratio))
    out: dict[str, float | None] = {"queue_reqs": queue, "running_reqs": running}
    if usage is not None:
        out["token_usage"] = usage
    return out


parse_get_load = parse_loads  # the older name


def parse_loads_max_running(body: bytes) -> int | None:
    """``/v1/loads``' ``max_running_requests``, summed over DP ranks (each rank's scheduler runs
    its own); None unless every rank reports a positive whole number."""
    report = orjson.loads(body)
    rows = report.get("loads") if isinstance(report, dict) else None
    if not isinstance(rows, list) or not rows:
        return None
    total = 0
    for row in rows:
        value = _count(row, "max_running_requests")
        if value is None:
            return None
        total += value
    return total


#: where a server reports its load, newest first (``/get_load`` is deprecated in SGLang and
#: logs a warning per call)
LOAD_PATHS = ("/v1/loads", "/get_load")


class Scraper:
    """Scrapes every backend of ``pool`` periodically (``start()``/``close()``)."""

    def __init__(
        self,
        pool: Any,
        settings: ScrapeSettings | None = None,
        *,
        session: aiohttp.ClientSession | None = None,
        clock: Callable[[], float] = time.monotonic,
        on_scrape: Callable[[Any], None] | None = None,
    ) -> None:
        self.pool = pool
        self.s = settings or ScrapeSettings()
        self._session = session
        self._own_session = session is None
        self._clock = clock
        self._task: asyncio.Task | None = None
        #: called after each backend's scrape (e.g. ``admission.wake`` when limits may move)
        self.on_scrape = on_scrape
        #: per backend, the load path it served last (one without /v1/loads: /get_load)
        self._load_path: dict[str, str] = {}

    @property
    def stale_after_s(self) -> float:
        """A few intervals, but never less than an interval plus two timeouts: a scrape takes
        wall time however fast the interval (a loaded machine must not read as saturated)."""
        s = self.s
        return max(s.interval_s * s.stale_after_intervals, s.interval_s + 2 * s.timeout_s)

    def _backends(self) -> list[Scraped]:
        return list(self.pool)

    async def _get(self, url: str, headers: dict[str, str] | None) -> bytes:
        if self._session is None:
            self._session = aiohttp.ClientSession()
        timeout = aiohttp.ClientTimeout(total=self.s.timeout_s)
        headers = {**(headers or {}), "User-Agent": USER_AGENT}
        async with self._session.get(url, headers=headers, timeout=timeout) as resp:
            if resp.status == 404:
                raise _NotServed(f"HTTP 404 for {url}")
            if resp.status != 200:
                raise RuntimeError(f"HTTP {resp.status}")
            return await resp.read()

    async def scrape_once(self, backend: Any) -> bool:
        """Scrape one backend and land the result in its stats. Returns success."""
        stats = backend.stats
        api_key = backend.api_key
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
        base = str(backend.url).rstrip("/")
        if stats.scrape.source != "metrics":
            ok = await self._scrape_loads(backend, base, headers)
            await self._ask_server_info(backend, base, headers)
            return ok
        stats.stale_after_s = self.stale_after_s
        try:
            values = parse_metrics((await self._get(base + self.s.path, headers)).decode())
            if self.s.use_loads:
                values.update(parse_loads(await self._loads(backend.name, base, headers)))
        except asyncio.CancelledError:
            raise
        except _NotServed as e:
            # SGLang without --enable-metrics (started so, or restarted so: a 404 is the
            # server's answer, not a failure to age the counts by): its load report says the
            # same counts. Asked for metrics again when health sees it come back.
            log.warning(
                "backend %s: %s; reading its queue from /v1/loads instead (start SGLang "
                "with --enable-metrics for its metrics)",
                backend.name,
                e,
            )
            stats.stale_after_s = None
            stats.scrape.source = "loads"
            return await self.scrape_once(backend)
        except Exception as e:  # any failure ages the metrics; the limit treats stale as full
            stats.observe_scrape(ok=False, error=f"{type(e).__name__}: {e}"[:200])
            return False
        stats.observe_scrape(ok=True, **values)
        await self._ask_server_info(backend, base, headers)
        return True

    async def _scrape_loads(self, backend: Any, base: str, headers: dict[str, str] | None) -> bool:
        """A backend without metrics: its queue and running counts from ``/v1/loads`` (SGLang
        answers it from the scheduler, metrics or not). One without that either (an older
        SGLang: ``/get_load`` logs a deprecation warning per call, so it is not polled
        unasked) is never scraped, so never "stale" either."""
        stats = backend.stats
        if stats.scrape.source == "none":
            return False
        stats.stale_after_s = self.stale_after_s
        try:
            values = parse_loads(await self._get(base + LOAD_PATHS[0], headers))
        except asyncio.CancelledError:
            raise
        except (_NotServed, ValueError) as e:
            # not served (now), or what answers at first is not one
            if isinstance(e, _NotServed) or stats.scrape.ok_at is None:
                log.warning(
                    "backend %s: no load report either (%s); not scraping it", backend.name, e
                )
                stats.stale_after_s = None
                stats.scrape.source = "none"
                return False
            stats.observe_scrape(ok=False, error=f"load report: {e}"[:200])
            return False
        except Exception as e:  # as for metrics: failures age the counts
            stats.observe_scrape(ok=False, error=f"{type(e).__name__}: {e}"[:200])
            return False
        stats.observe_scrape(ok=True, **values)
        return True

    async def _ask_server_info(
        self, backend: Any, base: str, headers: dict[str, str] | None
    ) -> None:
        """Once, and again after each restart the metrics show (without metrics: once)."""
        stats = backend.stats
        if stats.scrape.word_asked == stats.scrape.restarts:
            return
        stats.scrape.word_asked = stats.scrape.restarts
        word = await self._server_info(base, headers)
        stats.scrape.max_running_requests = word.max_running_requests
        stats.scrape.pp_size = word.pp_size

    async def _loads(self, name: str, base: str, headers: dict[str, str] | None) -> bytes:
        """The load report: ``/v1/loads`` where the server has it, else ``/get_load``."""
        known = self._load_path.get(name)
        for path in (known,) if known else LOAD_PATHS:
            try:
                body = await self._get(base + path, headers)
            except _NotServed:
                if known or path == LOAD_PATHS[-1]:
                    raise RuntimeError(f"no load report at {path}") from None
                continue
            self._load_path[name] = path
            return body
        raise RuntimeError("no load report")  # not reached

    async def _server_info(self, base: str, headers: dict[str, str] | None) -> ServerWord:
        """What the server says of itself; asked once, and again after a restart. Newer SGLang
        serves ``/server_info``, older ``/get_server_info``; no answer is no hint.

        ``/server_info`` repeats the server's arguments: its ``max_running_requests`` is null
        unless the operator set ``--max-running-requests``. What the scheduler derived from its
        memory is then only in the load report, ``/v1/loads``, per DP rank."""
        word = ServerWord()
        for path in ("/server_info", "/get_server_info"):
            try:
                word = parse_server_info(await self._get(base + path, headers))
            except asyncio.CancelledError:
                raise
            except _NotServed:
                continue
            except Exception:  # failed, or not JSON (orjson's error is a ValueError): no word
                pass
            break
        if word.max_running_requests is None:
            try:
                running = parse_loads_max_running(await self._get(base + LOAD_PATHS[0], headers))
            except asyncio.CancelledError:
                raise
            except Exception:
                running = None
            word = replace(word, max_running_requests=running)
        return word

    async def scrape_all(self) -> None:
        backends = self._backends()
        if backends:
            await asyncio.gather(*(self.scrape_once(b) for b in backends))
        if self.on_scrape is not None:
            for b in backends:
                self.on_scrape(b)

    def start(self) -> asyncio.Task | None:
        if not self.s.enabled:
            return None
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())
        return self._task

    async def _run(self) -> None:
        while True:
            started = self._clock()
            try:
                await self.scrape_all()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("scrape round failed")
            elapsed = self._clock() - started
            await asyncio.sleep(max(0.0, self.s.interval_s - elapsed))

    async def close(self) -> None:
        task, self._task = self._task, None
        await stop_task(task)
        if self._own_session and self._session is not None:
            await self._session.close()
            self._session = None
