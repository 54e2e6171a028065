"""EngineConfig.resolve_kv_cache: the KV blocks that fit, and the model's context and the KV
cache bound max_model_len (the one place both are checked)."""
from __future__ import annotations

import pytest

from sloserve.config import EngineConfig

ENV = "SLOSERVE_ALLOW_LONG_MAX_MODEL_LEN"
PAGE = 1000  # bytes of one block over all layers


def resolve(cfg: EngineConfig, model_max_len: int, kv_tokens: int) -> int:
    """max_model_len over a cache of ``kv_tokens`` (available memory for exactly that many)."""
    blocks, max_len = cfg.resolve_kv_cache(PAGE, kv_tokens // cfg.block_size * PAGE + PAGE - 1,
                                           model_max_len)
    assert blocks == kv_tokens // cfg.block_size
    return max_len


def test_unset_is_the_context_capped_at_the_cache():
    assert resolve(EngineConfig(), 8192, 4096) == 4096
    assert resolve(EngineConfig(), 2048, 4096) == 2048


def test_blocks_are_the_setting_else_what_the_memory_holds():
    assert EngineConfig(num_kv_blocks=7).resolve_kv_cache(PAGE, 10 ** 9, 8192) == (7, 7 * 16)
    assert EngineConfig().resolve_kv_cache(PAGE, 300 * PAGE - 1, 8192) == (299, 299 * 16)
    with pytest.raises(ValueError, match="at least one block of 1000 bytes"):
        EngineConfig().resolve_kv_cache(PAGE, PAGE - 1, 8192)


def test_over_the_models_context_is_refused_unless_allowed(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    cfg = EngineConfig(max_model_len=9000)
    with pytest.raises(ValueError) as e:
        resolve(cfg, 8192, 16384)
    assert str(e.value) == ("max_model_len=9000 tokens is over the model's context of 8192 "
                            "tokens; lower --max-model-len (or set "
                            "SLOSERVE_ALLOW_LONG_MAX_MODEL_LEN=1 to allow it)")
    assert resolve(EngineConfig(max_model_len=8192), 8192, 16384) == 8192
    monkeypatch.setenv(ENV, "1")
    assert resolve(cfg, 8192, 16384) == 9000
    with pytest.raises(ValueError, match="does not fit the KV cache of 1024 blocks x 16"):
        resolve(EngineConfig(max_model_len=20000), 8192, 16384)


def test_kv_cache_dtype_int8_is_a_choice_and_others_are_refused():
    """``--kv-cache-dtype int8`` parses (the CLI and EngineConfig agree); a value outside the
    choices is refused naming them, as argparse refuses it at the command line (exit 2)."""
    import argparse

    import pytest

    from sloserve.config import EngineConfig, add_engine_args, engine_config_from_args
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert engine_config_from_args(p.parse_args(["--kv-cache-dtype", "int8"])).kv_cache_dtype == "int8"
    EngineConfig(kv_cache_dtype="int8").validate()
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, bfloat16, float32, "
                                         "float16, int8, got 'int4'"):
        EngineConfig(kv_cache_dtype="int4").validate()
    with pytest.raises(SystemExit) as e:
        p.parse_args(["--kv-cache-dtype", "fp8"])
    assert e.value.code == 2


def test_the_choice_lists_have_one_home():
    """Every parser and validator of a setting's choices reads them from ``sloserve.config``:
    the loader's, the platform's, the roofline's and the simulator's flags, and the attention
    backends that ``sloserve.model.attention`` registers are exactly the listed ones."""
    import argparse

    from sloserve import config, platform
    from sloserve.model import attention, loader
    from sloserve.model.attention.backend import _BACKENDS
    from sloserve.roofline.cli import build_parser
    from sloserve.roofline.kv import DTYPE_BYTES
    from sloserve.sim.cli import _parser as sim_parser

    assert loader.QUANTIZATIONS is config.QUANTIZATION_CHOICES
    assert platform.DTYPES is config.DTYPE_CHOICES
    assert platform.KV_CACHE_DTYPES is config.KV_CACHE_DTYPE_CHOICES
    assert attention is not None and sorted(_BACKENDS) == sorted(
        config.ATTENTION_BACKEND_CHOICES[1:])
    assert sorted(DTYPE_BYTES) == sorted(config.ROOFLINE_DTYPES)
    assert set(config.ROOFLINE_DTYPE_OF) == set(config.KV_CACHE_DTYPE_CHOICES) - {"auto"}
    assert set(config.ROOFLINE_DTYPE_OF.values()) <= set(config.ROOFLINE_DTYPES)

    def choices(p: argparse.ArgumentParser) -> dict:
        return {a.dest: a.choices for a in p._actions if a.choices is not None}

    eng = argparse.ArgumentParser()
    config.add_engine_args(eng)
    got = choices(eng)
    assert got["dtype"] is config.DTYPE_CHOICES
    assert got["kv_cache_dtype"] is config.KV_CACHE_DTYPE_CHOICES
    assert got["load_format"] is config.LOAD_FORMAT_CHOICES
    assert got["quantization"] is config.QUANTIZATION_CHOICES
    assert got["attention_backend"] is config.ATTENTION_BACKEND_CHOICES
    roof = choices(build_parser())
    assert roof["dtype"] is config.DTYPE_CHOICES
    assert roof["load_format"] is config.LOAD_FORMAT_CHOICES
    assert roof["weight_dtype"] is roof["kv_dtype"] is config.ROOFLINE_DTYPES
    assert {"fcfs", "priority"} <= set(choices(sim_parser())["scheduling_policy"])
    from sloserve.engine.request_queue import QUEUES
    from sloserve.engine.scheduler import SchedulingPolicy
    assert tuple(p.value for p in SchedulingPolicy) == config.POLICIES
    assert tuple(QUEUES) == config.QUEUE_POLICIES


@pytest.mark.parametrize("name,value", [("attention_backend", "flash"),
                                        ("load_format", "pickle")])
def test_choices_are_checked_by_validate(name, value):
    """A value outside a setting's choices is refused before any model loads, naming them."""
    with pytest.raises(ValueError, match=f"{name} must be one of auto, .*, got '{value}'"):
        EngineConfig(**{name: value}).validate()


def test_batch_invariant_flag():
    """--batch-invariant (default off) reaches the config; the torch reference has no
    batch-invariant path, so it is refused with --enforce-eager or the torch-ref backend before
    any model loads."""
    import argparse

    from sloserve import config
    p = argparse.ArgumentParser()
    config.add_engine_args(p)
    assert config.engine_config_from_args(p.parse_args([])).batch_invariant is False
    assert config.engine_config_from_args(p.parse_args(["--batch-invariant"])).batch_invariant
    EngineConfig(batch_invariant=True).validate()
    with pytest.raises(ValueError, match="cannot be combined with enforce_eager"):
        EngineConfig(batch_invariant=True, enforce_eager=True).validate()
    with pytest.raises(ValueError, match="needs the cpu-paged attention backend"):
        EngineConfig(batch_invariant=True, attention_backend="torch-ref").validate()
