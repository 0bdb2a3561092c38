"""fnebm's build: setuptools, its metadata in ``pyproject.toml``. One step is added: a wheel or a
regular install compiles the C kernels for the installing machine into the package
(``fnebm/kernels/_prebuilt``, :func:`fnebm._cbuild.prebuild`), so that the first run after
``pip install`` builds nothing. Without a working C compiler, or where the build fails, it says so
and goes on: the kernels then build on first use, as they do in an editable install (whose
runs build into ``~/.cache/fnebm``) and wherever the prebuilt ones do not match the machine.
``FNEBM_PREBUILD=0`` skips the step.
"""

import importlib.util
import os
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.dist import Distribution


class BuildPyAndKernels(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False) or os.environ.get("FNEBM_PREBUILD", "1").strip() == "0":
            return
        package = Path(self.build_lib) / "fnebm"
        # the build's own copy of fnebm/_cbuild.py, loaded alone: it needs no torch (not installed yet)
        spec = importlib.util.spec_from_file_location("fnebm_cbuild_at_install", package / "_cbuild.py")
        cbuild = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(cbuild)
        for stem, problem in cbuild.prebuild().items():
            if problem is not None:
                print(f"fnebm: the C kernel {stem} was not built at install ({problem}); it will be built on first use")


class PlatformDistribution(Distribution):
    """The wheel holds libraries built for one platform: it is tagged so."""

    def has_ext_modules(self):
        return True


setup(cmdclass={"build_py": BuildPyAndKernels}, distclass=PlatformDistribution)
