"""One process's context: its configuration, its store and its MLflow client, each opened once.

A step's ``run(config)``, ``relaunch run`` and ``relaunch tune`` build one :class:`Context` per
configuration and hand it (or its :attr:`~Context.store`) to the helpers they call, where each helper
once opened the store from ``config.store.uri`` itself (the same store up to six times a process, an
object store's check request each time) and its own MLflow client.

Both are opened lazily, on first use: a step that must not touch the store before it needs it (finalize,
whose store may be away) opens nothing by building one. An open that fails is not remembered: the next use
tries again, as the next ``open_store`` call did. A namespaced configuration (a training of ``relaunch
run``, a trial of a study) is another configuration and so another context (:meth:`Context.for_config`),
which shares only what is the same: the store when its URI is, the client when its tracking URI is.

The rooms below tracking (store, runtime, data, checkpoint) do not see this module: they keep taking a
``Store``.
"""

from __future__ import annotations

from typing import Any

from ..store import Store, open_store
from . import client as mlflow_client


class Context:
    """A process's ``config`` (the one configuration model), its ``store`` and its MLflow ``tracker``."""

    def __init__(self, config: Any, *, store: Store | None = None):
        self.config = config
        self._store = store
        self._tracker: Any = None
        self._tracker_uri: str | None = None

    @property
    def store(self) -> Store:
        """The store at ``config.store.uri``, opened on first use (BadInput, TransientFailure as ``open_store``)."""
        if self._store is None:
            self._store = open_store(self.config.store.uri)
        return self._store

    @property
    def tracker(self) -> Any:
        """The ``MlflowClient`` of the tracking URI (``MLFLOW_TRACKING_URI``, else ``tracking.uri``), made on first use."""
        if self._tracker is None:
            self._tracker_uri = mlflow_client.tracking_uri(self.config)
            self._tracker = mlflow_client.client(self._tracker_uri)
        return self._tracker

    def for_config(self, config: Any) -> "Context":
        """The context of ``config`` (a namespaced training, a trial, the resolved configuration): this one's
        store when its ``store.uri`` is the same, its client when its tracking URI is, nothing else."""
        if config is self.config:
            return self
        other = Context(config, store=self._store if self._store is not None
                        and config.store.uri == self.config.store.uri else None)
        if self._tracker is not None and mlflow_client.tracking_uri(config) == self._tracker_uri:
            other._tracker, other._tracker_uri = self._tracker, self._tracker_uri
        return other
