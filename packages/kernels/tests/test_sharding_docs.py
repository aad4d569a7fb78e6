"""docs/sharding.md's examples run as written (8 forced CPU devices)."""

from __future__ import annotations

import os
import re

import pytest

_DOC = os.path.join(os.path.dirname(__file__), "..", "..", "..", "docs", "sharding.md")
_BLOCKS = re.findall(r"```python\n(.*?)```", open(_DOC).read(), flags=re.S)


def test_the_doc_has_an_example_per_way_in_and_for_expert_parallelism():
    assert len(_BLOCKS) == 4


@pytest.mark.parametrize("index", range(len(_BLOCKS)))
def test_example_runs(index):
    exec(compile(_BLOCKS[index], f"docs/sharding.md example {index + 1}", "exec"), {})
