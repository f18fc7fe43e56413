"""train/batches.py: RowSource's peek against its draw, and CollateAhead's hand-over of the thread's work."""
import threading

import pytest

from mindvl_ms.train.batches import CollateAhead, RowSource


class _Counting(RowSource):
    def __init__(self, rows):
        super().__init__(rows, seed=4)
        self.draws = 0

    def next_global_batch(self, n):
        self.draws += 1
        return super().next_global_batch(n)


def test_peek_is_the_next_draw_across_epochs_and_moves_nothing():
    """7 rows, batches of 3: the third batch crosses into epoch 1 (a new permutation). Each peek equals the
    draw after it, leaves the position where it was and runs no subclass draw."""
    src = _Counting([[{"i": i}] for i in range(7)])
    for _ in range(5):
        state = src.state_dict()
        peeked = src.peek_global_batch(3)
        assert src.state_dict() == state
        drawn = src.next_global_batch(3)
        assert [r is d for r, d in zip(peeked, drawn)] == [True] * 3
    assert src.draws == 5 and src.state_dict()["epoch"] == 2


def test_collate_ahead_hands_over_the_threads_work_or_collates_again():
    calls = []

    def collate(rows):
        calls.append((tuple(r["i"] for r in rows), threading.current_thread() is threading.main_thread()))
        if rows and rows[0]["i"] < 0:
            raise ValueError("bad sample")
        return [{"n": len(rows)}]

    rows = [{"i": 1}, {"i": 2}]
    ahead = CollateAhead(collate)
    ahead.ahead(rows)
    assert ahead.take(list(rows)) == [{"n": 2}] and calls == [((1, 2), False)]   # the same row objects
    ahead.ahead(rows)
    assert ahead.take([{"i": 1}, {"i": 2}]) == [{"n": 2}]                          # equal, not the same: again
    assert calls[1:] == [((1, 2), False), ((1, 2), True)]
    ahead.ahead([{"i": -1}])
    with pytest.raises(ValueError, match="bad sample"):                          # raised at the step needing it
        ahead.take(ahead._pending[0])
    ahead.ahead([{"i": -1}])
    ahead.close()                                                                 # waited for, its error dropped
    assert ahead.take(rows) == [{"n": 2}] and calls[-1] == ((1, 2), True)
