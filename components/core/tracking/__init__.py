"""Tracking: the tracker protocol and its trackers (MLflow, TensorBoard, W&B), the MLflow client, the async
run logger, lineage, the warm start's registry lookup and the goodput report."""
