"""Each generation keeps what it was asked: the Playground mode, instruction and code of its request
(None for generations made before, which show their session's).

Revision ID: 0007
Revises: 0006
"""
import sqlalchemy as sa
from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("generations") as batch:
        batch.add_column(sa.Column("mode", sa.String(length=16), nullable=True))
        batch.add_column(sa.Column("instruction", sa.Text(), nullable=True))
        batch.add_column(sa.Column("code", sa.Text(), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("generations") as batch:
        batch.drop_column("code")
        batch.drop_column("instruction")
        batch.drop_column("mode")
