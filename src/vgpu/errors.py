"""The errors vgpu-ctl and its library raise: one line and a hint each (cli.py prints both)."""


class VgpuError(Exception):
    """A runtime failure the operator can act on."""

    def __init__(self, message, hint=None):
        super().__init__(message)
        self.hint = hint


class InvalidRequest(VgpuError):
    """The arguments contradict each other or the slice (a usage error)."""


class NotFound(VgpuError):
    pass


class Exists(VgpuError):
    pass


class Busy(VgpuError):
    pass


class Overcommitted(VgpuError):
    pass


class BadFile(VgpuError):
    pass


class CapacityUnknown(VgpuError):
    pass


class Changed(VgpuError):
    """The quota moved on since the caller read it (a compare-and-swap that lost)."""
