"""Shared test set-up that more than one test module uses (no tests live here)."""
