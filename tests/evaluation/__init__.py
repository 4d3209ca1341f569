"""Tests of the evaluation layer; see docs/contributing.md, "The test suite"."""
