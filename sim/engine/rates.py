"""The engine's own rates on this machine: `python -m sim.engine.rates` (docs/engine.md).

Measured on llama.cpp directly (``/completion`` with token-id prompts, no API in front), each
figure the median of ``--repeats`` runs: decode speed free and forced (the token-id grammar
longrun uses for the same tokens in every design), cold prefill against context length, what a
prefix-cache hit does to the time to first token, and aggregate decode with several streams.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from typing import Any

import aiohttp
import msgspec

from .config import EngineConfig
from .model import BOS_ID, ID_OFFSET
from .process import EngineNotInstalled, LlamaServer

__all__ = ["measure", "rates_text"]


def _prompt(n: int, salt: int) -> list[int]:
    """`n` ordinary token ids, different for each salt (so no two prompts share a prefix)."""
    return [BOS_ID] + [ID_OFFSET + (salt * 7919 + 31 * i) % 150_000 for i in range(n - 1)]


async def _complete(session: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    start = time.perf_counter()
    async with session.post(f"{url}/completion", json=body) as reply:
        data: dict[str, Any] = msgspec.json.decode(await reply.read())
    if "error" in data:
        raise RuntimeError(f"llama.cpp: {data['error']}")
    return time.perf_counter() - start, data


async def _rates(url: str, slots: int, repeats: int) -> dict[str, float]:
    out: dict[str, float] = {}
    salt = iter(range(1, 10_000))
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True)) as s:
        n = 64
        free, forced = [], []
        for _ in range(repeats):
            p = _prompt(32, next(salt))
            _, d = await _complete(s, url, {"prompt": p, "n_predict": n, "ignore_eos": True, "id_slot": 0})
            free.append(d["timings"]["predicted_per_second"])
            ids = [ID_OFFSET + 500 + 13 * i for i in range(n)]
            grammar = "root ::= " + " ".join(f"<[{t}]>" for t in ids)
            _, d = await _complete(s, url, {"prompt": p, "n_predict": n, "grammar": grammar, "id_slot": 0})
            forced.append(d["timings"]["predicted_per_second"])
        out["decode_free_tok_s"] = statistics.median(free)
        out["decode_forced_tok_s"] = statistics.median(forced)
        for ctx in (500, 2000):
            rates, hits = [], []
            for _ in range(repeats):
                p = _prompt(ctx, next(salt))
                cold, d = await _complete(s, url, {"prompt": p, "n_predict": 1, "cache_prompt": True, "id_slot": 0})
                rates.append(d["timings"]["prompt_per_second"])
                warm, d = await _complete(
                    s,
                    url,
                    {"prompt": p + _prompt(21, next(salt))[1:], "n_predict": 1, "cache_prompt": True, "id_slot": 0},
                )
                hits.append(warm / cold)
            out[f"prefill_cold_tok_s_at_{ctx}"] = statistics.median(rates)
            out[f"cached_ttft_share_at_{ctx}"] = statistics.median(hits)
        for k in range(1, slots + 1):
            aggregate = []
            for _ in range(repeats):
                bodies = [
                    {"prompt": _prompt(32, next(salt)), "n_predict": n, "ignore_eos": True, "id_slot": i}
                    for i in range(k)
                ]
                start = time.perf_counter()
                await asyncio.gather(*(_complete(s, url, b) for b in bodies))
                aggregate.append(k * n / (time.perf_counter() - start))
            out[f"decode_aggregate_tok_s_{k}_streams"] = statistics.median(aggregate)
    return out


def measure(config: EngineConfig, *, repeats: int = 3) -> dict[str, float]:
    """Start an engine of `config` (or attach to ``engine_url``) and measure its rates."""
    if config.engine_url:
        return asyncio.run(_rates(config.engine_url, config.engine_slots, repeats))
    with LlamaServer(config) as server:
        return asyncio.run(_rates(server.url, config.engine_slots, repeats))


def rates_text(r: dict[str, float]) -> str:
    lines = [
        f"decode, one stream: {r['decode_free_tok_s']:.1f} tokens/s free, {r['decode_forced_tok_s']:.1f} forced "
        f"(the token-id grammar: {100 * (1 - r['decode_forced_tok_s'] / r['decode_free_tok_s']):.0f} % slower)",
    ]
    for ctx in (500, 2000):
        lines.append(
            f"prefill at {ctx} tokens: {r[f'prefill_cold_tok_s_at_{ctx}']:.0f} tokens/s cold; a cached prefix + 20 new "
            f"tokens takes {100 * r[f'cached_ttft_share_at_{ctx}']:.1f} % of the cold time"
        )
    streams = sorted(int(k.split("_")[4]) for k in r if k.startswith("decode_aggregate"))
    agg = ", ".join(f"{r[f'decode_aggregate_tok_s_{k}_streams']:.1f} at {k}" for k in streams)
    lines.append(f"decode, aggregate tokens/s by streams: {agg}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sim.engine.rates", description=__doc__)
    p.add_argument("--url", help="attach to a running llama.cpp server instead of starting one")
    p.add_argument("--slots", type=int, default=2, help="llama.cpp --parallel (and the most streams measured)")
    p.add_argument("--threads", type=int, default=1, help="llama.cpp -t")
    p.add_argument("--repeats", type=int, default=3, help="runs per figure (the median is shown)")
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    config = EngineConfig(
        engine_kind="llamacpp", engine_url=args.url, engine_slots=args.slots, engine_threads=args.threads
    )
    try:
        r = measure(config, repeats=args.repeats)
    except EngineNotInstalled as err:
        print(f"python -m sim.engine.rates: {err}", file=sys.stderr)
        return 2
    print(msgspec.json.encode(r).decode() if args.json else rates_text(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
