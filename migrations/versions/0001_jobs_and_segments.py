"""jobs and segments

Revision ID: 0001
Revises:
Create Date: 2026-11-29 12:18:29.333375
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None


# A copy, not an import, of worker.jobs.tables.VIEW_SQL as of this revision: migrations are history.
VIEW_SQL = """
CREATE VIEW longtake_jobs_v AS
SELECT
    j.id AS job_id,
    j.tenant AS tenant,
    j.status AS status,
    j.priority AS priority,
    j.attempts AS attempts,
    j.max_attempts AS max_attempts,
    j.cancel_requested AS cancel_requested,
    j.progress_chunks AS chunks_done,
    j.num_chunks AS num_chunks,
    j.progress_frames AS frames_done,
    j.num_frames AS num_frames,
    j.progress_s AS seconds_done,
    j.error_code AS error_code,
    j.error_message AS error_message,
    j.outputs AS outputs,
    j.outputs_partial AS outputs_partial,
    j.created_at AS created_at,
    j.started_at AS started_at,
    j.finished_at AS finished_at,
    j.updated_at AS updated_at,
    (SELECT count(*) FROM segments s WHERE s.job_id = j.id) AS segments_committed
FROM jobs j
"""


def upgrade() -> None:
    op.create_table('jobs',
    sa.Column('id', sa.String(length=36), nullable=False),
    sa.Column('tenant', sa.String(length=64), nullable=False),
    sa.Column('idempotency_key', sa.String(length=128), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('priority', sa.Integer(), nullable=False),
    sa.Column('spec', sa.JSON(), nullable=False),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('max_attempts', sa.Integer(), nullable=False),
    sa.Column('lease_owner', sa.String(length=255), nullable=True),
    sa.Column('lease_token', sa.String(length=36), nullable=True),
    sa.Column('lease_expires_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('cancel_requested', sa.Boolean(), nullable=False),
    sa.Column('progress_chunks', sa.Integer(), nullable=False),
    sa.Column('num_chunks', sa.Integer(), nullable=True),
    sa.Column('progress_frames', sa.Integer(), nullable=False),
    sa.Column('num_frames', sa.Integer(), nullable=True),
    sa.Column('progress_s', sa.Float(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('queued_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('error_code', sa.String(length=64), nullable=True),
    sa.Column('error_message', sa.Text(), nullable=True),
    sa.Column('outputs', sa.JSON(), nullable=False),
    sa.Column('outputs_partial', sa.Boolean(), nullable=False),
    sa.Column('delivery_state', sa.JSON(), nullable=True),
    sa.CheckConstraint("status IN ('queued', 'running', 'succeeded', 'failed', 'cancelled')", name=op.f('ck_jobs_status_valid')),
    sa.CheckConstraint('attempts >= 0 AND max_attempts >= 1', name=op.f('ck_jobs_attempts_valid')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_jobs')),
    sa.UniqueConstraint('tenant', 'idempotency_key', name='uq_jobs_tenant_idempotency_key')
    )
    op.create_index('ix_jobs_status_lease_expires_at', 'jobs', ['status', 'lease_expires_at'], unique=False)
    op.create_index('ix_jobs_tenant_created_at', 'jobs', ['tenant', 'created_at'], unique=False)
    op.create_table('segments',
    sa.Column('job_id', sa.String(length=36), nullable=False),
    sa.Column('idx', sa.Integer(), nullable=False),
    sa.Column('key', sa.String(length=1024), nullable=False),
    sa.Column('nbytes', sa.BigInteger(), nullable=False),
    sa.Column('duration_s', sa.Float(), nullable=False),
    sa.Column('checksum', sa.String(length=64), nullable=False),
    sa.Column('state_key', sa.String(length=1024), nullable=True),
    sa.Column('first_frame', sa.Integer(), nullable=False),
    sa.Column('num_frames', sa.Integer(), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('committed_at', sa.DateTime(timezone=True), nullable=False),
    sa.CheckConstraint('idx >= 0 AND nbytes >= 0', name=op.f('ck_segments_segment_valid')),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], name=op.f('fk_segments_job_id_jobs'), ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('job_id', 'idx', name=op.f('pk_segments'))
    )
    op.execute(VIEW_SQL)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS longtake_jobs_v")
    op.drop_table('segments')
    op.drop_index('ix_jobs_tenant_created_at', table_name='jobs')
    op.drop_index('ix_jobs_status_lease_expires_at', table_name='jobs')
    op.drop_table('jobs')
