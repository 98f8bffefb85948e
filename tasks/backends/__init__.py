"""Launch backends: one protocol (:mod:`tasks.backends.base`), a local and an EKS implementation."""
