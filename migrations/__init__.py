"""Alembic migrations for pdscope's store (run with ``pdscope db upgrade``)."""
