"""The main job's harness: the same rollouts in every mode, same model-visible tokens."""

from __future__ import annotations

import pytest

from sim.__main__ import build_parser, compare, main, table


async def test_same_tokens_in_every_mode_and_incremental_bytes() -> None:
    args = build_parser().parse_args(
        ["compare", "--rollouts", "2", "--tool-calls", "4", "--tps", "0", "--tool-time", "0", "--seed", "7"]
    )
    results = await compare(args)
    by_mode = {m: [r for r in results if r.mode == m] for m in ("http", "http_prev", "ws", "append")}
    assert all(len(v) == 2 for v in by_mode.values())
    for i in range(2):
        per_mode = {m: rs[i].turns for m, rs in by_mode.items()}
        assert {len(t) for t in per_mode.values()} == {5}  # 4 tool calls, then the answer
        for k in range(5):
            usages = {m: turns[k].response.usage for m, turns in per_mode.items() if m != "append"}
            assert len({u.input_tokens for u in usages.values() if u}) == 1, (i, k, usages)
            assert len({u.output_tokens for u in usages.values() if u}) == 1
            outputs = {
                m: turns[k].output_items[0].get("arguments") or turns[k].output_items[0]["content"][0]["text"]
                for m, turns in per_mode.items()
            }
            assert len(set(outputs.values())) == 1
        # http resends the growing history; the others send settings plus new items only
        http_bytes = [t.bytes_sent for t in per_mode["http"]]
        assert http_bytes == sorted(http_bytes) and len(set(http_bytes)) == 5
        for mode in ("ws", "http_prev"):
            sent = [t.bytes_sent for t in per_mode[mode]]
            assert abs(sent[0] - http_bytes[0]) < 100 and max(sent) < http_bytes[-1]
        assert all(t.response.usage.input_tokens_details.cached_tokens > 0 for t in per_mode["ws"][1:])  # type: ignore[union-attr]
        # append: one response whose usage totals the ws turns'; pauses carry usage null
        final = per_mode["append"][-1].response.usage
        assert final is not None and all(t.response.usage is None for t in per_mode["append"][:-1])
        assert final.input_tokens == sum(t.response.usage.input_tokens for t in per_mode["ws"])  # type: ignore[union-attr]
        assert len({t.response.id for t in per_mode["append"]}) == 1
        assert max(t.bytes_sent for t in per_mode["append"][1:]) < min(t.bytes_sent for t in per_mode["ws"][1:])
    assert "time saved vs http" in table(results)


def test_cli_rejects_unknown_mode() -> None:
    with pytest.raises(SystemExit, match="unknown mode 'grpc'"):
        main(["compare", "--modes", "grpc", "--rollouts", "1"])
