"""The names the in-place agent (:mod:`relaunch.components.launchers.inplace`) and its workers
(:mod:`relaunch.components.core.trainer.inplace`) share: a generation is one rendezvous round of a
worker group that keeps its survivors (no torch here: the local launcher imports it)."""

GENERATION_ENV = "RELAUNCH_INPLACE_GENERATION"
"""Set by the in-place agent on every worker it starts: the generation (rendezvous round) it joins."""
GENERATION_KEY = "relaunch/generation"
"""The agent's key in its store: the current generation; a survivor waits for it to grow."""


def generation_key(generation: int) -> str:
    """Set by the agent when ``generation`` starts: a survivor waits for the next one's key (no poll)."""
    return f"{GENERATION_KEY}/{generation}"
