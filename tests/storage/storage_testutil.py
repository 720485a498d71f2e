"""Helpers shared by the storage tests."""
from math import comb

from sqlalchemy import inspect, text

from laneplay.storage import OPERATOR, Store


def row_counts(store: Store) -> dict[str, int]:
    """Rows per table: compared before/after a rejected write to show it wrote nothing."""
    with store.engine.connect() as conn:
        tables = [t for t in inspect(conn).get_table_names() if t != "alembic_version"]
        return {t: conn.execute(text(f"SELECT count(*) FROM {t}")).scalar_one() for t in tables}


def gen(sample_index=0, text="def f():\n    return 1\n", **kw):
    """A generation record in the engine's shape (metrics fields flat)."""
    rec = dict(sample_index=sample_index, seed=1234 + sample_index, temperature=0.8, text=text,
               finish_reason="stop", prompt_tokens=42, completion_tokens=17, ttft_ms=12.5,
               decode_tokens_per_second=250.0, ms_per_token=4.0, device="cpu", world_size=1)
    rec.update(kw)
    return rec


def passk_formula(n: int, c: int, k: int) -> float:
    """The unbiased estimator, written out: 1 - C(n-c, k) / C(n, k)."""
    return 1.0 - comb(n - c, k) / comb(n, k)


def make_comparison(store: Store, session_id=None, problems=("HumanEval/0", "HumanEval/1"), n=4, **kw) -> str:
    kw.setdefault("owner", OPERATOR)
    return store.create_comparison(session_id=session_id, problem_set="humaneval", problem_ids=list(problems),
                                   n=n, temperature=0.8, model="smollm2-135m-instruct", **kw)
