"""The validation gate: the host compared with its plans, read-only."""
