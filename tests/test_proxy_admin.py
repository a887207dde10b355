"""/admin/backends: list, add, drain, undrain, remove, without dropping streams in flight."""

from __future__ import annotations

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
