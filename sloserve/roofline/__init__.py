"""Roofline, KV-cache and capacity calculator (``sloserve roofline``).

Plain Python + numpy; nothing here imports torch (reading a GGUF goes through
:mod:`sloserve.model.gguf_loader`, which does, and is imported lazily only for ``--model x.gguf``).

Modules, one concept each:

- :mod:`.units`     -- byte/FLOP/time units and formatting (GiB vs GB).
- :mod:`.hardware`  -- accelerator table with sources, interconnect presets, ``local`` measurement.
- :mod:`.models`    -- model specs: presets, config.json, GGUF; MLA and MoE fields.
- :mod:`.kv`        -- KV-cache bytes per token (MHA/GQA/MQA/MLA), totals, per-GPU under TP.
- :mod:`.roofline`  -- the roofline model itself (balance point, attainable FLOP/s, MFU, bound).
- :mod:`.ops`       -- per-operator FLOPs/bytes of prefill and decode (LLM-Viewer style).
- :mod:`.bounds`    -- lower bounds: step time, TPOT, tokens/s, max batch, KV transfer.
- :mod:`.textbook`  -- the worked numbers of the lecture (golden values) and where its units slip.
- :mod:`.cli`       -- ``main(argv)``: the table / JSON printer.
"""
