"""`make demo`: serve the embedded model and drive real streamed chat requests through it.

Starts `sloserve serve` (SmolLM2-135M-Instruct, the dtype chosen for this CPU, chunked prefill) in a subprocess,
waits for /health, sends a handful of chat requests concurrently through the official `openai`
client with streaming, shows the answers as they stream, then prints each request's TTFT and
TPOT (client-side, vLLM's definitions) and the scheduler summary scraped from /metrics, and
shuts the server down. Part 2 runs the chunked-prefill experiment (``sloserve.bench.experiment``)
on this machine; part 3 asks the same question of the simulator where decode steps are
memory-bound (``sloserve sim --preset lecture``).
"""
from __future__ import annotations

import argparse
import asyncio
import os
import re
import sys
import time
from dataclasses import dataclass, field

import httpx
from rich.console import Console
from rich.live import Live
from rich.table import Table

from sloserve.bench.server_proc import scrape_metrics, sloserve_server
from sloserve.latency import tpot

QUESTIONS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a haiku about the ocean.",
    "Give three tips for staying focused while studying.",
    "Explain in two sentences what a GPU is.",
    "What is 12 times 12? Explain briefly.",
    "Name three planets of the solar system and one fact about each.",
]


#: the engine core's start-up lines that say what it chose for this CPU (logged at INFO)
_CHOICE = re.compile(r"\[core\]: ((?:cpu|weights|engine core): .*)$")


def engine_choices(log_text: str) -> list[str]:
    """The engine core's start-up lines on what it picked for this CPU (dtype, kernels, attention),
    from a ``sloserve serve`` log, without their timestamp and logger prefix."""
    return [m.group(1) for line in log_text.splitlines() if (m := _CHOICE.search(line))]


@dataclass
class Stream:
    """One streamed chat request as the client sees it (times: time.perf_counter seconds)."""

    question: str
    text: str = ""
    sent: float = 0.0
    first: float | None = None
    last: float | None = None
    output_tokens: int = 0
    finish_reason: str | None = None
    error: str | None = None
    chunks: list[float] = field(default_factory=list)

    @property
    def ttft_ms(self) -> float | None:
        """First content chunk minus send time (ms)."""
        return None if self.first is None else (self.first - self.sent) * 1e3

    @property
    def tpot_ms(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1), vLLM's per-request TPOT."""
        if self.first is None or self.last is None:
            return None
        t = tpot(self.last - self.sent, self.first - self.sent, self.output_tokens)
        return None if t is None else t * 1e3


async def chat_stream(client, model: str, s: Stream, max_tokens: int) -> None:
    """Send one streamed greedy chat request and fill `s` as chunks arrive (errors go to s.error)."""
    s.sent = time.perf_counter()
    try:
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": s.question}],
            max_tokens=max_tokens, temperature=0.0, stream=True,
            stream_options={"include_usage": True})
        async for chunk in stream:
            now = time.perf_counter()
            if chunk.usage is not None:
                s.output_tokens = chunk.usage.completion_tokens
            for c in chunk.choices:
                if c.delta.content:
                    s.first = s.first or now
                    s.last = now
                    s.text += c.delta.content
                    s.chunks.append(now)
                if c.finish_reason:
                    s.finish_reason = c.finish_reason
    except Exception as e:  # show it, keep the demo going
        s.error = f"{type(e).__name__}: {e}"


def render(streams: list[Stream]) -> Table:
    t = Table(title="streaming answers", show_lines=True, expand=True)
    t.add_column("#", width=2)
    t.add_column("question", ratio=1)
    t.add_column("answer (streaming)", ratio=2)
    for i, s in enumerate(streams):
        ans = s.text + ("" if s.finish_reason or s.error else " ▌")
        t.add_row(str(i), s.question, ans if not s.error else f"[red]{s.error}")
    return t


async def drive(base: str, model: str, n: int, max_tokens: int, console: Console) -> list[Stream]:
    """Run `n` concurrent streamed chats, showing the answers live; returns them when all end."""
    from openai import AsyncOpenAI
    client = AsyncOpenAI(base_url=f"{base}/v1", api_key="sloserve")
    streams = [Stream(q) for q in (QUESTIONS * 4)[:n]]
    with Live(render(streams), console=console, refresh_per_second=8) as live:
        tasks = [asyncio.create_task(chat_stream(client, model, s, max_tokens)) for s in streams]
        while not all(t.done() for t in tasks):
            live.update(render(streams))
            await asyncio.sleep(0.12)
        live.update(render(streams))
    console.line()  # piped output: keep the next table off the last border line
    await client.close()
    return streams


def chat_demo(base: str, a: argparse.Namespace, console: Console) -> bool:
    """Part 1: concurrent streamed chats, per-request TTFT/TPOT, scheduler summary. True if all ok."""
    model = httpx.get(f"{base}/v1/models", timeout=5).json()["data"][0]["id"]
    console.print(f"model [bold]{model}")
    t1 = time.perf_counter()
    streams = asyncio.run(drive(base, model, a.num_requests, a.max_tokens, console))
    wall = time.perf_counter() - t1

    t = Table(title=f"per request (client-side; {a.num_requests} concurrent chats, greedy)")
    for col in ("#", "TTFT ms", "TPOT ms", "output tokens", "finish_reason"):
        t.add_column(col, justify="right")
    for i, s in enumerate(streams):
        t.add_row(str(i), f"{s.ttft_ms:.0f}" if s.ttft_ms else "-",
                  f"{s.tpot_ms:.1f}" if s.tpot_ms else "-", str(s.output_tokens),
                  s.finish_reason or (s.error or "-"))
    console.print(t)
    total_out = sum(s.output_tokens for s in streams)
    console.print(f"{total_out} output tokens in {wall:.1f} s = {total_out / wall:.1f} tok/s")

    m = scrape_metrics(base)
    steps = m.get("sloserve:engine_steps_total", 0)
    tok_sum = m.get("sloserve:batched_tokens_per_step_sum", 0)
    st = Table(title="scheduler summary (from /metrics)")
    st.add_column("metric")
    st.add_column("value", justify="right")
    st.add_row("engine steps", f"{steps:.0f}")
    st.add_row("tokens per step (mean)", f"{tok_sum / steps:.1f}" if steps else "-")
    st.add_row("prompt tokens", f"{m.get('vllm:prompt_tokens_total', 0):.0f}")
    st.add_row("generation tokens", f"{m.get('vllm:generation_tokens_total', 0):.0f}")
    st.add_row("preemptions", f"{m.get('vllm:num_preemptions_total', 0):.0f}")
    st.add_row("peak KV cache usage", f"{100 * m.get('sloserve:kv_cache_usage_peak_perc', 0):.2f} %")
    console.print(st)
    return not any(s.error or not s.text for s in streams)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    ap.add_argument("--num-requests", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--skip-experiment", action="store_true",
                    help="only the chat demo, not the three-policy chunked-prefill experiment")
    ap.add_argument("--out-dir", default="demo-results", help="experiment results and plots")
    ap.add_argument("server_args", nargs="*", help="extra flags for `sloserve serve` (after --)")
    a = ap.parse_args(argv)
    console = Console(width=None if sys.stdout.isatty() else 160)
    console.rule("[bold]sloserve demo, part 1: streamed chats")
    t0 = time.perf_counter()
    console.print(f"starting: sloserve serve {' '.join(a.server_args)}")
    os.makedirs(a.out_dir, exist_ok=True)
    log_path = os.path.join(a.out_dir, "server.log")
    with sloserve_server(a.server_args, port=a.port, log_level="info", log_path=log_path) as base:
        console.print(f"server healthy after {time.perf_counter() - t0:.1f} s; what the engine "
                      f"chose for this CPU (full log: {log_path}):")
        with open(log_path, encoding="utf-8") as f:
            for line in engine_choices(f.read()):
                console.print(f"  {line}", markup=False)
        console.print("(SmolLM2-135M is a small model: its answers are often wrong; what this "
                      "shows is the serving)")
        ok = chat_demo(base, a, console)
    console.print(f"server stopped; part 1 took {time.perf_counter() - t0:.1f} s")
    if not ok:
        return 1
    if a.skip_experiment:
        return 0
    from sloserve.bench.experiment import ExperimentConfig, run_experiment
    console.rule("[bold]part 2: chunked prefill vs naive vs static, same mixed workload")
    cfg = ExperimentConfig(server_args=tuple(a.server_args))
    rows = run_experiment(cfg, a.out_dir, console)
    console.rule("[bold]part 3: the same question where decode is memory-bound (simulated)")
    console.print("`sloserve sim --preset lecture`: the engine's own scheduler, an 8B-class model "
                  "on an H100 as a cost model (decode 22 ms per step, prefill 35,000 tok/s); "
                  "docs/sim.md")
    from sloserve.sim.cli import main as sim_main
    sim_rc = sim_main(["--preset", "lecture"])
    console.print(f"demo took {time.perf_counter() - t0:.1f} s in all")
    return 0 if all(r["failed"] == 0 for r in rows) and sim_rc == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
