"""``sloserve router``: an OpenAI-compatible HTTP front that spreads requests over sloserve (or
vLLM) servers: replicas under a routing policy (round-robin, least-outstanding, prefix-aware on
the replicas' KV cache events), or prefill/decode pairs (disaggregated serving), with health
checks that take a dead worker out of rotation and fail its requests within 2 s.
See docs/router.md."""
