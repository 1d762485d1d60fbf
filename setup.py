"""Build hook: compiles the C parts into the package next to the cffi module.

The C libraries (simgpu's libcuda.so.1 / libnvidia-ml.so.1, later the shim) are plain
shared objects, not Python extensions, so they are built with the system C compiler by
tools/build_c.py and dropped into vgpu/_lib/ wherever build_ext puts the package
(build/lib... for a wheel, src/ for an editable install).
"""
import os
import sys

from setuptools import setup
from setuptools.command.build_ext import build_ext

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools"))
import build_c  # noqa: E402


class BuildWithCLibraries(build_ext):
    def run(self):
        super().run()
        pkg_dir = os.path.dirname(self.get_ext_fullpath("vgpu._region"))
        build_c.build_all(os.path.join(pkg_dir, "_lib"))


setup(
    cffi_modules=["src/vgpu/_region_build.py:ffibuilder"],
    cmdclass={"build_ext": BuildWithCLibraries},
)
