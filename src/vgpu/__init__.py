"""vgpu: fractional GPUs for containers."""

__version__ = "0.1.0"
