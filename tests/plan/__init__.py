"""Tests of the plan layer; see docs/contributing.md, "The test suite"."""
