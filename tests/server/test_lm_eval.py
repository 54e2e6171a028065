"""lm-evaluation-harness (``lm_eval`` from PyPI, ``local-completions``, the server's /tokenize)
against a server with the embedded model's weights dequantized to float32: the first docs of the
repository's two tasks (benchmarks/lm_eval/tasks) give the same loglikelihoods (within 1e-3),
is-greedy flags and generations as lm-eval's own Hugging Face backend did on the same weights
(stored in benchmarks/lm_eval/reference_hf.json by ``benchmarks/lm_eval/run.sh``)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

from sloserve.config import EngineConfig

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LIMIT = 6


def _compare_module():
    spec = importlib.util.spec_from_file_location(
        "lm_eval_compare", os.path.join(ROOT, "benchmarks", "lm_eval", "compare.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_lm_eval_matches_the_hf_backend(helpers, tmp_path):
    srv = helpers.start_server(EngineConfig(model=None, dtype="float32", quantization="none",
                                            num_kv_blocks=256, max_model_len=1024))
    try:
        env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                   TOKENIZERS_PARALLELISM="false", HF_DATASETS_CACHE=str(tmp_path / "ds"))
        args = (f"base_url={srv.base_url}/v1/completions,model={srv.model},"
                f"tokenizer_backend=remote,num_concurrent=2,max_retries=1")
        p = subprocess.run(
            [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args",
             args, "--tasks", "sloserve_mc,sloserve_gen", "--include_path",
             "benchmarks/lm_eval/tasks", "--limit", str(LIMIT), "--log_samples",
             "--output_path", str(tmp_path / "out")],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
        assert p.returncode == 0, p.stderr[-3000:]
    finally:
        srv.stop()
    cmp = _compare_module()
    run = cmp.load_run(str(tmp_path / "out"))
    assert {t: len(d) for t, d in run.items()} == {"sloserve_mc": LIMIT, "sloserve_gen": LIMIT}
    lines = cmp.compare(run, cmp.load_run(os.path.join(ROOT, "benchmarks", "lm_eval",
                                                       "reference_hf.json")), 1e-3)
    assert all(ln.startswith("ok") for ln in lines), lines
