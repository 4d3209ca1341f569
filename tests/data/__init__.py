"""Tests of the data layer; see docs/contributing.md, "The test suite"."""
