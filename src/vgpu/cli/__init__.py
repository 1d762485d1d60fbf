"""vgpu-ctl: the operator's command line.

A thin click layer over plain functions (vgpu.slices, vgpu.status, vgpu.runtime); nothing
here touches NVML or the GPU at import, so `vgpu-ctl --help` works anywhere (the modules of
one command family -- the agent, autoscaler, metrics server, MIG, Kubernetes, installers --
are imported inside their commands, so a command loads only what it runs).  Errors are
one line with a hint: runtime failures exit 1, usage errors exit 2 (click's convention).
"""
from . import (manifest_commands, plan_commands, run_commands, service_commands,  # noqa: F401
               sim_commands, slice_commands)   # (imported for their commands, which join `main`)
from .common import main

__all__ = ["main"]
