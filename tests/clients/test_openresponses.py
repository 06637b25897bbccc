"""The Open Responses compliance suite against the server, unchanged.

tests/openresponses/ holds upstream's compliance CLI (openresponses/openresponses, commit and
license in its source.json); `make node-clients` installs what it runs on (bun and zod, pinned).
Its 17 tests cover HTTP JSON, SSE, WebSocket mode (sequences, continuation, reconnect with
`store: false`, a missing and a failed previous response) and `/v1/responses/compact`, and
validate every response object and event against the Open Responses schemas. They run against
the server as it starts by default (OpenAI's dialect), with the SSE `data: [DONE]` terminator
on, and with the Open Responses dialect on (`--open-responses`): all 17 must pass in each.

Where the two specs disagree the server follows OpenAI by default: the Open Responses request
fields `frequency_penalty` and `presence_penalty` are unknown parameters unless the dialect is on,
which the last test checks on both transports.
"""

from __future__ import annotations

import json
from typing import Any, Final

import aiohttp
import pytest

from prototype.config import ServerConfig
from tests.support import TESTS, live_server, run_client

SUITE: Final = TESTS / "openresponses"
BUN: Final = SUITE / "node_modules" / ".bin" / "bun"
SUITE_TIMEOUT_S: Final = 180.0
"""Upper bound on one run of the suite, so a test waiting for an event that never comes fails."""
TESTS: Final = 17


async def _suite(config: ServerConfig) -> dict[str, Any]:
    async with live_server(config=config) as live:
        args = ("--base-url", live.base_url, "--api-key", "sk-longrun", "--json")
        code, out, err = await run_client(
            str(BUN), "run", "bin/compliance-test.ts", *args, cwd=SUITE, timeout_s=SUITE_TIMEOUT_S
        )
    try:
        report: dict[str, Any] = json.loads(out)
    except json.JSONDecodeError:
        raise AssertionError(f"the suite printed no report ({code}):\n{err.decode()[-4000:]}") from None
    return report


@pytest.mark.slow
@pytest.mark.parametrize(
    "config",
    [ServerConfig(), ServerConfig(sse_done=True), ServerConfig(open_responses=True)],
    ids=["openai", "sse-done", "open-responses"],
)
async def test_every_compliance_test_passes(config: ServerConfig) -> None:
    if not BUN.exists():
        pytest.skip(f"the compliance suite's runtime is not installed at {BUN} (`make node-clients`)")
    report = await _suite(config)
    failed = {r["id"]: r.get("errors", [])[:3] for r in report["results"] if r["status"] != "passed"}
    assert not failed, json.dumps(failed, indent=1)[:6000]
    assert report["summary"]["total"] == report["summary"]["passed"] == TESTS


@pytest.mark.parametrize("transport", ["http", "ws"])
async def test_open_responses_request_fields_need_the_dialect(transport: str) -> None:
    body = {"model": "sim", "input": "hi", "frequency_penalty": 0.5, "presence_penalty": -0.25}
    for dialect in (False, True):
        async with live_server(config=ServerConfig(open_responses=dialect)) as live, aiohttp.ClientSession() as http:
            if transport == "http":
                async with http.post(f"{live.base_url}/responses", json=body) as reply:
                    data = await reply.json()
                    status = reply.status
            else:
                async with http.ws_connect(live.ws_url) as ws:
                    await ws.send_json({"type": "response.create", **body})
                    while (data := await ws.receive_json())["type"] not in ("error", "response.completed"):
                        pass
                    status = data.get("status", 200) if data["type"] == "error" else 200
                    data = data if data["type"] == "error" else data["response"]
        if dialect:
            assert status == 200, data
            assert (data["frequency_penalty"], data["presence_penalty"]) == (0.5, -0.25)
        else:
            assert status == 400, data
            assert (data["error"]["code"], data["error"]["param"]) == ("unknown_parameter", "frequency_penalty")
