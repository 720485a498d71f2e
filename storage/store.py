"""The repository API: every read and write the app and `laneplay eval` make.

Deny by default: every read and write that concerns a session, a pass@N run (comparison) or a share link
takes an `owner` keyword and refuses without one. An owner is a browser's owner id (the random id its
signed cookie carries; only its SHA-256 is stored), or `OPERATOR`: the operator's own tools on this
machine (`laneplay eval`, maintenance), which reach every row and must say so. "No owner" is never "any
owner": a read for None, a malformed id or another owner answers as if the row did not exist (None, [],
False), and a write raises `NotFound`. The one owner-less read is a share link's snapshot, by its token.

Each public write is one transaction (all rows or none) that starts with validation: bad input raises
`ValidationError` before anything is written; a write naming an unknown session or comparison raises
`NotFound`. Reads return plain dicts (JSON-ready, detached from the database) or None.
"""
from __future__ import annotations

import json
from collections.abc import Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, selectinload, sessionmaker

from laneplay.storage import limits, share
from laneplay.storage import validate as v
from laneplay.storage.db import WRITE, database_url, make_engine, upgrade_engine
from laneplay.storage.models import (GENERATION_KINDS, RUN_STATUSES, STATUSES, Comparison, Generation, PassK,
                                     PlaySession, SampleResult, ShareLink, is_id, iso, new_id, utcnow)
from laneplay.storage.validate import LimitReached, NotFound, ValidationError

LINK_KEY_CHARS = 24  # a share link's key in list_shares / revoke_link: a prefix of its token's SHA-256
class _Operator:
    """The operator's own tools (`laneplay eval`, scripts on the server): every row, explicitly."""
    __slots__ = ()

    def __repr__(self) -> str:
        return "OPERATOR"


OPERATOR = _Operator()
_DENIED = object()  # the scope of a missing or malformed owner: matches no row

SESSION_FIELDS = ("title", "model", "device", "world_size", "columns", "code", "instruction", "params", "mode")
MODES = ("chat", "complete")  # a session's Playground mode


def _session_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    unknown = sorted(set(fields) - set(SESSION_FIELDS))
    if unknown:
        raise ValidationError(f"session: unknown field(s) {unknown}; allowed: {', '.join(SESSION_FIELDS)}")
    checks = {
        "title": lambda x: v.text("title", x, "MAX_TITLE_CHARS"),
        "model": lambda x: v.text("model", x, "MAX_MODEL_CHARS"),
        "device": lambda x: v.text("device", x, "MAX_DEVICE_CHARS"),
        "world_size": lambda x: v.integer("world_size", x, 1, "MAX_WORLD_SIZE"),
        "columns": lambda x: v.integer("columns", x, 1, "MAX_COLUMNS"),
        "code": lambda x: v.text("code", x, "MAX_CODE_CHARS"),
        "instruction": lambda x: v.text("instruction", x, "MAX_INSTRUCTION_CHARS"),
        "params": lambda x: v.sampling_params("params", x),
        "mode": lambda x: None if x is None else v.one_of("mode", x, MODES),
    }
    return {k: checks[k](x) for k, x in fields.items()}


def _owner_hash(owner: Any) -> str:
    """The stored form of an owner id (the random id a browser keeps in its cookie): its SHA-256."""
    owner = v.text("owner", owner, "MAX_OWNER_CHARS", min_chars=limits.MIN_OWNER_CHARS)
    return share.digest(owner)


def _scope(owner: Any) -> Any:
    """OPERATOR, an owner's digest, or _DENIED (None, malformed: never any row)."""
    if owner is OPERATOR:
        return OPERATOR
    try:
        return _owner_hash(owner)
    except ValidationError:
        return _DENIED


def _allows(scope: Any, owner_hash: str | None) -> bool:
    return scope is OPERATOR or (scope is not _DENIED and owner_hash is not None and owner_hash == scope)


def _excerpt(field: str, value: Any) -> str | None:
    """An error text, cut to MAX_ERROR_CHARS keeping the end (where the exception is)."""
    error = v.text(field, value, "MAX_OUTPUT_CHARS", optional=True)
    if error is not None and len(error) > limits.MAX_ERROR_CHARS:
        error = "…" + error[-(limits.MAX_ERROR_CHARS - 1):]
    return error


def _generation(i: int, rec: Any) -> dict[str, Any]:
    f = v.record(f"records[{i}]", rec, Generation.FIELDS)
    p = f"records[{i}]"
    return {
        "top_p": v.number(f"{p}.top_p", f["top_p"], 0.0, 1.0, optional=True, lo_open=True),
        "top_k": v.integer(f"{p}.top_k", f["top_k"], 0, "MAX_TOP_K", optional=True),
        "kind": None if f["kind"] is None else v.one_of(f"{p}.kind", f["kind"], GENERATION_KINDS),
        "test_status": None if f["test_status"] is None else v.one_of(f"{p}.test_status", f["test_status"], STATUSES),
        "test_error": _excerpt(f"{p}.test_error", f["test_error"]),
        "speculative": None if f["speculative"] is None else v.boolean(f"{p}.speculative", f["speculative"]),
        "mode": None if f["mode"] is None else v.one_of(f"{p}.mode", f["mode"], MODES),
        "instruction": v.text(f"{p}.instruction", f["instruction"], "MAX_INSTRUCTION_CHARS", optional=True),
        "code": v.text(f"{p}.code", f["code"], "MAX_CODE_CHARS", optional=True),
        "sample_index": v.integer(f"{p}.sample_index", f["sample_index"], 0, limits.MAX_SAMPLES - 1),
        "seed": v.integer(f"{p}.seed", f["seed"], 0, "MAX_SEED", optional=True),
        "temperature": v.number(f"{p}.temperature", f["temperature"], 0.0, "MAX_TEMPERATURE", optional=True),
        "text": v.text(f"{p}.text", f["text"], "MAX_OUTPUT_CHARS"),
        "finish_reason": v.text(f"{p}.finish_reason", f["finish_reason"], "MAX_FINISH_REASON_CHARS", optional=True),
        "prompt_tokens": v.integer(f"{p}.prompt_tokens", f["prompt_tokens"], 0, "MAX_TOKENS"),
        "completion_tokens": v.integer(f"{p}.completion_tokens", f["completion_tokens"], 0, "MAX_TOKENS"),
        "ttft_ms": v.number(f"{p}.ttft_ms", f["ttft_ms"], 0.0, "MAX_METRIC", optional=True),
        "decode_tokens_per_second": v.number(f"{p}.decode_tokens_per_second", f["decode_tokens_per_second"],
                                             0.0, "MAX_METRIC", optional=True),
        "ms_per_token": v.number(f"{p}.ms_per_token", f["ms_per_token"], 0.0, "MAX_METRIC", optional=True),
        "device": v.text(f"{p}.device", f["device"], "MAX_DEVICE_CHARS", optional=True),
        "world_size": v.integer(f"{p}.world_size", f["world_size"], 1, "MAX_WORLD_SIZE", optional=True),
    }


def _generation_batch(records: Any) -> list[dict[str, Any]]:
    rows = [_generation(i, r) for i, r in enumerate(v.items("records", records, "MAX_SAMPLES", min_items=1))]
    if len({r["sample_index"] for r in rows}) != len(rows):
        raise ValidationError("records: sample_index values must be distinct within a batch")
    return rows


def _comparison_fields(problem_set: Any, problem_ids: Any, n: Any, temperature: Any, greedy: Any,
                       model: Any, tests: Any) -> dict[str, Any]:
    ids = [v.text(f"problem_ids[{i}]", p, "MAX_PROBLEM_ID_CHARS", min_chars=1)
           for i, p in enumerate(v.items("problem_ids", problem_ids, "MAX_PROBLEMS", min_items=1))]
    if len(set(ids)) != len(ids):
        raise ValidationError("problem_ids: must be distinct")
    if tests is not None:
        tests = [v.text(f"tests[{i}]", t, "MAX_TEST_CHARS")
                 for i, t in enumerate(v.items("tests", tests, "MAX_TESTS", min_items=1))]
    n, greedy = v.integer("n", n, 0, "MAX_SAMPLES"), v.boolean("greedy", greedy)
    if n == 0 and not greedy:
        raise ValidationError("n: a run needs samples (n >= 1) or a greedy baseline (n = 0 is greedy only)")
    return {"problem_set": v.text("problem_set", problem_set, "MAX_PROBLEM_SET_CHARS", min_chars=1),
            "problem_ids": ids, "n": n,
            "temperature": v.number("temperature", temperature, 0.0, "MAX_TEMPERATURE"),
            "greedy": greedy, "model": v.text("model", model, "MAX_MODEL_CHARS"),
            "tests": tests}


SETTING_NAMES = ("top_p", "max_tokens", "seed", "mode", "timeout_s", "engine", "prompt", "entry_point", "step_ms")


def _step_ms(value: Any) -> dict[str, float]:
    """Measured decode step time per batch size: {"1": ms, "2": ms, ...} (batch sizes up to MAX_SAMPLES)."""
    value = v.keyed("settings.step_ms", value, [str(k) for k in range(1, limits.MAX_SAMPLES + 1)])
    return {k: v.number(f"settings.step_ms.{k}", x, 0.0, "MAX_METRIC") for k, x in value.items()}


def _settings(value: Any) -> dict[str, Any]:
    """A run's other settings (temperature and n have columns of their own)."""
    value = v.keyed("settings", value, SETTING_NAMES)
    checks = {
        "top_p": lambda x: v.number("settings.top_p", x, 0.0, 1.0, lo_open=True),
        "max_tokens": lambda x: v.integer("settings.max_tokens", x, 1, "MAX_TOKENS"),
        "seed": lambda x: v.integer("settings.seed", x, 0, "MAX_SEED", optional=True),
        "mode": lambda x: v.one_of("settings.mode", x, ("base", "instruct")),
        "timeout_s": lambda x: v.number("settings.timeout_s", x, 0.0, "MAX_RUNTIME_S", lo_open=True),
        "engine": lambda x: v.text("settings.engine", x, "MAX_MODEL_CHARS"),
        "prompt": lambda x: v.text("settings.prompt", x, "MAX_CODE_CHARS"),  # a user problem's prompt
        "entry_point": lambda x: v.text("settings.entry_point", x, "MAX_PROBLEM_ID_CHARS"),
        "step_ms": _step_ms,
    }
    return {k: checks[k](x) for k, x in value.items()}


TIMING_NAMES = ("greedy_ms", "greedy_ttft_ms", "greedy_step_ms", "greedy_tokens", "batch_ms", "batch_ttft_ms",
                "batch_step_ms", "batch_tokens")


def _timing(value: Any) -> dict[str, float]:
    """One problem's request timing: the greedy call and the N-sample batch (ms, tokens)."""
    if value is None:
        raise ValidationError("timing: expected a mapping, got NoneType")
    value = v.keyed("timing", value, TIMING_NAMES)
    return {k: v.number(f"timing.{k}", x, 0.0, "MAX_METRIC") for k, x in value.items() if x is not None}


def _result(c: Comparison, problems: set[str], i: int, rec: Any) -> dict[str, Any]:
    f = v.record(f"results[{i}]", rec, SampleResult.FIELDS)
    p = f"results[{i}]"
    greedy = v.boolean(f"{p}.greedy", False if f["greedy"] is None else f["greedy"])
    if greedy and not c.greedy:
        raise ValidationError(f"{p}.greedy: this comparison has no greedy baseline")
    problem_id = v.text(f"{p}.problem_id", f["problem_id"], "MAX_PROBLEM_ID_CHARS")
    if problem_id not in problems:
        raise ValidationError(f"{p}.problem_id: {problem_id!r} is not one of the comparison's problem_ids")
    error = _excerpt(f"{p}.error", f["error"])
    return {
        "code": v.text(f"{p}.code", f["code"], "MAX_CODE_CHARS", optional=True),
        "problem_id": problem_id, "greedy": greedy,
        "sample_index": v.integer(f"{p}.sample_index", f["sample_index"], 0, 0 if greedy else c.n - 1),
        "status": v.one_of(f"{p}.status", f["status"], STATUSES), "error": error,
        "runtime_s": v.number(f"{p}.runtime_s", f["runtime_s"], 0.0, "MAX_RUNTIME_S", optional=True),
        "completion_tokens": v.integer(f"{p}.completion_tokens", f["completion_tokens"], 0, "MAX_TOKENS",
                                       optional=True),
        "generation_ms": v.number(f"{p}.generation_ms", f["generation_ms"], 0.0, "MAX_METRIC", optional=True),
    }


def _passk(c: Comparison, values: Any, greedy_pass1: Any, greedy_seconds: Any,
           sampled_seconds: Any) -> tuple[dict[int, float], dict[str, Any]]:
    if not isinstance(values, Mapping):
        raise ValidationError(f"passk: expected a mapping k -> value, got {type(values).__name__}")
    passk = {v.integer("passk k", k, 1, c.n): v.number(f"passk[{k}]", x, 0.0, 1.0) for k, x in values.items()}
    if greedy_pass1 is not None and not c.greedy:
        raise ValidationError("greedy_pass1: this comparison has no greedy baseline")
    return passk, {"greedy_pass1": v.number("greedy_pass1", greedy_pass1, 0.0, 1.0, optional=True),
                   "greedy_seconds": v.number("greedy_seconds", greedy_seconds, 0.0, "MAX_METRIC", optional=True),
                   "sampled_seconds": v.number("sampled_seconds", sampled_seconds, 0.0, "MAX_METRIC", optional=True)}


class Store:
    """A database, migrated to the newest schema on open (pass upgrade=False to skip)."""

    def __init__(self, url: str | None = None, *, upgrade: bool = True) -> None:
        self.url = database_url(url)
        self.engine = make_engine(self.url)
        if upgrade:
            upgrade_engine(self.engine)
        self._reader = sessionmaker(self.engine, expire_on_commit=False)
        self._writer = sessionmaker(self.engine.execution_options(**WRITE), expire_on_commit=False)

    def close(self) -> None:
        self.engine.dispose()

    def __enter__(self) -> Store:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextmanager
    def _write(self) -> Iterator[Session]:
        with self._writer.begin() as s:  # BEGIN IMMEDIATE ... COMMIT, or ROLLBACK on any exception
            yield s

    @contextmanager
    def _read(self) -> Iterator[Session]:
        with self._reader() as s:  # one BEGIN: every query sees the same snapshot
            yield s

    @staticmethod
    def _session(s: Session, session_id: Any, owner: Any) -> PlaySession:
        """The session if `owner` may reach it; NotFound otherwise (the same answer as an unknown id)."""
        row = s.get(PlaySession, session_id) if is_id(session_id) else None
        if row is None or not _allows(_scope(owner), row.owner_hash):
            raise NotFound("session not found")
        return row

    @staticmethod
    def _comparison(s: Session, comparison_id: Any, owner: Any) -> Comparison:
        """The run if `owner` may reach it (it belongs to one of its sessions; standalone runs of
        `laneplay eval` are the operator's); NotFound otherwise."""
        row = s.get(Comparison, comparison_id) if is_id(comparison_id) else None
        scope = _scope(owner)
        if row is not None and scope is not OPERATOR:
            holder = None if row.session_id is None else s.get(PlaySession, row.session_id)
            if holder is None or not _allows(scope, holder.owner_hash):
                row = None
        if row is None:
            raise NotFound("comparison not found")
        return row

    @staticmethod
    def _creator(owner: Any) -> str | None:
        """The owner_hash a new session gets: the owner's digest (None for OPERATOR: nobody's but the
        operator's). Without an owner nothing is created."""
        if owner is OPERATOR:
            return None
        if owner is None:
            raise ValidationError("owner: required (a browser's owner id, or OPERATOR for the operator's tools)")
        return _owner_hash(owner)

    @staticmethod
    def _check_session_room(s: Session, owner_hash: str | None) -> None:
        if owner_hash is None:
            return
        held = s.scalar(select(func.count()).where(PlaySession.owner_hash == owner_hash))
        if held >= limits.MAX_SESSIONS_PER_OWNER:
            raise LimitReached(f"owner: you already have {held} sessions, the limit of {limits.MAX_SESSIONS_PER_OWNER} "
                               "(MAX_SESSIONS_PER_OWNER); delete some in History first")

    # -- sessions ---------------------------------------------------------------------------------

    def create_session(self, *, title: str = "", model: str = "", device: str = "", world_size: int = 1,
                       columns: int = 1, code: str = "", instruction: str = "",
                       params: Mapping[str, Any] | None = None, mode: str | None = None, owner: Any) -> str:
        """A new session in `owner`'s History (OPERATOR: a session of the operator's, in nobody's History).
        An owner holds at most MAX_SESSIONS_PER_OWNER sessions (LimitReached past it)."""
        fields = _session_fields(dict(title=title, model=model, device=device, world_size=world_size,
                                      columns=columns, code=code, instruction=instruction, params=params,
                                      mode=mode))
        owner_hash = self._creator(owner)
        with self._write() as s:
            self._check_session_room(s, owner_hash)
            row = self._insert_session(s, fields)
            if owner_hash is not None:  # (left unset otherwise: older schemas have no such column)
                row.owner_hash = owner_hash
            return row.id

    def owns(self, session_id: str, owner: Any) -> bool:
        """May `owner` reach this session? (False for unknown ids, None and malformed owners.)"""
        scope = _scope(owner)
        if not is_id(session_id) or scope is _DENIED:
            return False
        with self._read() as s:
            found = s.execute(select(PlaySession.owner_hash).where(PlaySession.id == session_id)).first()
        return found is not None and _allows(scope, found[0])

    @staticmethod
    def _insert_session(s: Session, fields: dict[str, Any]) -> PlaySession:
        now = utcnow()
        row = PlaySession(id=new_id(), created_at=now, updated_at=now, **fields)
        s.add(row)
        return row

    def get_session(self, session_id: str, *, owner: Any) -> dict[str, Any] | None:
        """The session with its generations and comparisons (with per-sample results); None unless
        `owner` may reach it."""
        scope = _scope(owner)
        if not is_id(session_id) or scope is _DENIED:
            return None
        with self._read() as s:
            row = s.get(PlaySession, session_id, options=[
                selectinload(PlaySession.generations),
                selectinload(PlaySession.comparisons).selectinload(Comparison.results),
                selectinload(PlaySession.comparisons).selectinload(Comparison.passk)])
            return None if row is None or not _allows(scope, row.owner_hash) else row.to_dict()

    def update_session(self, session_id: str, *, owner: Any, **fields: Any) -> None:
        fields = _session_fields(fields)
        with self._write() as s:
            row = self._session(s, session_id, owner)
            for k, x in fields.items():
                setattr(row, k, x)
            row.updated_at = utcnow()

    def list_sessions(self, limit: int = 50, *, owner: Any) -> list[dict[str, Any]]:
        """Summaries (no code, outputs or results), most recently updated first, each with the best
        decode tokens/s of its generations, its generation count and its live share links.
        Only `owner`'s sessions (every session for OPERATOR; none for None)."""
        limit = v.integer("limit", limit, 1, "MAX_SESSIONS_LISTED")
        scope = _scope(owner)
        if scope is _DENIED:
            return []
        best = (select(Generation.session_id, func.max(Generation.decode_tokens_per_second).label("best"),
                       func.count().label("count")).group_by(Generation.session_id).subquery())
        links = (select(ShareLink.session_id, func.count().label("links")).group_by(ShareLink.session_id).subquery())
        query = (select(PlaySession, best.c.best, best.c.count, links.c.links)
                 .outerjoin(best, best.c.session_id == PlaySession.id)
                 .outerjoin(links, links.c.session_id == PlaySession.id)
                 .order_by(PlaySession.updated_at.desc()).limit(limit))
        if scope is not OPERATOR:
            query = query.where(PlaySession.owner_hash == scope)
        with self._read() as s:
            return [{**row.summary(), "best_tokens_per_second": best_tps, "generations": count or 0,
                     "share_links": n_links or 0}
                    for row, best_tps, count, n_links in s.execute(query)]

    def delete_session(self, session_id: str, *, owner: Any) -> bool:
        """Deletes `owner`'s session with everything hanging off it, its share links included. False when
        there is no such session of `owner`'s."""
        try:
            with self._write() as s:
                s.delete(self._session(s, session_id, owner))
        except NotFound:
            return False
        return True

    def forget_owner(self, *, owner: Any) -> int:
        """Deletes every session of `owner` (with their generations, runs and share links): a browser that
        asked to be forgotten. Returns how many sessions went; 0 for None or a malformed owner."""
        scope = _scope(owner)
        if scope is _DENIED or scope is OPERATOR:
            return 0
        with self._write() as s:
            rows = list(s.scalars(select(PlaySession).where(PlaySession.owner_hash == scope)))
            for row in rows:
                s.delete(row)
            return len(rows)

    # -- generations ------------------------------------------------------------------------------

    def add_generations(self, session_id: str, records: Sequence[Any], *, owner: Any) -> int:
        """Stores one batch (1..MAX_SAMPLES samples of one request); returns its batch number.
        A record is a mapping or object with `sample_index`, `text`, optional `seed`, `temperature`,
        `finish_reason` and the engine's metrics fields (flat, or nested under `metrics`)."""
        rows = _generation_batch(records)
        with self._write() as s:
            return self._insert_generations(s, self._session(s, session_id, owner), rows)

    @staticmethod
    def _insert_generations(s: Session, session: PlaySession, rows: list[dict[str, Any]],
                            batch: int | None = None) -> int:
        count, last = s.execute(select(func.count(), func.max(Generation.batch))
                                .where(Generation.session_id == session.id)).one()
        if count + len(rows) > limits.MAX_GENERATIONS_PER_SESSION:
            raise ValidationError(f"records: the session would hold {count + len(rows)} generations, over the "
                                  f"limit of {limits.MAX_GENERATIONS_PER_SESSION} (MAX_GENERATIONS_PER_SESSION)")
        batch = batch if batch is not None else (last or 0) + 1
        now = utcnow()
        s.add_all(Generation(session_id=session.id, batch=batch, created_at=now, **r) for r in rows)
        session.updated_at = now
        return batch

    # -- pass@N comparisons -----------------------------------------------------------------------

    def create_comparison(self, *, problem_set: str, problem_ids: Sequence[str], n: int, temperature: float,
                          greedy: bool = True, session_id: str | None = None, model: str = "",
                          tests: Sequence[str] | None = None, status: str = "running",
                          settings: Mapping[str, Any] | None = None, owner: Any) -> str:
        """A pass@N run over `problem_ids` of `problem_set`, attached to one of `owner`'s sessions, or
        standalone (`laneplay eval`: OPERATOR only). Returns its id. It starts `running` (or `queued`);
        `set_passk` marks it done."""
        fields = _comparison_fields(problem_set, problem_ids, n, temperature, greedy, model, tests)
        fields["status"] = v.one_of("status", status, ("queued", "running"))
        fields["settings"] = _settings(settings)
        if session_id is None and owner is not OPERATOR:
            raise ValidationError("session_id: a run outside a session is the operator's (owner=OPERATOR)")
        with self._write() as s:
            if session_id is not None:
                self._session(s, session_id, owner)
            return self._insert_comparison(s, session_id, fields).id

    def set_run_status(self, comparison_id: str, status: str, error: str | None = None, *, owner: Any) -> None:
        """Moves a run along: queued -> running -> done / cancelled / error / interrupted. A run that
        ended stays ended (a late "running" from a cancelled job changes nothing)."""
        status = v.one_of("status", status, RUN_STATUSES)
        error = _excerpt("error", error)
        with self._write() as s:
            c = self._comparison(s, comparison_id, owner)
            if c.status in ("queued", "running"):
                c.status, c.error = status, error
                if status not in ("queued", "running"):
                    c.finished_at = c.finished_at or utcnow()

    def set_problem_timing(self, comparison_id: str, problem_id: str, timing: Mapping[str, Any], *,
                           owner: Any) -> None:
        """Stores one problem's request timing (see TIMING_NAMES)."""
        timing = _timing(timing)
        with self._write() as s:
            c = self._comparison(s, comparison_id, owner)
            if problem_id not in set(c.problem_ids):
                raise ValidationError(f"problem_id: {str(problem_id)[:40]!r} is not one of the comparison's problem_ids")
            c.timing = {**(c.timing or {}), problem_id: timing}

    def update_run_settings(self, comparison_id: str, settings: Mapping[str, Any], *, owner: Any) -> None:
        """Merges `settings` (SETTING_NAMES) into a run's settings, e.g. step times measured as it starts."""
        settings = _settings(settings)
        with self._write() as s:
            c = self._comparison(s, comparison_id, owner)
            c.settings = {**(c.settings or {}), **settings}

    def interrupt_unfinished(self) -> int:
        """Maintenance (every owner's runs, reads nothing out), at start-up: runs left queued or running by a server that stopped are marked interrupted
        (their stored results stay). Returns how many."""
        with self._write() as s:
            rows = list(s.scalars(select(Comparison).where(Comparison.status.in_(("queued", "running")))))
            for c in rows:
                c.status, c.finished_at = "interrupted", c.finished_at or utcnow()
            return len(rows)

    def _insert_comparison(self, s: Session, session_id: str | None, fields: dict[str, Any]) -> Comparison:
        if session_id is not None:
            session = s.get(PlaySession, session_id)  # (the callers checked its owner)
            count = s.scalar(select(func.count()).where(Comparison.session_id == session.id))
            if count >= limits.MAX_COMPARISONS_PER_SESSION:
                raise ValidationError(f"session_id: the session already holds {count} comparisons, the limit of "
                                      f"{limits.MAX_COMPARISONS_PER_SESSION} (MAX_COMPARISONS_PER_SESSION)")
            session.updated_at = utcnow()
        row = Comparison(id=new_id(), session_id=session_id, created_at=utcnow(), **fields)
        s.add(row)
        return row

    def add_sample_results(self, comparison_id: str, results: Iterable[Any], *, owner: Any) -> int:
        """Stores per-sample outcomes: each a mapping or object with `problem_id`, `sample_index`,
        `status` (pass/fail/timeout/memory/error), optional `greedy` (the baseline; sample_index 0),
        `error` (cut to MAX_ERROR_CHARS), `runtime_s`, `completion_tokens`, `generation_ms`.
        Returns how many were stored."""
        if isinstance(results, (str, bytes, Mapping)) or not isinstance(results, Iterable):
            raise ValidationError(f"results: expected a list, got {type(results).__name__}")
        results = list(results)
        with self._write() as s:
            c = self._comparison(s, comparison_id, owner)
            return self._insert_results(s, c, results)

    @staticmethod
    def _insert_results(s: Session, c: Comparison, results: list[Any]) -> int:
        problems = set(c.problem_ids)
        rows = [_result(c, problems, i, r) for i, r in enumerate(results)]
        keys = [(r["problem_id"], r["greedy"], r["sample_index"]) for r in rows]
        existing = {tuple(r) for r in s.execute(select(SampleResult.problem_id, SampleResult.greedy,
                                                       SampleResult.sample_index)
                                                .where(SampleResult.comparison_id == c.id))}
        if len(set(keys)) != len(keys) or existing & set(keys):
            raise ValidationError("results: each (problem_id, greedy, sample_index) may be stored only once")
        s.add_all(SampleResult(comparison_id=c.id, **r) for r in rows)
        return len(rows)

    def set_passk(self, comparison_id: str, values: Mapping[int, float], *, owner: Any,
                  greedy_pass1: float | None = None,
                  greedy_seconds: float | None = None, sampled_seconds: float | None = None) -> None:
        """Stores pass@k per k (1 <= k <= n, replacing earlier values), the greedy pass@1 and the
        wall-clock cost of each side, and marks the comparison finished. Values are the caller's
        (evals.passk); storage does not recompute them."""
        with self._write() as s:
            c = self._comparison(s, comparison_id, owner)
            passk, extra = _passk(c, values, greedy_pass1, greedy_seconds, sampled_seconds)
            self._finish(s, c, passk, extra)

    @staticmethod
    def _finish(s: Session, c: Comparison, passk: dict[int, float], extra: dict[str, Any]) -> None:
        c.passk = [PassK(k=k, value=x) for k, x in sorted(passk.items())]
        for k, x in extra.items():
            setattr(c, k, x)
        c.finished_at = utcnow()
        if c.status in ("queued", "running"):
            c.status = "done"

    def get_comparison(self, comparison_id: str, *, owner: Any) -> dict[str, Any] | None:
        """The run with its results and pass@k; None unless `owner` may reach it."""
        with self._read() as s:
            try:
                return self._comparison(s, comparison_id, owner).to_dict()
            except NotFound:
                return None

    def list_comparisons(self, limit: int = 50, *, owner: Any) -> list[dict[str, Any]]:
        """Summaries with pass@k (no per-sample results), newest first, each with how many of its
        results are stored: the runs of `owner`'s sessions (every run for OPERATOR; none for None)."""
        limit = v.integer("limit", limit, 1, "MAX_SESSIONS_LISTED")
        scope = _scope(owner)
        if scope is _DENIED:
            return []
        counts = (select(SampleResult.comparison_id, func.count().label("done"))
                  .group_by(SampleResult.comparison_id).subquery())
        query = (select(Comparison, counts.c.done).outerjoin(counts, counts.c.comparison_id == Comparison.id)
                 .options(selectinload(Comparison.passk)).order_by(Comparison.created_at.desc()).limit(limit))
        if scope is not OPERATOR:
            query = query.join(PlaySession, PlaySession.id == Comparison.session_id).where(
                PlaySession.owner_hash == scope)
        with self._read() as s:
            return [{**r.summary(), "problems": len(r.problem_ids), "problem_ids": list(r.problem_ids),
                     "results_stored": done or 0}
                    for r, done in s.execute(query)]

    def owns_comparison(self, comparison_id: str, owner: Any) -> bool:
        """May `owner` reach the run (part of one of its sessions; any run for OPERATOR)?"""
        if not is_id(comparison_id) or _scope(owner) is _DENIED:
            return False
        try:
            with self._read() as s:
                self._comparison(s, comparison_id, owner)
        except NotFound:
            return False
        return True

    def set_generation_test(self, session_id: str, batch: int, sample_index: int, status: str,
                            error: str | None = None, *, owner: Any) -> None:
        """Records the outcome of running one stored generation's code against the user's tests."""
        status = v.one_of("status", status, STATUSES)
        error = _excerpt("error", error)
        with self._write() as s:
            self._session(s, session_id, owner)
            row = s.scalar(select(Generation).where(Generation.session_id == session_id, Generation.batch == batch,
                                                    Generation.sample_index == sample_index))
            if row is None:
                raise NotFound("generation not found")
            row.test_status, row.test_error = status, error

    # -- share links ------------------------------------------------------------------------------

    def share_session(self, session_id: str, *, owner: Any) -> tuple[str, str]:
        """Freezes `owner`'s session as it is now behind a new link. Returns (token, owner_secret): the
        token goes in /s/<token>; the owner secret (to revoke) stays with the owner. Neither is
        stored, only their SHA-256 digests."""
        token, owner_secret = share.new_token(), share.new_owner_secret()
        with self._write() as s:
            row = self._session(s, session_id, owner)
            count = s.scalar(select(func.count()).where(ShareLink.session_id == row.id))
            if count >= limits.MAX_SHARES_PER_SESSION:
                raise ValidationError(f"session_id: the session already has {count} share links, the limit of "
                                      f"{limits.MAX_SHARES_PER_SESSION} (MAX_SHARES_PER_SESSION)")
            snapshot = share.snapshot(row.to_dict())
            held = s.scalar(select(func.coalesce(func.sum(func.length(ShareLink.snapshot)), 0))
                            .where(ShareLink.session_id == row.id))
            if row.owner_hash is not None:
                owner_held = s.scalar(select(func.coalesce(func.sum(func.length(ShareLink.snapshot)), 0))
                                      .join(PlaySession, PlaySession.id == ShareLink.session_id)
                                      .where(PlaySession.owner_hash == row.owner_hash))
                if owner_held + len(snapshot) > limits.MAX_SHARED_BYTES_PER_OWNER:
                    raise ValidationError(f"owner: share links already hold {owner_held} characters of snapshots; "
                                          f"another {len(snapshot)} would pass the limit of "
                                          f"{limits.MAX_SHARED_BYTES_PER_OWNER} (MAX_SHARED_BYTES_PER_OWNER); "
                                          "revoke some links first")
            if held + len(snapshot) > limits.MAX_SHARED_BYTES_PER_SESSION:
                raise ValidationError(f"session_id: its share links already hold {held} characters of snapshots; "
                                      f"another {len(snapshot)} would pass the limit of "
                                      f"{limits.MAX_SHARED_BYTES_PER_SESSION} (MAX_SHARED_BYTES_PER_SESSION); "
                                      "revoke a link first")
            s.add(ShareLink(token_hash=share.digest(token), owner_hash=share.digest(owner_secret),
                            session_id=row.id, created_at=utcnow(), snapshot=snapshot))
        return token, owner_secret

    def get_shared(self, token: str) -> dict[str, Any] | None:
        """The snapshot behind `token`, or None for an unknown, revoked or malformed token (the
        three are indistinguishable). Contains no session or comparison ids."""
        if not share.is_token(token):
            return None
        with self._read() as s:
            text = s.scalar(select(ShareLink.snapshot).where(ShareLink.token_hash == share.digest(token)))
        return None if text is None else json.loads(text)

    def revoke_share(self, token: str, owner_secret: str) -> bool:
        """Deletes the link if `owner_secret` is the one issued with it. False otherwise, with the
        same answer (and the same work) whether the token is unknown or the secret wrong."""
        found = share.is_token(token)
        with self._write() as s:
            row = s.scalar(select(ShareLink).where(ShareLink.token_hash == share.digest(token))) if found else None
            if share.owner_matches(owner_secret, row.owner_hash if row is not None else None):
                s.delete(row)
                return True
        return False

    def list_shares(self, session_id: str, *, owner: Any) -> list[dict[str, Any]]:
        """The live links of `owner`'s session: [{"link": a key for revoke_link, "created_at"}], newest
        first; [] for anyone else. (Tokens are not stored, so they cannot be listed; the key is a prefix of
        the token's digest.)"""
        with self._read() as s:
            try:
                self._session(s, session_id, owner)
            except NotFound:
                return []
            rows = s.execute(select(ShareLink.token_hash, ShareLink.created_at)
                             .where(ShareLink.session_id == session_id).order_by(ShareLink.created_at.desc()))
            return [{"link": h[:LINK_KEY_CHARS], "created_at": iso(t)} for h, t in rows]

    def revoke_link(self, session_id: str, link: str, *, owner: Any) -> bool:
        """Deletes one of `owner`'s session's links by its `list_shares` key. False when there is no such
        link of a session of `owner`'s."""
        if not is_id(session_id) or not isinstance(link, str) or len(link) != LINK_KEY_CHARS or \
                not all(c in "0123456789abcdef" for c in link):
            return False
        with self._write() as s:
            try:
                self._session(s, session_id, owner)
            except NotFound:
                return False
            row = s.scalar(select(ShareLink).where(ShareLink.session_id == session_id,
                                                   ShareLink.token_hash.startswith(link)))
            if row is not None:
                s.delete(row)
            return row is not None

    def fork_shared(self, token: str, *, owner: Any) -> str | None:
        """A new session of `owner`'s (new id, editable) with a copy of everything in the snapshot, or None
        for an unknown token. Counts against the owner's MAX_SESSIONS_PER_OWNER."""
        owner_hash = self._creator(owner)
        snap = self.get_shared(token)
        if snap is None:
            return None
        fields = _session_fields({k: snap[k] for k in SESSION_FIELDS if k in snap})  # (older snapshots: no mode)
        batches: dict[int, list[dict[str, Any]]] = {}
        asked = {k: snap.get(k) for k in share.ASKED} if snap.get("snapshot_version", 1) >= 2 else {}
        for g in snap["generations"]:  # (version 2 drops what a generation asked where it is the session's)
            batches.setdefault(g["batch"], []).append({**asked, **g})
        with self._write() as s:
            self._check_session_room(s, owner_hash)
            session = self._insert_session(s, fields)
            if owner_hash is not None:
                session.owner_hash = owner_hash
            for batch, records in sorted(batches.items()):
                self._insert_generations(s, session, _generation_batch(records), batch=batch)
            for c in snap["comparisons"]:
                fields = _comparison_fields(c["problem_set"], c["problem_ids"], c["n"], c["temperature"],
                                            c["greedy"], c["model"], c["tests"])
                fields["settings"] = _settings(c.get("settings"))
                # A copy is never a live job: a run that was still going when it was shared is interrupted.
                status = c.get("status") or "done"
                fields["status"] = "interrupted" if status in ("queued", "running") else v.one_of(
                    "status", status, RUN_STATUSES)
                fields["error"] = _excerpt("error", c.get("error"))
                row = self._insert_comparison(s, session.id, fields)
                for pid, t in (c.get("timing") or {}).items():
                    if pid in set(row.problem_ids):
                        row.timing = {**(row.timing or {}), pid: _timing(t)}
                self._insert_results(s, row, c["results"])
                if c["finished_at"] is not None:
                    passk, extra = _passk(row, {p["k"]: p["value"] for p in c["passk"]}, c["greedy_pass1"],
                                          c["greedy_seconds"], c["sampled_seconds"])
                    self._finish(s, row, passk, extra)
            return session.id
