"""The pipeline's steps (one module each) and the libraries they share (``components.core``)."""

# Step name (kebab-case, the same in KFP and Argo) -> the module whose ``run`` it calls.
STEP_MODULES: dict[str, str] = {
    "prepare": "components.prepare",
    "locate-latest-checkpoint": "components.locate",
    "launch": "components.launch",
    "evaluate": "components.evaluate",
    "register": "components.register",
    "finalize": "components.finalize",  # the exit handler's task
}
