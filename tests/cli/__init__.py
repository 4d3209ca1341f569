"""Tests of the cli layer; see docs/contributing.md, "The test suite"."""
