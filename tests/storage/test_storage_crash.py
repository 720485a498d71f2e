"""A writer killed with SIGKILL leaves a consistent database: a transaction is whole or absent, and
everything committed before the kill is there."""
import multiprocessing as mp
import os
import sqlite3

import storage_workers

from laneplay.storage import OPERATOR


def _check(path: str) -> None:
    con = sqlite3.connect(path)
    try:
        assert con.execute("PRAGMA integrity_check").fetchall() == [("ok",)]
        assert con.execute("PRAGMA foreign_key_check").fetchall() == []
    finally:
        con.close()


def test_kill_in_the_middle_of_a_transaction(store, db_url):
    sid = store.create_session(title="crash", owner=OPERATOR)
    path = db_url.removeprefix("sqlite:///")
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=storage_workers.die_mid_transaction, args=(db_url, sid, child))
    proc.start()
    try:
        assert parent.poll(60), "the writer never reached the middle of its transaction"
        assert parent.recv() == "mid-transaction"
        # 16 rows of 60 KB are flushed but not committed; with the tiny page cache they sit in the WAL.
        assert os.path.getsize(path + "-wal") > 500_000
        proc.kill()  # SIGKILL: no cleanup, no rollback
    finally:
        proc.join(timeout=30)
    assert proc.exitcode == -9

    _check(path)
    gens = store.get_session(sid, owner=OPERATOR)["generations"]
    assert [(g["batch"], g["sample_index"]) for g in gens] == [(1, 0)]  # the committed batch, nothing of the other
    assert store.add_generations(sid, [storage_workers.record(0, 2)], owner=OPERATOR) == 2  # and the database takes writes
    _check(path)


def test_kill_while_committing_in_a_loop_loses_nothing_committed(store, db_url):
    sid = store.create_session(title="crash loop", owner=OPERATOR)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=storage_workers.commit_forever, args=(db_url, sid, child))
    proc.start()
    acked = []
    try:
        while len(acked) < 25:
            assert parent.poll(60), "the writer stopped reporting commits"
            acked.append(parent.recv())
        proc.kill()
    finally:
        proc.join(timeout=30)
    while parent.poll(0):  # commits reported just before the kill
        acked.append(parent.recv())

    _check(db_url.removeprefix("sqlite:///"))
    batches = {}
    for g in store.get_session(sid, owner=OPERATOR)["generations"]:
        batches.setdefault(g["batch"], []).append(g["sample_index"])
    assert set(acked) <= set(batches)  # every acknowledged commit survived
    assert len(batches) in (len(acked), len(acked) + 1)  # plus at most the one committed unacknowledged
    assert all(sorted(ix) == [0, 1, 2, 3] for ix in batches.values())  # and each batch is whole
