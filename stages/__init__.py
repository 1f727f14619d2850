"""snowcat: stages."""
