"""Which errors of a training rank count as "a peer went away" (retryable) and which as a bug: by the
error's type and where it was raised, never by its message."""

from __future__ import annotations

import pytest
import torch

from relaunch.components.core.contract.classify import classify
from relaunch.components.core.contract.errors import BadInput
from relaunch.components.core.contract.exitcodes import ExitCode
from relaunch.components.train import PeerFailure, waiting_on_peers


def test_a_runtime_error_while_waiting_on_peers_is_a_peer_of_a_killed_worker_137_without_gloos_text():
    with pytest.raises(PeerFailure) as caught, waiting_on_peers(world_size=2):
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:48812")
    assert caught.value.exit_code == ExitCode.KILLED and classify(caught.value) == ExitCode.KILLED
    assert "peer worker was killed" in str(caught.value) and "gloo" not in str(caught.value)


def test_torchs_distributed_errors_are_peer_failures_even_in_a_world_of_one():
    with pytest.raises(PeerFailure), waiting_on_peers(world_size=1):
        raise torch.distributed.DistNetworkError("store went away")


@pytest.mark.parametrize("error", [RuntimeError("mat1 and mat2 shapes cannot be multiplied"),
                                   ValueError("the NCCL version in my config is wrong"),
                                   BadInput("train.lr: must be positive")])
def test_other_errors_keep_their_type_whatever_their_message_says(error):
    world = 1 if isinstance(error, RuntimeError) else 2  # alone, a RuntimeError cannot come from a peer
    with pytest.raises(type(error)) as caught, waiting_on_peers(world_size=world):
        raise error
    assert caught.value is error
