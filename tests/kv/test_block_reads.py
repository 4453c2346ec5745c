"""Reading the block books from another thread: only at rest, never torn, never waiting for a forward pass."""

from __future__ import annotations

import threading

import pytest

from server.kv.blocks import BlockManager, BooksBusy
from tests.helpers import DEADLINE_S


def books() -> BlockManager:
    blocks = BlockManager(num_blocks=8, block_size=4)
    blocks.reserve(2)
    first, second = blocks.allocate(), blocks.allocate()
    root = blocks.root("t")
    blocks.record(first, root, [1, 2, 3, 4])
    blocks.record(second, first.hash, [5, 6])
    blocks.release([first, second])
    return blocks


def test_at_rest_a_read_answers_at_once_and_in_a_forward_pass_too():
    blocks = books()
    assert blocks.read(lambda: blocks.chain("t", [1, 2, 3, 4, 5, 6])[1], DEADLINE_S) == 6
    with blocks.changing(), blocks.resting():  # the engine thread inside a forward pass: it only reads the books
        assert blocks.read(lambda: blocks.chain("t", [1, 2, 3, 4, 5, 6])[1], 0) == 6


def test_a_read_that_a_change_overlapped_is_read_again():
    blocks = books()
    calls = []

    def overlapped() -> int:
        calls.append(blocks.epoch)
        if len(calls) == 1:  # the engine thread began and ended a change while this read ran
            with blocks.changing():
                blocks.trim(blocks.chain("t", [1, 2, 3, 4, 5, 6])[0][1], 1)
        return blocks.chain("t", [1, 2, 3, 4, 5, 6])[1]

    assert blocks.read(overlapped, DEADLINE_S) == 5  # the answer of the books after the change, not during it
    assert len(calls) == 2


def test_a_read_waits_while_the_books_change_and_never_runs_meanwhile():
    blocks = books()
    seen_odd = []
    release, entered = threading.Event(), threading.Event()

    def engine_thread() -> None:
        with blocks.changing():
            entered.set()
            assert release.wait(DEADLINE_S)

    holder = threading.Thread(target=engine_thread)
    holder.start()
    assert entered.wait(DEADLINE_S)
    answers = []
    reader = threading.Thread(
        target=lambda: answers.append(blocks.read(lambda: seen_odd.append(blocks.epoch % 2) or 6, DEADLINE_S))
    )
    reader.start()
    with pytest.raises(BooksBusy):
        blocks.read(lambda: seen_odd.append(blocks.epoch % 2), 0)  # no rest within the deadline: it says so
    release.set()
    holder.join(DEADLINE_S)
    reader.join(DEADLINE_S)
    assert answers == [6]
    assert seen_odd == [0]  # the function ran once, at rest; never while the books changed


def test_an_error_at_rest_is_the_reader_s_own():
    blocks = books()
    with pytest.raises(ZeroDivisionError):
        blocks.read(lambda: 1 // 0, DEADLINE_S)
