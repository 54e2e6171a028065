"""The front end's handle on an engine core running in its own process.

Starts the process (``python -m sloserve.engine.core_proc``: a fresh interpreter, no inherited
OpenMP state, and unlike ``multiprocessing``'s spawn it never re-imports the caller's main
module; its environment bounds OpenMP's busy-wait, ``sloserve.cpus.engine_core_env``), binds
the two ZeroMQ sockets it connects to, waits for its EngineCoreReady, and then sends and
receives messages. Sending is thread-safe (a lock around the PUSH socket); receiving is for one
thread (the async front end's receiver).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict

import zmq

from sloserve.config import EngineConfig
from sloserve.cpus import engine_core_env
from sloserve.engine.messages import (EngineCoreReady, EngineInfo, FromCore, ToCore,
                                      decode_from_core, encoder)

logger = logging.getLogger(__name__)

_ERRORS = {"FileNotFoundError": FileNotFoundError, "ValueError": ValueError, "OSError": OSError}


class EngineCoreStartError(RuntimeError):
    """The engine core process died or gave up before it was ready."""


class CoreClient:
    """Start an engine core process for ``config`` and talk to it.

    Args:
        config: the engine's settings.
        step_trace: the core writes its step trace here.
        log_level: the core process's logging level.
        startup_timeout_s: most seconds to wait for the model to load.

    Raises (constructor):
        FileNotFoundError / ValueError / OSError: the core refused the model or the settings
            (the core's message, one line).
        EngineCoreStartError: the core crashed or did not get ready in time.
    """

    def __init__(self, config: EngineConfig, step_trace: str | None = None,
                 log_level: str = "info", startup_timeout_s: float = 900.0):
        self._tmp = tempfile.mkdtemp(prefix="sloserve-")
        self._ctx = zmq.Context(io_threads=1)
        self._send_lock = threading.Lock()
        self._closed = False
        self.proc = None
        socks = []
        try:  # a signal raised in here (SIGTERM while starting) must leave nothing behind
            self._in = self._ctx.socket(zmq.PUSH)
            socks.append(self._in)
            self._in.setsockopt(zmq.LINGER, 0)
            self._out = self._ctx.socket(zmq.PULL)
            socks.append(self._out)
            self._out.setsockopt(zmq.LINGER, 0)
            in_addr, out_addr = f"ipc://{self._tmp}/input", f"ipc://{self._tmp}/output"
            self._in.bind(in_addr)
            self._out.bind(out_addr)
            spec = {"config": asdict(config), "step_trace": step_trace, "input": in_addr,
                    "output": out_addr, "log_level": log_level, "parent_pid": os.getpid()}
            # -P: never the working directory's `sloserve/` (another checkout) before this one
            self.proc = subprocess.Popen([sys.executable, "-P", "-m", "sloserve.engine.core_proc",
                                          json.dumps(spec)], env=engine_core_env())
        except BaseException:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.kill()
            for sock in socks:
                sock.close(linger=0)
            self._ctx.term()
            shutil.rmtree(self._tmp, ignore_errors=True)
            raise
        self._startup_timeout_s = startup_timeout_s
        self.info: EngineInfo | None = None

    def wait_ready(self) -> EngineInfo:
        """Block until the core says it is ready; returns its EngineInfo (see the class's
        Raises). Cleans up on failure."""
        deadline = time.monotonic() + self._startup_timeout_s
        try:
            while True:
                if self._out.poll(200):
                    msg = decode_from_core(self._out.recv())
                    if not isinstance(msg, EngineCoreReady):
                        raise EngineCoreStartError(f"engine core sent {type(msg).__name__} "
                                                   f"before it was ready")
                    if msg.error:
                        raise _ERRORS.get(msg.error_type, EngineCoreStartError)(msg.error)
                    self.info = msg.info
                    return msg.info
                if self.proc.poll() is not None:
                    raise EngineCoreStartError(f"the engine core process exited with code "
                                               f"{self.proc.returncode} while starting")
                if time.monotonic() > deadline:
                    raise EngineCoreStartError(f"the engine core was not ready after "
                                               f"{self._startup_timeout_s:.0f} s")
        except BaseException:
            self.shutdown()
            raise

    def send(self, msg: ToCore) -> None:
        """Queue a message for the core (never blocks on the core; thread-safe)."""
        data = encoder.encode(msg)
        with self._send_lock:
            if not self._closed:
                self._in.send(data, copy=False)

    def recv(self, timeout_ms: int = 100) -> FromCore | None:
        """The next message from the core, or None after ``timeout_ms`` (one thread only)."""
        if self._closed or not self._out.poll(timeout_ms):
            return None
        return decode_from_core(self._out.recv(copy=False).buffer)

    @property
    def is_alive(self) -> bool:
        return self.proc.poll() is None

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the core (SIGTERM, then SIGKILL after ``timeout_s``) and close the sockets;
        idempotent."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("engine core did not stop in %.0f s; killing it", timeout_s)
                self.proc.kill()
                self.proc.wait(5)
        with self._send_lock:
            if not self._closed:
                self._closed = True
                self._in.close()
                self._out.close()
                self._ctx.term()
        shutil.rmtree(self._tmp, ignore_errors=True)
