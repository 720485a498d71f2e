"""Session owners: the SHA-256 of a browser's random owner id, so History lists a browser's own sessions.

Revision ID: 0003
Revises: 0002
"""
import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("sessions") as batch:
        batch.add_column(sa.Column("owner_hash", sa.String(64), nullable=True))
        batch.create_index("ix_sessions_owner_hash", ["owner_hash"])


def downgrade() -> None:
    with op.batch_alter_table("sessions") as batch:
        batch.drop_index("ix_sessions_owner_hash")
        batch.drop_column("owner_hash")
