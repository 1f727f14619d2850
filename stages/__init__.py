"""The work: one module per stage kind (`stages/<kind>.py` with `Config` and `run(ctx)`), and the
machine-learning parts they share in sub-packages and helper modules."""

# Stage kinds, in pipeline order. A kind is listed here once its module exists.
KINDS = ("prestage", "tasks", "sft", "probe", "select", "rl", "evaluate", "export", "card", "scan", "mpi_check")
