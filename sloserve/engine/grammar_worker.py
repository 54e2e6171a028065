"""The grammar compile worker: a process at the lowest CPU priority that compiles
structured-output grammars for the engine core's
:class:`~sloserve.engine.structured_output.StructuredOutputManager`, which starts it (``python
-m sloserve.engine.grammar_worker FD``) at the first compile it needs.

It loads xgrammar (which imports torch: seconds) and the model's tokenizer information once,
then forks one process per compile (a fork of the loaded worker starts in milliseconds and
shares its memory until it writes). The engine core kills a job's process to stop its compile
(no request waits for the grammar any more, or it ran over
``--structured-outputs-compile-timeout``); the worker and the other jobs go on.

The worker compiles at nice 19 (every process and thread it starts inherits it): the kernel
gives the compiles only the CPU time the engine core's step loop leaves. It loads xgrammar and
the tokenizer first, at the priority it was started with, and lowers itself only then: that
start-up is seconds of CPU once per engine, and at nice 19 on a host whose cores another job
keeps busy (~1.5 % of a core) it took minutes, so that the first structured-output requests
timed out (a loaded CI run). Its ``oom_score_adj`` is raised so that a grammar that needs too
much memory gets a compile process killed, not the engine core. The worker exits when the engine core goes away
or closes its socket; a job's process exits when the worker goes away.

:func:`build_grammar` (a spec's xgrammar ``Grammar``) lives here, the one place a spec becomes
a grammar: the compile processes, the core's own compile and the API process's check
(``structured_output.validate``) all use it.

Protocol: frames of a 4-byte little-endian length and a msgpack map.

* On the socket ``FD`` (a Unix stream socket), from the core: ``{"op": "init", "model",
  "load_format", "vocab_size", "tokenizer_info"}`` once; the worker answers ``{"op": "ready",
  "tokenizer_info"}`` (xgrammar's TokenizerInfo as JSON, built here from the model's tokenizer
  when the init frame had none) or ``{"op": "ready", "error"}``. Then per job ``{"op":
  "compile", "spec": {...StructuredOutputsParams...}, "max_bytes"}``, sent with the write end
  of a pipe attached (``SCM_RIGHTS``); the worker answers nothing on the socket.
* On that pipe, from the job's process: ``{"op": "started", "pid"}``; ``{"op": "compiled"}``
  as soon as the grammar compiled; then ``{"op": "grammar", "json"}``
  (``CompiledGrammar.serialize_json``) or ``{"op": "too_large", "bytes"}`` when that JSON is
  over ``max_bytes``; or ``{"op": "error", "message"}`` for a spec that does not compile. The
  pipe's end of file without a final frame means the process died (killed, or crashed).
"""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import struct
import sys
import threading
import time

import msgspec

from sloserve.sampling_params import StructuredOutputsParams

#: the worker's nice value (the lowest priority)
NICE = 19
_HEADER = struct.Struct("<I")


def xgrammar_module():
    """xgrammar, imported now (it imports torch). Raises ValueError when it is missing."""
    try:
        import xgrammar
    except ImportError:
        raise ValueError("structured outputs need xgrammar on the server (`make` installs it; "
                         "or pip install 'sloserve[structured]')") from None
    return xgrammar


def build_grammar(spec: StructuredOutputsParams):
    """The xgrammar ``Grammar`` of a spec. Raises ValueError (with xgrammar's reason)."""
    xgr = xgrammar_module()
    try:
        if spec.json is not None:
            return xgr.Grammar.from_json_schema(spec.json, any_whitespace=False)
        if spec.json_object:  # an object, as OpenAI's json_object and vLLM mean it (xgrammar's
            # builtin JSON grammar also takes a top-level array: a seeded sample produced one)
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=True,
                                                strict_mode=False)
        if spec.regex is not None:
            return xgr.Grammar.from_regex(spec.regex)
        if spec.choice is not None:
            return xgr.Grammar.from_ebnf(
                "root ::= " + " | ".join(json.dumps(c) for c in spec.choice))
        return xgr.Grammar.from_ebnf(spec.grammar)
    except (RuntimeError, ValueError) as e:
        # xgrammar's messages start with "[time] file.cc:line: "
        why = re.sub(r"^\[[\d:]+\]\s+\S+:\d+:\s*", "", str(e).strip().splitlines()[-1])
        raise ValueError(f"cannot compile the {spec.kind}: {why}") from None


def read_frame(fd: int) -> dict | None:
    """The next frame from ``fd``; None at end of file (the other side is gone)."""
    head = _read_exact(fd, _HEADER.size)
    if head is None:
        return None
    body = _read_exact(fd, _HEADER.unpack(head)[0])
    return None if body is None else msgspec.msgpack.decode(body)


def write_frame(fd: int, msg: dict) -> None:
    """Write one frame to ``fd`` (raises OSError, e.g. BrokenPipeError, if the reader is gone)."""
    data = memoryview(encode_frame(msg))
    while data:
        data = data[os.write(fd, data):]


def encode_frame(msg: dict) -> bytes:
    body = msgspec.msgpack.encode(msg)
    return _HEADER.pack(len(body)) + body


def send_job(sock: socket.socket, msg: dict, pipe_fd: int) -> None:
    """Send a compile job with the write end of its result pipe attached."""
    data = encode_frame(msg)
    sent = socket.send_fds(sock, [data], [pipe_fd])
    if sent < len(data):
        sock.sendall(data[sent:])


def _recv_job(sock: socket.socket) -> tuple[dict, int | None] | None:
    """The next job frame and the pipe attached to it; None when the core closed the socket."""
    head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 1)
    if not head:
        return None
    head += _read_exact(sock.fileno(), _HEADER.size - len(head)) or b""
    body = _read_exact(sock.fileno(), _HEADER.unpack(head)[0])
    if body is None:
        return None
    return msgspec.msgpack.decode(body), (fds[0] if fds else None)


def _read_exact(fd: int, n: int) -> bytes | None:
    chunks = []
    while n:
        b = os.read(fd, min(n, 1 << 20))
        if not b:
            return None
        chunks.append(b)
        n -= len(b)
    return b"".join(chunks)


def lower_priority(nice: int = NICE) -> None:
    """Set this process's nice value to ``nice`` (where allowed; else keep the inherited one)."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)
    except (OSError, AttributeError):  # not POSIX, or not allowed: run at the inherited priority
        pass


def _first_to_be_killed() -> None:
    try:  # the OOM killer takes these processes first (raising one's own score is allowed)
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass


def watch_parent(parent_pid: int) -> None:
    """End this process within 0.5 s of its parent going away (even while it compiles): a
    helper process never outlives the process it serves."""
    def watch() -> None:
        while True:
            time.sleep(0.5)
            if os.getppid() != parent_pid:
                os._exit(0)
    threading.Thread(target=watch, name="sloserve-grammar-parent-watch", daemon=True).start()


def _tokenizer_info(xgr, init: dict) -> tuple[object, str | None]:
    """(xgrammar TokenizerInfo, its JSON if built here) from the init frame."""
    if init.get("tokenizer_info"):
        return xgr.TokenizerInfo.deserialize_json(init["tokenizer_info"]), None
    from sloserve.tokenizer import load_model_tokenizer
    tok = load_model_tokenizer(init.get("model"), init.get("load_format") or "auto")
    if tok is None:
        raise ValueError("structured outputs need the model's tokenizer")
    info = xgr.TokenizerInfo.from_huggingface(tok.hf, vocab_size=init["vocab_size"])
    return info, info.serialize_json()


def _compile(xgr, info, job: dict, out_fd: int) -> None:
    """A job's process: compile, send the frames, return (the caller exits)."""
    write_frame(out_fd, {"op": "started", "pid": os.getpid()})
    try:
        spec = StructuredOutputsParams(**job["spec"])
        compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        compiled = compiler.compile_grammar(build_grammar(spec))
    except Exception as e:  # noqa: BLE001 - the spec's problem: its requests fail
        write_frame(out_fd, {"op": "error", "message": f"{type(e).__name__}: {e}"})
        return
    write_frame(out_fd, {"op": "compiled"})
    text = compiled.serialize_json()
    max_bytes = int(job.get("max_bytes") or 0)
    if max_bytes and len(text) > max_bytes:
        write_frame(out_fd, {"op": "too_large", "bytes": len(text)})
    else:
        write_frame(out_fd, {"op": "grammar", "json": text})


def serve(sock: socket.socket) -> None:
    """Answer the init frame, then fork a process per compile job until the socket closes."""
    init = read_frame(sock.fileno())
    if init is None:
        return
    try:
        xgr = xgrammar_module()
        info, info_json = _tokenizer_info(xgr, init)
    except Exception as e:  # noqa: BLE001 - no xgrammar, no tokenizer: every job would fail
        write_frame(sock.fileno(), {"op": "ready", "error": f"{type(e).__name__}: {e}"})
        return
    lower_priority()  # loaded: from here on only compiles (module docstring)
    write_frame(sock.fileno(), {"op": "ready", "tokenizer_info": info_json})
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps the jobs' processes
    me = os.getpid()
    while True:
        got = _recv_job(sock)
        if got is None:
            return
        job, out_fd = got
        if out_fd is None:
            continue
        try:
            pid = os.fork()
        except OSError:  # the core sees the pipe close without a "started" frame
            os.close(out_fd)
            continue
        if pid == 0:
            status = 0
            try:
                sock.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                watch_parent(me)
                _compile(xgr, info, job, out_fd)
            except BaseException:  # noqa: BLE001 - the core sees the pipe close
                status = 1
            finally:
                os._exit(status)
        os.close(out_fd)


def main() -> None:
    _first_to_be_killed()
    watch_parent(os.getppid())
    sock = socket.socket(fileno=int(sys.argv[1]))
    os.dup2(2, 1)  # print() and C++ logging to stdout land on stderr
    serve(sock)


if __name__ == "__main__":
    main()
