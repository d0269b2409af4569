"""Everything a resume needs, as one DCP ``Stateful``.

    state = TrainingState(model, optimizer, scheduler, scaler, extra={"sampler": sampler})
    mgr.save(step, state)        # or mgr.load(state)

Model and optimizer go through ``torch.distributed.checkpoint.state_dict.get_state_dict`` /
``set_state_dict`` (which unwrap DDP and FSDP), so a checkpoint written by N ranks loads into M.
RNG streams (python, numpy, torch CPU, every CUDA device) are captured per rank under
``rng.rank<r>``: a rank restores its own stream; a rank that did not exist when the checkpoint was
written keeps its fresh stream (:attr:`TrainingState.rng_restored` says which happened).
``extra`` holds custom objects with ``state_dict()``/``load_state_dict()``; their state must be
made of tensors and plain Python values (ints, floats, strings, lists, dicts), because non-tensor
values load with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import copy
import ctypes
import random
from typing import Any, Callable

import numpy as np
import torch
import torch.distributed as dist

from ..checkpoint.prefault import populate_in_background
from ..checkpoint.torch_private import parameter_fqns


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


MT19937_STATE_BYTES = 624 * 4 + 4  # numpy/random/src/mt19937/mt19937.h: uint32_t key[624]; int pos


class NumpyRng:
    """``np.random.get_state()`` of the global generator, asked again only when it may have changed.

    The call costs ~33 us (its getter copies the 624 words one by one), a third of a memory snapshot's
    time on the training's thread. The generator's raw state (its C struct, read through the public
    ``ctypes.state_address``: under a microsecond) changes with every draw, so an unchanged one means
    an unchanged state, except for the cached Gaussian of the legacy ``randn``, which a draw can take
    without touching the raw state: while one is cached the state is always asked again.
    """

    def __init__(self):
        self.state: tuple | None = None
        self.raw: tuple[int, bytes] | None = None

    def __call__(self) -> tuple:
        generator = np.random.get_bit_generator()
        raw = None
        if isinstance(generator, np.random.MT19937):
            address = generator.ctypes.state_address
            raw = (address, ctypes.string_at(address, MT19937_STATE_BYTES))
        if raw is None or raw != self.raw or self.state is None or self.state[3]:  # [3]: a Gaussian is cached
            self.state, self.raw = np.random.get_state(), raw
        return self.state


numpy_rng = NumpyRng()


def rng_now() -> tuple:
    """This process's RNG streams as they are, unconverted (the cheap part of :func:`capture_rng`: a
    snapshot takes it at a step's end and converts it off the training's thread)."""
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    return random.getstate(), numpy_rng(), torch.get_rng_state(), cuda


def rng_state(now: tuple) -> dict[str, Any]:
    """:func:`rng_now`'s streams as tensors and plain values (``weights_only``-loadable)."""
    (version, internal, gauss), np_state, torch_cpu, cuda = now
    out: dict[str, Any] = {
        "python_version": int(version),
        "python_state": torch.tensor(internal, dtype=torch.int64),
        "python_gauss": -1.0 if gauss is None else float(gauss),
        "python_has_gauss": gauss is not None,
        "numpy_keys": torch.from_numpy(np.asarray(np_state[1], dtype=np.int64).copy()),
        "numpy_pos": int(np_state[2]),
        "numpy_has_gauss": int(np_state[3]),
        "numpy_gauss": float(np_state[4]),
        "torch_cpu": torch_cpu,
    }
    if cuda is not None:
        out["cuda"] = {str(i): s for i, s in enumerate(cuda)}
    return out


def capture_rng() -> dict[str, Any]:
    """This process's RNG streams as tensors and plain values (``weights_only``-loadable)."""
    return rng_state(rng_now())


def restore_rng(state: dict[str, Any]) -> None:
    """Set this process's RNG streams from :func:`capture_rng` output."""
    gauss = float(state["python_gauss"]) if bool(state["python_has_gauss"]) else None
    random.setstate((int(state["python_version"]), tuple(int(x) for x in state["python_state"].tolist()), gauss))
    np.random.set_state(("MT19937", state["numpy_keys"].numpy().astype(np.uint32), int(state["numpy_pos"]),
                         int(state["numpy_has_gauss"]), float(state["numpy_gauss"])))
    torch.set_rng_state(state["torch_cpu"])
    if "cuda" in state and torch.cuda.is_available():
        cuda = state["cuda"]
        for i in range(min(len(cuda), torch.cuda.device_count())):
            torch.cuda.set_rng_state(cuda[str(i)], i)


class TrainingState:
    """A DCP ``Stateful`` bundling model, optimizer, scheduler, AMP scaler, counters, RNG and extras.

    Attributes:
        step: the global optimizer step the state is at.
        epoch: the epoch.
        samples_seen: global number of samples consumed (the data cursor).
        sampler_epoch: the epoch the sampler was last set to.
        rng_restored: after ``load_state_dict``, whether this rank's RNG streams were in the checkpoint.
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                 scheduler: Any = None, scaler: Any = None, extra: dict[str, Any] | None = None,
                 loader: Any = None):
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler
        self.extra = dict(extra or {})
        self.loader = loader  # this rank's data loader: its position is this rank's, like its RNG
        self.step = 0
        self.epoch = 0
        self.samples_seen = 0
        self.sampler_epoch = 0
        self.rng_restored = False

    def _model_optim(self) -> tuple[dict[str, Any], dict[str, Any] | None]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        if self.optimizer is None:
            from torch.distributed.checkpoint.state_dict import get_model_state_dict

            return get_model_state_dict(self.model), None
        return get_state_dict(self.model, self.optimizer)

    def prepare_load(self, stored: dict[str, Any]) -> Callable[[], None] | None:
        """Before a load of a checkpoint whose DCP metadata is ``stored``: give an optimizer that has
        no state yet the state tensors the checkpoint holds for it, allocated but not filled, so the
        load reads straight into them. (Else ``get_state_dict`` makes them by one optimizer step on
        zero gradients: gradients and temporaries the size of the model, and seconds of DTensor
        dispatch under FSDP.) Returns the undo (back to no state) for a load that fails, or None
        when nothing was allocated: an optimizer state this cannot mirror exactly (a value that is
        not a tensor, a tensor neither of its parameter's shape nor a scalar) is left to DCP's way.
        """
        optimizer = self.optimizer
        if optimizer is None or optimizer.state:
            return None
        planned = _optimizer_state_like(self.model, optimizer, stored)
        if not planned:
            return None
        for param, entries in planned.items():
            optimizer.state[param] = entries
        # the load reads into them after its planning: their pages are populated meanwhile
        populate_in_background([t for entries in planned.values() for t in entries.values() if t.dim()])

        def undo() -> None:
            for param in planned:
                optimizer.state.pop(param, None)

        return undo

    def state_dict(self) -> dict[str, Any]:
        """The nested state DCP saves; ``rng`` holds only this rank's streams."""
        return {**self.live_tensors(), **self.step_head()}

    def live_tensors(self) -> dict[str, Any]:
        """``model`` and ``optimizer`` of :meth:`state_dict`: their tensors are the live ones (views of
        the parameters, the optimizer's own state tensors), which only the optimizer step changes; a
        caller may keep this and read the values again at a later step (the memory tier's snapshots)."""
        model_sd, optim_sd = self._model_optim()
        return {"model": model_sd, **({"optimizer": optim_sd} if optim_sd is not None else {})}

    def param_groups(self, live: dict[str, Any]) -> list[dict[str, Any]]:
        """The optimizer's hyperparameters now (a scheduler changes them), shaped as ``live``'s
        ``param_groups`` (parameters named by FQN)."""
        return [{**{k: v for k, v in group.items() if k != "params"}, "params": named["params"]}
                for group, named in zip(self.optimizer.param_groups, live["optimizer"]["param_groups"])]

    def step_head(self, rng: Callable[[], Any] = capture_rng) -> dict[str, Any]:
        """Everything of :meth:`state_dict` but model and optimizer: counters, this rank's RNG streams
        (as ``rng()`` gives them), scheduler, scaler, extras: what the next step may change before
        its optimizer step (RNG, a sampler), so a snapshot taken while that step runs takes these on
        the training's thread first."""
        sd: dict[str, Any] = {
            "progress": {"step": int(self.step), "epoch": int(self.epoch),
                         "samples_seen": int(self.samples_seen), "sampler_epoch": int(self.sampler_epoch)},
            "rng": {f"rank{_rank()}": rng()},
        }
        if self.scheduler is not None:
            sd["scheduler"] = self.scheduler.state_dict()
        if self.scaler is not None:
            sd["scaler"] = self.scaler.state_dict()
        if self.extra:
            sd["extra"] = {name: obj.state_dict() for name, obj in self.extra.items()}
        if self.loader is not None:
            sd["data"] = {f"rank{_rank()}": self.loader.state_dict()}
        return sd

    def load_state_dict(self, sd: dict[str, Any], *, in_place: bool = False) -> None:
        """Restore in place from a dict shaped like :meth:`state_dict` (``rng`` may be absent).
        ``in_place``: the caller copied the values into the tensors of this state's own
        :meth:`state_dict` (a restore from memory), so model and optimizer hold them already and only
        the optimizer's hyperparameters, counters, RNG and the rest are loaded."""
        from torch.distributed.checkpoint.state_dict import (set_model_state_dict, set_optimizer_state_dict,
                                                             set_state_dict)

        # a DCP load read straight into the model (and, with prepare_load, into the optimizer's state)
        model_held = in_place or _holds_model_memory(self.model, sd["model"])
        if self.optimizer is not None and "optimizer" in sd:
            if in_place or (model_held and _holds_optimizer_memory(self.optimizer, sd["optimizer"])):
                _load_param_groups(self.optimizer, sd["optimizer"]["param_groups"])
            elif model_held:
                set_optimizer_state_dict(self.model, self.optimizer, sd["optimizer"])
            else:
                set_state_dict(self.model, self.optimizer, model_state_dict=sd["model"],
                               optim_state_dict=sd["optimizer"])
        elif not model_held:
            set_model_state_dict(self.model, sd["model"])
        progress = sd.get("progress", {})
        self.step = int(progress.get("step", 0))
        self.epoch = int(progress.get("epoch", 0))
        self.samples_seen = int(progress.get("samples_seen", 0))
        self.sampler_epoch = int(progress.get("sampler_epoch", 0))
        if self.scheduler is not None and "scheduler" in sd:
            self.scheduler.load_state_dict(sd["scheduler"])
        if self.scaler is not None and "scaler" in sd:
            self.scaler.load_state_dict(sd["scaler"])
        for name, obj in self.extra.items():
            if name in sd.get("extra", {}):
                obj.load_state_dict(sd["extra"][name])
        loader_state = sd.get("data", {}).get(f"rank{_rank()}")
        if self.loader is not None and loader_state is not None:
            self.loader.load_state_dict(loader_state)
        mine = sd.get("rng", {}).get(f"rank{_rank()}")
        self.rng_restored = mine is not None
        if mine is not None:
            restore_rng(mine)


def _holds_model_memory(model: torch.nn.Module, loaded: dict[str, Any]) -> bool:
    """Whether every value of ``loaded`` is the very memory of the model's own entry of the same key
    (:func:`_same_memory`): then loading it would copy each tensor onto itself (under FSDP2 through
    DTensor dispatch, 30-50 ms a load), and the model holds the values already."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    current = get_model_state_dict(model)
    return current.keys() == loaded.keys() and all(_same_memory(mine, loaded[key]) for key, mine in current.items())


def _holds_optimizer_memory(optimizer: torch.optim.Optimizer, loaded: dict[str, Any]) -> bool:
    """Whether ``loaded`` (``get_optimizer_state_dict``'s shape: state by parameter FQN, groups listing
    FQNs in the optimizer's parameter order) holds, for every parameter, the very tensors of the
    optimizer's own state (same keys, :func:`_same_memory`; equal plain values): a load read into them
    (a restore from memory copied into them, or DCP read into what ``prepare_load`` gave the optimizer),
    and ``set_optimizer_state_dict`` would only hand them back (2-7 ms of a survivor's restore)."""
    groups, state = loaded.get("param_groups"), loaded.get("state")
    if not isinstance(groups, list) or not isinstance(state, dict) or len(groups) != len(optimizer.param_groups):
        return False
    seen = 0
    for group, saved_group in zip(optimizer.param_groups, groups):
        names = saved_group.get("params")
        if not isinstance(names, list) or len(names) != len(group["params"]):
            return False
        for param, name in zip(group["params"], names):
            mine, theirs = optimizer.state.get(param, {}), state.get(name, {})
            if mine.keys() != theirs.keys():
                return False
            seen += bool(theirs)
            for key, value in mine.items():
                if not (_same_memory(value, theirs[key]) if isinstance(value, torch.Tensor) else value == theirs[key]):
                    return False
    return seen == len(state)


def _same_memory(mine: torch.Tensor, theirs: Any) -> bool:
    """Whether ``theirs`` is the very memory of ``mine``: same tensor type, storage address, shape,
    strides, dtype, device and DTensor placements."""
    from torch.distributed.tensor import DTensor

    if not (isinstance(mine, torch.Tensor) and type(theirs) is type(mine)):
        return False
    if isinstance(mine, DTensor):
        if mine.placements != theirs.placements or mine.device_mesh != theirs.device_mesh:
            return False
        mine, theirs = mine.to_local(), theirs.to_local()
    return (mine.data_ptr() == theirs.data_ptr() and mine.shape == theirs.shape and mine.stride() == theirs.stride()
            and mine.dtype == theirs.dtype and mine.device == theirs.device)


def _load_param_groups(optimizer: torch.optim.Optimizer, groups: list[dict[str, Any]]) -> None:
    """Each group's hyperparameters (lr, betas, ...) from ``groups``, its parameters kept: what
    ``Optimizer.load_state_dict`` does to the groups (a deep copy: nothing aliases the snapshot)."""
    for group, saved in zip(optimizer.param_groups, groups):
        group.update(copy.deepcopy({key: value for key, value in saved.items() if key not in ("params", "param_names")}))


def _optimizer_state_like(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                          stored: dict[str, Any]) -> dict[Any, dict[str, torch.Tensor]] | None:
    """``{param: {state key: empty tensor}}`` mirroring the checkpoint's ``optimizer.state.<fqn>.<key>``
    entries, or None when any of them cannot be mirrored exactly (see ``prepare_load``)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    prefix = "optimizer.state."
    by_fqn: dict[str, dict[str, Any]] = {}
    for key, meta in stored.items():
        if key.startswith(prefix):
            fqn, _, name = key[len(prefix):].rpartition(".")
            by_fqn.setdefault(fqn, {})[name] = meta
    if not by_fqn:
        return None
    params: dict[int, tuple[str, torch.nn.Parameter]] = {}
    for name, param in model.named_parameters():
        try:
            fqns = parameter_fqns(model, name)
        except ImportError:  # pragma: no cover - a torch without the helper: DCP's own way
            return None
        if len(fqns) != 1:
            return None
        params[id(param)] = (next(iter(fqns)), param)
    planned: dict[Any, dict[str, torch.Tensor]] = {}
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in params:
                return None
            fqn = params[id(param)][0]
            entries: dict[str, torch.Tensor] = {}
            for name, meta in by_fqn.pop(fqn, {}).items():
                if not isinstance(meta, TensorStorageMetadata):
                    return None
                dtype = meta.properties.dtype
                if tuple(meta.size) == tuple(param.shape):
                    entries[name] = torch.empty_like(param, dtype=dtype, requires_grad=False)
                elif len(meta.size) == 0:
                    entries[name] = torch.zeros((), dtype=dtype)
                else:
                    return None
            if entries:
                planned[param] = entries
    return None if by_fqn else planned  # state of a parameter this optimizer does not have: DCP's way


class ModelWeights:
    """Only a model's weights, as a DCP ``Stateful``: what a warm start loads (never the optimizer,
    the scheduler, the step counter or the RNG of the checkpoint it starts from)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return {"model": get_model_state_dict(self.model)}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, sd["model"])
