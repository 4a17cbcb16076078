"""Accounting: SQLAlchemy models and sessions (tenants, API keys), Alembic-made schema, key hashing."""
