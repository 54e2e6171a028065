"""The worker in a Ray actor (``--distributed-executor-backend ray``): the same greedy output as
in-process, and an actor killed mid-serving restarted by Ray with the engine serving on (the
lost prefix cache not trusted). P/D with the workers in Ray actors: tests/router/test_cluster.py."""
from __future__ import annotations

import dataclasses
import time

import pytest

from sloserve.config import EngineConfig
from sloserve.engine.core import EngineCore
from sloserve.engine.messages import EngineCoreRequest
from sloserve.sampling_params import SamplingParams

ray = pytest.importorskip("ray")

PROMPT = [11 + 5 * j for j in range(37)]
SP = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def ray_local():
    # a new local cluster, never one another run left registered (/tmp/ray/ray_current_cluster)
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    yield
    ray.shutdown()


def _config(model, **kw) -> EngineConfig:
    return EngineConfig(model=model, dtype="float32", num_kv_blocks=64, block_size=4,
                        max_num_batched_tokens=10, num_threads=1, **kw)


def _run(cores, rid_prefix="") -> dict[str, list[int]]:
    toks: dict[str, list[int]] = {}
    t = time.monotonic()
    while any(c.has_unfinished_requests() for c in cores):
        for c in cores:
            if c.has_unfinished_requests():
                o = c.step()
                for x in (o.outputs if o else ()):
                    toks.setdefault(x.request_id, []).extend(x.new_token_ids)
                    if x.error:
                        toks.setdefault("errors", []).append(x.error)
        time.sleep(0.0005)
        assert time.monotonic() - t < 120
    return toks


@pytest.fixture(scope="module")
def reference(tiny_llama_dir):
    core = EngineCore(_config(tiny_llama_dir))
    core.add_request(EngineCoreRequest("ref", PROMPT, SP, 0.0))
    toks = _run([core])["ref"]
    core.close()
    return toks


def test_ray_worker_serves_as_in_process_and_comes_back_after_a_kill(tiny_llama_dir, reference,
                                                                     ray_local):
    core = EngineCore(_config(tiny_llama_dir, distributed_executor_backend="ray"))
    try:
        core.add_request(EngineCoreRequest("a", PROMPT, SP, 0.0))
        assert _run([core])["a"] == reference
        # the worker's process dies: that step's request fails, Ray restarts the actor, the
        # executor sets it up again and the next request is served as before
        core.add_request(EngineCoreRequest("b", PROMPT, SP, 0.0))
        core.step()
        ray.kill(core.model_executor.actor, no_restart=False)
        out = _run([core])
        assert out.get("b", []) != reference and any("restarted" in e for e in out["errors"])
        core.add_request(EngineCoreRequest("c", PROMPT, SP, 0.0))
        assert _run([core])["c"] == reference  # the lost prefix cache was not trusted
        assert core.kv.num_free_blocks == core.num_kv_blocks
    finally:
        core.close()


def test_a_missing_ray_node_is_one_clear_error(tiny_llama_dir, ray_local):
    with pytest.raises(ValueError, match="no live Ray node at 10.255.255.1"):
        EngineCore(dataclasses.replace(_config(tiny_llama_dir), distributed_executor_backend="ray",
                                       ray_node_ip="10.255.255.1"))
