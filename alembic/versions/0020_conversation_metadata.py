"""Sessions keep a conversation's metadata (issue 35: `metadata` of the OpenAI Conversations
API, which was refused while sessions stored none).

* `sessions.metadata` (new, jsonb, `{}` by default): at most 16 string pairs, keys of at most
  64 characters, values of at most 512, as OpenAI's API allows; the API checks those and
  answers OpenAI's 400 (app/protocols/openai_conversations.py). `ck_sessions_metadata` is the
  database's backstop: a JSON object of bounded size (64 KiB covers 16 pairs of the longest
  keys and values even with every character escaped), so no writer can grow a session row
  without bound.

Safe for the release before it: its statements name the session columns they read and write,
and the new one has a default, so its inserts fill it.

Revision ID: 0020
Revises: 0018
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

from alembic import op
from app.store.migrate import lock_up_front

revision = "0020"
down_revision = "0018"
branch_labels = None
depends_on = None

METADATA_RULE = (
    "jsonb_typeof(metadata) = 'object' AND octet_length(CAST(metadata AS text)) <= 65536"
)


def upgrade() -> None:
    lock_up_front(op.get_bind(), "LOCK TABLE sessions IN ACCESS EXCLUSIVE MODE")
    # A constant default: PostgreSQL adds the column without rewriting the table.
    op.add_column(
        "sessions",
        sa.Column(
            "metadata",
            postgresql.JSONB(),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
    )
    op.create_check_constraint(op.f("ck_sessions_metadata"), "sessions", METADATA_RULE)
    # The release before this one still works on this schema (see above); 0018's bound stands
    # (the release of 0016, whose submission function 0018 replaced compatibly).
    op.execute("UPDATE schema_compatibility SET oldest_release = '0016'")


def downgrade() -> None:
    lock_up_front(op.get_bind(), "LOCK TABLE sessions IN ACCESS EXCLUSIVE MODE")
    op.drop_column("sessions", "metadata")  # its CHECK goes with it
