"""OpenAI-compatible HTTP server: FastAPI app, protocol models, Prometheus exporter, runner.

Import the pieces from their modules (``sloserve.server.app``, ``.protocol``, ``.metrics``,
``.api_server``); importing this package itself pulls in nothing heavy.
"""

__all__ = ["build_app", "create_engine_and_app", "run_server", "PrometheusStatLogger"]


def __getattr__(name):  # lazy: keep `import sloserve.server` free of torch / fastapi imports
    if name in ("build_app", "create_engine_and_app"):
        from sloserve.server import app
        return getattr(app, name)
    if name == "run_server":
        from sloserve.server.api_server import run_server
        return run_server
    if name == "PrometheusStatLogger":
        from sloserve.server.metrics import PrometheusStatLogger
        return PrometheusStatLogger
    raise AttributeError(name)
