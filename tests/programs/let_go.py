"""Let go of a file the way the kernel would see a process done with it: unmap every mapping
of it and close every descriptor of it (for the shim's usage file: its slot's lock is then
no longer held through this process).  Imported by tests/programs/tenant.py and by the
children of tests/shim/test_shim_races.py."""
import ctypes
import os


def let_go(path) -> int:
    """Unmap and close `path` in this process; returns how many descriptors were closed."""
    target, closed = os.stat(path), 0
    libc = ctypes.CDLL(None)
    libc.munmap.argtypes = (ctypes.c_void_p, ctypes.c_size_t)
    for line in open("/proc/self/maps").read().splitlines():
        fields = line.split()
        if len(fields) >= 6 and int(fields[4]) == target.st_ino:
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if libc.munmap(start, end - start):
                raise OSError(ctypes.get_errno(), f"munmap of {path}")
    for fd in os.listdir("/proc/self/fd"):
        try:
            st = os.stat(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) == (target.st_dev, target.st_ino):
            os.close(int(fd))
            closed += 1
    return closed
