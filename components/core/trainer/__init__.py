"""The training loop's helpers: set-up, checkpoints, tracking, health, injection, parallelism and
the training state (components/train.py is the loop)."""
