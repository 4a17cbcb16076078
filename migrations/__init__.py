"""Alembic environment and versions (not built yet)."""
