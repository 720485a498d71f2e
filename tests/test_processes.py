"""laneplay.processes: a call in a thread of its own."""
import threading

import pytest

from laneplay.processes import in_own_thread


def test_a_call_in_its_own_thread_returns_its_result_and_raises_its_error():
    here = threading.get_ident()
    seen = {}

    def where(x, y=0):
        seen["thread"] = threading.get_ident()
        return x + y

    assert in_own_thread(where, 2, y=3) == 5
    assert seen["thread"] != here
    assert not any(t.ident == seen["thread"] for t in threading.enumerate())  # it has ended

    def fail():
        raise ValueError("no such checkpoint")

    with pytest.raises(ValueError, match="no such checkpoint"):
        in_own_thread(fail)
