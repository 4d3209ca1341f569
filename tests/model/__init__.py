"""Tests of the model layer; see docs/contributing.md, "The test suite"."""
