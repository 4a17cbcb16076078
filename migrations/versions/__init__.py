"""Alembic migration scripts, applied in order by accounting.db.upgrade_database."""
