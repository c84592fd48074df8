"""scripts/budgets.py: the duplicate count and the allow list of long service functions."""

from __future__ import annotations

import textwrap
from pathlib import Path

from scripts import budgets

# Seven statements, long enough to be a run of identical lines (6 or more).
BODY = "".join(f"    total += {i} * x\n" for i in range(7))


def _write(root: Path, name: str, text: str) -> Path:
    path = root / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def test_a_run_shared_by_two_files_is_one_block(tmp_path: Path) -> None:
    a = _write(tmp_path, "pkg/a.py", f"def f(x):\n    total = 0\n{BODY}    return total\n")
    b = _write(tmp_path, "pkg/b.py", f"def g(x, y=1):\n    total = 0\n{BODY}    return total\n")
    c = _write(tmp_path, "pkg/c.py", "def h(x):\n    return x\n")
    blocks = budgets.duplicate_blocks(tmp_path, [a, b, c])
    assert len(blocks) == 1
    lines, copies = blocks[0]
    assert lines >= 6
    assert [name for name, _, _ in copies] == ["pkg/a.py", "pkg/b.py"]


def test_imports_signatures_comments_and_docstrings_are_not_code(tmp_path: Path) -> None:
    head = 'import os\nimport sys\nfrom pathlib import Path\n"""A module."""\n# a comment\n'
    sig = "def f(\n    a: int,\n    b: int,\n    c: int,\n    d: int,\n    e: int,\n) -> int:\n"
    text = head * 2 + sig + "    return a\n"
    a = _write(tmp_path, "a.py", text)
    b = _write(tmp_path, "b.py", text.replace("return a", "return b"))
    assert budgets.duplicate_blocks(tmp_path, [a, b]) == []


def test_blanking_keeps_line_numbers() -> None:
    source = "import os\n\nclass C:\n    def m(\n        self,\n    ) -> None:\n        os.sep\n"
    lines = budgets.blank_imports_and_signatures(source)
    assert lines == ["\n", "\n", "class C:\n", "\n", "\n", "\n", "        os.sep\n"]


def test_findings_name_the_function_and_the_rule(tmp_path: Path) -> None:
    branches = "".join(f"        if x == {i}:\n            return {i}\n" for i in range(13))
    _write(tmp_path, "pkg/m.py", f"class K:\n    def branchy(self, x):\n{branches}        return -1\n")
    _write(tmp_path, "pkg/n.py", "def short(x):\n    return x\n")
    found = budgets.complexity_findings(tmp_path, ["pkg"])
    assert found == {("pkg/m.py::K.branchy", "C901"), ("pkg/m.py::K.branchy", "PLR0912")}


def test_the_checked_in_budget_file_reads() -> None:
    data = budgets.tomllib.loads(budgets.BUDGET_FILE.read_text())
    assert isinstance(data["duplicates"]["max"], int)
    for func, rules in data["complexity"]["allowed"].items():
        assert "::" in func and set(rules) <= set(budgets.COMPLEXITY_RULES), func


# A loop with a guard and an accumulator: six logical lines of logic, written twice with other names.
SHAPE = """
def {f}({xs}, {lim}):
    {acc} = []
    for {x} in {xs}:
        if {x}.{attr} > {lim}:
            continue
        {acc}.append({x}.{attr} * {n})
    return sorted({acc})
"""


def test_a_copy_with_other_names_and_values_is_one_shape_pair(tmp_path: Path) -> None:
    a = _write(tmp_path, "pkg/a.py", SHAPE.format(f="f", xs="xs", lim="lim", acc="out", x="x", attr="s", n=2))
    text = SHAPE.format(f="g", xs="rows", lim="cap", acc="kept", x="r", attr="ttft", n=1000)
    b = _write(tmp_path, "pkg/b.py", '"""Another module."""\n\nimport os\n' + text)
    assert budgets.shape_pairs(tmp_path, [a, b]) == [(("pkg/a.py", 2, 8), ("pkg/b.py", 5, 11))]


def test_other_logic_and_tables_of_declarations_are_not_shape_copies(tmp_path: Path) -> None:
    a = _write(tmp_path, "a.py", SHAPE.format(f="f", xs="xs", lim="lim", acc="out", x="x", attr="s", n=2))
    other = (
        "def f(xs):\n    n = 0\n    while n < 3:\n        n += len(xs)\n        xs = xs[1:]\n    return n\n"
    )
    b = _write(tmp_path, "b.py", other)
    fields = "".join(f"    f{i}: int = {i}\n    '''field {i}'''\n" for i in range(8))
    c = _write(tmp_path, "c.py", f"class A:\n{fields}\n\nclass B:\n{fields.replace('int', 'str')}")
    assert budgets.shape_pairs(tmp_path, [a, b, c]) == []


def test_shape_lines_normalise_names_strings_and_numbers() -> None:
    source = 'import os\n"""Doc."""\nx: int = 1\ny = f(a, "s" "t", 2)  # why\nif y:\n    pass\n'
    assert budgets.shape_lines(source) == [(4, 4, "N = N ( N , S , 0 )"), (5, 5, "if N :"), (6, 6, "pass")]


def test_the_checked_in_shape_budget_is_a_count() -> None:
    data = budgets.tomllib.loads(budgets.BUDGET_FILE.read_text())
    assert isinstance(data["shapes"]["max"], int) and data["shapes"]["max"] >= 0
