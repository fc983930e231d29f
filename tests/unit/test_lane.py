"""pipeline.lane.Lane: order, back-pressure, error propagation, dropping on failure."""

from __future__ import annotations

import threading

import pytest

from pipeline.lane import Lane


def test_items_are_handled_in_order_on_the_lane_thread() -> None:
    seen: list[tuple[int, str]] = []
    lane: Lane[int] = Lane("t", lambda i: seen.append((i, threading.current_thread().name)))
    lane.start()
    for i in range(20):
        lane.submit(i)
    lane.finish(ok=True)
    assert [i for i, _ in seen] == list(range(20))
    assert {name for _, name in seen} == {"longtake-t"}
    assert not lane.running


def test_submit_waits_for_room_so_at_most_depth_items_queue() -> None:
    gate = threading.Event()
    handled: list[int] = []

    def handler(i: int) -> None:
        gate.wait()
        handled.append(i)

    lane: Lane[int] = Lane("t", handler, depth=1)
    lane.start()
    lane.submit(0)  # taken by the handler, which blocks
    lane.submit(1)  # fills the queue
    third = threading.Thread(target=lane.submit, args=(2,))
    third.start()
    third.join(timeout=1.0)
    assert third.is_alive()  # no room: the producer waits
    gate.set()
    third.join(timeout=5.0)
    assert not third.is_alive()
    lane.finish(ok=True)
    assert handled == [0, 1, 2]


def test_handler_error_surfaces_on_submit_and_finish_and_later_items_are_dropped() -> None:
    handled: list[int] = []

    def handler(i: int) -> None:
        if i == 1:
            raise ValueError("bad item 1")
        handled.append(i)

    lane: Lane[int] = Lane("t", handler)
    lane.start()
    lane.submit(0)
    lane.submit(1)
    with pytest.raises(ValueError, match="bad item 1"):
        for i in range(2, 100):  # the error shows up on a later submit
            lane.submit(i)
    with pytest.raises(ValueError, match="bad item 1"):
        lane.finish(ok=True)
    assert handled == [0]


def test_finish_not_ok_drops_queued_items() -> None:
    gate = threading.Event()
    handled: list[int] = []

    def handler(i: int) -> None:
        gate.wait()
        handled.append(i)

    lane: Lane[int] = Lane("t", handler)
    lane.start()
    lane.submit(0)
    lane.submit(1)
    threading.Timer(0.2, gate.set).start()
    lane.finish(ok=False)
    assert handled == [0]  # 0 was being handled; 1 was dropped


def test_submit_before_start_is_an_error() -> None:
    lane: Lane[int] = Lane("t", lambda i: None)
    with pytest.raises(RuntimeError, match="not running"):
        lane.submit(0)
