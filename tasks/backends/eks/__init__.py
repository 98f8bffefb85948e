"""The EKS backend: render (pure), watch and classify (pure), and the kubernetes client glue."""
