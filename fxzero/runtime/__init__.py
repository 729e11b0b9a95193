"""The runtime: executes a Schedule (executor), collectives (comm), AdamW (optim),
rank-local materialization (materialize, with init_events and init_replay for a model built on
the meta device), and the user-facing Engine (engine)."""
