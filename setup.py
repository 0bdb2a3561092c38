"""fnebm's build: setuptools, its metadata in ``pyproject.toml``. One step is added: an install
compiles the C kernels for the installing machine into the package (``fnebm/kernels/_prebuilt``,
:func:`fnebm._cbuild.prebuild`), so that the first run after ``pip install`` builds nothing: into
the wheel's copy of the package, or, for ``pip install -e``, into the checkout (as setuptools
builds extensions in place; git ignores it). Without a working C compiler, or where a build
fails, it says so and goes on: the kernels then build on first use into ``~/.cache/fnebm``, as
they do wherever the prebuilt ones do not match the machine or the sources (edited since).
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
        if os.environ.get("FNEBM_PREBUILD", "1").strip() == "0":
            return
        editable = getattr(self, "editable_mode", False)
        package = (Path(__file__).resolve().parent if editable else Path(self.build_lib)) / "fnebm"
        # that package's fnebm/_cbuild.py, loaded alone: it needs no torch (maybe not installed yet)
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
