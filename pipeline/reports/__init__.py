"""Read-only reports of a run directory: the provenance card, the audit, paired comparisons of
evaluations, kept trajectories and weight drift, behaviour records, plots, a pattern search over
the demonstrations. They read what the stages recorded and write only their own report files; the
`card` stage and the CLI call them."""
