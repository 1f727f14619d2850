"""snowcat: containers."""
