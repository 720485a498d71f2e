"""The schema: SQLAlchemy 2 ORM models, and their conversion to plain, JSON-ready dicts.

Sessions and comparisons are reached by random ids (see `new_id`), never by a counter, so knowing
one id says nothing about any other. Generations, sample results and share links have integer keys
that stay inside this package: they are only reached through their session, comparison or token.
Times are stored as naive UTC and handed out as ISO 8601 strings with an explicit +00:00.
"""
from __future__ import annotations

import secrets
from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (JSON, BigInteger, Boolean, CheckConstraint, DateTime, Float, ForeignKey, Integer,
                        MetaData, String, Text, UniqueConstraint)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

from laneplay.storage import limits

# Named constraints, so migrations and the ORM agree on names on every database.
NAMING = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

STATUSES = ("pass", "fail", "timeout", "memory", "error")
RUN_STATUSES = ("queued", "running", "done", "cancelled", "interrupted", "error")  # a comparison's state as a job
GENERATION_KINDS = ("playground", "side-by-side")
ID_CHARS = 22  # secrets.token_urlsafe(16): 128 random bits


def new_id() -> str:
    return secrets.token_urlsafe(16)


def is_id(value: object) -> bool:
    return isinstance(value, str) and len(value) == ID_CHARS and value.isascii() and \
        all(ch.isalnum() or ch in "-_" for ch in value)


def utcnow() -> datetime:
    return datetime.now(timezone.utc).replace(tzinfo=None)


def iso(t: datetime | None) -> str | None:
    return None if t is None else t.replace(tzinfo=timezone.utc).isoformat()


class Base(DeclarativeBase):
    metadata = MetaData(naming_convention=NAMING)


class PlaySession(Base):
    """One playground session: the editor state and sampling settings it was last run with."""
    __tablename__ = "sessions"

    id: Mapped[str] = mapped_column(String(ID_CHARS), primary_key=True)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    updated_at: Mapped[datetime] = mapped_column(DateTime, index=True)
    title: Mapped[str] = mapped_column(String(limits.MAX_TITLE_CHARS))
    model: Mapped[str] = mapped_column(String(limits.MAX_MODEL_CHARS))
    device: Mapped[str] = mapped_column(String(limits.MAX_DEVICE_CHARS))
    world_size: Mapped[int] = mapped_column(Integer)
    columns: Mapped[int] = mapped_column(Integer)  # side-by-side columns shown
    code: Mapped[str] = mapped_column(Text)
    instruction: Mapped[str] = mapped_column(Text)
    params: Mapped[dict[str, Any]] = mapped_column(JSON)  # SamplingParams fields
    mode: Mapped[str | None] = mapped_column(String(16))  # MODES: the Playground mode; None: made before it was kept
    owner_hash: Mapped[str | None] = mapped_column(String(64), index=True)  # SHA-256 of the owner id; None: nobody's

    generations: Mapped[list[Generation]] = relationship(
        back_populates="session", cascade="all, delete-orphan", passive_deletes=True,
        order_by=lambda: (Generation.batch, Generation.sample_index))
    comparisons: Mapped[list[Comparison]] = relationship(
        back_populates="session", cascade="all, delete-orphan", passive_deletes=True,
        order_by=lambda: (Comparison.created_at, Comparison.id))

    def summary(self) -> dict[str, Any]:
        return {"id": self.id, "created_at": iso(self.created_at), "updated_at": iso(self.updated_at),
                "title": self.title, "model": self.model, "device": self.device, "world_size": self.world_size}

    def to_dict(self) -> dict[str, Any]:
        return {**self.summary(), "columns": self.columns, "code": self.code, "instruction": self.instruction,
                "params": dict(self.params), "mode": self.mode, "generations": [g.to_dict() for g in self.generations],
                "comparisons": [c.to_dict() for c in self.comparisons]}


class Generation(Base):
    """One streamed sample with the engine's metrics record (field names unchanged)."""
    __tablename__ = "generations"
    __table_args__ = (UniqueConstraint("session_id", "batch", "sample_index"),)

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"))
    batch: Mapped[int] = mapped_column(Integer)  # 1, 2, ... per session: one add_generations call
    sample_index: Mapped[int] = mapped_column(Integer)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    seed: Mapped[int | None] = mapped_column(BigInteger)
    temperature: Mapped[float | None] = mapped_column(Float)
    text: Mapped[str] = mapped_column(Text)
    finish_reason: Mapped[str | None] = mapped_column(String(limits.MAX_FINISH_REASON_CHARS))
    prompt_tokens: Mapped[int] = mapped_column(Integer)
    completion_tokens: Mapped[int] = mapped_column(Integer)
    ttft_ms: Mapped[float | None] = mapped_column(Float)
    decode_tokens_per_second: Mapped[float | None] = mapped_column(Float)
    ms_per_token: Mapped[float | None] = mapped_column(Float)
    device: Mapped[str | None] = mapped_column(String(limits.MAX_DEVICE_CHARS))
    world_size: Mapped[int | None] = mapped_column(Integer)
    top_p: Mapped[float | None] = mapped_column(Float)
    top_k: Mapped[int | None] = mapped_column(Integer)
    kind: Mapped[str | None] = mapped_column(String(16))  # GENERATION_KINDS: which tab made it
    test_status: Mapped[str | None] = mapped_column(String(8))  # STATUSES, once its code ran against tests
    test_error: Mapped[str | None] = mapped_column(Text)
    speculative: Mapped[bool | None] = mapped_column(Boolean)  # prompt-lookup speculation asked for ("auto": on)
    # what its request asked: the Playground mode, instruction and code (None: made before they were kept)
    mode: Mapped[str | None] = mapped_column(String(16))
    instruction: Mapped[str | None] = mapped_column(Text)
    code: Mapped[str | None] = mapped_column(Text)

    session: Mapped[PlaySession] = relationship(back_populates="generations")

    FIELDS = ("sample_index", "seed", "temperature", "text", "finish_reason", "prompt_tokens",
              "completion_tokens", "ttft_ms", "decode_tokens_per_second", "ms_per_token", "device", "world_size",
              "top_p", "top_k", "kind", "test_status", "test_error", "speculative", "mode", "instruction", "code")

    def to_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, **{f: getattr(self, f) for f in self.FIELDS}, "created_at": iso(self.created_at)}


class Comparison(Base):
    """One pass@N run: greedy baseline + N samples per problem, with its timing and pass@k. It is also a
    job: `status` goes queued -> running -> done (or cancelled, error; interrupted when the server
    stopped mid-run), and what finished before that stays stored."""
    __tablename__ = "comparisons"
    __table_args__ = (CheckConstraint("status IN ('queued', 'running', 'done', 'cancelled', 'interrupted', 'error')",
                                      name="run_status"),)

    id: Mapped[str] = mapped_column(String(ID_CHARS), primary_key=True)
    session_id: Mapped[str | None] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime, index=True)
    finished_at: Mapped[datetime | None] = mapped_column(DateTime)
    model: Mapped[str] = mapped_column(String(limits.MAX_MODEL_CHARS))
    problem_set: Mapped[str] = mapped_column(String(limits.MAX_PROBLEM_SET_CHARS))
    problem_ids: Mapped[list[str]] = mapped_column(JSON)
    n: Mapped[int] = mapped_column(Integer)
    temperature: Mapped[float] = mapped_column(Float)
    greedy: Mapped[bool]  # whether a greedy baseline is part of the run
    tests: Mapped[list[str] | None] = mapped_column(JSON)  # user-written tests, if not a built-in set
    greedy_pass1: Mapped[float | None] = mapped_column(Float)
    greedy_seconds: Mapped[float | None] = mapped_column(Float)
    sampled_seconds: Mapped[float | None] = mapped_column(Float)
    status: Mapped[str] = mapped_column(String(12), server_default="done")
    settings: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # top_p, max_tokens, seed, mode, ...
    timing: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # problem id -> greedy/batch timing of its requests
    error: Mapped[str | None] = mapped_column(Text)  # why a run ended in "error"

    session: Mapped[PlaySession | None] = relationship(back_populates="comparisons")
    results: Mapped[list[SampleResult]] = relationship(
        back_populates="comparison", cascade="all, delete-orphan", passive_deletes=True)
    passk: Mapped[list[PassK]] = relationship(
        back_populates="comparison", cascade="all, delete-orphan", passive_deletes=True, order_by="PassK.k")

    def summary(self) -> dict[str, Any]:
        return {"id": self.id, "session_id": self.session_id, "created_at": iso(self.created_at),
                "finished_at": iso(self.finished_at), "model": self.model, "problem_set": self.problem_set,
                "n": self.n, "temperature": self.temperature, "greedy": self.greedy,
                "greedy_pass1": self.greedy_pass1, "greedy_seconds": self.greedy_seconds,
                "sampled_seconds": self.sampled_seconds, "status": self.status,
                "settings": dict(self.settings or {}), "error": self.error,
                "passk": [{"k": p.k, "value": p.value} for p in self.passk]}

    def to_dict(self) -> dict[str, Any]:
        order = {p: i for i, p in enumerate(self.problem_ids)}
        results = sorted(self.results, key=lambda r: (order[r.problem_id], not r.greedy, r.sample_index))
        return {**self.summary(), "problem_ids": list(self.problem_ids),
                "tests": None if self.tests is None else list(self.tests),
                "timing": dict(self.timing or {}), "results": [r.to_dict() for r in results]}


class SampleResult(Base):
    """The outcome of running one sample (or the greedy completion) against one problem's tests."""
    __tablename__ = "sample_results"
    __table_args__ = (UniqueConstraint("comparison_id", "problem_id", "greedy", "sample_index"),
                      CheckConstraint("status IN ('pass', 'fail', 'timeout', 'memory', 'error')", name="status"))

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    comparison_id: Mapped[str] = mapped_column(ForeignKey("comparisons.id", ondelete="CASCADE"))
    problem_id: Mapped[str] = mapped_column(String(limits.MAX_PROBLEM_ID_CHARS))
    greedy: Mapped[bool]
    sample_index: Mapped[int] = mapped_column(Integer)  # 0 for the greedy completion
    status: Mapped[str] = mapped_column(String(8))
    error: Mapped[str | None] = mapped_column(Text)  # short excerpt, at most MAX_ERROR_CHARS
    runtime_s: Mapped[float | None] = mapped_column(Float)
    completion_tokens: Mapped[int | None] = mapped_column(Integer)
    generation_ms: Mapped[float | None] = mapped_column(Float)
    code: Mapped[str | None] = mapped_column(Text)  # the program that was checked

    comparison: Mapped[Comparison] = relationship(back_populates="results")

    FIELDS = ("problem_id", "greedy", "sample_index", "status", "error", "runtime_s",
              "completion_tokens", "generation_ms", "code")

    def to_dict(self) -> dict[str, Any]:
        return {f: getattr(self, f) for f in self.FIELDS}


class PassK(Base):
    """pass@k for one k, as computed by the caller (evals.passk) over the comparison's problems."""
    __tablename__ = "passk"

    comparison_id: Mapped[str] = mapped_column(ForeignKey("comparisons.id", ondelete="CASCADE"), primary_key=True)
    k: Mapped[int] = mapped_column(Integer, primary_key=True)
    value: Mapped[float] = mapped_column(Float)

    comparison: Mapped[Comparison] = relationship(back_populates="passk")


class ShareLink(Base):
    """A read-only snapshot behind /s/<token>. Only SHA-256 digests of the token and the owner secret
    are stored; the snapshot is a serialized copy, written once (insert and delete only: revoking
    deletes the row, so a revoked token and a never-issued one look exactly the same)."""
    __tablename__ = "share_links"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    owner_hash: Mapped[str] = mapped_column(String(64))
    session_id: Mapped[str] = mapped_column(ForeignKey("sessions.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime] = mapped_column(DateTime)
    snapshot: Mapped[str] = mapped_column(Text)  # JSON

