"""cffi builder for vgpu._region: the layout of the quota and usage files.

The cdef is the marked region of csrc/vgpu_region.h, so C and Python cannot drift apart
(tests/test_region_layout.py checks offsets as C compiles them against these).
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


ffibuilder = FFI()
ffibuilder.cdef(region_cdef())
ffibuilder.set_source("vgpu._region", '#include "vgpu_region.h"',
                      include_dirs=[os.path.dirname(os.path.abspath(HEADER))])

if __name__ == "__main__":
    ffibuilder.compile(verbose=True)
