"""Goodput benchmark: round robin vs static weights vs the controller vs an oracle."""
