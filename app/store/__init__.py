"""The store: the only package that talks to PostgreSQL.

It holds the current text of everything the database runs (named statements in `sql/`, one
file per concern; every PL/pgSQL function in `functions/`, one file each), the ways a
statement is sent and what a lost connection proves (`database.py`, `outcomes.py`), the
engines (`engine.py`), the embedded server (`embedded.py`), migrations (`migrate.py`; the
migrations themselves install frozen copies of the function texts) and the table definitions
for reading (`tables.py`). Everything above it calls its typed methods.
"""
