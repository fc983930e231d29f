"""jobs.progress_at: when the job last moved, so a stuck job shows in `longtake status` (issue 18 item 8)

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01 23:40:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None


# Copies of the view before and after this revision (migrations are history). The view names
# ``jobs``, which SQLite's batch mode rebuilds, so it is dropped around the change and recreated.
VIEW_SQL_0002 = """
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

VIEW_SQL_0003 = VIEW_SQL_0002.replace(
    "AS segments_committed\n", "AS segments_committed,\n    j.progress_at AS progress_at\n"
)
assert "progress_at" in VIEW_SQL_0003


def upgrade() -> None:
    op.execute("DROP VIEW IF EXISTS longtake_jobs_v")
    with op.batch_alter_table('jobs') as batch:
        # existing rows get NULL: "not moved since this column exists"; the next claim sets it
        batch.add_column(sa.Column('progress_at', sa.DateTime(timezone=True), nullable=True))
    op.execute(VIEW_SQL_0003)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS longtake_jobs_v")
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('progress_at')
    op.execute(VIEW_SQL_0002)
