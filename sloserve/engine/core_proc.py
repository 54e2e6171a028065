"""The engine core in its own process (``sloserve serve``), talking ZeroMQ to the front end.

Sockets (the front end binds both, this process connects): ``input`` PULL (EngineCoreRequest /
EngineCoreAbort from the front end) and ``output`` PUSH (EngineCoreReady once, then one
EngineCoreOutputs per step, plus one after inputs that changed state, and one every
``HEARTBEAT_S`` while it has requests but none it can run; nothing while idle). Messages are
msgpack through msgspec (``sloserve.engine.messages``).

The step loop never waits on the front end: an input thread receives and decodes messages into
a queue, and the loop drains it between steps (blocking on it only when nothing is left to run).
SIGINT is ignored (a Ctrl-C in a terminal reaches the whole process group; the API process
decides how to stop); SIGTERM, or the parent process going away, ends the loop, and SIGTERM
while the model loads ends the process at once (exit 0).
"""
from __future__ import annotations

import logging
import os
import queue
import signal
import sys
import threading
import time

from sloserve.config import EngineConfig
from sloserve.engine.messages import (EngineCoreAbort, EngineCoreOutput, EngineCoreOutputs,
                                      EngineCoreResetPrefixCache,
                                      EngineCoreReady, EngineCoreRequest, decode_to_core, encoder)

logger = logging.getLogger("sloserve.engine.core")

#: exit codes: the model or the settings were refused (the user's to fix), or the core crashed
EXIT_BAD_SETTINGS, EXIT_CRASH = 2, 1


def run_engine_core(config: EngineConfig, step_trace: str | None, input_addr: str,
                    output_addr: str, log_level: str, parent_pid: int) -> None:
    """Process entry point: build the core, say ready, serve until told to stop."""
    import zmq

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    stop = threading.Event()
    loading = [True]

    def on_term(*_) -> None:  # while loading: stop now (the API process is waiting for us)
        stop.set()
        if loading[0]:
            # not SystemExit: raised inside a __del__ (a zmq socket closing on the refused-
            # settings path) Python only prints it, as a traceback on the server's stderr, and
            # goes on; nothing of a half-loaded core needs cleaning up
            os._exit(0)
    signal.signal(signal.SIGTERM, on_term)
    _watch_parent(parent_pid, input_addr)
    logging.basicConfig(level=log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s [core]: %(message)s")
    ctx = zmq.Context(io_threads=1)
    out_sock = ctx.socket(zmq.PUSH)
    out_sock.setsockopt(zmq.LINGER, 2000)
    out_sock.connect(output_addr)
    in_sock = ctx.socket(zmq.PULL)
    in_sock.setsockopt(zmq.LINGER, 0)
    in_sock.connect(input_addr)

    def send(msg) -> None:
        out_sock.send(encoder.encode(msg), copy=False)

    from sloserve.engine.core import EngineCore
    publisher = None
    try:
        core = EngineCore(config, step_trace=step_trace)
        if core.kv_events_config is not None and core.kv_events_config.enabled:
            from sloserve.engine.kv_events import KVEventPublisher
            publisher = KVEventPublisher(core.kv_events_config)
    except (FileNotFoundError, ValueError, OSError) as e:
        send(EngineCoreReady(error=str(e), error_type=type(e).__name__))
        _close(ctx, in_sock, out_sock)
        sys.exit(EXIT_BAD_SETTINGS)
    except BaseException as e:  # noqa: BLE001 - report, then die
        logger.exception("engine core failed to start")
        send(EngineCoreReady(error=f"{type(e).__name__}: {e}", error_type="RuntimeError"))
        _close(ctx, in_sock, out_sock)
        sys.exit(EXIT_CRASH)
    loading[0] = False  # from here SIGTERM ends the loop (a swallowed SystemExit too: stop is set)
    send(EngineCoreReady(info=core.info))

    inbox: queue.Queue = queue.Queue()

    def receive() -> None:  # the input thread: the only user of in_sock
        while not stop.is_set():
            if not in_sock.poll(200):
                continue
            data = in_sock.recv(copy=False)
            try:
                inbox.put(decode_to_core(data.buffer))
            except Exception:  # a malformed message is a front-end bug: say so, keep serving
                logger.exception("undecodable message from the front end (%d bytes)", len(data))

    reader = threading.Thread(target=receive, name="sloserve-core-input", daemon=True)
    reader.start()
    try:
        _serve(core, inbox, send, stop, parent_pid, publisher)
    finally:
        stop.set()
        if publisher is not None:
            publisher.close()
        core.close()
        reader.join(timeout=1)
        _close(ctx, in_sock, out_sock)


def _close(ctx, *socks) -> None:
    """Close every socket before the context (``term()`` blocks until they are all closed)."""
    for sk in socks:
        sk.close()
    ctx.term()


def _watch_parent(parent_pid: int, input_addr: str) -> None:
    """A thread that ends this process within 0.5 s of the API process going away (even a
    kill -9, and even while the model loads), removing the sockets' folder it leaves."""
    import shutil

    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                folder = os.path.dirname(input_addr.removeprefix("ipc://"))
                if os.path.basename(folder).startswith("sloserve-"):
                    shutil.rmtree(folder, ignore_errors=True)
                os._exit(0)
    threading.Thread(target=watch, name="sloserve-parent-watch", daemon=True).start()


#: while the core has requests but none it can run (grammars still compiling), it publishes
#: its snapshot this often (s), so the front end does not take the wait for a stall
#: (``--engine-stall-timeout``); an idle core sends nothing
HEARTBEAT_S = 0.5


def _serve(core, inbox: queue.Queue, send, stop: threading.Event, parent_pid: int,
           publisher=None) -> None:
    """The busy loop: drain inputs (publishing the state they left at once: the front end's
    queue gauges and overload control read it), step while there is work, publish every step
    (and a heartbeat while no step can run). While only KV transfers are in flight it waits
    on the inbox, which a finished transfer wakes (``EngineCore.set_wakeup``). With a KV event
    ``publisher``, the prefix cache's block events go out after each round."""
    pending: list[EngineCoreOutput] = []
    sent_at = time.monotonic()
    core.set_wakeup(lambda: inbox.put(_WAKE))
    wait_s = 0.0
    warmed = 0  # weight parts read since the last step (prewarm_for_remote_kv)
    while not stop.is_set():
        if os.getppid() != parent_pid:
            logger.warning("the API process is gone; the engine core stops")
            return
        idle = not core.has_unfinished_requests()
        if _drain(core, inbox, pending, block=idle or wait_s > 0,
                  timeout=0.5 if idle else wait_s) or pending:
            sent_at = time.monotonic()
            send(EngineCoreOutputs(pending, core.stats(), None, sent_at))
            pending = []
        wait_s = 0.0
        if core.has_unfinished_requests():
            outs = core.step()
            if outs is not None:
                send(outs)
                sent_at = time.monotonic()
                warmed = 0
            else:  # nothing could run (e.g. grammars still compiling): do not spin
                now = time.monotonic()
                if now - sent_at >= HEARTBEAT_S:
                    send(EngineCoreOutputs([], core.stats(), None, now))
                    sent_at = now
                if core.waits_only_for_transfers():
                    # idle with a prompt's KV on its way: warm the weights in small parts,
                    # looking for the KV's arrival between them, then wait on the inbox
                    if warmed < PREWARM_PASSES * PREWARM_PARTS and core.prewarm_for_remote_kv(
                            warmed % PREWARM_PARTS, PREWARM_PARTS):
                        warmed += 1
                    else:
                        wait_s = TRANSFER_POLL_S
                else:
                    time.sleep(0.001)
        if publisher is not None:
            publisher.publish(core.kv.pool.take_events())


#: a finished KV transfer's wake-up call in the inbox (no message of the front end's)
_WAKE = object()
#: while only KV transfers are in flight the loop looks at least this often (s): deadlines
TRANSFER_POLL_S = 0.05
#: a decode instance idle while a prompt's KV arrives reads its decode weights this many
#: times, in this many parts each (one part: ~2 ms for the 135M model's 97 MB), so that the
#: request's first decode steps find them in the CPU's caches; a KV that lands meanwhile waits
#: for one part at most. (On the AMX host, 3 reads after an idle spell took the next steps from
#: 10-12 ms to 7-8, a warm step being 6.6: benchmarks/README.md.)
PREWARM_PASSES = 3
PREWARM_PARTS = 4


def _drain(core, inbox: queue.Queue, pending: list[EngineCoreOutput], block: bool,
           timeout: float = 0.5) -> bool:
    """Apply every queued input; wait up to ``timeout`` s for one when ``block``. Returns
    whether any input arrived (the state the front end sees changed)."""
    try:
        msg = inbox.get(timeout=timeout) if block else inbox.get_nowait()
    except queue.Empty:
        return False
    changed = False
    while True:
        if msg is not _WAKE:
            changed = True
        if isinstance(msg, EngineCoreRequest):
            try:
                core.add_request(msg)
            except Exception as e:  # the front end validated it: this is an engine fault
                logger.exception("could not queue %s", msg.request_id)
                pending.append(EngineCoreOutput(request_id=msg.request_id, finish_reason="abort",
                                                error=f"engine could not queue the request: "
                                                      f"{type(e).__name__}: {e}"))
        elif isinstance(msg, EngineCoreAbort):
            pending.extend(core.abort_requests(msg.request_ids))
        elif isinstance(msg, EngineCoreResetPrefixCache):
            core.reset_prefix_cache()
        try:
            msg = inbox.get_nowait()
        except queue.Empty:
            return changed


def main(argv: list[str] | None = None) -> None:
    """``python -m sloserve.engine.core_proc SPEC_JSON`` (what CoreClient starts)."""
    import json
    spec = json.loads((sys.argv[1:] if argv is None else argv)[0])
    run_engine_core(EngineConfig(**spec["config"]), spec["step_trace"], spec["input"],
                    spec["output"], spec["log_level"], spec["parent_pid"])


if __name__ == "__main__":
    main()
