"""`python -m sim measure`: longrun's seeded rollouts driven against any Responses endpoint
through the recorder, for a user without an agent of their own at hand (docs/calibration.md,
"Measuring an endpoint").

The rollouts are the ones `sim compare` plans from the same options (`custom_specs`, or a
workload profile's `draw_rollouts`), run by the comparison's own clients and loop
(sim/client), one rollout at a time, each mode in turn. What a live endpoint would otherwise
decide is forced, so the budget holds: every tool turn sends `tool_choice: "required"` (and
`parallel_tool_calls: false`), the answer turn `tool_choice: "none"`, and every turn
`max_output_tokens`. A tool step waits its drawn time on the wall clock (times
`--tool-time-scale`): this is a live measurement, and the client's time between a response and
its next request is part of what the workload file records.

The clients talk to the recorder (sim/record/proxy.py), started in this process on an
ephemeral loopback port in front of `--url`, so the run folder holds `capture.jsonl`,
`workload.jsonl` and `summary.json` exactly as `sim record` writes them, and the chain's next
command is printed at the end.

Before anything is sent the budget is printed (requests, input tokens estimated, output tokens
bounded, tool time waited); `--dry-run` stops there. Then one preflight request, `GET
{url}/models/{model}`, which spends no tokens: an unreachable URL, a refused key or an unknown
model (the upstream's own message) is refused in one line before the budget is spent. An
endpoint that serves no such route is not refused for it; its first request checks the model.
The API key comes from the environment (`--api-key-env`, `OPENAI_API_KEY` by default) and is
never printed or written.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import shutil
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final
from urllib.parse import quote, urlsplit

import aiohttp
import msgspec
from aiohttp import web

from prototype.clock import Clock
from prototype.context.tokenizer import get_tokenizer
from prototype.serve.wallclock import AsyncioClock
from sim.client.client import ResponsesClient, open_client
from sim.client.loop import run_rollout
from sim.harness.console import add_save_options, start_folder
from sim.harness.experiment import CompareConfig
from sim.harness.specs import custom_specs
from sim.harness.trace import write_json
from sim.record.capture import Line
from sim.record.proxy import Recorder, make_recorder_app
from sim.rollout.result import ClientError, Mode, RolloutResult, TurnResult, error_line
from sim.rollout.spec import EXEC_TOOL, RolloutSpec
from sim.rollout.workload import WORKLOADS, draw_rollouts

__all__ = ["Budget", "Forced", "measure", "measure_main", "measure_options", "plan", "preflight"]

MEASURABLE: Final[tuple[Mode, ...]] = ("http", "http_prev", "ws")  # what a Responses endpoint offers
ITEM_TOKENS: Final = 4  # an input item's framing, beside its text (o200k chat formatting)
PREFLIGHT_TIMEOUT_S: Final = 15.0


@dataclass(frozen=True, slots=True)
class Budget:
    """What a measurement will send: requests (each rollout's turns, if the endpoint honours the
    forced `tool_choice`), input tokens estimated (o200k counts of the texts sent, every earlier
    output at its bound), output tokens at their bound, and the tool time waited."""

    requests: int
    input_tokens: int
    output_tokens: int
    tool_s: float

    def text(self, modes: Sequence[str], rollouts: int, max_output_tokens: int) -> str:
        return (
            f"budget: {self.requests:,} requests ({len(modes)} modes × {rollouts} rollouts), "
            f"≈ {self.input_tokens:,} input tokens (estimated), ≤ {self.output_tokens:,} output tokens "
            f"(max_output_tokens {max_output_tokens} a request), {self.tool_s:,.1f} s of tool time waited"
        )


def spec_budget(spec: RolloutSpec, max_output_tokens: int) -> Budget:
    """One rollout's budget in one mode: turn k's input is the prompt (instructions, the tool's
    definition, the task) and, per earlier turn, its output at the bound and its tool's output."""
    count = get_tokenizer().encode_list
    context = len(count(spec.instructions)) + len(count(msgspec.json.encode(EXEC_TOOL).decode()))
    context += len(count(spec.task)) + ITEM_TOKENS
    turns = len(spec.tool_times_s) + 1
    total = 0
    for k in range(turns):
        total += context
        if k < len(spec.tool_outputs):
            context += max_output_tokens + len(count(spec.tool_outputs[k])) + 2 * ITEM_TOKENS
    return Budget(turns, total, turns * max_output_tokens, sum(spec.tool_times_s))


def plan(args: argparse.Namespace, modes: int) -> tuple[list[RolloutSpec], Budget]:
    """The rollouts `sim compare` would run on these options (tool times scaled), and the budget
    of running each in every mode."""
    if args.workload != "custom":
        specs, _ = draw_rollouts(WORKLOADS[args.workload], args.seed, args.rollouts)
    else:
        config = CompareConfig.of(
            rollouts=args.rollouts,
            tool_calls=args.tool_calls,
            tool_time_s=args.tool_time_s,
            tool_time_sigma=args.tool_time_sigma,
            tool_output_tokens=args.tool_output_tokens,
            system_prompt_tokens=args.system_prompt_tokens,
            seed=args.seed,
        )
        specs = custom_specs(config, 0, args.rollouts)
    if args.tool_time_scale != 1.0:
        specs = [
            dataclasses.replace(spec, tool_times_s=tuple(t * args.tool_time_scale for t in spec.tool_times_s))
            for spec in specs
        ]
    each = [spec_budget(spec, args.max_output_tokens) for spec in specs]
    n = modes
    return specs, Budget(
        n * sum(b.requests for b in each),
        n * sum(b.input_tokens for b in each),
        n * sum(b.output_tokens for b in each),
        n * sum(b.tool_s for b in each),
    )


class Forced:
    """A client whose turns force the rollout's shape on a live model: a tool call on each of
    the first `tool_turns` turns (one at a time), a text answer after, every output bounded."""

    def __init__(self, client: ResponsesClient, tool_turns: int, max_output_tokens: int) -> None:
        self.mode: Mode = client.mode
        self.client = client
        self.tool_turns = tool_turns
        self.max_output_tokens = max_output_tokens
        self.turns = 0

    async def turn(self, new_items: list[dict[str, Any]], **settings: Any) -> TurnResult:
        forced = {
            "tool_choice": "required" if self.turns < self.tool_turns else "none",
            "parallel_tool_calls": False,
            "max_output_tokens": self.max_output_tokens,
        }
        self.turns += 1
        return await self.client.turn(new_items, **settings, **forced)

    async def close(self) -> None:
        await self.client.close()


def _upstream_error(body: bytes) -> tuple[str, str, str]:
    """An error body's (code, param, message): the API's `{"error": {...}}`, else its first line."""
    try:
        error = msgspec.json.decode(body).get("error")
    except (msgspec.DecodeError, AttributeError):
        error = None
    if isinstance(error, dict):
        code = str(error.get("code") or error.get("type") or "")
        return code, str(error.get("param") or ""), str(error.get("message") or "")
    text = body.decode("utf-8", "replace").strip().splitlines()
    return "", "", text[0][:200] if text else ""


async def preflight(url: str, model: str, api_key: str) -> str | None:
    """Why the endpoint cannot be measured (module doc), in one line; None when it can."""
    timeout = aiohttp.ClientTimeout(total=PREFLIGHT_TIMEOUT_S)
    target = f"{url}/models/{quote(model, safe='')}"
    try:
        async with aiohttp.ClientSession(timeout=timeout) as session:
            async with session.get(target, headers={"Authorization": f"Bearer {api_key}"}) as response:
                status, body = response.status, await response.read()
    except (aiohttp.ClientError, OSError, TimeoutError) as exc:
        return f"cannot reach {url}: {type(exc).__name__}: {exc}".rstrip(": ")
    if status < 400:
        return None
    code, param, message = _upstream_error(body)
    said = f"{status} {code}: {message}".replace(" :", ":")
    if status in (401, 403) or status >= 500 or (status == 404 and (code == "model_not_found" or param == "model")):
        return f"{url} refused the preflight (GET {target}): {said}"
    return None  # no models route here: the first request checks the model


@contextlib.asynccontextmanager
async def recorder_at(url: str, out: Path) -> AsyncIterator[tuple[str, Recorder]]:
    """The recorder on an ephemeral loopback port in front of `url`'s origin; yields the base URL
    a client uses (the same path under the recorder) and the recorder, stopped on exit."""
    parts = urlsplit(url)
    recorder = Recorder(f"{parts.scheme}://{parts.netloc}", out)
    runner = web.AppRunner(make_recorder_app(recorder), handler_cancellation=True)
    await runner.setup()
    try:
        await web.TCPSite(runner, "127.0.0.1", 0).start()
        yield f"http://127.0.0.1:{runner.addresses[0][1]}{parts.path.rstrip('/')}", recorder
    finally:
        await runner.cleanup()


@dataclass(slots=True)
class Measured:
    rollouts: list[RolloutResult]
    error: str | None = None  # the line the run stopped on
    summary: dict[str, object] = dataclasses.field(default_factory=dict)  # the recorder's
    used: tuple[int, int] = (0, 0)  # input and output tokens of the captured requests' `usage`


async def measure(
    url: str,
    model: str,
    api_key: str,
    modes: Sequence[Mode],
    specs: Sequence[RolloutSpec],
    out: Path,
    *,
    max_output_tokens: int,
    clock: Clock | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> Measured:
    """Each spec in each mode through the recorder in front of `url`, one rollout at a time; the
    first rollout that fails stops the run (what was captured so far stays)."""
    clock = clock or AsyncioClock()
    done = Measured([])
    async with recorder_at(url, out) as (base, recorder):
        for mode in modes:
            for spec in specs:
                client = Forced(
                    open_client(mode, base, clock, api_key=api_key), len(spec.tool_times_s), max_output_tokens
                )
                try:
                    result = await run_rollout(client, clock, spec, model=model)
                except (ClientError, aiohttp.ClientError, OSError, ValueError) as exc:
                    done.error = f"{mode} rollout {spec.index}: {error_line(exc)}"
                    break
                finally:
                    await client.close()
                done.rollouts.append(result)
                progress(
                    f"{mode:<9} rollout {spec.index}: {len(result.turns)} turns in {result.completion_s:.1f} s "
                    f"({result.tool_time_s:.1f} s of tools)"
                )
            if done.error is not None:
                break
    done.summary = recorder.capture.summary()
    done.used = _used(recorder.capture.lines)
    return done


def _used(lines: Sequence[Line]) -> tuple[int, int]:
    """Input and output tokens the endpoint's `usage` reported on the captured requests (a
    stopped rollout's turns too)."""
    inputs = outputs = 0
    for line in lines:
        usage = msgspec.json.decode(line.usage) if line.usage is not None else None
        if isinstance(usage, dict):
            inputs += int(usage.get("input_tokens") or 0)
            outputs += int(usage.get("output_tokens") or 0)
    return inputs, outputs


def measure_options(sub: Any) -> None:
    """`python -m sim measure`'s parser."""
    m = sub.add_parser(
        "measure",
        help="drive any Responses endpoint with longrun's seeded rollouts through the recorder: "
        "a capture and workload for calibrate (docs/calibration.md)",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    m.add_argument("--url", required=True, metavar="URL", help="the API's base URL, e.g. https://api.openai.com/v1")
    m.add_argument("--model", required=True, metavar="M", help="the model every request names")
    m.add_argument("--modes", default="http,http_prev,ws", help=f"comma-separated, of {', '.join(MEASURABLE)}")
    m.add_argument("--api-key-env", default="OPENAI_API_KEY", metavar="NAME", help="the variable the key is read from")
    m.add_argument("--dry-run", action="store_true", help="print the budget and exit: nothing is sent")
    m.add_argument("--rollouts", type=int, default=4, help="rollouts per mode")
    m.add_argument("--tool-calls", type=int, default=5, help="tool calls per rollout, then a text answer (custom)")
    m.add_argument("--workload", default="custom", choices=("custom", *WORKLOADS), help="or a workload profile")
    m.add_argument("--tool-time-s", type=float, default=0.3, help="median tool time (custom)")
    m.add_argument("--tool-time-sigma", type=float, default=0.8, help="lognormal sigma of tool time (custom)")
    m.add_argument("--tool-output-tokens", type=int, default=500, help="median tool output size (custom)")
    m.add_argument("--system-prompt-tokens", type=int, default=6000, help="initial context (custom)")
    m.add_argument(
        "--tool-time-scale", type=float, default=1.0, help="wait each drawn tool time times this (0: no wait)"
    )
    m.add_argument("--max-output-tokens", type=int, default=256, help="every request's output bound (at least 16)")
    m.add_argument("--seed", type=int, default=0, help="seeds the rollouts")
    add_save_options(m, "capture.jsonl, workload.jsonl, summary.json, measure.json", "measure")


def _checked(args: argparse.Namespace) -> tuple[list[Mode], str]:
    """The modes and the URL without a trailing slash, or a one-line refusal (SystemExit)."""
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    for m in modes:
        if m not in MEASURABLE:
            raise SystemExit(f"invalid option: --modes: unknown mode {m!r}; choose from {', '.join(MEASURABLE)}")
    if not modes or len(set(modes)) != len(modes):
        raise SystemExit(f"invalid option: --modes {args.modes!r}: want distinct modes of {', '.join(MEASURABLE)}")
    parts = urlsplit(args.url)
    if parts.scheme not in ("http", "https") or not parts.netloc or parts.query or parts.fragment:
        raise SystemExit(f"invalid option: --url {args.url!r}: want http(s)://HOST[:PORT][/PATH]")
    for name, low in (("rollouts", 1), ("tool_calls", 0), ("tool_output_tokens", 1), ("system_prompt_tokens", 1)):
        if getattr(args, name) < low:
            raise SystemExit(f"invalid option: --{name.replace('_', '-')}: at least {low}")
    for name in ("tool_time_s", "tool_time_sigma", "tool_time_scale"):
        if not getattr(args, name) >= 0:
            raise SystemExit(f"invalid option: --{name.replace('_', '-')}: at least 0")
    if args.max_output_tokens < 16:
        raise SystemExit("invalid option: --max-output-tokens: at least 16 (the API's minimum)")
    return [m for m in MEASURABLE if m in modes], args.url.rstrip("/")


def measure_main(args: argparse.Namespace, run: Callable[[Coroutine[Any, Any, Any]], Any]) -> int:
    """Plan, print the budget, preflight, measure through the recorder, report (module doc)."""
    modes, url = _checked(args)
    specs, budget = plan(args, len(modes))
    print(budget.text(modes, len(specs), args.max_output_tokens), flush=True)
    if args.dry_run:
        return 0
    api_key = os.environ.get(args.api_key_env)
    if not api_key:
        raise SystemExit(f"no API key: set {args.api_key_env} (or name another variable with --api-key-env)")
    refused = run(preflight(url, args.model, api_key))
    if refused is not None:
        raise SystemExit(refused)
    folder = start_folder(args, "measure")
    scratch = None if folder is not None else Path(tempfile.mkdtemp(prefix="longrun-measure-"))
    out = folder or scratch
    assert out is not None
    try:
        if folder is not None:
            write_json(
                {
                    "url": url,
                    "model": args.model,
                    "modes": modes,
                    "rollouts": len(specs),
                    "workload": args.workload,
                    "seed": args.seed,
                    "max_output_tokens": args.max_output_tokens,
                    "tool_time_scale": args.tool_time_scale,
                    "budget": dataclasses.asdict(budget),
                },
                folder / "measure.json",
            )
        done: Measured = run(
            measure(
                url,
                args.model,
                api_key,
                modes,
                specs,
                out,
                max_output_tokens=args.max_output_tokens,
                progress=lambda line: print(line, file=sys.stderr, flush=True),
            )
        )
    finally:
        if scratch is not None:
            shutil.rmtree(scratch, ignore_errors=True)
    return _report(done, budget, folder)


def _report(done: Measured, budget: Budget, folder: Path | None) -> int:
    inputs, outputs = done.used
    s = done.summary
    latency = s.get("proxy_request_ms")
    median = latency.get("median") if isinstance(latency, dict) else None
    print(
        f"sent: {s.get('requests', 0):,} of {budget.requests:,} requests ({s.get('failed', 0)} failed), "
        f"{inputs:,} input tokens (≈ {budget.input_tokens:,} estimated), "
        f"{outputs:,} output tokens (≤ {budget.output_tokens:,})"
        + (f"; the recorder added {median:.2f} ms a request (median, to the hand-off)" if median is not None else "")
    )
    if done.error is not None:
        print(f"python -m sim measure: stopped: {done.error}", file=sys.stderr)
    if folder is not None:
        print(f"wrote {folder}/capture.jsonl, {folder}/workload.jsonl")
        print(f"next: python -m sim calibrate {folder}/capture.jsonl --predict --trace {folder}/workload.jsonl")
    return 0 if done.error is None else 2
