"""Executors: how the engine core reaches its workers (``abstract.Executor``; the in-process
``uniproc.UniProcExecutor`` is the default)."""
