"""Code that runs in spawned child processes (kept apart from the test modules so a child imports
only this and `storage`)."""
import time

from sqlalchemy import event
from sqlalchemy.orm import Session

from laneplay.storage import OPERATOR, Store


def record(worker: int, i: int, sample_index: int = 0, text: str = "") -> dict:
    return dict(sample_index=sample_index, seed=worker * 100_000 + i, text=text or f"w{worker}-{i}",
                finish_reason="stop", prompt_tokens=3, completion_tokens=5, ttft_ms=1.0,
                decode_tokens_per_second=100.0, ms_per_token=10.0, device="cpu", world_size=1)


def write_many(url: str, session_id: str, worker: int, count: int, barrier, results) -> None:
    """`count` separate write transactions, all workers starting together."""
    try:
        store = Store(url, upgrade=False)  # the parent migrated the database
        barrier.wait(timeout=60)
        for i in range(count):
            store.add_generations(session_id, [record(worker, i)], owner=OPERATOR)
        store.close()
        results.put((worker, "ok"))
    except BaseException as e:  # report everything, "database is locked" included
        results.put((worker, f"{type(e).__name__}: {e}"))


def die_mid_transaction(url: str, session_id: str, pipe) -> None:
    """Commits one batch, then starts a 16-row batch and stops inside it (rows flushed, not committed)
    until the parent SIGKILLs it. A tiny page cache makes SQLite spill the uncommitted pages into the
    WAL file, so the kill really leaves a partial transaction on disk."""
    store = Store(url, upgrade=False)
    store.add_generations(session_id, [record(0, 0)], owner=OPERATOR)
    store.engine.dispose()
    event.listen(store.engine, "connect", lambda conn, _: conn.execute("PRAGMA cache_size = 8"))

    def hold(session, flush_context):
        pipe.send("mid-transaction")
        time.sleep(120)

    event.listen(Session, "after_flush_postexec", hold)
    store.add_generations(session_id, [record(0, 1, k, text=f"{k}" * 60_000) for k in range(16)], owner=OPERATOR)
    pipe.send("committed?!")  # never reached


def commit_forever(url: str, session_id: str, pipe) -> None:
    """Commits 4-sample batches in a loop, reporting each batch number after its commit returns."""
    store = Store(url, upgrade=False)
    for i in range(100_000):
        batch = store.add_generations(session_id, [record(1, i, k) for k in range(4)], owner=OPERATOR)
        pipe.send(batch)
