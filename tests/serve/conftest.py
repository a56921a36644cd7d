"""Fixtures the server tests share."""

from __future__ import annotations

import pytest

from minillm.api import LLM


@pytest.fixture(scope="module")
def llm(smollm2):
    """The session's SmolLM2 (shared, so read-only) behind the front door's LLM, once per test module."""
    return LLM(*smollm2)
