"""Fixtures of the ``sloserve bench`` tests: the scripted mock OpenAI server (session-wide; every
test registers its own uniquely named scripts) and the embedded SmolLM2 tokenizer."""
from __future__ import annotations

import copy
import random

import pytest

from .mock_server import MockServer


@pytest.fixture(scope="session")
def mock_server():
    srv = MockServer().start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def bench_tokenizer(gguf_path):
    """sloserve's Tokenizer of the embedded GGUF, loaded once (as ``sloserve bench`` loads it)."""
    from sloserve.bench.tokenizer import load_tokenizer

    return load_tokenizer(gguf_path)


@pytest.fixture(scope="session")
def _base_factory(bench_tokenizer):
    from sloserve.bench.datasets import PromptFactory

    return PromptFactory(bench_tokenizer, seed=0)


@pytest.fixture(scope="session")
def make_factory(_base_factory):
    """``make_factory(seed)``: what ``PromptFactory(tokenizer, seed)`` gives, without rescanning the
    vocabulary (0.6 s each): a copy of one scanned factory with a fresh seeded generator
    (test_datasets checks the two agree)."""

    def make(seed: int = 0):
        f = copy.copy(_base_factory)
        f.rng = random.Random(seed)
        return f

    return make


@pytest.fixture
def factory(make_factory):
    """A fresh PromptFactory (seed 0) over the embedded tokenizer."""
    return make_factory(0)
