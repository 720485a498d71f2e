"""Sessions, generations, pass@N comparisons, sample results and pass@k.

Revision ID: 0001
Revises:
"""
import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sessions",
        sa.Column("id", sa.String(22), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("updated_at", sa.DateTime(), nullable=False),
        sa.Column("title", sa.String(200), nullable=False),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("device", sa.String(32), nullable=False),
        sa.Column("world_size", sa.Integer(), nullable=False),
        sa.Column("columns", sa.Integer(), nullable=False),
        sa.Column("code", sa.Text(), nullable=False),
        sa.Column("instruction", sa.Text(), nullable=False),
        sa.Column("params", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id", name="pk_sessions"),
    )
    op.create_index("ix_sessions_updated_at", "sessions", ["updated_at"])

    op.create_table(
        "generations",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("session_id", sa.String(22), nullable=False),
        sa.Column("batch", sa.Integer(), nullable=False),
        sa.Column("sample_index", sa.Integer(), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("seed", sa.BigInteger(), nullable=True),
        sa.Column("temperature", sa.Float(), nullable=True),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("finish_reason", sa.String(32), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=False),
        sa.Column("completion_tokens", sa.Integer(), nullable=False),
        sa.Column("ttft_ms", sa.Float(), nullable=True),
        sa.Column("decode_tokens_per_second", sa.Float(), nullable=True),
        sa.Column("ms_per_token", sa.Float(), nullable=True),
        sa.Column("device", sa.String(32), nullable=True),
        sa.Column("world_size", sa.Integer(), nullable=True),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.id"], name="fk_generations_session_id_sessions",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_generations"),
        sa.UniqueConstraint("session_id", "batch", "sample_index", name="uq_generations_session_id_batch_sample_index"),
    )

    op.create_table(
        "comparisons",
        sa.Column("id", sa.String(22), nullable=False),
        sa.Column("session_id", sa.String(22), nullable=True),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("finished_at", sa.DateTime(), nullable=True),
        sa.Column("model", sa.String(200), nullable=False),
        sa.Column("problem_set", sa.String(64), nullable=False),
        sa.Column("problem_ids", sa.JSON(), nullable=False),
        sa.Column("n", sa.Integer(), nullable=False),
        sa.Column("temperature", sa.Float(), nullable=False),
        sa.Column("greedy", sa.Boolean(), nullable=False),
        sa.Column("tests", sa.JSON(), nullable=True),
        sa.Column("greedy_pass1", sa.Float(), nullable=True),
        sa.Column("greedy_seconds", sa.Float(), nullable=True),
        sa.Column("sampled_seconds", sa.Float(), nullable=True),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.id"], name="fk_comparisons_session_id_sessions",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_comparisons"),
    )
    op.create_index("ix_comparisons_created_at", "comparisons", ["created_at"])
    op.create_index("ix_comparisons_session_id", "comparisons", ["session_id"])

    op.create_table(
        "sample_results",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("comparison_id", sa.String(22), nullable=False),
        sa.Column("problem_id", sa.String(64), nullable=False),
        sa.Column("greedy", sa.Boolean(), nullable=False),
        sa.Column("sample_index", sa.Integer(), nullable=False),
        sa.Column("status", sa.String(8), nullable=False),
        sa.Column("error", sa.Text(), nullable=True),
        sa.Column("runtime_s", sa.Float(), nullable=True),
        sa.Column("completion_tokens", sa.Integer(), nullable=True),
        sa.Column("generation_ms", sa.Float(), nullable=True),
        sa.CheckConstraint("status IN ('pass', 'fail', 'timeout', 'memory', 'error')", name="ck_sample_results_status"),
        sa.ForeignKeyConstraint(["comparison_id"], ["comparisons.id"],
                                name="fk_sample_results_comparison_id_comparisons", ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_sample_results"),
        sa.UniqueConstraint("comparison_id", "problem_id", "greedy", "sample_index",
                            name="uq_sample_results_comparison_id_problem_id_greedy_sample_index"),
    )

    op.create_table(
        "passk",
        sa.Column("comparison_id", sa.String(22), nullable=False),
        sa.Column("k", sa.Integer(), nullable=False),
        sa.Column("value", sa.Float(), nullable=False),
        sa.ForeignKeyConstraint(["comparison_id"], ["comparisons.id"], name="fk_passk_comparison_id_comparisons",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("comparison_id", "k", name="pk_passk"),
    )


def downgrade() -> None:
    op.drop_table("passk")
    op.drop_table("sample_results")
    op.drop_index("ix_comparisons_session_id", "comparisons")
    op.drop_index("ix_comparisons_created_at", "comparisons")
    op.drop_table("comparisons")
    op.drop_table("generations")
    op.drop_index("ix_sessions_updated_at", "sessions")
    op.drop_table("sessions")
