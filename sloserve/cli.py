"""The `sloserve` command: `serve` (OpenAI-compatible server), `generate` (one prompt offline),
`bench` (SLO load tester, `bench sweep`), `sim` (the engine's scheduler on a cost model),
`profile` (fit the sim's cost model), `compare` (two result files), `roofline` (roofline /
KV-cache / capacity calculator), `router` (an OpenAI front over several servers)."""
from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import fields

from sloserve.argtypes import port, pos_int
from sloserve.config import (DEFAULT_ENGINE_STALL_TIMEOUT_S, DEFAULT_MAX_BODY_BYTES,
                             DEFAULT_MAX_PENDING_COMPILES_PER_CLIENT, EngineConfig,
                             add_engine_args, engine_config_from_args)
from sloserve.router.args import add_router_args
from sloserve.slo import add_goodput_arg


#: signals that arrived while the server's modules imported (see _stop_before_start)
_signals_before_start: list[int] = []


def _stop_before_start(sig, frame):
    """SIGTERM / SIGINT while the server's modules import: nothing runs yet, exit 0.

    The signal is remembered before the exit is raised: raised inside a C extension's module
    init (torch._C imports numpy there and swallows a failed import), the SystemExit is lost
    and the import goes on; _serve then stops once the import returns."""
    _signals_before_start.append(sig)
    raise SystemExit(0)


def _serve(a: argparse.Namespace) -> int:
    if a.data_parallel_size > 1:
        return _data_parallel(a)
    import signal
    for s in (signal.SIGTERM, signal.SIGINT):  # run_server installs its own before the load
        signal.signal(s, _stop_before_start)
    from sloserve.server.api_server import run_server
    if _signals_before_start:  # swallowed where it landed: stop now, before any model loads
        return 0
    from sloserve.slo import parse_goodput
    run_server(engine_config_from_args(a), host=a.host, port=a.port, log_level=a.log_level,
               drain_timeout_s=a.shutdown_timeout, step_trace=a.step_trace,
               max_request_body_bytes=a.max_request_body_bytes, chat=chat_config_from_args(a),
               goodput=parse_goodput(a.goodput))
    return 0


def add_chat_args(p: argparse.ArgumentParser) -> None:
    """The chat endpoint's flags (vLLM's names; ``sloserve.server.tools``)."""
    p.add_argument("--chat-template", default=None, metavar="FILE",
                   help="a Jinja chat template to use instead of the model's (e.g. one that "
                        "renders tools: sloserve/templates/hermes_chatml.jinja for ChatML "
                        "models such as the embedded SmolLM2)")
    p.add_argument("--chat-template-content-format", default="auto",
                   choices=("auto", "string", "openai"),
                   help="message content as the template gets it: one string (auto, string) "
                        "or OpenAI's list of text parts (openai)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto": the --tool-call-parser reads tool calls out of '
                        "the model's text (the default choice where a request gives tools)")
    p.add_argument("--tool-call-parser", default=None, choices=("hermes", "llama3_json"),
                   help="how tool calls are written in the model's text")
    p.add_argument("--reasoning-parser", default=None, choices=("deepseek_r1", "qwen3"),
                   help="<think>...</think> text goes to reasoning_content")


def chat_config_from_args(a: argparse.Namespace):
    """The ``ChatConfig`` of ``serve``'s flags, the template file read.

    Raises:
        ValueError: a template file that cannot be read (one line naming it).
    """
    from sloserve.server.tools import ChatConfig
    template = None
    if a.chat_template is not None:
        try:
            with open(a.chat_template, encoding="utf-8") as f:
                template = f.read()
        except (OSError, UnicodeDecodeError) as e:
            raise ValueError(f"--chat-template: cannot read {a.chat_template}: "
                             f"{getattr(e, 'strerror', None) or e}") from None
    return ChatConfig(enable_auto_tool_choice=a.enable_auto_tool_choice,
                      tool_call_parser=a.tool_call_parser, reasoning_parser=a.reasoning_parser,
                      chat_template=template,
                      chat_template_content_format=a.chat_template_content_format)


def _generate(a: argparse.Namespace) -> int:
    from sloserve.engine.llm import LLM
    from sloserve.sampling_params import SamplingParams
    cfg = engine_config_from_args(a)
    llm = LLM(**{f.name: getattr(cfg, f.name) for f in fields(EngineConfig)})
    sp = SamplingParams(temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, seed=a.seed,
                        max_tokens=a.max_tokens, stop=a.stop or [])
    if a.chat:
        out = llm.chat([{"role": "user", "content": a.prompt}], sp)
    else:
        out = llm.generate(a.prompt, sp)[0]
    if out.error:
        print(f"sloserve: error: {out.error}", file=sys.stderr)
        return 1
    print(out.text)
    print(f"[{out.num_prompt_tokens} prompt tokens, {out.num_output_tokens} output tokens, "
          f"finish_reason={out.finish_reason}]", file=sys.stderr)
    return 0


def _data_parallel(a: argparse.Namespace) -> int:
    """``serve --data-parallel-size N``: N replicas (their workers in Ray actors with the ray
    backend), the router in front on --host/--port."""
    from sloserve.router.cluster import run_cluster, strip_flags
    serve_argv = strip_flags(a.argv[1:], {"--data-parallel-size", "--data-parallel-backend",
                                          "--host", "--port"})
    return run_cluster(["replica"] * a.data_parallel_size, serve_argv, a.host, a.port,
                       a.ray_address, None, ["--log-level", a.log_level],
                       use_ray=a.data_parallel_backend == "ray")


def _cluster(a: argparse.Namespace, serve_argv: list[str]) -> int:
    from sloserve.router.cluster import run_cluster
    roles = ["prefill"] * a.num_prefill_instances + ["decode"] * a.num_decode_instances
    return run_cluster(roles, serve_argv, a.host, a.port, a.ray_address, a.kv_transfer_config,
                       ["--kv-transfer-flow", a.kv_transfer_flow, "--log-level", a.log_level])


def _router(a: argparse.Namespace) -> int:
    from sloserve.router.args import config_from_args
    from sloserve.router.server import run_router
    run_router(config_from_args(a))
    return 0


def _roofline_measure(*args, **kwargs):
    """``sloserve roofline --measure``: :func:`sloserve.tools.roofline_measure.measure`, imported
    (with torch and the engine) only when called."""
    from sloserve.tools.roofline_measure import measure
    return measure(*args, **kwargs)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `sloserve`; returns the exit code (2 for bad settings, with one line)."""
    parser = argparse.ArgumentParser(prog="sloserve", description=__doc__, allow_abbrev=False)
    sub = parser.add_subparsers(dest="cmd", required=True)

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server", allow_abbrev=False)
    add_engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=port, default=8000)
    s.add_argument("--log-level", default="info")
    s.add_argument("--shutdown-timeout", type=float, default=30.0, metavar="S",
                   help="on SIGTERM/SIGINT, seconds requests in flight get to finish (new ones "
                        "get 503) before the server exits 0")
    s.add_argument("--max-request-body-bytes", type=pos_int, default=DEFAULT_MAX_BODY_BYTES,
                   metavar="N", help=f"larger request bodies get HTTP 413 in the API's error "
                                     f"shape (default {DEFAULT_MAX_BODY_BYTES} = "
                                     f"{DEFAULT_MAX_BODY_BYTES / 2 ** 20:g} MiB)")
    add_goodput_arg(s, "; /metrics counts sloserve:requests_slo_met_total and "
                       "sloserve:requests_slo_missed_total{reason} as requests finish")
    s.add_argument("--engine-stall-timeout", type=float,
                   default=DEFAULT_ENGINE_STALL_TIMEOUT_S, metavar="S",
                   help="/health answers 503 while the engine core has had requests in hand "
                        "and sent nothing (it publishes after every step) for over S seconds; "
                        "200 again at its next step. Nothing in flight is failed. Choose about "
                        "ten times the longest step you expect (a prefill of "
                        "--max-num-batched-tokens tokens on the slowest, busiest host): too "
                        "small and one long step reads as a stall (default "
                        f"{DEFAULT_ENGINE_STALL_TIMEOUT_S:g}; 0: never)")
    s.add_argument("--max-pending-compiles-per-client", type=int,
                   default=DEFAULT_MAX_PENDING_COMPILES_PER_CLIENT, metavar="N",
                   help="most structured-output grammars new to the server that one client "
                        "may have compiling at once; a request that would add one more gets "
                        "HTTP 429 with Retry-After. A client is a peer address as the server "
                        "sees it (behind a proxy on 127.0.0.1, the X-Forwarded-For address, "
                        "as uvicorn reads it; else every client of the proxy is one). "
                        "Requests whose spec is already compiled, or already compiling for "
                        "that client, do not count; a grammar counts until its first request "
                        "starts or ends (default "
                        f"{DEFAULT_MAX_PENDING_COMPILES_PER_CLIENT}; 0: no cap)")
    s.add_argument("--data-parallel-size", type=pos_int, default=1, metavar="N",
                   help="N replicas of the engine behind one router on --host/--port "
                        "(docs/router.md)")
    s.add_argument("--data-parallel-backend", choices=("mp", "ray"), default="mp",
                   help="data parallel: the replicas' workers in their engine cores' processes "
                        "on this host (mp), or in Ray actors over the cluster's nodes (ray)")
    s.add_argument("--step-trace", default=None, metavar="FILE.jsonl",
                   help="write one JSON line per engine step (composition and times), for "
                        "`sloserve profile --from-trace`")
    add_chat_args(s)
    s.set_defaults(func=_serve)

    g = sub.add_parser("generate", help="generate text for one prompt offline", allow_abbrev=False)
    g.add_argument("prompt")
    add_engine_args(g, positional_model=False)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--stop", action="append")
    g.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    g.set_defaults(func=_generate)

    cl = sub.add_parser("cluster", help="prefill and decode instances over a Ray cluster, "
                                        "the router in front; other flags go to each "
                                        "instance's `serve` (docs/disaggregation.md)",
                        allow_abbrev=False)
    cl.add_argument("--num-prefill-instances", type=pos_int, required=True, metavar="P")
    cl.add_argument("--num-decode-instances", type=pos_int, required=True, metavar="D")
    cl.add_argument("--ray-address", default=None,
                    help="the Ray cluster (default: a local one started here)")
    cl.add_argument("--kv-transfer-config", default=None, metavar="JSON",
                    help="the instances' KV connector settings (kv_role, kv_ip and kv_port are "
                         "set per instance)")
    cl.add_argument("--kv-transfer-flow", choices=("concurrent", "serial"),
                    default="concurrent")
    cl.add_argument("--host", default="127.0.0.1")
    cl.add_argument("--port", type=port, default=8000)
    cl.add_argument("--log-level", default="info")

    rt = sub.add_parser("router", help="OpenAI front over replicas or prefill/decode servers "
                                       "(docs/router.md)", allow_abbrev=False)
    add_router_args(rt)
    rt.set_defaults(func=_router)

    sub.add_parser("roofline", add_help=False,
                   help="roofline, KV-cache and capacity calculator (its own --help)")
    sub.add_parser("bench", add_help=False,
                   help="SLO load tester for OpenAI-compatible servers; `bench sweep` (own --help)")
    for name, hlp in (("sim", "simulate a benchmark on the engine's scheduler with a cost model"),
                      ("profile", "time the engine over step compositions; fit the sim cost model"),
                      ("tune", "search the scheduler settings for the most goodput under an SLO "
                               "in the simulator; --verify measures the best"),
                      ("compare", "two result JSON files side by side")):
        sub.add_parser(name, add_help=False, help=hlp + " (own --help)")
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sim"]:
        from sloserve.sim.cli import main as sim_main
        return sim_main(argv[1:])
    if argv[:1] == ["tune"]:
        from sloserve.sim.tune import main as tune_main
        return tune_main(argv[1:])
    if argv[:1] == ["profile"]:
        from sloserve.sim.profile import main as profile_main
        return profile_main(argv[1:])
    if argv[:1] == ["compare"]:
        from sloserve.bench.compare import main as compare_main
        return compare_main(argv[1:])
    if argv[:1] == ["bench"]:
        from sloserve.bench.cli import main as bench_main
        return bench_main(argv[1:])
    if argv[:1] == ["roofline"]:  # its own parser takes every flag after the word
        from sloserve.roofline.cli import main as roofline_main
        return roofline_main(argv[1:], measure=_roofline_measure)

    if argv[:1] == ["cluster"]:  # its own flags; the rest go to each instance's `serve`
        a, rest = parser.parse_known_args(argv)
        run = lambda: _cluster(a, rest)  # noqa: E731
    else:
        a = parser.parse_args(argv)
        a.argv = list(argv)
        run = lambda: a.func(a)  # noqa: E731
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return run()
    except (OSError, ValueError) as e:  # a missing model, bad settings, an unwritable trace
        print(f"sloserve: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:  # the engine core crashed while starting (its log says why)
        print(f"sloserve: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
