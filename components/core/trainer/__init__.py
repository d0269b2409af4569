"""The training loop's helpers: set-up, saving, tracking, health, injection, parallelism and the training
state (components/train.py is the loop; where it starts is the recovery room's)."""
