"""vgpu as a Kubernetes DRA driver: the node agent behind `vgpu-ctl k8s-plugin`.

Needs the `k8s` extra (kubernetes, grpcio, protobuf); nothing here is imported by the rest
of vgpu, so vgpu-ctl works without it.
"""

# The claim annotation naming the pod's container a claim serves: the webhook writes it into
# the ResourceClaimTemplates it makes (the resourceclaim controller copies it into each
# claim), the driver copies it into the slice's labels (vgpu.podlabels).
CONTAINER_ANNOTATION = "vgpu.dev/container"
# Set on every claim made from a template by Kubernetes' resourceclaim controller.
POD_CLAIM_ANNOTATION = "resource.kubernetes.io/pod-claim-name"
