"""Synthetic data for development: histories written into a store for tests, benchmarks and
screenshots. Beside the services, never imported by them; it stands on the store and the kernel."""
