"""``python -m genolong.cli``: the ``genolong`` console script (:func:`genolong.cli.entry`)."""

from . import entry

entry()
