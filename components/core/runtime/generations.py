"""The names the in-place agent (:mod:`relaunch.components.launchers.inplace`) and its workers
(:mod:`relaunch.components.core.recovery.in_place`) share: a generation is one rendezvous round of a
worker group that keeps its survivors (no torch here: the local launcher imports it)."""

GENERATION_ENV = "RELAUNCH_INPLACE_GENERATION"
"""Set by the in-place agent on every worker it starts: the generation (rendezvous round) it joins."""
GENERATION_KEY = "relaunch/generation"
"""The agent's key in its store: the current generation; a survivor waits for it to grow."""


def generation_key(generation: int) -> str:
    """Set by the agent when ``generation`` starts: a survivor looks for the next one's key."""
    return f"{GENERATION_KEY}/{generation}"


RECOVERING_KEY = "relaunch/inplace/recovering"
"""``{key}/{generation}``: how many workers of that generation took a broken collective for a lost peer and
wait for the next generation. All of them: no worker was lost (none to replace, no agent starts one), so
they end at once with the collective's failure instead of waiting out the generation's timeout."""


def recovering_key(generation: int) -> str:
    return f"{RECOVERING_KEY}/{generation}"


JOINED_KEY = "relaunch/inplace/joined"
"""``{key}/{generation}/{rank}``: set by a worker right before it enters ``generation``'s rendezvous. A rank
lost without it never touched that rendezvous, which still waits for the rank: its replacement joins the
same generation. A rank lost with it may have left its address there: its replacement needs a new one."""


def joined_key(generation: int, rank: int) -> str:
    return f"{JOINED_KEY}/{generation}/{rank}"


REPLACE = "replace"
"""A generation's mode (the value of its key): only the lost ranks start; the survivors rejoin."""
RESTART = "restart"
"""A generation's mode: every rank starts again (every node's agent restarts its workers)."""
NODE_ADDRESS_ENV = "RELAUNCH_NODE_ADDRESS"
"""Set by the agent on its workers: the address of their node that other nodes reach (the tier's replica
servers listen on it)."""
NODE_STARTS_KEY = "relaunch/inplace/node-starts"
"""``{key}/{node_rank}``: how many agents of that node started (a second one: the node was lost and started again)."""
END_KEY = "relaunch/inplace/end"
"""An agent that ended the job (a permanent code, no restarts left) sets its code: every other agent ends with it."""
DONE_KEY = "relaunch/inplace/done"
"""How many nodes' workers all ended 0 (node 0's agent keeps the store up until every node's did)."""
