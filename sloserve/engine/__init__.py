"""Engine core: requests, block pool, KV cache manager, scheduler, engine loop.

The scheduler and KV cache manager are plain Python (no torch, no clock of their own), and the
core takes its clock and its executor as parameters, so the simulator runs the core itself with
a cost-model executor and a virtual clock (``sloserve.sim``).
"""
