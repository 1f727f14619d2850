"""snowcat: kernels."""
