"""Engine core: requests, block pool, KV cache manager, scheduler, engine loop.

The scheduler and KV cache manager are plain Python (no torch, no clock of their own) so the
simulator can drive them with a cost model in place of the model runner.
"""
