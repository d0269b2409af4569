"""The RNG streams a snapshot captures (components/core/trainer/state.py): numpy's global state asked
again only when it may have changed, and always equal to what ``np.random.get_state()`` says."""

from __future__ import annotations

import ctypes

import numpy as np

from relaunch.components.core.trainer.state import MT19937_STATE_BYTES, NumpyRng


def _same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and np.array_equal(a[1], b[1]) and a[2:] == b[2:]


def test_numpys_captured_state_follows_every_draw_and_every_seed():
    capture = NumpyRng()
    np.random.seed(1)
    first = capture()
    assert capture() is first  # nothing drawn: the state is not asked again
    np.random.rand()
    assert _same(capture(), np.random.get_state()) and not _same(capture(), first)
    np.random.seed(1)
    assert _same(capture(), first)


def test_a_cached_gaussian_taken_without_touching_the_raw_state_is_still_seen():
    capture = NumpyRng()
    np.random.seed(2)
    np.random.randn()  # the polar method makes two: the second is cached (has_gauss = 1)
    cached = capture()
    assert cached[3] == 1
    np.random.randn()  # takes the cached one: the generator's raw state does not move
    after = capture()
    assert after[3] == 0 and _same(after, np.random.get_state())


def test_the_raw_state_read_is_numpys_mt19937_struct_and_moves_with_each_draw():
    # fails loudly if a numpy upgrade changes the struct this relies on (key[624], then pos)
    generator = np.random.get_bit_generator()
    assert isinstance(generator, np.random.MT19937)
    np.random.seed(3)
    address = generator.ctypes.state_address
    before = ctypes.string_at(address, MT19937_STATE_BYTES)
    assert ctypes.string_at(address, MT19937_STATE_BYTES) == before
    np.random.rand()
    after = ctypes.string_at(address, MT19937_STATE_BYTES)
    _, key, pos, _, _ = np.random.get_state()
    assert after != before
    assert np.frombuffer(after[:624 * 4], dtype=np.uint32).tolist() == key.tolist()
    assert int.from_bytes(after[624 * 4:], "little", signed=True) == pos
