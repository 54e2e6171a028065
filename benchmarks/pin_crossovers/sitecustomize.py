"""Pin the linear layers' start-up crossovers for A/B runs: with this folder on PYTHONPATH, every
sloserve process (the API's and the engine core's) uses fixed token counts instead of racing the
kernels at start-up, whose outcome moves between runs on a noisy host (quantized steps up to 12,
16 or 24 tokens; AMX up to 1,024 or 2,048 seen on one host in one hour).

    SLOSERVE_PIN_CROSSOVERS=16,2048 PYTHONPATH=benchmarks/pin_crossovers \
        bash ../shared/compare/compare.sh --only sloserve --sloserve-checkout .

The value is ``QUANT_MAX_TOKENS,AMX_MAX_TOKENS``. It patches ``sloserve.model.crossover`` (this
tree) and ``sloserve.model.fast_path`` (trees before the one model definition) when they are
imported, so the same run pins an older checkout too. Nothing is imported before sloserve is.
"""
import importlib.abc
import os
import sys

_PIN = os.environ.get("SLOSERVE_PIN_CROSSOVERS")
_TARGETS = ("sloserve.model.crossover", "sloserve.model.fast_path")


class _PinFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _TARGETS:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = getattr(finder, "find_spec", lambda *a: None)(name, path, target)
            if spec is not None:
                break
        else:
            return None
        exec_module = spec.loader.exec_module
        quant, amx = (int(v) for v in _PIN.split(","))

        def exec_and_pin(module):
            exec_module(module)
            module.quant_crossover = lambda *a, **k: quant
            module.amx_crossover = lambda *a, **k: amx
        spec.loader.exec_module = exec_and_pin
        return spec


if _PIN:
    sys.meta_path.insert(0, _PinFinder())
