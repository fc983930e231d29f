"""jobs.session_state, jobs.audio_opened_at: live sessions (issue 13)

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-20 10:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None


# A copy of the view before this revision, and the view after it (one column added: the session's
# report). SQLite's batch mode rebuilds ``jobs``, which a view that names it would block, so the
# view is dropped and recreated around each change.
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
    (SELECT count(*) FROM segments s WHERE s.job_id = j.id) AS segments_committed,
    j.progress_at AS progress_at
FROM jobs j
"""

VIEW_SQL_0004 = VIEW_SQL.replace(
    "AS progress_at\n", "AS progress_at,\n    j.session_state AS session\n"
)
assert "AS session" in VIEW_SQL_0004


def upgrade() -> None:
    # existing rows are jobs with an audio file: NULL in both
    op.execute("DROP VIEW IF EXISTS longtake_jobs_v")
    with op.batch_alter_table('jobs') as batch:
        batch.add_column(sa.Column('session_state', sa.JSON(), nullable=True))
        batch.add_column(sa.Column('audio_opened_at', sa.DateTime(timezone=True), nullable=True))
    op.execute(VIEW_SQL_0004)


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS longtake_jobs_v")
    with op.batch_alter_table('jobs') as batch:
        batch.drop_column('audio_opened_at')
        batch.drop_column('session_state')
    op.execute(VIEW_SQL)
