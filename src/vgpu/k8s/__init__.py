"""vgpu as a Kubernetes DRA driver: the node agent behind `vgpu-ctl k8s-plugin`.

Needs the `k8s` extra (kubernetes, grpcio, protobuf); nothing here is imported by the rest
of vgpu, so vgpu-ctl works without it.
"""
