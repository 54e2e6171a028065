"""Discrete-event simulation of the serving engine: the engine's own scheduler and KV cache
manager, unchanged, with a cost model in place of the model runner (``cost_model``,
``simulator``). Work in progress toward ``sloserve sim``: the core runs and is tested; the CLI,
the roofline cost model, clusters and disaggregation are not built yet."""
