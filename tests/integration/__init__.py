"""End-to-end and multi-process tests; see docs/contributing.md, "The test suite"."""
