"""Processor.encode: a prompt that is not valid Unicode is a ParamError naming where."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from sloserve.engine.processor import Processor
from sloserve.sampling_params import ParamError


class _Tok:
    eos_token_ids = (0,)

    def encode(self, text):
        return [ord(c) for c in text]


def test_lone_surrogate_is_named_before_the_tokenizer_sees_it():
    p = Processor(_Tok(), SimpleNamespace(eos_token_ids=[0]))
    assert p.encode("hi") == [104, 105]
    with pytest.raises(ParamError) as e:
        p.encode("ab\ud800 hi")
    assert str(e.value) == "the prompt is not valid Unicode: surrogates not allowed at character 2"
    assert e.value.param == "prompt"
