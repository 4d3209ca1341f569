"""Rules of the test suite itself, checked on its sources (issue 13).

Computed floating-point results are bitwise reproducible only for the same computation on the same
shapes under the same number of torch threads: with two threads a reduction is split into partial
sums whose boundary moves with the shapes (3e-8 in test_model_lm's causality check on a user's
2-core machine), and where the shapes differ even one thread is not enough (the BLAS picks its
kernel by shape: compare with a tolerance there). The rule: a module that compares bitwise
(``torch.equal``, ``np.array_equal``, ``np.testing.assert_array_equal``, ``assert_close`` or
``assert_allclose`` with ``rtol=0, atol=0``, pandas' ``check_exact=True``) is under the
``one_thread`` fixture, or each such comparison carries an ``# exact: <why>`` comment saying why it
is exact by nature (integers, bools, indices, a copy of the same bytes, a constant);
``assert_bitwise_equal`` (tests/helpers.py, which also checks the thread count when it runs) is
used only in modules under ``one_thread``. What a static check cannot see (``==`` on a float read
back from a log, ``.tolist() ==`` of float results, aliased imports) stays for review.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest
import torch

from .helpers import assert_bitwise_equal, genolong_frames

# this module sets the thread count itself where it matters (test_assert_bitwise_equal_needs_one_thread)
pytestmark = pytest.mark.usefixtures("one_thread")

TESTS = Path(__file__).resolve().parent

_BITWISE = {
    "torch.equal",
    "np.array_equal",
    "numpy.array_equal",
    "np.testing.assert_array_equal",
    "numpy.testing.assert_array_equal",
}
_ZERO_TOLERANCE = {"torch.testing.assert_close", "np.testing.assert_allclose", "numpy.testing.assert_allclose"}
_PANDAS = {"pd.testing.assert_frame_equal", "pd.testing.assert_series_equal"}  # exact only with check_exact=True
_MARKER = "# exact:"


def _name(node: ast.expr) -> str:
    """Dotted name of a call target (``torch.testing.assert_close``), or '' for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return ""


def _zero(node: ast.expr | None) -> bool:
    return isinstance(node, ast.Constant) and node.value == 0


def _under_one_thread(tree: ast.Module) -> bool:
    """Whether a module-level ``pytestmark`` uses the ``one_thread`` fixture."""
    for stmt in tree.body:
        targets = (
            stmt.targets if isinstance(stmt, ast.Assign) else [stmt.target] if isinstance(stmt, ast.AnnAssign) else []
        )
        if any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in targets) and stmt.value is not None:
            for node in ast.walk(stmt.value):
                if (
                    isinstance(node, ast.Call)
                    and _name(node.func).endswith("usefixtures")
                    and any(isinstance(a, ast.Constant) and a.value == "one_thread" for a in node.args)
                ):
                    return True
    return False


def violations(source: str, filename: str = "<test>") -> list[str]:
    """Breaches of the rule in a test module's ``source``: one ``file:line: message`` each."""
    tree = ast.parse(source, filename)
    text = source.splitlines()
    comments: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string
    one_thread = _under_one_thread(tree)
    # the statement around each call: a marker anywhere on its lines counts
    statement: dict[ast.AST, ast.stmt] = {}
    for stmt in ast.walk(tree):
        if isinstance(stmt, ast.stmt):
            for node in ast.walk(stmt):
                if isinstance(node, ast.Call):
                    statement[node] = stmt  # inner statements come later and win
    exempt: set[ast.AST] = set()
    for node in ast.walk(tree):  # the helper's own comparison, after its thread check
        if isinstance(node, ast.FunctionDef) and node.name == "assert_bitwise_equal":
            exempt.update(ast.walk(node))
    found = []
    for call in (n for n in ast.walk(tree) if isinstance(n, ast.Call) and n not in exempt):
        name = _name(call.func)
        where = f"{filename}:{call.lineno}"
        if name.endswith("assert_bitwise_equal"):
            if not one_thread:
                found.append(f"{where}: assert_bitwise_equal in a module not under the one_thread fixture")
            continue
        kwargs = {k.arg: k.value for k in call.keywords}
        bitwise = (
            name in _BITWISE
            or (name in _ZERO_TOLERANCE and _zero(kwargs.get("rtol")) and _zero(kwargs.get("atol")))
            or (
                name in _PANDAS
                and isinstance(kwargs.get("check_exact"), ast.Constant)
                and kwargs["check_exact"].value is True
            )
        )
        if not bitwise or one_thread:
            continue
        stmt = statement[call]
        # a compound statement (if, for, with) counts up to its body: a call in its header
        last = stmt.body[0].lineno - 1 if getattr(stmt, "body", None) else stmt.end_lineno or stmt.lineno
        lines = list(range(stmt.lineno, last + 1))
        if stmt.lineno >= 2 and text[stmt.lineno - 2].lstrip().startswith("#"):
            lines.append(stmt.lineno - 1)  # a comment line just above the statement
        marks = [comments[i] for i in lines if i in comments and _MARKER in comments[i]]
        if not any(m.split(_MARKER, 1)[1].strip() for m in marks):
            found.append(f"{where}: {name} outside the one_thread fixture, no '{_MARKER} <why>' comment")
    return sorted(found, key=lambda v: int(v.split(":")[1]))


def _modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("*.py") if p.name != "__init__.py")


def test_bitwise_comparisons_only_under_one_thread_or_marked_exact() -> None:
    found = []
    for path in _modules():
        found += violations(path.read_text(), path.relative_to(TESTS).as_posix())
    assert not found, (
        "bitwise comparisons that two torch threads can break. Where the values are exact by nature "
        "(ints, bools, indices, a copy of the same bytes) say so with '# exact: <why>'; where bitwise "
        "equality of computed floats is the point, put the module under one_thread and use "
        "assert_bitwise_equal; otherwise compare with a tolerance and say why that one:\n" + "\n".join(found)
    )


# The folders of tests/ (docs/contributing.md, "Tests"): one per package, plus integration/; at the
# top only the repository's own rules and the shared helpers
_FOLDERS = {"data", "model", "kernels", "parallel", "plan", "train", "evaluation", "cli", "integration"}
_TOP_LEVEL_TESTS = {
    "test_readme.py",
    "test_imports.py",
    "test_suite_rules.py",
    "test_experiments_boundary.py",
    "test_bench_helper.py",
}


def test_test_files_live_in_the_package_folders() -> None:
    """Every test file sits in a package's folder (each a package: ``__init__.py``) or is one of the
    repository's rules at the top; a new flat ``tests/test_*.py`` goes to the folder of the package
    it tests (or ``integration/``), as docs/contributing.md says."""
    top = sorted(p.name for p in TESTS.glob("test_*.py") if p.name not in _TOP_LEVEL_TESTS)
    assert not top, f"test files at the top of tests/, move each to its package's folder: {top}"
    deeper = sorted(
        p.relative_to(TESTS).as_posix()
        for p in TESTS.rglob("test_*.py")
        if len(p.relative_to(TESTS).parts) > 1 and p.relative_to(TESTS).parts[0] not in _FOLDERS
    )
    assert not deeper, f"test files outside the package folders {sorted(_FOLDERS)}: {deeper}"
    assert all((TESTS / folder / "__init__.py").is_file() for folder in _FOLDERS)


_OLD_CAUSALITY = """
import torch

def test_causality_and_loss_masks() -> None:
    a, b = model(tokens), model(changed)
    assert torch.equal(a[:, :12], b[:, :12]) and not torch.allclose(a[:, 12:], b[:, 12:])
"""


def test_the_rule_catches_what_it_is_for() -> None:
    """The checker flags issue 13's comparison (tests/model/test_model_lm.py before the fix) and accepts the
    three ways out: the fixture, a marker with a reason, a tolerance."""
    assert violations(_OLD_CAUSALITY, "old.py") == [
        "old.py:6: torch.equal outside the one_thread fixture, no '# exact: <why>' comment"
    ]
    fixed = _OLD_CAUSALITY.replace(
        "import torch\n", 'import pytest, torch\npytestmark = pytest.mark.usefixtures("one_thread")\n'
    )
    assert violations(fixed) == []
    assert violations(_OLD_CAUSALITY.replace("b[:, 12:])", "b[:, 12:])  # exact:")) != []  # a reason is needed
    assert violations(_OLD_CAUSALITY.replace("b[:, 12:])", "b[:, 12:])  # exact: token ids")) == []
    assert violations("import numpy as np\nnp.testing.assert_allclose(a, b, rtol=0, atol=0)\n") != []
    assert violations("import numpy as np\nnp.testing.assert_allclose(a, b, rtol=0, atol=1e-6)\n") == []
    assert violations("from .helpers import assert_bitwise_equal\nassert_bitwise_equal(a, b, 'x')\n") != []
    # a marker on any line of the statement counts (long calls wrap), or on a comment line just above
    assert violations("import torch\nassert torch.equal(\n    a,  # exact: ints\n    b)\n") == []
    assert violations("import torch\n# exact: ints\nassert torch.equal(a, b)\n") == []
    assert violations("import torch\nx = 1  # exact: ints\nassert torch.equal(a, b)\n") != []
    assert violations("import torch\nif torch.equal(a, b):\n    pass  # exact: ints\n") != []
    assert violations("import pandas as pd\npd.testing.assert_frame_equal(a, b, check_exact=True)\n") != []
    assert violations("import pandas as pd\npd.testing.assert_frame_equal(a, b)\n") == []  # rtol 1e-5 on floats


def test_assert_bitwise_equal_needs_one_thread() -> None:
    x = torch.arange(6.0)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        with pytest.raises(
            pytest.fail.Exception, match="under 2 torch threads; put the test module under the one_thread"
        ):
            assert_bitwise_equal(x, x.clone(), "x")
        torch.set_num_threads(1)
        assert_bitwise_equal(x, x.clone(), "x")
        assert_bitwise_equal({"w": x}, {"w": x.clone()}, "state")
        with pytest.raises(pytest.fail.Exception, match=r"x: 1 of 6 elements differ \(largest difference 1.19e-07\)"):
            assert_bitwise_equal(x, x + torch.tensor([0, 1.1920929e-07, 0, 0, 0, 0]), "x")
        with pytest.raises(pytest.fail.Exception, match=r"state: the keys differ"):
            assert_bitwise_equal({"w": x}, {"v": x}, "state")
        with pytest.raises(pytest.fail.Exception, match=r"x: \(6,\) torch.float32 against \(6,\) torch.float64"):
            assert_bitwise_equal(x, x.double(), "x")
    finally:
        torch.set_num_threads(threads)


def test_genolong_frames_match_the_package_not_a_checkout_named_genolong() -> None:
    """A checkout in a folder named ``genolong`` (what ``git clone`` makes) puts ``/genolong/`` in
    every path of its virtualenv: only frames of genolong's own code count as genolong's."""
    import genolong.cli
    import genolong.kernels.backends

    own = genolong.cli.__file__
    kernel = genolong.kernels.backends.__file__
    text = "\n".join(
        [
            "Traceback (most recent call last):",
            '  File "/home/me/genolong/.venv/lib/python3.11/site-packages/lightning/fabric/strategies/ddp.py", line 9, in f',
            '  File "/home/me/genolong/.venv/bin/torchrun", line 8, in <module>',
            "srun is available, see /home/me/genolong/.venv/bin/python",
            f'  File "{own}", line 12, in entry',
            f'  File "{kernel}", line 40, in get_backend',
        ]
    )
    assert genolong_frames(text) == [own, kernel]
    assert genolong_frames(text.split(f'  File "{own}"')[0]) == []
