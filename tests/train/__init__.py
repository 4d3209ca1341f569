"""Tests of the train layer; see docs/contributing.md, "The test suite"."""
