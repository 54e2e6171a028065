"""`sloserve bench`: an SLO load tester for any OpenAI-compatible server.

One module per job: ``arrivals`` (when requests are sent), ``datasets`` (what is sent),
``request_func`` (one streamed HTTP request, timed), ``metrics`` (TTFT/TPOT/ITL/E2E percentiles,
throughput, goodput: pure math over per-request records (:mod:`sloserve.workload`), shared
with the simulator),
``results`` (vLLM-compatible JSON), ``runner`` (one benchmark run), ``sweep`` (a series of rates,
Pareto frontier), ``plots``, ``experiment`` (the three-policy chunked-prefill experiment), ``cli``.
"""
