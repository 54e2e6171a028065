"""Chat content parts: text parts are joined; anything else is a ParamError naming what is wrong."""
from __future__ import annotations

import pytest

from sloserve.sampling_params import ParamError
from sloserve.server.protocol import ChatMessage


def test_text_parts_joined_with_newlines():
    m = ChatMessage(role="user", content=[{"type": "text", "text": "a"},
                                          {"type": "text", "text": "b"}])
    assert m.to_template_dict() == {"role": "user", "content": "a\nb"}


@pytest.mark.parametrize("part, message", [
    ({"type": "image_url", "image_url": {"url": "x"}},
     "only text content parts are supported, got 'image_url'"),
    ({"text": "no type"}, "only text content parts are supported, got None"),
    ({"type": "text"}, "a text content part needs a string 'text' field, got None"),
    ({"type": "text", "text": 5}, "a text content part needs a string 'text' field, got 5"),
])
def test_bad_part_names_the_problem(part, message):
    with pytest.raises(ParamError) as e:
        ChatMessage(role="user", content=[part]).to_template_dict()
    assert str(e.value) == message and e.value.param == "messages"
