"""Dashboard sessions, server-side: one row per browser logged in to /admin/dashboard, shared by every
gateway replica; only a hash of the session token is stored.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-23
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0004'
down_revision: str | Sequence[str] | None = '0003'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('dashboard_sessions',
    sa.Column('token_hash', sa.String(length=64), nullable=False),
    sa.Column('admin_key_fingerprint', sa.String(length=64), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('token_hash', name=op.f('pk_dashboard_sessions'))
    )
    op.create_index(op.f('ix_dashboard_sessions_expires_at'), 'dashboard_sessions', ['expires_at'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_dashboard_sessions_expires_at'), table_name='dashboard_sessions')
    op.drop_table('dashboard_sessions')
