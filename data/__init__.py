"""genolong.bundled: data shipped with genolong (the real human sample genome in ``sample/``).

Installed as ``genolong.bundled`` (see ``package-dir`` in pyproject.toml); find files with
``importlib.resources.files("genolong.bundled.sample")``.
"""
