"""Alembic environment and versions of the accounting database (run through accounting.db)."""
