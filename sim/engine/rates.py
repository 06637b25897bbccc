"""The engine's own rates on this machine: `python -m sim.engine.rates` (docs/engine.md).

Measured on llama.cpp directly (``/completion`` with token-id prompts, no API in front), each
figure the median of ``--repeats`` runs: decode speed free and forced (the token-id grammar
longrun uses for the same tokens in every design), verified decoding's effective rate at several
k (planned tokens sent k a pass through the prompt path, as `EngineModel` does: by the client's
clock, HTTP included, and by the engine's own time), cold prefill against context length, what a
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
from .model import BOS_ID, ID_OFFSET, verify_ends
from .process import EngineNotInstalled, LlamaServer

__all__ = ["VERIFY_KS", "measure", "rates_text"]

VERIFY_KS = (8, 16, 32, 64, 128)  # the k measured for verified decoding
VERIFIED_TOKENS = 256  # planned tokens a verified measurement decodes, after a 500-token prompt


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


async def _rates(url: str, slots: int, repeats: int, verify_ks: tuple[int, ...]) -> dict[str, float]:
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
        for k in verify_ks:
            runs = [await _verified(s, url, k, next(salt)) for _ in range(repeats)]
            out[f"verified_tok_s_k{k}"] = statistics.median(wall for wall, _ in runs)
            out[f"verified_engine_tok_s_k{k}"] = statistics.median(engine for _, engine in runs)
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


async def _verified(s: aiohttp.ClientSession, url: str, k: int, salt: int) -> tuple[float, float]:
    """Verified decoding of `VERIFIED_TOKENS` after a prompt of 500: tokens/s by the client's
    clock (from the prefill pass's end to the last pass's, HTTP included) and by the engine's."""
    p = _prompt(500, salt)
    planned = [ID_OFFSET + 500 + 13 * i for i in range(VERIFIED_TOKENS)]
    body = {"n_predict": 1, "cache_prompt": True, "id_slot": 0, "temperature": 0.0}
    ends = verify_ends(len(planned), k)
    await _complete(s, url, {**body, "prompt": p})
    wall = engine_ms = 0.0
    for end in ends[1:]:
        took, d = await _complete(s, url, {**body, "prompt": p + planned[:end]})
        wall += took
        engine_ms += d["timings"]["prompt_ms"] + d["timings"]["predicted_ms"]
    # The prefill pass stood for the first planned token; the passes for the rest.
    return (len(planned) - 1) / wall, (len(planned) - 1) / (engine_ms / 1e3)


def measure(config: EngineConfig, *, repeats: int = 3, verify_ks: tuple[int, ...] = VERIFY_KS) -> dict[str, float]:
    """Start an engine of `config` (or attach to ``engine_url``) and measure its rates
    (verified decoding at each of `verify_ks`: none, not measured)."""
    if config.engine_url:
        return asyncio.run(_rates(config.engine_url, config.engine_slots, repeats, verify_ks))
    with LlamaServer(config) as server:
        return asyncio.run(_rates(server.url, config.engine_slots, repeats, verify_ks))


def rates_text(r: dict[str, float]) -> str:
    lines = [
        f"decode, one stream: {r['decode_free_tok_s']:.1f} tokens/s free, {r['decode_forced_tok_s']:.1f} forced "
        f"(the token-id grammar: {100 * (1 - r['decode_forced_tok_s'] / r['decode_free_tok_s']):.0f} % slower)",
    ]
    verified = ", ".join(
        f"{r[f'verified_tok_s_k{k}']:.0f} at k={k} ({r[f'verified_engine_tok_s_k{k}']:.0f} by the engine's time)"
        for k in VERIFY_KS
        if f"verified_tok_s_k{k}" in r
    )
    lines.append(f"verified decoding (planned tokens k a pass, after 500 prompt tokens), tokens/s: {verified}")
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
    p.add_argument(
        "--verify-k",
        default=",".join(map(str, VERIFY_KS)),
        help="verified decoding's tokens per pass to measure, comma-separated",
    )
    p.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = p.parse_args(argv)
    try:
        verify_ks = tuple(int(k) for k in args.verify_k.split(",") if k)
    except ValueError:
        verify_ks = ()
    if not verify_ks or min(verify_ks) < 1 or max(verify_ks) > 512:
        p.error(f"--verify-k: comma-separated integers from 1 to 512, got {args.verify_k!r}")
    config = EngineConfig(
        engine_kind="llamacpp", engine_url=args.url, engine_slots=args.slots, engine_threads=args.threads
    )
    try:
        r = measure(config, repeats=args.repeats, verify_ks=verify_ks)
    except EngineNotInstalled as err:
        print(f"python -m sim.engine.rates: {err}", file=sys.stderr)
        return 2
    print(msgspec.json.encode(r).decode() if args.json else rates_text(r))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
