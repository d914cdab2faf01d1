"""The claim walks the fair order only as far as it takes (issue 32; docs/adr/0009).

* `turnstile_claim` (the text of app/store/functions/ at this revision,
  alembic/frozen/0029-*): round 1 reads the marked pairs through a cursor in
  ix_tenant_class_counts_fair's order, merged with a second over the pairs come due, and
  stops at the claim's limit, where it read and sorted every marked pair of the class first;
  each tenant's limit is read for the tenants walked only, and each tenant's head by a
  statement of the function instead of a call of `turnstile_claim_heads` (still called for
  the further rounds' shares). A claim of one run among 1,000 tenants with work cost about
  four times one with a single tenant; now about the same (docs/adr/0009, "Consequences").

Safe for the release before it: the function's signature and result are unchanged, and it
reads and writes the same rows in the same order. No table changes.

Revision ID: 0029
Revises: 0028
Create Date: 2026-12-02
"""

from __future__ import annotations

from alembic import op
from app.store.migrate import frozen

revision = "0029"
down_revision = "0028"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute(frozen("0029", "turnstile_claim"))


def downgrade() -> None:
    op.execute(frozen("0016", "turnstile_claim"))
