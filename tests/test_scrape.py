"""Scraping SGLang's /metrics: rank aggregation, restarts, staleness, a 404 backend."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
from adapt_fakes import FakeBackend, FakeClock
from aiohttp import web
from conftest import free_port
from sim_util import running_sim, wait_until

from proxy.scrape import (
    Scraper,
    ScrapeSettings,
    parse_get_load,
    parse_loads,
    parse_loads_max_running,
    parse_metrics,
    parse_server_info,
)
from proxy.stats import BackendStats

PAGE = """\
# HELP sglang:num_queue_reqs The number of requests in the waiting queue.
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="m",engine_type="unified",tp_rank="0",pp_rank="0",dp_rank="0"} 3.0
sglang:num_queue_reqs{model_name="m",engine_type="unified",tp_rank="0",pp_rank="0",dp_rank="1"} 2.0
sglang:num_queue_reqs{model_name="m",engine_type="unified",tp_rank="1",pp_rank="0",dp_rank="0"} 3.0
sglang:num_running_reqs{model_name="m",tp_rank="0",dp_rank="0"} 10.0
sglang:num_running_reqs{model_name="m",tp_rank="0",dp_rank="1"} 12.0
sglang:token_usage{model_name="m",tp_rank="0",dp_rank="0"} 0.5
sglang:token_usage{model_name="m",tp_rank="0",dp_rank="1"} 0.75
sglang:num_used_tokens{model_name="m",tp_rank="0"} 999.0
# TYPE sglang:generation_tokens counter
sglang:generation_tokens_total{model_name="m"} 1234.0
sglang:generation_tokens_created{model_name="m"} 1.7e9
sglang:num_retracted_requests_total{model_name="m",dp_rank="0"} 4.0
sglang:num_retracted_requests_total{model_name="m",dp_rank="1"} 3.0
"""


def test_parse_sums_ranks_once_and_takes_the_fullest_kv_pool():
    v = parse_metrics(PAGE)
    assert v["queue_reqs"] == 5.0  # dp ranks summed, tp_rank 1 repeats rank 0 and is skipped
    assert v["running_reqs"] == 22.0
    assert v["token_usage"] == 0.75
    assert v["generation_tokens_total"] == 1234.0
    assert v["retractions_total"] == 7.0


def test_parse_missing_metrics_are_none():
    v = parse_metrics("# nothing here\nother_metric 1\n")
    assert v == {
        "queue_reqs": None,
        "running_reqs": None,
        "token_usage": None,
        "generation_tokens_total": None,
        "retractions_total": None,
    }


def test_parse_get_load_rows():
    body = (
        b'[{"dp_rank":0,"num_reqs":7,"num_waiting_reqs":2,"num_tokens":100},'
        b'{"dp_rank":1,"num_reqs":3,"num_waiting_reqs":0,"num_tokens":50}]'
    )
    assert parse_get_load(body) == {"queue_reqs": 2.0, "running_reqs": 8.0}


def test_counter_going_backwards_marks_a_restart():
    clock = FakeClock()
    st = BackendStats(clock=clock)
    st.observe_scrape(ok=True, generation_tokens_total=500.0)
    assert st.take_window().restarted is False
    st.observe_scrape(ok=True, generation_tokens_total=20.0)
    assert st.scrape.restarts == 1
    assert st.take_window().restarted is True
    assert st.take_window().restarted is False


def test_stale_after_failures():
    clock = FakeClock()
    st = BackendStats(clock=clock, stale_after_s=3.0)
    assert st.scrape_stale() is False  # never scraped: not stale
    st.observe_scrape(ok=True, queue_reqs=1.0, token_usage=0.2)
    clock.advance(2.0)
    st.observe_scrape(ok=False, error="timeout")
    assert st.scrape_stale() is False
    w = st.take_window()
    assert w.queue_reqs == 1.0 and w.stale is False
    clock.advance(2.0)
    st.observe_scrape(ok=False, error="timeout")
    assert st.scrape_stale() is True
    w = st.take_window()
    assert w.stale is True and w.queue_reqs is None  # stale values are not passed on


async def _serve(routes: dict[str, bytes | int]) -> tuple[web.AppRunner, str]:
    app = web.Application()
    for path in routes:

        async def handler(_request, path=path):
            answer = routes[path]  # read per request: a test may change what the server says
            if isinstance(answer, int):
                return web.Response(status=answer)
            return web.Response(body=answer)

        app.router.add_get(path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    return runner, f"http://127.0.0.1:{port}"


@contextlib.asynccontextmanager
async def _scraping(routes: dict, name: str = "a"):
    """A fake backend serving ``routes`` and a scraper of it (both closed after)."""
    runner, url = await _serve(routes)
    b = FakeBackend(name, url=url)
    scraper = Scraper([b], ScrapeSettings(interval_s=0.5))
    try:
        yield b, scraper
    finally:
        await scraper.close()
        await runner.cleanup()


async def test_scraper_lands_gauges_in_stats():
    runner, url = await _serve(
        {
            "/metrics": PAGE.encode(),
            "/get_load": b'[{"num_reqs": 9, "num_waiting_reqs": 4}]',
        }
    )
    b = FakeBackend("a", url=url)
    seen = []
    scraper = Scraper([b], ScrapeSettings(interval_s=0.5), on_scrape=seen.append)
    try:
        await scraper.scrape_all()
        assert b.stats.scrape.queue_reqs == 5.0 and b.stats.scrape.token_usage == 0.75
        assert b.stats.stale_after_s == 2.5 and seen == [b]  # interval + 2 x timeout
        scraper.s = ScrapeSettings(use_get_load=True)
        assert await scraper.scrape_once(b)
        assert b.stats.scrape.queue_reqs == 4.0 and b.stats.scrape.running_reqs == 5.0
    finally:
        await scraper.close()
        await runner.cleanup()


async def test_scraper_failure_and_404():
    runner, url = await _serve({"/metrics": 500})
    failing = FakeBackend("fails", url=url)
    missing = FakeBackend("nometrics", url=url)
    scraper = Scraper([failing], ScrapeSettings(path="/metrics"))
    scraper404 = Scraper([missing], ScrapeSettings(path="/absent"))
    try:
        assert not await scraper.scrape_once(failing)
        assert failing.stats.scrape.errors == 1 and failing.stats.scrape_stale()
        # A backend without /metrics or a load report is not scraped (never stale, limits not
        # pinned).
        assert not await scraper404.scrape_once(missing)
        assert missing.stats.scrape.source == "none"  # no load report either
        assert not missing.stats.scrape_stale()
        unreachable = FakeBackend("down", url=f"http://127.0.0.1:{free_port()}")
        assert not await scraper.scrape_once(unreachable)
        assert unreachable.stats.scrape_stale()
    finally:
        await scraper.close()
        await scraper404.close()
        await runner.cleanup()


async def test_a_backend_without_metrics_is_still_asked_what_it_runs():
    # SGLang's default (no --enable-metrics): /metrics is 404, /server_info is served
    routes = {"/metrics": 404, "/server_info": b'{"max_running_requests": 64}'}
    async with _scraping(routes) as (b, scraper):
        assert not await scraper.scrape_once(b)
        assert b.stats.scrape.source == "none" and not b.stats.scrape_stale()
        assert b.stats.take_window().max_running == 64
        b.stats.scrape.max_running_requests = None  # asked once: no restart can be seen
        assert not await scraper.scrape_once(b)
        assert b.stats.scrape.max_running_requests is None


async def test_a_backend_without_metrics_is_read_from_its_load_report():
    routes = {
        "/metrics": 404,
        "/v1/loads": b'{"loads": [{"dp_rank": 0, "num_running_reqs": 30, '
        b'"num_waiting_reqs": 5, "token_usage": 0.5, "max_running_requests": 32}]}',
    }
    async with _scraping(routes) as (b, scraper):
        assert await scraper.scrape_once(b)
        assert (b.stats.scrape.queue_reqs, b.stats.scrape.running_reqs) == (5.0, 30.0)
        assert b.stats.scrape.max_running_requests == 32  # no /server_info: the report's
        assert b.stats.stale_after_s == scraper.stale_after_s and not b.stats.scrape_stale()
        assert await scraper.scrape_once(b)  # and again each interval (not /metrics)
        assert b.stats.snapshot()["scrape"]["source"] == "loads"


async def test_a_server_answering_any_path_is_not_read_as_a_load_report():
    # a catch-all 200 (HTML, or JSON without counts) is no report: never scraped, never stale
    for page in (b"<html>hello</html>", b'{"path": "/v1/loads"}'):
        async with _scraping({"/metrics": 404, "/v1/loads": page}) as (b, scraper):
            assert not await scraper.scrape_once(b)
            assert b.stats.scrape.source == "none" and not b.stats.scrape_stale()
            assert b.stats.snapshot()["scrape"]["source"] == "none"
            assert b.stats.scrape.queue_reqs is None


async def test_a_backend_replaced_under_the_same_name_is_scraped_afresh():
    # a reload may point a name at another server: what was learnt of the old one goes with it
    old_runner, old_url = await _serve(
        {"/metrics": 404, "/server_info": b'{"max_running_requests": 8}'}
    )
    new_runner, new_url = await _serve(
        {"/metrics": PAGE.encode(), "/server_info": b'{"max_running_requests": 48}'}
    )
    scraper = Scraper([], ScrapeSettings(interval_s=0.5))
    try:
        old = FakeBackend("a", url=old_url)
        assert not await scraper.scrape_once(old)
        assert (old.stats.scrape.source, old.stats.scrape.max_running_requests) == ("none", 8)
        new = FakeBackend("a", url=new_url)
        assert await scraper.scrape_once(new)
        assert (new.stats.scrape.source, new.stats.scrape.max_running_requests) == ("metrics", 48)
    finally:
        await scraper.close()
        await old_runner.cleanup()
        await new_runner.cleanup()


def test_parse_loads_max_running_sums_the_ranks_only_when_each_says_it():
    rows = b'{"loads": [{"dp_rank": 0, "max_running_requests": 32}, '
    assert parse_loads_max_running(rows + b'{"dp_rank": 1, "max_running_requests": 32}]}') == 64
    assert parse_loads_max_running(rows + b'{"dp_rank": 1, "max_running_requests": null}]}') is None
    for body in [b"{}", b'{"loads": []}', b"[]", b'{"loads": [7]}']:
        assert parse_loads_max_running(body) is None


async def test_max_running_left_to_the_scheduler_is_read_from_its_load_report():
    # no --max-running-requests: /server_info has null, the scheduler's value is per DP rank
    routes = {
        "/metrics": 404,
        "/server_info": b'{"max_running_requests": null, "dp_size": 2}',
        "/v1/loads": b'{"loads": [{"dp_rank": 0, "max_running_requests": 48}, '
        b'{"dp_rank": 1, "max_running_requests": 48}]}',
    }
    async with _scraping(routes) as (b, scraper):
        await scraper.scrape_all()
        assert b.stats.scrape.max_running_requests == 96


async def test_a_backend_back_from_down_is_asked_its_word_again():
    # SGLang without metrics: no restart shows in any counter; health seeing it come back is
    # the only sign, and it may have come back with other arguments
    routes: dict[str, bytes | int] = {
        "/metrics": 404,
        "/server_info": b'{"max_running_requests": 48, "pp_size": 1}',
        "/v1/loads": b'{"loads": [{"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 0}]}',
    }
    async with _scraping(routes) as (b, scraper):
        await scraper.scrape_all()
        assert b.stats.scrape.max_running_requests == 48
        routes["/server_info"] = b'{"max_running_requests": 96, "pp_size": 4}'
        await scraper.scrape_all()
        assert b.stats.scrape.max_running_requests == 48  # not asked again while it stayed up
        b.stats.mark_restarted()
        await scraper.scrape_all()
        assert (b.stats.scrape.max_running_requests, b.stats.scrape.pp_size) == (96, 4)


async def test_metrics_turned_off_or_on_across_restarts_change_where_counts_come_from():
    # restarted without --enable-metrics: the 404 is the server's answer (read its load report,
    # not stale); back from down with them again: read its metrics again
    routes: dict[str, bytes | int] = {
        "/metrics": PAGE.encode(),
        "/server_info": b'{"max_running_requests": 48}',
        "/v1/loads": b'{"loads": [{"dp_rank": 0, "num_running_reqs": 3, "num_waiting_reqs": 2}]}',
    }
    async with _scraping(routes) as (b, scraper):
        assert await scraper.scrape_once(b) and b.stats.scrape.source == "metrics"
        routes["/metrics"] = 404
        assert await scraper.scrape_once(b)
        assert b.stats.scrape.source == "loads" and b.stats.scrape.errors == 0
        assert (b.stats.scrape.queue_reqs, b.stats.scrape.running_reqs) == (2.0, 3.0)
        assert not b.stats.scrape_stale()
        routes["/metrics"] = PAGE.encode()
        assert await scraper.scrape_once(b) and b.stats.scrape.source == "loads"  # still up
        b.stats.mark_restarted()
        assert await scraper.scrape_once(b)
        assert b.stats.scrape.source == "metrics" and b.stats.scrape.queue_reqs == 5.0


def test_parse_server_info_takes_each_number_only_when_it_is_one():
    word = parse_server_info(b'{"max_running_requests": 64, "pp_size": 4}')
    assert (word.max_running_requests, word.pp_size) == (64, 4)
    bad = ["null", "0", '"64"', "true"]
    for body in [b"{}", b"[1]", *(b'{"max_running_requests": %s}' % v.encode() for v in bad)]:
        assert parse_server_info(body).max_running_requests is None
    for v in bad:
        assert parse_server_info(b'{"pp_size": %s}' % v.encode()).pp_size is None


async def test_the_server_word_carries_its_pipeline_stages_to_the_limit():
    # SGLang started with its defaults: no metrics, max_running_requests null in /server_info
    # (the scheduler's in /v1/loads), pp_size there
    routes = {
        "/metrics": 404,
        "/server_info": b'{"max_running_requests": null, "pp_size": 8}',
        "/v1/loads": b'{"loads": [{"dp_rank": 0, "max_running_requests": 64}]}',
    }
    async with _scraping(routes) as (b, scraper):
        await scraper.scrape_all()
        w = b.stats.take_window()
        assert (w.max_running, w.pp_size) == (64, 8)
        assert b.stats.snapshot()["scrape"]["pp_size"] == 8


async def test_scraper_asks_the_server_what_it_runs_once_and_after_a_restart():
    runner, url = await _serve(
        {
            "/metrics": PAGE.encode(),
            "/server_info": 404,  # an older SGLang: only /get_server_info
            "/get_server_info": b'{"max_running_requests": 48}',
        }
    )
    b = FakeBackend("a", url=url)
    scraper = Scraper([b], ScrapeSettings(interval_s=0.5))
    try:
        await scraper.scrape_all()
        assert b.stats.scrape.max_running_requests == 48
        assert b.stats.take_window().max_running == 48
        b.stats.scrape.max_running_requests = None  # not asked again without a restart
        await scraper.scrape_all()
        assert b.stats.scrape.max_running_requests is None
        b.stats.scrape.restarts += 1
        await scraper.scrape_all()
        assert b.stats.scrape.max_running_requests == 48
    finally:
        await scraper.close()
        await runner.cleanup()


# ---- SGLang's label sets: DP attention, priority scheduling, pipeline stages, pid ------------

DP_ATTENTION = "".join(
    f'sglang:num_running_reqs{{dp_rank="{r}",engine_type="unified",model_name="m",'
    f'moe_ep_rank="{r}",pp_rank="0",tp_rank="{r}"}} 10.0\n'
    f'sglang:num_queue_reqs{{dp_rank="{r}",engine_type="unified",model_name="m",'
    f'moe_ep_rank="{r}",pp_rank="0",tp_rank="{r}"}} {r}.0\n'
    f'sglang:token_usage{{dp_rank="{r}",engine_type="unified",model_name="m",'
    f'moe_ep_rank="{r}",pp_rank="0",tp_rank="{r}"}} 0.{r}\n'
    for r in range(8)
)


def test_dp_attention_ranks_are_summed_though_their_tp_rank_is_not_zero():
    v = parse_metrics(DP_ATTENTION)
    assert v["running_reqs"] == 80.0  # 8 DP ranks x 10 (rank 0 alone would read 10)
    assert v["queue_reqs"] == 28.0
    assert v["token_usage"] == 0.7  # the fullest rank's pool, never a sum of ratios


PRIORITY = """\
sglang:num_running_reqs{model_name="m",priority="",pp_rank="0",tp_rank="0"} 12.0
sglang:num_running_reqs{model_name="m",priority="0",pp_rank="0",tp_rank="0"} 8.0
sglang:num_running_reqs{model_name="m",priority="5",pp_rank="0",tp_rank="0"} 4.0
sglang:num_running_reqs{model_name="m",priority="9",pp_rank="0",tp_rank="0"} 0.0
sglang:num_queue_reqs{model_name="m",priority="",pp_rank="0",tp_rank="0"} 3.0
sglang:num_queue_reqs{model_name="m",priority="None",pp_rank="0",tp_rank="0"} 3.0
"""


def test_priority_scheduling_takes_the_total_only():
    v = parse_metrics(PRIORITY)
    assert (v["running_reqs"], v["queue_reqs"]) == (12.0, 3.0)  # not 24 and 6


def test_one_pipeline_stage_and_no_per_process_series():
    page = "".join(
        f'sglang:num_running_reqs{{model_name="m",pp_rank="{s}",tp_rank="0"}} 16.0\n'
        for s in range(8)
    )
    page += 'sglang:num_retracted_requests_total{model_name="m",pid="42"} 9.0\n'
    page += 'sglang:num_retracted_requests_total{model_name="m"} 2.0\n'
    v = parse_metrics(page)
    assert v["running_reqs"] == 16.0  # every stage holds the same requests
    assert v["retractions_total"] == 2.0


def test_tp_ranks_repeating_one_dp_rank_count_once():
    # --enable-metrics-for-all-schedulers with DP attention of attn_tp_size 2: tp ranks 2r, 2r+1
    page = "".join(
        f'sglang:num_running_reqs{{dp_rank="{r}",pp_rank="0",tp_rank="{2 * r + t}"}} 5.0\n'
        for r in range(4)
        for t in range(2)
    )
    assert parse_metrics(page)["running_reqs"] == 20.0


def test_parse_v1_loads_rows():
    body = (
        b'{"timestamp": 1, "loads": [{"dp_rank": 0, "num_running_reqs": 7, "num_waiting_reqs": 2,'
        b' "token_usage": 0.25}, {"dp_rank": 1, "num_running_reqs": 3, "num_waiting_reqs": 1,'
        b' "token_usage": 0.5}]}'
    )
    assert parse_loads(body) == {"queue_reqs": 3.0, "running_reqs": 10.0, "token_usage": 0.5}


async def test_scraper_reads_the_ep8_simulator_with_dp_attention_and_priority():
    """The simulator's ep8 profile writes SGLang's label sets (8 DP ranks, priority totals and
    breakdowns, per-process series): the scraper reads the server's true running count."""
    # modelled time runs at wall speed: the 80 answers cannot finish (or fill the KV pool) while
    # the test reads the gauges, however slowly a loaded machine gets there
    ep8 = {"priority_scheduling": True}
    async with running_sim("ep8", time_scale=1.0, overrides=ep8) as (url, sim):
        body = {
            "text": ["hello there"] * 80,
            "sampling_params": {"max_new_tokens": 20000, "ignore_eos": True},
        }
        async with aiohttp.ClientSession() as session:
            task = asyncio.create_task(session.post(url + "/generate", json=body))
            try:
                await wait_until(lambda: sim.engine.logged_stats().num_running_reqs == 80)
                page = (await (await session.get(url + "/metrics")).read()).decode()
                assert 'priority="0"' in page and 'dp_rank="7"' in page and "pid=" in page
                b = FakeBackend("ep8", url=url)
                scraper = Scraper([b], ScrapeSettings(), session=session)
                assert await scraper.scrape_once(b)
                assert b.stats.scrape.running_reqs == 80.0
                assert b.stats.scrape.queue_reqs == 0.0
                scraper.s = ScrapeSettings(use_loads=True)
                assert await scraper.scrape_once(b)
                assert scraper._load_path["ep8"] == "/v1/loads"
                assert b.stats.scrape.running_reqs == 80.0
            finally:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task


async def test_scraper_falls_back_to_get_load_without_v1_loads():
    runner, url = await _serve(
        {
            "/metrics": PAGE.encode(),
            "/v1/loads": 404,
            "/get_load": b'[{"num_reqs": 9, "num_waiting_reqs": 4}]',
        }
    )
    b = FakeBackend("old", url=url)
    scraper = Scraper([b], ScrapeSettings(use_get_load=True))  # the older name still reads
    try:
        assert scraper.s.use_loads
        assert await scraper.scrape_once(b)
        assert b.stats.scrape.queue_reqs == 4.0 and b.stats.scrape.running_reqs == 5.0
        assert scraper._load_path["old"] == "/get_load"
    finally:
        await scraper.close()
        await runner.cleanup()
