"""The demo's reading of the server log."""
from __future__ import annotations

from sloserve.demo import engine_choices


def test_engine_choices_are_the_core_start_up_lines_without_their_prefix():
    log = (
        "2026-12-05 00:23:26,593 INFO sloserve.engine.core [core]: cpu: AMD EPYC; ISA avx2 fma; "
        "2 torch threads -> dtype bfloat16, KV cache bfloat16 (auto)\n"
        "INFO:     Started server process [123]\n"
        "2026-12-05 00:23:31,903 INFO sloserve.engine.core [core]: weights: gguf (Q4_1 x 210); "
        "fused forward on the avx512 kernels\n"
        "2026-12-05 00:23:33,370 INFO sloserve.engine.core [core]: engine core: SmolLM2, 30 "
        "layers, attention cpu-paged (prefill chunks: avx512_bf16 flash attention)\n"
        "2026-12-05 00:23:33,395 INFO sloserve.server.api_server: serving SmolLM2 on http://x\n"
        "INFO:     127.0.0.1:5555 - \"GET /health HTTP/1.1\" 200 OK\n")
    assert engine_choices(log) == [
        "cpu: AMD EPYC; ISA avx2 fma; 2 torch threads -> dtype bfloat16, KV cache bfloat16 (auto)",
        "weights: gguf (Q4_1 x 210); fused forward on the avx512 kernels",
        "engine core: SmolLM2, 30 layers, attention cpu-paged (prefill chunks: avx512_bf16 flash "
        "attention)"]
    assert engine_choices("INFO: nothing here\n") == []
