"""The contract every part shares: the config model, errors, the exit-code table, the
classifier and the event schema."""
