"""MLflow: the run life cycle, the async run logger, lineage, goodput and model packaging."""
