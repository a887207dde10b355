"""The simulator's admin route for faults: ``GET|POST|DELETE /sim/faults``.

``POST`` takes a partial JSON object of `FaultConfig` fields (e.g. ``{"error_rate": 0.5}``)
and answers the full current settings; ``DELETE`` turns every fault off. Invalid settings
answer 400 ``{"error": {"message": ...}}`` and change nothing.
"""

from __future__ import annotations

from aiohttp import web

from loadtest.sim.http_util import BACKEND, generate_error, json_response, read_json


def add_routes(app: web.Application) -> None:
    app.router.add_get("/sim/faults", get_faults)
    app.router.add_post("/sim/faults", post_faults)
    app.router.add_delete("/sim/faults", delete_faults)


async def get_faults(request: web.Request) -> web.Response:
    return json_response(request.app[BACKEND].faults.snapshot())


async def post_faults(request: web.Request) -> web.Response:
    body, err = await read_json(request)
    if err is not None:
        return err
    faults = request.app[BACKEND].faults
    try:
        faults.update(body)
    except ValueError as exc:
        return generate_error(str(exc))
    return json_response(faults.snapshot())


async def delete_faults(request: web.Request) -> web.Response:
    faults = request.app[BACKEND].faults
    faults.reset()
    return json_response(faults.snapshot())
