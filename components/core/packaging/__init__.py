"""The task's model as relaunch ships it: an MLflow pyfunc model built from a committed checkpoint
(:mod:`relaunch.components.core.packaging.model`). Above the trainer: it rebuilds the task's model and loads a
checkpoint into it; the evaluate and register steps use it."""
