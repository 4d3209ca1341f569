"""genolong.files: atomic outputs whose temporary names no two writers share.

Two writers of the same output released at the same instant (threads here; the ranks of a job in
tests/integration/test_finetune_distributed.py) both finish, and the output is one writer's complete content.
With the fixed ``.NAME.tmp`` of before, the second rename found its temporary file renamed away by
the first (``FileNotFoundError``), the race of issue 13.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from genolong.config import load_recipe, parse_recipe
from genolong.files import replace_dir, replace_file, unique_sibling


def _race(writers: int, write_one: object) -> list[BaseException]:
    """Run ``write_one(i)`` in ``writers`` threads released together; the exceptions they raised."""
    barrier = threading.Barrier(writers)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        barrier.wait()
        try:
            write_one(i)  # type: ignore[operator]
        except BaseException as exc:  # noqa: BLE001 - collected for the assertion
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


@pytest.mark.parametrize("repeat", range(3))
def test_concurrent_replace_file_writers_all_finish_with_one_whole_output(tmp_path: Path, repeat: int) -> None:
    out = tmp_path / "table.csv"
    inside = threading.Barrier(4)

    def write_one(i: int) -> None:
        def write(tmp: Path) -> None:
            tmp.write_text(f"writer {i}\n" * 1000)
            inside.wait()  # every writer has written its temporary file before anyone renames

        replace_file(out, write)

    errors = _race(4, write_one)
    assert errors == [], errors
    text = out.read_text()
    assert text in {f"writer {i}\n" * 1000 for i in range(4)}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["table.csv"]  # no temporary file left


def test_concurrent_recipe_saves_all_finish(tmp_path: Path) -> None:
    recipe = parse_recipe(
        {
            "name": "race",
            "model": {"preset": "tiny"},
            "data": {"store": str(tmp_path / "genome"), "context": 1024},
            "train": {"max_steps": 1},
        }
    )
    out = tmp_path / "runs" / "race" / "recipe.yaml"
    errors = _race(4, lambda i: recipe.save(out))
    assert errors == [], errors
    assert load_recipe(out) == recipe
    assert sorted(p.name for p in out.parent.iterdir()) == ["recipe.yaml"]


def test_failed_write_leaves_the_old_output_and_no_temporary_file(tmp_path: Path) -> None:
    out = tmp_path / "report.md"
    out.write_text("old")

    def fail(tmp: Path) -> None:
        tmp.write_text("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        replace_file(out, fail, durable=True)
    assert out.read_text() == "old" and sorted(p.name for p in tmp_path.iterdir()) == ["report.md"]


def test_unique_siblings_differ_and_are_hidden(tmp_path: Path) -> None:
    names = {unique_sibling(tmp_path / "export", "tmp").name for _ in range(100)}
    assert len(names) == 100 and all(n.startswith(".export.tmp-") for n in names)


def test_replace_dir_swaps_a_finished_directory_in(tmp_path: Path) -> None:
    out, work = tmp_path / "result", tmp_path / ".result.work"
    out.mkdir()
    (out / "old.txt").write_text("old")
    work.mkdir()
    (work / "new.txt").write_text("new")
    replace_dir(work, out)
    assert [p.name for p in out.iterdir()] == ["new.txt"] and sorted(p.name for p in tmp_path.iterdir()) == ["result"]
