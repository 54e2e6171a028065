"""``sloserve sim``: discrete-event simulation of the serving engine. The engine core itself
(``EngineCore`` with its scheduler, KV cache manager and request state, unchanged) runs with a
cost-model executor in place of the workers and a virtual clock in place of time.

Modules: ``executor`` (the cost-model executor and the virtual clock), ``cost_model``
(profiled linear, roofline, overlap), ``profile`` (``sloserve profile``: fit a cost model to a
server's step trace or to a grid of timed steps), ``simulator`` (the event loop, replicas
behind a router, prefill/decode disaggregation), ``kv_transfer`` (the KV hand-off over a link),
``capacity`` (KV blocks that fit a simulated instance), ``workload`` (the bench's workloads as
lengths), ``setup`` / ``modes`` / ``presets`` / ``cli`` (the command: one run, rate sweeps,
capacity search under SLOs, the lecture presets)."""
