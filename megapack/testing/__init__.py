"""Helpers for tests of megapack and of users' own training code (worker pool, grids)."""
