"""Tests of the parallel layer; see docs/contributing.md, "The test suite"."""
