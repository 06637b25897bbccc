"""How the agent runs the tool calls it receives: simulated, or as real subprocesses.

Covers: the tool step of the closed loop (sim/client/loop.py). Scenario: the default
waits the drawn tool time on the injected clock (live or virtual); `--real-tools`
spawns a real process per call that takes the drawn time and prints the drawn
output, so process start-up and pipe I/O are real while the tokens stay the
same in every mode; `--tool-command CMD` runs the researcher's own command and
sends its standard output back (then the tokens are only as repeatable as the
command). Subprocesses need the real clock: they are refused in virtual time.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Final, Protocol

from prototype.clock import Clock

__all__ = ["CommandTools", "RealTools", "SimulatedTools", "ToolRunner", "tool_runner"]

# A tool output is capped like Codex caps command output (≈10K tokens; docs/experiments.md#workloads).
MAX_OUTPUT_CHARS: Final = 40_000


class ToolRunner(Protocol):
    async def run(self, clock: Clock, seconds: float, output: str) -> tuple[str, float]:
        """Run one tool step whose drawn time is `seconds` and drawn output `output`;
        return the output sent back and the time the step took on `clock`."""
        ...


class SimulatedTools:
    async def run(self, clock: Clock, seconds: float, output: str) -> tuple[str, float]:
        await clock.sleep_until(clock.now() + seconds)
        return output, seconds


async def _communicate(clock: Clock, argv: list[str], stdin: bytes | None) -> tuple[str, float]:
    start = clock.now()
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    out, _ = await proc.communicate(stdin)
    text = out.decode("utf-8", "replace")[:MAX_OUTPUT_CHARS]
    if proc.returncode:
        text += f"\n[exit status {proc.returncode}]"
    return text, clock.now() - start


class RealTools:
    """A real process per tool step: `sleep` for the drawn time, then print the drawn output."""

    async def run(self, clock: Clock, seconds: float, output: str) -> tuple[str, float]:
        return await _communicate(clock, ["sh", "-c", 'sleep "$1"; cat', "tool", f"{seconds:.6f}"], output.encode())


@dataclass(frozen=True, slots=True)
class CommandTools:
    """The researcher's own shell command per tool step; its output (stdout and stderr) goes back."""

    command: str

    async def run(self, clock: Clock, seconds: float, output: str) -> tuple[str, float]:
        return await _communicate(clock, ["sh", "-c", self.command], None)


def tool_runner(*, real_tools: bool, tool_command: str | None, virtual: bool) -> ToolRunner:
    if tool_command is not None and real_tools:
        raise ValueError("choose one of real_tools and tool_command")
    if virtual and (real_tools or tool_command is not None):
        raise ValueError("real tool subprocesses run on the real clock: not with virtual time")
    if tool_command is not None:
        return CommandTools(tool_command)
    return RealTools() if real_tools else SimulatedTools()
