"""LangChain (`langchain-openai`'s `ChatOpenAI` on the Responses API) and LiteLLM (`litellm.aresponses`)
against the server, unchanged; both pinned in setup.cfg.

Each drives the agent loop the way its users write it: the default policy calls the one function
tool on the first turns and then answers in text; the client sends each call's output back and
stops at the text. LangChain resends the history each turn (and, with `use_previous_response_id`,
chains on the last response); LiteLLM chains with `previous_response_id`. The check is the
loop's shape, the text at its end, and, as in tests/clients/test_openai_sdk.py, that the model saw the
same turns: the same calls, arguments and final text in every variant for one seed.
"""

from __future__ import annotations

import os
from typing import Any, Final

import pytest

from tests.support import live_server

TOOL_CALLS: Final = 3
PROMPT: Final = "Fix the failing test in module 3."
TOOL: Final[dict[str, Any]] = {
    "type": "function",
    "name": "exec_command",
    "description": "Run a shell command and return its output.",
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
}
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # LiteLLM fetches a price list at import otherwise

Turns = list[tuple[str, str]]  # per model turn: (tool name or "", its arguments or the text)


async def _langchain(base_url: str, *, chained: bool) -> Turns:
    langchain_openai = pytest.importorskip("langchain_openai", reason="langchain-openai is not installed")
    from langchain_core.messages import BaseMessage, HumanMessage, ToolMessage

    llm = langchain_openai.ChatOpenAI(
        model="sim", base_url=base_url, api_key="sk-longrun", use_responses_api=True, use_previous_response_id=chained
    ).bind_tools([TOOL])
    messages: list[BaseMessage] = [HumanMessage(PROMPT)]
    turns: Turns = []
    for _ in range(TOOL_CALLS + 2):
        ai = await llm.ainvoke(messages)
        messages.append(ai)
        if not ai.tool_calls:
            turns.append(("", ai.text))
            return turns
        for call in ai.tool_calls:
            turns.append((call["name"], call["args"]["cmd"]))
            messages.append(ToolMessage("ok", tool_call_id=call["id"]))
    raise AssertionError(f"no text after {len(turns)} turns")


async def _litellm(base_url: str) -> Turns:
    litellm = pytest.importorskip("litellm", reason="litellm is not installed")
    import json

    common = {"model": "openai/sim", "tools": [TOOL], "api_base": base_url, "api_key": "sk-longrun"}
    response = await litellm.aresponses(input=PROMPT, **common)
    turns: Turns = []
    for _ in range(TOOL_CALLS + 2):
        calls = [o for o in response.output if getattr(o, "type", None) == "function_call"]
        if not calls:
            text = "".join(c.text for o in response.output if o.type == "message" for c in o.content)
            turns.append(("", text))
            return turns
        turns += [(c.name, json.loads(c.arguments)["cmd"]) for c in calls]
        outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "ok"} for c in calls]
        response = await litellm.aresponses(input=outputs, previous_response_id=response.id, **common)
    raise AssertionError(f"no text after {len(turns)} turns")


@pytest.mark.slow
async def test_langchain_and_litellm_run_the_same_tool_loop() -> None:
    async with live_server(tool_calls=TOOL_CALLS) as live:
        runs = {
            "langchain": await _langchain(live.base_url, chained=False),
            "langchain chained": await _langchain(live.base_url, chained=True),
            "litellm": await _litellm(live.base_url),
        }
    for name, turns in runs.items():
        assert [t[0] for t in turns] == ["exec_command"] * TOOL_CALLS + [""], (name, turns)
        assert turns[-1][1], (name, turns)
    assert runs["langchain"] == runs["langchain chained"] == runs["litellm"]
