"""A small recipe for the planner's tests (``tests/test_plan_*.py``): a preset at a context on the CPU."""

from __future__ import annotations

from pathlib import Path

from genolong.config import Recipe, parse_recipe


def plan_recipe(tmp_path: Path, preset: str = "tiny", context: int = 1024, **sections: dict) -> Recipe:
    """A recipe named ``plan-test`` for ``preset`` at ``context`` tokens, 10 steps, on the CPU, its
    store under ``tmp_path`` (never read: the planner needs only the settings); ``sections`` update
    the recipe's sections (e.g. ``parallel={"cp": 2, "devices": 4}``)."""
    data: dict = {
        "name": "plan-test",
        "model": {"preset": preset},
        "data": {"store": str(tmp_path / "store"), "context": context},
        "train": {"max_steps": 10},
        "parallel": {"accelerator": "cpu"},
    }
    for key, value in sections.items():
        data.setdefault(key, {}).update(value)
    return parse_recipe(data)
