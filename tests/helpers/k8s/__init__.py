"""Kubernetes stand-ins, each following the real component's rules (see each module)."""
