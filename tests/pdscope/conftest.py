"""Fixtures the command-line tests share with the controller's: a seeded store and a reconciler over it."""

from tests.controller.conftest import world  # noqa: F401 - a fixture, used by name
