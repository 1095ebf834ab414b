"""Fixtures shared by the core tests: ``new_store`` makes empty segment stores of both kinds."""

from tests.core.segment_stores import new_store

__all__ = ["new_store"]
