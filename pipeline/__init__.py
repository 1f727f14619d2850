"""snowcat: pipeline."""
