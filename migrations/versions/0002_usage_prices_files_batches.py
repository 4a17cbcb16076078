"""Usage events, prices, idempotency keys, files and batches (hand-checked autogenerate).

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-22
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0002'
down_revision: str | Sequence[str] | None = '0001'
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:

    op.create_table('prices',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('model', sa.String(length=200), nullable=False),
    sa.Column('input_per_mtok', sa.Numeric(precision=18, scale=6), nullable=False),
    sa.Column('cached_input_per_mtok', sa.Numeric(precision=18, scale=6), nullable=False),
    sa.Column('output_per_mtok', sa.Numeric(precision=18, scale=6), nullable=False),
    sa.Column('batch_discount', sa.Numeric(precision=5, scale=4), nullable=False),
    sa.Column('effective_from', sa.DateTime(timezone=True), nullable=False),
    sa.Column('effective_to', sa.DateTime(timezone=True), nullable=True),
    sa.CheckConstraint('batch_discount >= 0 AND batch_discount <= 1', name=op.f('ck_prices_batch_discount_fraction')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_prices'))
    )
    with op.batch_alter_table('prices', schema=None) as batch_op:
        batch_op.create_index('ix_prices_model_from', ['model', 'effective_from'], unique=False)

    op.create_table('files',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('tenant_id', sa.Integer(), nullable=False),
    sa.Column('filename', sa.String(length=255), nullable=False),
    sa.Column('purpose', sa.String(length=32), nullable=False),
    sa.Column('bytes', sa.BigInteger(), nullable=False),
    sa.Column('storage_key', sa.String(length=255), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('deleted_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_files_tenant_id_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_files'))
    )
    with op.batch_alter_table('files', schema=None) as batch_op:
        batch_op.create_index('ix_files_tenant_created', ['tenant_id', 'created_at'], unique=False)

    op.create_table('idempotency_keys',
    sa.Column('id', sa.Integer(), nullable=False),
    sa.Column('tenant_id', sa.Integer(), nullable=False),
    sa.Column('key', sa.String(length=255), nullable=False),
    sa.Column('request_hash', sa.String(length=64), nullable=False),
    sa.Column('request_id', sa.String(length=64), nullable=False),
    sa.Column('status_code', sa.Integer(), nullable=True),
    sa.Column('content_type', sa.String(length=100), nullable=True),
    sa.Column('body', sa.LargeBinary(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_idempotency_keys_tenant_id_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_idempotency_keys')),
    sa.UniqueConstraint('tenant_id', 'key', name=op.f('uq_idempotency_keys_tenant_id'))
    )
    op.create_table('batches',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('tenant_id', sa.Integer(), nullable=False),
    sa.Column('key_id', sa.Integer(), nullable=True),
    sa.Column('endpoint', sa.String(length=64), nullable=False),
    sa.Column('input_file_id', sa.String(length=64), nullable=False),
    sa.Column('output_file_id', sa.String(length=64), nullable=True),
    sa.Column('error_file_id', sa.String(length=64), nullable=True),
    sa.Column('completion_window', sa.String(length=16), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('metadata', sa.JSON(), nullable=True),
    sa.Column('errors', sa.JSON(), nullable=True),
    sa.Column('total', sa.Integer(), nullable=False),
    sa.Column('completed', sa.Integer(), nullable=False),
    sa.Column('failed', sa.Integer(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('in_progress_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finalizing_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('completed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('failed_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('expired_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('cancelling_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('cancelled_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['error_file_id'], ['files.id'], name=op.f('fk_batches_error_file_id_files')),
    sa.ForeignKeyConstraint(['input_file_id'], ['files.id'], name=op.f('fk_batches_input_file_id_files')),
    sa.ForeignKeyConstraint(['key_id'], ['api_keys.id'], name=op.f('fk_batches_key_id_api_keys')),
    sa.ForeignKeyConstraint(['output_file_id'], ['files.id'], name=op.f('fk_batches_output_file_id_files')),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_batches_tenant_id_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_batches'))
    )
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.create_index('ix_batches_tenant_created', ['tenant_id', 'created_at'], unique=False)

    op.create_table('usage_events',
    sa.Column('id', sa.BigInteger().with_variant(sa.Integer(), 'sqlite'), nullable=False),
    sa.Column('request_id', sa.String(length=64), nullable=False),
    sa.Column('tenant_id', sa.Integer(), nullable=False),
    sa.Column('key_id', sa.Integer(), nullable=True),
    sa.Column('model', sa.String(length=200), nullable=False),
    sa.Column('prompt_tokens', sa.Integer(), nullable=False),
    sa.Column('cached_tokens', sa.Integer(), nullable=False),
    sa.Column('completion_tokens', sa.Integer(), nullable=False),
    sa.Column('status', sa.String(length=32), nullable=False),
    sa.Column('finish_reason', sa.String(length=32), nullable=True),
    sa.Column('ttft_ms', sa.Float(), nullable=True),
    sa.Column('latency_ms', sa.Float(), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('batch_id', sa.String(length=64), nullable=True),
    sa.CheckConstraint('cached_tokens >= 0', name=op.f('ck_usage_events_cached_tokens_non_negative')),
    sa.CheckConstraint('completion_tokens >= 0', name=op.f('ck_usage_events_completion_tokens_non_negative')),
    sa.CheckConstraint('prompt_tokens >= 0', name=op.f('ck_usage_events_prompt_tokens_non_negative')),
    sa.ForeignKeyConstraint(['key_id'], ['api_keys.id'], name=op.f('fk_usage_events_key_id_api_keys')),
    sa.ForeignKeyConstraint(['tenant_id'], ['tenants.id'], name=op.f('fk_usage_events_tenant_id_tenants')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_usage_events')),
    sa.UniqueConstraint('request_id', name=op.f('uq_usage_events_request_id'))
    )
    with op.batch_alter_table('usage_events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_usage_events_batch_id'), ['batch_id'], unique=False)
        batch_op.create_index('ix_usage_events_tenant_finished', ['tenant_id', 'finished_at'], unique=False)




def downgrade() -> None:

    with op.batch_alter_table('usage_events', schema=None) as batch_op:
        batch_op.drop_index('ix_usage_events_tenant_finished')
        batch_op.drop_index(batch_op.f('ix_usage_events_batch_id'))

    op.drop_table('usage_events')
    with op.batch_alter_table('batches', schema=None) as batch_op:
        batch_op.drop_index('ix_batches_tenant_created')

    op.drop_table('batches')
    op.drop_table('idempotency_keys')
    with op.batch_alter_table('files', schema=None) as batch_op:
        batch_op.drop_index('ix_files_tenant_created')

    op.drop_table('files')
    with op.batch_alter_table('prices', schema=None) as batch_op:
        batch_op.drop_index('ix_prices_model_from')

    op.drop_table('prices')

