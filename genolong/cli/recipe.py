"""``genolong recipe``: ``schema`` writes the recipe JSON Schema (for editors), ``show`` prints a
recipe as genolong reads it (:mod:`genolong.config`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from .common import Command, Subcommands, set_argument

__all__ = ["COMMAND", "add", "run"]


def add(sub: Subcommands) -> argparse.ArgumentParser:
    """Add ``recipe`` (with its actions ``schema`` and ``show``) to the subcommands and return its parser."""
    rec = sub.add_parser(
        "recipe",
        help="the recipe schema for editors, or a recipe as genolong reads it",
        description="`recipe schema` writes the JSON Schema of recipe files (for editor completion and "
        "checking); `recipe show RECIPE` prints the recipe with every key resolved.",
    )
    rec_sub = rec.add_subparsers(dest="action", required=True, metavar="ACTION")
    schema = rec_sub.add_parser("schema", help="write the recipe JSON Schema (to stdout, or --out FILE)")
    schema.add_argument("--out", metavar="FILE", help="write it here, e.g. recipe.schema.json (default: stdout)")
    schema.add_argument("--force", action="store_true", help="replace an existing --out")
    show = rec_sub.add_parser("show", help="print a recipe with every key resolved (defaults filled, paths absolute)")
    show.add_argument("recipe", metavar="RECIPE", help="YAML recipe (see recipes/)")
    set_argument(show, "override a recipe key (repeatable)")
    return rec


def run(args: argparse.Namespace) -> int:
    """Run ``genolong recipe ACTION``."""
    import json

    from ..config import load_recipe, recipe_schema
    from ..errors import InputError
    from ..files import replace_file

    if args.action == "show":
        print(load_recipe(args.recipe, args.set).to_yaml(), end="")
        return 0
    text = json.dumps(recipe_schema(), indent=2) + "\n"
    if args.out is None:
        print(text, end="")
        return 0
    out = Path(args.out)
    if out.exists() and not args.force:
        raise InputError(f"{out} already exists; pass --force to replace it, or choose another --out")
    if not out.parent.is_dir():
        raise InputError(
            f"--out {str(out)!r}: the directory {str(out.parent)!r} does not exist; create it or choose another path"
        )
    replace_file(out, lambda tmp: tmp.write_text(text))
    print(
        f"genolong recipe: JSON Schema written to {out}; a recipe whose first line is "
        f"`# yaml-language-server: $schema={out.name}` (the path relative to the recipe) gets completion and checks"
    )
    return 0


COMMAND = Command("recipe", add, run)
