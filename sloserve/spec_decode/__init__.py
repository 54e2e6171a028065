"""Speculative decoding: proposers that draft the next tokens of decoding requests, which the
next step verifies in the same forward pass as everything else (``sloserve.spec_decode.drafter``
says how the engine core uses them)."""
