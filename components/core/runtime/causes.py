"""An attempt's cause where every rank of the group reads it: the store of the launcher that started them.

A rank that ends for a reason of its own (a full store, a bad input, a bug in a task) leaves its peers in a
collective that breaks when it goes, and to them that break looks like a killed peer: they would end 137
("a peer worker was killed"), or wait for a replacement that no launcher starts (no worker was killed).
So before such a rank leaves it records its cause (:func:`record`) in the launcher's store (the in-place
agent's, or torchrun's rendezvous store where the workers share it): every rank reaches it, also when the
checkpoint store is full or read-only, and it outlives the workers. Where there is none (relaunch's local
torchrun gives each rendezvous round a store of the workers' own, hosted by rank 0) the rank writes its
cause as the attempt's exit record instead (``runs/exit.json``, what a watchdog's hang writes too). A peer whose collective broke reads it (:func:`recorded`) and
ends with that cause at once. One cause per round of the group (its restart count: a generation under the
in-place agent); the first recorded wins.

    record(env, StoreUnwritable("store /s cannot be written (No space left on device); ..."))
    recorded(env)    # on a peer: the same error, "rank 1: " before its message; None when none was recorded
"""

from __future__ import annotations

import datetime
import json
import os
import threading
from typing import Any

from ..contract.errors import RelaunchError, error_for

CAUSE_KEY = "relaunch/cause"
"""``{key}/{restart count}``: the cause a rank recorded before it left that round (JSON: rank, exit
code, kind, reason); ``{key}/{restart count}/claims`` counts the ranks that tried to record one."""
STORE_SECONDS = 5.0  # a launcher's store that does not answer in this long is gone: nothing is recorded or read
CLAIMED_SECONDS = 2.0  # a cause claimed by a rank and not yet written: how long a reader waits for it

_client: Any = None
_lock = threading.Lock()


def _store(env: Any) -> Any:
    """A client of the launcher's store, made once; None without a launcher's store or peers."""
    global _client
    if env is None or env.world_size <= 1 or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    with _lock:
        if _client is None:
            import torch.distributed as dist

            _client = dist.TCPStore(env.master_addr, env.master_port, is_master=False, wait_for_workers=False,
                                    timeout=datetime.timedelta(seconds=STORE_SECONDS))
        return _client


def cause_key(restart_count: int) -> str:
    return f"{CAUSE_KEY}/{restart_count}"


def record(env: Any, err: RelaunchError) -> bool:
    """This rank (``env``, a :class:`~relaunch.components.core.runtime.distributed.DistEnv`) ends with
    ``err``: record it for its peers unless another rank recorded a cause first. Whether the launcher's
    store holds a cause of this round now (this one or an earlier rank's): False where there is no such
    store (torchrun with a store of the workers' own per round, which goes with its rank 0) or it does
    not answer; the caller then leaves its cause where its peers look next (``runs/exit.json``)."""
    try:
        store = _store(env)
        if store is None:
            return False
        key = cause_key(env.restart_count)
        if store.add(f"{key}/claims", 1) != 1:
            return True
        store.set(key, json.dumps({"rank": env.rank, "exit_code": int(err.exit_code), "kind": type(err).kind,
                                   "reason": str(err)}))
        return True
    except (RuntimeError, OSError, ValueError):  # torch's DistError is a RuntimeError
        return False


def recorded(env: Any) -> RelaunchError | None:
    """The cause a peer of this rank recorded in this round (its error again: the same kind and exit
    code, ``rank N: `` before its message), or None when none did (a peer killed, a lost node)."""
    try:
        store = _store(env)
        if store is None:
            return None
        key = cause_key(env.restart_count)
        if not store.check([key]):
            if store.add(f"{key}/claims", 0) == 0:
                return None
            store.wait([key], datetime.timedelta(seconds=CLAIMED_SECONDS))  # claimed a moment ago: being written
        cause = json.loads(store.get(key))
    except (RuntimeError, OSError, ValueError):
        return None
    prefix = f"rank {cause['rank']}: " if cause.get("rank") != env.rank else ""
    return error_for(int(cause["exit_code"]), prefix + str(cause.get("reason", "")), str(cause.get("kind", "")))
