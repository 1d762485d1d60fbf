"""cffi builder for vgpu._region: the layout of the quota and usage files.

The cdef is the marked region of csrc/vgpu_region.h (and of csrc/region_atomics.h), so C
and Python cannot drift apart (tests/shim/test_region_layout.py checks offsets as C compiles
them against these).
"""
import os
import re

from cffi import FFI

HEADER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "csrc", "vgpu_region.h")


def region_cdef(path=HEADER):
    with open(path) as f:
        text = f.read()
    m = re.search(r"/\* cffi:begin \*/(.*?)/\* cffi:end \*/", text, re.S)
    if not m:
        raise RuntimeError(f"{path}: no cffi:begin/cffi:end region")
    return m.group(1)


CSRC = os.path.dirname(os.path.abspath(HEADER))
ATOMICS = os.path.join(CSRC, "region_atomics.h")   # atomic accessors for the controller

ffibuilder = FFI()
ffibuilder.cdef(region_cdef() + region_cdef(ATOMICS))
ffibuilder.set_source("vgpu._region", '#include "vgpu_region.h"\n#include "region_atomics.h"',
                      sources=[os.path.relpath(os.path.join(CSRC, "region_atomics.c"))],
                      include_dirs=[CSRC])

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
