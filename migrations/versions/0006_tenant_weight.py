"""A tenant's scheduling weight: its share of an engine's service when tenants contend (issue 25;
workers/engine/fairness.py). Existing tenants get 1.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0006'
down_revision: str | Sequence[str] | None = '0005'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.add_column(sa.Column('weight', sa.Float(), server_default=sa.text('1'), nullable=False))
        batch_op.create_check_constraint(batch_op.f('ck_tenants_weight_positive'), 'weight > 0')


def downgrade() -> None:
    with op.batch_alter_table('tenants', schema=None) as batch_op:
        batch_op.drop_constraint(batch_op.f('ck_tenants_weight_positive'), type_='check')
        batch_op.drop_column('weight')
