"""ModelConfig validation: bad shapes are a ValueError naming the field, never a crash later."""
import pytest

from sloserve.model.config import ModelConfig


def test_missing_keys_are_named():
    with pytest.raises(ValueError, match="missing vocab_size, hidden_size"):
        ModelConfig.from_hf_dict({"model_type": "llama", "intermediate_size": 8,
                                  "num_hidden_layers": 1, "num_attention_heads": 1})


@pytest.mark.parametrize("field,value", [("num_hidden_layers", 0), ("vocab_size", -1),
                                         ("hidden_size", "64"), ("num_attention_heads", True)])
def test_non_positive_or_non_int_shapes_rejected(field, value):
    kw = dict(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
              num_attention_heads=2, num_key_value_heads=1)
    kw[field] = value
    with pytest.raises(ValueError, match=field):
        ModelConfig(**kw)


def test_gqa_heads_must_divide():
    with pytest.raises(ValueError, match="multiple of"):
        ModelConfig(vocab_size=16, hidden_size=12, intermediate_size=16, num_hidden_layers=1,
                    num_attention_heads=3, num_key_value_heads=2)


@pytest.mark.parametrize("extra,context", [
    ({"model_type": "mistral", "sliding_window": 4096}, 4096),    # Mistral v0.1: the window
    ({"model_type": "mistral", "sliding_window": None}, 32768),   # v0.2+: none
    ({"model_type": "qwen2", "sliding_window": 4096}, 32768),     # Qwen2: only when used
    ({"model_type": "qwen2", "sliding_window": 4096, "use_sliding_window": True}, 4096),
    ({"model_type": "mistral", "sliding_window": 65536}, 32768),  # wider than the context
])
def test_a_sliding_window_ends_the_context(extra, context):
    """Sliding-window attention is not served, so the model's context stops at a window that
    applies: up to it, full attention is the same as the window's."""
    cfg = ModelConfig.from_hf_dict({"vocab_size": 16, "hidden_size": 8, "intermediate_size": 16,
                                    "num_hidden_layers": 1, "num_attention_heads": 2,
                                    "max_position_embeddings": 32768, **extra})
    assert cfg.max_position_embeddings == context
