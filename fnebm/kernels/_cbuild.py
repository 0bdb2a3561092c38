"""The C build cache, kept at :mod:`fnebm._cbuild` (below :mod:`fnebm.random`, whose eager CPU draws
are built with it too); this name is the same module object, so code and tests that patch it here
patch the one module."""

import sys

from fnebm import _cbuild

sys.modules[__name__] = _cbuild
