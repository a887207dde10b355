"""/admin/backends: list, add, drain, undrain, remove, without dropping streams in flight."""

from __future__ import annotations

import asyncio
import contextlib

import aiohttp
import orjson
from proxy_support import MODEL, fakes, running_proxy, wait_for

from proxy.backends import State

ADMIN = {"Authorization": "Bearer adm"}


async def _admin(session: aiohttp.ClientSession, method: str, url: str, body=None):
    data = orjson.dumps(body) if body is not None else None
    async with session.request(method, url, data=data, headers=ADMIN) as r:
        return r.status, orjson.loads(await r.read())


async def test_add_drain_remove_keep_streams_in_flight():
    async with fakes(2) as (a, b), running_proxy([a.url], server={"admin_key": "adm"}) as px:
        base = px.url + "/admin/backends"
        async with aiohttp.ClientSession() as s:
            status, out = await _admin(s, "GET", base)
            assert status == 200 and [x["url"] for x in out["backends"]] == [a.url]
            listed = out["backends"][0]
            assert {"state", "in_flight", "limit", "stats", "routable"} <= set(listed)

            # a long stream on backend a
            stream = await s.post(
                px.url + "/v1/chat/completions",
                json={"model": MODEL, "messages": [], "stream": True, "max_tokens": 20},
                headers={"X-Fake-Delay": "0.02"},
            )
            await stream.content.readline()

            status, out = await _admin(
                s, "POST", base, {"url": b.url, "name": "b", "parallelism": "pp", "pp_size": 2}
            )
            assert status == 201 and out["name"] == "b"
            status, out = await _admin(s, "POST", base, {"url": b.url, "name": "b"})
            assert status == 409
            status, out = await _admin(s, "POST", base, {"url": "ftp://x"})
            assert status == 400 and "url" in out["error"]["message"]
            await wait_for(lambda: px.proxy.pool.get("b").state is State.HEALTHY)

            a_name = f"127.0.0.1:{a.port}"
            status, out = await _admin(s, "POST", f"{base}/{a_name}/drain")
            assert status == 200 and out["state"] == "draining" and out["in_flight"] == 1
            r = await s.post(px.url + "/v1/chat/completions", json={"messages": []})
            assert r.headers["X-Pipefill-Backend"] == "b"  # drained: no new traffic
            status, out = await _admin(s, "DELETE", f"{base}/{a_name}")
            assert status == 202
            status, out = await _admin(s, "GET", base)
            assert [x["name"] for x in out["backends"]] == ["b", a_name]  # a is leaving

            body = await stream.read()  # the stream in flight completes untouched
            assert body.endswith(b"data: [DONE]\n\n") and b" w19" in body
            await wait_for(lambda: [x.name for x in px.proxy.pool.all()] == ["b"])
            status, _ = await _admin(s, "GET", f"{base}/{a_name}")
            assert status == 404

            status, out = await _admin(s, "POST", f"{base}/b/drain")
            r = await s.post(px.url + "/v1/chat/completions", json={"messages": []})
            assert r.status == 503
            status, out = await _admin(s, "POST", f"{base}/b/undrain")
            assert status == 200
            await wait_for(lambda: px.proxy.pool.get("b").state is State.HEALTHY)
            status, out = await _admin(s, "GET", px.url + "/admin/queue")
            assert status == 200


async def test_abort_request_goes_to_the_backend_holding_the_rid_or_cancels_it_in_the_queue():
    async with (
        fakes(2) as ups,
        running_proxy(
            [u.url for u in ups],
            server={"admin_key": "adm"},
            limits={"algorithm": "fixed", "initial": 1},
            scrape={"enabled": False},
        ) as px,
    ):
        for u in ups:
            u.hold_s = 30.0  # every chat request stays on its backend until its client leaves
        url = px.url + "/v1/chat/completions"
        async with aiohttp.ClientSession() as s:

            async def chat(rid: str | None):
                body = {"model": MODEL, "messages": [], "stream": True}
                if rid:
                    body["rid"] = rid
                return await s.post(url, json=body)

            running = [asyncio.create_task(chat("a")), asyncio.create_task(chat(None))]
            await wait_for(lambda: sum(u.held for u in ups) == 2)
            queued = asyncio.create_task(chat("b"))  # both backends full: it waits
            await wait_for(lambda: px.proxy.admission.depth == 1)

            status, out = await _admin(s, "POST", px.url + "/abort_request", {"rid": "b"})
            assert status == 200 and out["cancelled_in_queue"] is True and out["backends"] == {}
            r = await queued
            assert r.status == 400 and (await r.json())["error"]["code"] == "request_aborted"
            assert px.proxy.admission.depth == 0

            holder = px.proxy.holders.find("a").backend
            status, out = await _admin(s, "POST", px.url + "/abort_request", {"rid": "a"})
            assert status == 200 and list(out["backends"]) == [holder]  # only where it runs
            aborts = {
                f"127.0.0.1:{u.port}": sum(q.get("path") == "/abort_request" for q in u.requests)
                for u in ups
            }
            assert aborts == {n: int(n == holder) for n in aborts}

            status, out = await _admin(s, "POST", px.url + "/abort_request", {"rid": "zzz"})
            assert status == 200 and len(out["backends"]) == 2  # unknown: every backend
            for t in running:
                t.cancel()
            for t in running:
                with contextlib.suppress(asyncio.CancelledError):
                    (await t).close()
            await wait_for(lambda: len(px.proxy.holders) == 0)  # entries live with requests
