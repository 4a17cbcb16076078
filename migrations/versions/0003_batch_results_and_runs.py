"""Batch results (one row per input line that ran or was given up) and the batch runner's lease.

`batch_results` is what makes batch lines idempotent: UNIQUE(batch_id, line), so a line whose result
is recorded is never recorded (or run) again. `batches` gains the runner's lease (`runner_id`,
`lease_until`), when it was last queued (`dispatched_at`) and its queued-token estimate.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0003'
down_revision: str | Sequence[str] | None = '0002'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:

    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.add_column(sa.Column('estimated_tokens', sa.BigInteger(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('runner_id', sa.String(length=64), nullable=True))
        batch_op.add_column(sa.Column('lease_until', sa.DateTime(timezone=True), nullable=True))
        batch_op.add_column(sa.Column('dispatched_at', sa.DateTime(timezone=True), nullable=True))
        batch_op.create_index('ix_batches_status', ['status'], unique=False)

    op.create_table('batch_results',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('batch_id', sa.String(length=64), nullable=False),
    sa.Column('line', sa.Integer(), nullable=False),
    sa.Column('custom_id', sa.Text(), nullable=False),
    sa.Column('request_id', sa.String(length=64), nullable=True),
    sa.Column('status_code', sa.Integer(), nullable=True),
    sa.Column('body', sa.JSON(), nullable=True),
    sa.Column('error_code', sa.String(length=64), nullable=True),
    sa.Column('error_message', sa.Text(), nullable=True),
    sa.Column('prompt_tokens', sa.Integer(), nullable=False),
    sa.Column('cached_tokens', sa.Integer(), nullable=False),
    sa.Column('completion_tokens', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.CheckConstraint('cached_tokens >= 0', name=op.f('ck_batch_results_cached_tokens_non_negative')),
    sa.CheckConstraint('completion_tokens >= 0', name=op.f('ck_batch_results_completion_tokens_non_negative')),
    sa.CheckConstraint('prompt_tokens >= 0', name=op.f('ck_batch_results_prompt_tokens_non_negative')),
    sa.ForeignKeyConstraint(['batch_id'], ['batches.id'], name=op.f('fk_batch_results_batch_id_batches')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_batch_results')),
    sa.UniqueConstraint('batch_id', 'line', name=op.f('uq_batch_results_batch_id'))
    )


def downgrade() -> None:

    op.drop_table('batch_results')
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.drop_index('ix_batches_status')
        batch_op.drop_column('dispatched_at')
        batch_op.drop_column('lease_until')
        batch_op.drop_column('runner_id')
        batch_op.drop_column('estimated_tokens')
