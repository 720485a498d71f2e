"""Share links: hashed token + owner secret and an immutable JSON snapshot.

Revision ID: 0002
Revises: 0001
"""
import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None

# Snapshots are written once: rows may be inserted and deleted (revoke), never changed.
IMMUTABLE = """
CREATE TRIGGER share_links_immutable BEFORE UPDATE ON share_links
BEGIN SELECT RAISE(ABORT, 'share links are immutable'); END
"""


def upgrade() -> None:
    op.create_table(
        "share_links",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("token_hash", sa.String(64), nullable=False),
        sa.Column("owner_hash", sa.String(64), nullable=False),
        sa.Column("session_id", sa.String(22), nullable=False),
        sa.Column("created_at", sa.DateTime(), nullable=False),
        sa.Column("snapshot", sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(["session_id"], ["sessions.id"], name="fk_share_links_session_id_sessions",
                                ondelete="CASCADE"),
        sa.PrimaryKeyConstraint("id", name="pk_share_links"),
        sa.UniqueConstraint("token_hash", name="uq_share_links_token_hash"),
    )
    op.create_index("ix_share_links_session_id", "share_links", ["session_id"])
    if op.get_bind().dialect.name == "sqlite":
        op.execute(IMMUTABLE)


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        op.execute("DROP TRIGGER IF EXISTS share_links_immutable")
    op.drop_index("ix_share_links_session_id", "share_links")
    op.drop_table("share_links")
