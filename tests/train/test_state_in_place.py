"""TrainingState.load_state_dict skips set_state_dict's model copy only when the loaded model
state is the model's own memory (a DCP load read straight into it); otherwise it copies as before."""

from __future__ import annotations

import torch

from relaunch.components.core.trainer.state import TrainingState, _holds_model_memory


def _state(seed: int) -> TrainingState:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    return TrainingState(model, torch.optim.AdamW(model.parameters(), lr=0.1))


def test_a_state_dict_of_the_models_own_tensors_is_recognised_as_in_place():
    state = _state(1)
    sd = state.state_dict()
    assert _holds_model_memory(state.model, sd["model"])


def test_copies_or_a_missing_key_are_not_in_place():
    state = _state(1)
    copied = {k: v.clone() for k, v in state.state_dict()["model"].items()}
    assert not _holds_model_memory(state.model, copied)
    partial = dict(state.state_dict()["model"])
    partial.pop(next(iter(partial)))
    assert not _holds_model_memory(state.model, partial)


def test_a_state_dict_of_another_model_is_still_copied_into_this_one():
    source, target = _state(1), _state(2)
    target.load_state_dict(source.state_dict())
    for a, b in zip(target.model.parameters(), source.model.parameters()):
        assert torch.equal(a, b) and a.data_ptr() != b.data_ptr()


def test_an_in_place_state_dict_keeps_the_values_written_into_the_model():
    state = _state(1)
    sd = state.state_dict()
    with torch.no_grad():
        for value in sd["model"].values():
            value.fill_(0.5)  # what a load that reads straight into the model does
    state.load_state_dict(sd)
    assert all(bool((p == 0.5).all()) for p in state.model.parameters())
