"""Shared set-up for tests (no test functions here)."""
