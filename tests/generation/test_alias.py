"""glassformer.generation is the generation module; the old module path still works and warns once."""

import subprocess
import sys

from ..support import REPO

SCRIPT = """
import warnings
warnings.simplefilter("always")
import glassformer
from glassformer import generate as fn
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    from glassformer.generate import Session            # the documented old path
    from glassformer.generate import cache_length       # noqa: F401
    import glassformer.generate as alias
from glassformer.generation import Session as new
assert Session is new
kinds = [w.category.__name__ for w in caught]
assert kinds == ["DeprecationWarning"], kinds
assert "glassformer.generation" in str(caught[0].message)
model = glassformer.Transformer(glassformer.ModelConfig.from_preset("tiny")).eval()
# the package attribute is now the alias module, and it still generates like the function
assert list(glassformer.generate(model, [1, 2], max_new_tokens=3, greedy=True)) == \\
       list(fn(model, [1, 2], max_new_tokens=3, greedy=True))
print("ok")
"""


def test_the_old_generate_module_path_works_and_warns_once():
    out = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_the_package_keeps_generate_the_function_without_the_alias():
    out = subprocess.run([sys.executable, "-c", "import glassformer, inspect, sys; "
                          "assert inspect.isfunction(glassformer.generate); "
                          "assert 'glassformer.generate' not in sys.modules; print('ok')"],
                         capture_output=True, text=True, cwd=REPO, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
