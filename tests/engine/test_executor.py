"""The executor seam: EngineCore sizes its KV cache from what the executor's workers report
(their KV cache spec and available memory), has it allocated, and runs every step through
``execute_model``; any executor that implements ``collective_rpc`` will do (here a fake one with
no model and no torch, as a cost-model executor would be)."""
from __future__ import annotations

import subprocess
import sys
import textwrap

FAKE = textwrap.dedent('''
    from sloserve.config import EngineConfig
    from sloserve.engine.core import EngineCore
    from sloserve.engine.messages import EngineCoreRequest
    from sloserve.executor.abstract import Executor
    from sloserve.kv_cache_spec import KVCacheSpec
    from sloserve.model.config import ModelConfig
    from sloserve.sampling_params import SamplingParams
    from sloserve.step_io import ModelRunnerOutput, WorkerInfo

    SPEC = KVCacheSpec(block_size=16, num_kv_heads=2, head_dim=8, dtype="bfloat16", num_layers=3)


    class FakeWorker:
        """One token per sampling request: 100 + the request's position."""
        def __init__(self):
            self.calls = []

        def get_model_info(self):
            return WorkerInfo("fake", "/nowhere", ModelConfig(
                vocab_size=500, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=4096,
                eos_token_ids=[2]), "bfloat16", "bfloat16", description="fake attention")

        def get_kv_cache_spec(self):
            return SPEC

        def determine_available_memory(self):
            return 10 * SPEC.page_size_bytes + 1

        def initialize_cache(self, num_blocks):
            self.calls.append(("initialize_cache", num_blocks))

        def execute_model(self, out):
            self.calls.append(("execute_model", out.num_batched_tokens))
            return ModelRunnerOutput(
                req_ids=[s.request_id for s in out.scheduled],
                sampled_token_ids=[[100 + s.num_computed_tokens + s.num_new_tokens]
                                   if s.samples else [] for s in out.scheduled])

        def shutdown(self):
            self.calls.append(("shutdown",))


    class FakeExecutor(Executor):
        def _init_executor(self):
            self.worker = FakeWorker()

        def collective_rpc(self, method, args=(), kwargs=None):
            return [getattr(self.worker, method)(*args, **(kwargs or {}))]


    ex = FakeExecutor(EngineConfig(max_num_batched_tokens=64))
    core = EngineCore(ex.config, executor=ex)
    tokens = []
    core.add_request(EngineCoreRequest("a", list(range(10, 30)), SamplingParams(
        max_tokens=3, ignore_eos=True), arrival_time=0.0, eos_token_ids=[2]))
    while core.has_unfinished_requests():
        for o in core.step().outputs:
            tokens += o.new_token_ids
    core.close()
    import sys
    print(core.num_kv_blocks, core.info.max_model_len, core.kv_cache_bytes, tokens,
          ex.worker.calls, "torch" in sys.modules)
''')


def test_the_core_runs_on_any_executor_and_sizes_the_cache_from_its_workers():
    res = subprocess.run([sys.executable, "-c", FAKE], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    page = 2 * 3 * 2 * 8 * 2 * 16  # K and V x layers x heads x head_dim x bf16 bytes x tokens
    assert res.stdout.split("\n")[0] == (
        f"10 160 {10 * page} [120, 121, 122] [('initialize_cache', 10), ('execute_model', 20), "
        f"('execute_model', 1), ('execute_model', 1), ('shutdown',)] False")


def test_the_core_tells_the_executor_the_cpus_its_grammar_compiles_hold(monkeypatch):
    """Each step, when the count changed: the compute threads leave those CPUs to the compiles
    (a decode team sharing a core with a compile stepped at a P99 of ~100 ms, measured)."""
    from sloserve.config import EngineConfig
    from sloserve.engine.core import EngineCore
    from sloserve.engine.messages import EngineCoreRequest
    from sloserve.engine.structured_output import StructuredOutputManager
    from sloserve.sampling_params import SamplingParams

    ns: dict = {}
    exec(FAKE[:FAKE.index("ex = FakeExecutor(")], ns)
    ex = ns["FakeExecutor"](EngineConfig(max_num_batched_tokens=64))
    ex.worker.reserve_cpus = lambda n: ex.worker.calls.append(("reserve_cpus", n))
    busy = [0]
    monkeypatch.setattr(StructuredOutputManager, "cpus_busy", property(lambda self: busy[0]))
    core = EngineCore(ex.config, executor=ex)
    core.add_request(EngineCoreRequest("a", list(range(10, 30)), SamplingParams(
        max_tokens=6, ignore_eos=True), arrival_time=0.0, eos_token_ids=[2]))
    for b in (0, 1, 1, 2, 0, 0):
        busy[0] = b
        core.step()
    core.close()
    assert [c for c in ex.worker.calls if c[0] != "initialize_cache"] == [
        ("execute_model", 20), ("reserve_cpus", 1), ("execute_model", 1), ("execute_model", 1),
        ("reserve_cpus", 2), ("execute_model", 1), ("reserve_cpus", 0), ("execute_model", 1),
        ("execute_model", 1), ("shutdown",)]
