"""The one text-clipping helper (nodeagent.text.clip) that errors, refusals and plot labels use."""

import pytest

from nodeagent.text import clip

pytestmark = pytest.mark.unit


def test_text_within_the_limit_is_kept_and_longer_text_ends_in_dots_within_it():
    assert clip("abc", 3) == "abc"
    assert clip("abcdef", 5) == "ab..."
    assert clip("x" * 10_000, 100) == "x" * 97 + "..."
