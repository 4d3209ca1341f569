"""Tests of the kernels layer; see docs/contributing.md, "The test suite"."""
