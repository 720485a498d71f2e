"""Several processes writing one SQLite file: nobody sees "database is locked", nothing is lost."""
import multiprocessing as mp
import queue

import storage_workers

from laneplay.storage import OPERATOR

WORKERS, WRITES = 4, 200


def test_four_processes_two_hundred_writes_each(store, db_url):
    sid = store.create_session(title="contended", owner=OPERATOR)
    ctx = mp.get_context("spawn")
    barrier, results = ctx.Barrier(WORKERS), ctx.Queue()
    procs = [ctx.Process(target=storage_workers.write_many, args=(db_url, sid, w, WRITES, barrier, results))
             for w in range(WORKERS)]
    for p in procs:
        p.start()
    try:
        outcomes = dict(results.get(timeout=120) for _ in procs)
    except queue.Empty:
        outcomes = {}
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    assert outcomes == {w: "ok" for w in range(WORKERS)}, outcomes

    gens = store.get_session(sid, owner=OPERATOR)["generations"]
    assert len(gens) == WORKERS * WRITES
    # Each add_generations got its own batch number: read-then-write under BEGIN IMMEDIATE never races.
    assert sorted(g["batch"] for g in gens) == list(range(1, WORKERS * WRITES + 1))
    assert {g["text"] for g in gens} == {f"w{w}-{i}" for w in range(WORKERS) for i in range(WRITES)}
