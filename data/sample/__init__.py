"""genolong.bundled.sample: the real human sample genome (see README.md beside this file)."""
