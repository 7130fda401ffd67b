"""The worked examples in the package's docstrings run and print what they say (minbpe's habit:
a helper's docstring carries a tiny example). The cost modules' run in tests/cost as well."""

import doctest
import importlib

import pytest

from .support import REPO

SRC = REPO / "src"
MODULES = sorted(
    ".".join(p.relative_to(SRC).with_suffix("").parts)
    for p in (SRC / "glassformer").rglob("*.py")
    if ">>>" in p.read_text(encoding="utf-8") and not p.parts[-2:] == ("cost", p.name)
)


def test_the_examples_are_found():
    assert "glassformer.generation.sampling" in MODULES and "glassformer.probes" in MODULES


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    import glassformer

    public = {n: getattr(glassformer, n) for n in glassformer.__all__}  # what `from glassformer import ...` gives
    result = doctest.testmod(importlib.import_module(name), extraglobs=public,
                             optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 0 and result.failed == 0, name
