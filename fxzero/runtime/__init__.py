"""The runtime: executes a Schedule (executor), collectives (comm), AdamW (optim),
rank-local materialization (materialize), and the user-facing Engine (engine)."""
