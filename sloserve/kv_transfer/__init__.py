"""Prefill/decode disaggregation's KV connector (vLLM v1's split): the scheduler half
(``scheduler_side``, plain Python) decides which requests' KV comes or goes and holds their
blocks; the worker half (``worker_side``) moves the KV between instances' cache tensors over
the wire (``transport``)."""
