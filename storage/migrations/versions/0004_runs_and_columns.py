"""pass@N runs as jobs (status, settings, per-problem timing, checked code) and side-by-side columns
(each generation's top-p/top-k, which tab made it, and its test outcome).

Revision ID: 0004
Revises: 0003
"""
import sqlalchemy as sa
from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("comparisons") as batch:
        batch.add_column(sa.Column("status", sa.String(12), nullable=False, server_default="done"))
        batch.add_column(sa.Column("settings", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("timing", sa.JSON(), nullable=True))
        batch.add_column(sa.Column("error", sa.Text(), nullable=True))
        batch.create_check_constraint(
            "run_status", "status IN ('queued', 'running', 'done', 'cancelled', 'interrupted', 'error')")
    with op.batch_alter_table("sample_results") as batch:
        batch.add_column(sa.Column("code", sa.Text(), nullable=True))
    with op.batch_alter_table("generations") as batch:
        batch.add_column(sa.Column("top_p", sa.Float(), nullable=True))
        batch.add_column(sa.Column("top_k", sa.Integer(), nullable=True))
        batch.add_column(sa.Column("kind", sa.String(16), nullable=True))
        batch.add_column(sa.Column("test_status", sa.String(8), nullable=True))
        batch.add_column(sa.Column("test_error", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("generations") as batch:
        for name in ("test_error", "test_status", "kind", "top_k", "top_p"):
            batch.drop_column(name)
    with op.batch_alter_table("sample_results") as batch:
        batch.drop_column("code")
    with op.batch_alter_table("comparisons") as batch:
        batch.drop_constraint("run_status", type_="check")
        for name in ("error", "timing", "settings", "status"):
            batch.drop_column(name)
