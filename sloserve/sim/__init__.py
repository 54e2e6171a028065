"""``sloserve sim``: discrete-event simulation of the serving engine. The engine's own scheduling
code (scheduler, KV cache manager, request state) runs unchanged, with a step cost model in
place of the model and a virtual clock in place of time.

Modules: ``cost_model`` (profiled linear, roofline, overlap), ``profile`` (``sloserve profile``:
fit a cost model to a server's step trace or to a grid of timed steps), ``simulator`` (the event
loop, replicas behind a router, prefill/decode disaggregation), ``kv_transfer`` (the KV hand-off
over a link), ``capacity`` (KV blocks that fit a simulated instance), ``workload`` (the bench's
workloads as lengths), ``setup`` / ``modes`` / ``presets`` / ``cli`` (the command: one run, rate
sweeps, capacity search under SLOs, the lecture presets)."""
