"""CommandOutbox: commands posted in one turn of the event loop cross the pipe as one list, in order;
a turn that runs longer than HOLD_S hands what it posted earlier to the writer without waiting for
the turn to end (the engine starts on a burst's first requests while the server parses the rest)."""

from __future__ import annotations

import asyncio
import multiprocessing
import time

import pytest

from vllmlite.engine import command_outbox
from vllmlite.engine.command_outbox import CommandOutbox
from vllmlite.engine.engine_process import AbortRequest


@pytest.fixture
def outbox_and_reader():
    reader, writer = multiprocessing.Pipe(duplex=False)
    outbox = CommandOutbox(writer, on_send=lambda: None)
    loop = asyncio.new_event_loop()
    outbox.loop = loop   # a loop that is not turning: the scheduled flush waits for run_turn()

    def run_turn() -> None:
        loop.run_until_complete(asyncio.sleep(0))
    yield outbox, reader, run_turn
    outbox.close(timeout=5)
    loop.close()
    reader.close()


def ids(lists: list[list[AbortRequest]]) -> list[list[str]]:
    return [[c.request_id for c in commands] for commands in lists]


def received(reader, timeout: float = 5.0) -> list:
    assert reader.poll(timeout), "nothing came through the pipe"
    return reader.recv()


def test_a_turns_commands_go_as_one_list_at_its_end(outbox_and_reader):
    outbox, reader, run_turn = outbox_and_reader
    for i in range(5):
        outbox.post(AbortRequest(str(i), "test"))
    assert not reader.poll(0.05)   # held until the turn ends
    run_turn()
    assert ids([received(reader)]) == [["0", "1", "2", "3", "4"]]
    assert not reader.poll(0.05)


def test_a_long_turn_hands_over_what_it_posted_before(outbox_and_reader, monkeypatch):
    monkeypatch.setattr(command_outbox, "HOLD_S", 0.01)
    outbox, reader, run_turn = outbox_and_reader
    outbox.post(AbortRequest("0", "test"))
    outbox.post(AbortRequest("1", "test"))
    time.sleep(0.03)                          # the turn parses something long
    outbox.post(AbortRequest("2", "test"))    # 0 and 1 waited past HOLD_S: they go now, 2 waits
    assert ids([received(reader)]) == [["0", "1"]]
    outbox.post(AbortRequest("3", "test"))
    assert not reader.poll(0.05)
    run_turn()
    assert ids([received(reader)]) == [["2", "3"]]
    outbox.post(AbortRequest("4", "test"))    # a new turn's first command waits for its end again
    time.sleep(0.03)
    assert not reader.poll(0.01)
    run_turn()
    assert ids([received(reader)]) == [["4"]]
