"""snowcat: benchmarks."""
