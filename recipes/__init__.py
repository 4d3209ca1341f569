"""The shipped training recipes (YAML), installed as ``genolong.recipes`` for `genolong quickstart`."""
