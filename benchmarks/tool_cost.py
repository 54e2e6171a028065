"""What a forced tool call costs: TPOT of ``tool_choice: "required"`` chat requests against the
same prompts answered in text (``tool_choice: "none"``: the tools still rendered into the prompt,
so only the forcing differs) and against plain chat requests without tools (a shorter prompt),
at 1 and 16 concurrent streams (HTTP, streamed), and structured
decoding's per-step mask time (xgrammar's ``fill_next_token_bitmask`` on the tool schema's
grammar, along a valid output, in this process).

    sloserve serve --chat-template sloserve/templates/hermes_chatml.jinja \\
        --enable-auto-tool-choice --tool-call-parser hermes --port 8000 &
    .venv/bin/python benchmarks/tool_cost.py --base-url http://127.0.0.1:8000 --out F.json

TPOT: the server's own mean over each batch of requests (``vllm:request_time_per_output_token_seconds``
sum / count from ``/metrics`` before and after it: per request (last token - first token) /
(tokens - 1) as the engine timed them, mask time included). A client-side measure would be
biased: a forced call's first visible chunk comes several tokens in (the parser holds back
``[{"name": ...`` until the name is read). The plain requests run to the same token count as
the forced ones gave (``max_tokens`` set to it, ``ignore_eos``).
At 16 streams the tool schema's longer prompts also mean more prefill between decode steps.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import time

import httpx
import openai

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "days": {"type": "integer", "minimum": 1,
                                                     "maximum": 7},
                                            "unit": {"enum": ["celsius", "fahrenheit"]}},
           "required": ["city", "days", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description":
                                           "The weather forecast of a city", "parameters": WEATHER}}]


#: the three kinds of request compared: the forced call, the same prompt (tools rendered by
#: the template) answered in free text, and a plain chat request without tools
KINDS = ("required", "tools_none", "plain")


async def one(client, model: str, i: int, kind: str, max_tokens: int) -> tuple[float, int]:
    kw = dict(model=model, temperature=0.7, seed=i, stream=True, max_tokens=max_tokens,
              stream_options={"include_usage": True},
              messages=[{"role": "user", "content": f"Weather in city {i} for a few days?"}])
    if kind == "required":
        kw.update(tools=TOOLS, tool_choice="required")
    elif kind == "tools_none":
        kw.update(tools=TOOLS, tool_choice="none", extra_body={"ignore_eos": True})
    else:
        kw.update(extra_body={"ignore_eos": True})
    times, tokens = [], 0
    async for chunk in await client.chat.completions.create(**kw):
        if chunk.choices and (chunk.choices[0].delta.content or chunk.choices[0].delta.tool_calls):
            times.append(time.perf_counter())
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
    return ((times[-1] - times[0]) / max(1, tokens - 1) if len(times) > 1 else float("nan"),
            tokens)


async def run(base: str, conc: int, n: int, kind: str, max_tokens: int) -> list[tuple]:
    async with openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0,
                                  timeout=600) as client:
        model = (await client.models.list()).data[0].id
        sem = asyncio.Semaphore(conc)

        async def limited(i):
            async with sem:
                return await one(client, model, i, kind, max_tokens)
        return await asyncio.gather(*(limited(i) for i in range(n)))


def server_tpot(base: str) -> tuple[float, float]:
    """(sum, count) of the server's TPOT histogram."""
    text = httpx.get(base + "/metrics", timeout=30).text
    got = [float(re.search(rf"^vllm:request_time_per_output_token_seconds_{k}{{[^}}]*}} (\S+)$",
                           text, re.M).group(1)) for k in ("sum", "count")]
    return got[0], got[1]


def timed(base: str, conc: int, n: int, kind: str, max_tokens: int) -> tuple[float, list]:
    """(the server's mean TPOT over the batch in ms, the batch's (client TPOT, tokens))."""
    s0, c0 = server_tpot(base)
    out = asyncio.run(run(base, conc, n, kind, max_tokens))
    s1, c1 = server_tpot(base)
    return 1e3 * (s1 - s0) / max(1.0, c1 - c0), out


def mask_time(tokenizer_src: str | None) -> dict:
    """Median and P99 of one ``fill_next_token_bitmask`` along a valid output of the tool
    schema's grammar (as ``required`` builds it), in microseconds."""
    import xgrammar as xgr

    from sloserve.server.tools import ChatConfig, plan_tools
    from sloserve.server.protocol import ChatCompletionRequest
    from sloserve.tokenizer import load_model_tokenizer
    tok = load_model_tokenizer(tokenizer_src)
    plan = plan_tools(ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                            tools=TOOLS, tool_choice="required"), ChatConfig())
    info = xgr.TokenizerInfo.from_huggingface(tok.hf, vocab_size=tok.vocab_size)
    grammar = xgr.GrammarCompiler(info).compile_json_schema(plan.structured.json)
    text = json.dumps([{"name": "get_weather", "parameters": {"city": "Paris", "days": 3,
                                                              "unit": "celsius"}}])
    ids = tok.encode(text, add_special_tokens=False)
    times = []
    for _ in range(20):
        m = xgr.GrammarMatcher(grammar)
        mask = xgr.allocate_token_bitmask(1, tok.vocab_size)
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask)
            times.append((time.perf_counter() - t0) * 1e6)
            assert m.accept_token(t)
    times.sort()
    return {"mask_us_p50": statistics.median(times),
            "mask_us_p99": times[int(0.99 * (len(times) - 1))], "steps": len(times)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--tokenizer", default=None, help="the served model (default: embedded)")
    ap.add_argument("--rounds", type=int, default=5,
                    help="rounds of the three kinds in turn; medians over rounds are reported")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    result: dict = {"mask": mask_time(a.tokenizer)}
    print(f"mask: {result['mask']}")
    for conc in (1, 16):
        n = a.num_prompts if conc > 1 else max(4, a.num_prompts // 4)
        rounds: list[dict] = []
        for _ in range(a.rounds):  # the kinds alternate, so the host's drift touches all
            tpot_forced, forced = timed(a.base_url, conc, n, "required", 64)
            length = int(statistics.median(t for _, t in forced))
            got = {"tokens_median": length, "required": tpot_forced}
            for kind in KINDS[1:]:
                got[kind] = timed(a.base_url, conc, n, kind, length)[0]
            rounds.append(got)
        row = {"concurrency": conc, "requests_per_kind_per_round": n, "rounds": rounds}
        for kind in KINDS:
            row[f"tpot_ms_{kind}"] = statistics.median(r[kind] for r in rounds)
        for kind in KINDS[1:]:
            row[f"ratio_{kind}"] = statistics.median(r["required"] / r[kind] for r in rounds)
        result[f"c{conc}"] = row
        print(json.dumps({k: v for k, v in row.items() if k != "rounds"}))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
