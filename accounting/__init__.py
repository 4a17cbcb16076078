"""Accounting: the SQL side of tollway (SQLAlchemy models, sessions, an Alembic-made schema).

Tenants and API keys (hashed), usage rows and their group-commit writer with a local spool,
prices and billing reports, files and their store, batches and their results. Imports neither
the gateway nor the workers.
"""
