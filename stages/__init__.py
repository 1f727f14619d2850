"""The work: one module per stage kind (`stages/<kind>.py` with `Config` and `run(ctx)`), and the
machine-learning parts they share in sub-packages and helper modules."""
