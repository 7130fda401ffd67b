"""Deprecated alias: the generation module is `glassformer.generation`; `glassformer.generate` is the function.

`from glassformer.generate import Session` keeps working and warns once. Importing this module
makes the package attribute `glassformer.generate` this module, so the module itself can be
called like the function it shadows.
"""

import sys
import types
import warnings

from .generation import *  # noqa: F401,F403
from .generation import __all__, generate as _generate

warnings.warn("glassformer.generate as a module is deprecated: import from glassformer.generation instead "
              "(glassformer.generate stays the function)", DeprecationWarning, stacklevel=2)


class _CallableAlias(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return _generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableAlias
