"""usage_events.route: which API served a request (chat.completions, completions, responses), so
billing can tell routes apart. Rows from before this revision keep NULL (unknown).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0005'
down_revision: str | Sequence[str] | None = '0004'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('usage_events') as batch:
        batch.add_column(sa.Column('route', sa.String(length=32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('usage_events') as batch:
        batch.drop_column('route')
