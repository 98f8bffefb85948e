"""The EKS backend: render (pure), watch and classify (pure), and the kubernetes client glue."""

# The Kubernetes version the manifests are validated against; deploy/eks/cluster.yaml pins the
# same one.
K8S_VERSION = "1.34"
