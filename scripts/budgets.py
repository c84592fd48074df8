"""The house's budgets: three counts that may only go down, checked by `make lint` (so `make check`, CI).

- **Duplicates.** Runs of 6 or more identical lines (comments, docstrings, imports and function
  signatures left out) shared by two or more files of the service packages and bench: pylint's
  clone detector (`duplicate-code`, R0801, the `symilar` engine). Their number must not exceed
  `[duplicates] max` in `budgets.toml`.
- **Long and branchy service functions.** ruff's C901 (cyclomatic complexity over 12), PLR0912
  (over 12 branches) and PLR0915 (over 50 statements) over the service packages. Each finding must
  be on the allow list `[complexity.allowed]` in `budgets.toml`: functions to split; never add one.
- **Long functions.** Functions (and methods) over `LONG_LINES` lines, from the `def` to their last
  line, in the service packages and bench (tests left out). Their number must not exceed
  `[length] max_over_50` in `budgets.toml`.

Below budget (a duplicate mended, a listed function split), the check passes and says how to lower
the budget. It reads the tree and writes nothing; it exits 1 when a budget is exceeded.

    .venv/bin/python scripts/budgets.py PACKAGE...    # the service packages: `make budgets`

pylint is pinned (pyproject's dev extras): this script uses its detector's internals.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import tomllib
from collections.abc import Iterable, Iterator
from pathlib import Path

from pylint.checkers.symilar import LineSet, Symilar

ROOT = Path(__file__).resolve().parent.parent
BUDGET_FILE = ROOT / "budgets.toml"
ALSO_FOR_DUPLICATES = ("bench",)
MIN_DUPLICATE_LINES = 6
COMPLEXITY_RULES = ("C901", "PLR0912", "PLR0915")
COMPLEXITY_LIMITS = (
    "lint.mccabe.max-complexity = 12",
    "lint.pylint.max-branches = 12",
    "lint.pylint.max-statements = 50",
)

Block = tuple[int, list[tuple[str, int, int]]]  # lines, then (file, start, end) per copy, 0-based


def python_files(root: Path, dirs: Iterable[str]) -> list[Path]:
    """The .py files under `dirs` (relative to `root`), sorted, so that the report is stable."""
    return sorted(p for d in dirs for p in (root / d).rglob("*.py"))


def _signature_lines(tree: ast.Module) -> Iterator[int]:
    """Line numbers of function signatures (`def` to the line before the body), as pylint finds them:
    functions of the module, of classes and of functions, not those nested in other statements."""
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            yield from range(node.lineno, node.body[0].lineno)
        if isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            yield from _signature_lines(ast.Module(body=node.body, type_ignores=[]))


def _import_lines(tree: ast.Module) -> Iterator[int]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield from range(node.lineno, (node.end_lineno or node.lineno) + 1)


def blank_imports_and_signatures(source: str) -> list[str]:
    """The file's lines with imports and signatures blanked, line numbers kept.

    pylint's own ignore-imports and ignore-signatures parse every file with astroid: a minute on
    two cores. The standard library's parser finds the same lines in a second.
    """
    lines = source.splitlines(keepends=True)
    tree = ast.parse(source)
    for lineno in {*_import_lines(tree), *_signature_lines(tree)}:
        lines[lineno - 1] = "\n"
    return lines


def duplicate_blocks(root: Path, files: list[Path]) -> list[Block]:
    """pylint's duplicate-code report: each run of identical lines with the files (relative to `root`)
    that share it, longest first."""
    similar = Symilar(min_lines=MIN_DUPLICATE_LINES, ignore_comments=True, ignore_docstrings=True)
    for path in files:
        name = str(path.relative_to(root))
        lines = blank_imports_and_signatures(path.read_text(encoding="utf-8"))
        similar.linesets.append(LineSet(name, lines, ignore_comments=True, ignore_docstrings=True))
    blocks: list[Block] = [
        (lines, sorted((ls.name, int(start), int(end)) for ls, start, end in copies))
        for lines, copies in similar._compute_sims()
    ]
    return sorted(blocks, key=lambda b: (-b[0], b[1]))


def format_block(block: Block) -> str:
    lines, copies = block
    where = ", ".join(f"{name}:{start + 1}-{end}" for name, start, end in copies)
    return f"  {lines} lines in {len(copies)} files: {where}"


def _qualnames(tree: ast.AST, prefix: str = "") -> Iterator[tuple[int, str]]:
    """(line of the `def`, dotted name) for every function, methods under their class."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                yield node.lineno, name
            yield from _qualnames(node, f"{name}.")
        else:
            yield from _qualnames(node, prefix)


def complexity_findings(root: Path, dirs: Iterable[str]) -> set[tuple[str, str]]:
    """("file::function", rule) for each function under `dirs` (relative to `root`) over ruff's limits
    (`COMPLEXITY_LIMITS`); raises CalledProcessError when ruff cannot run."""
    config = [arg for limit in COMPLEXITY_LIMITS for arg in ("--config", limit)]
    cmd = [sys.executable, "-m", "ruff", "check", "--isolated", "--exit-zero", "--output-format", "json"]
    cmd += ["--select", ",".join(COMPLEXITY_RULES), *config, *dirs]
    out = subprocess.run(cmd, cwd=root, capture_output=True, text=True, check=True).stdout
    names: dict[str, dict[int, str]] = {}
    found = set()
    for item in json.loads(out):
        path = str(Path(item["filename"]).resolve().relative_to(root.resolve()))
        if path not in names:
            names[path] = dict(_qualnames(ast.parse((root / path).read_text(encoding="utf-8"))))
        found.add((f"{path}::{names[path][item['location']['row']]}", item["code"]))
    return found


LONG_LINES = 50


def long_functions(root: Path, files: list[Path]) -> list[str]:
    """Each function of ``files`` over ``LONG_LINES`` lines, as "file::function (N lines)"."""
    out = []
    for path in files:
        tree = ast.parse(path.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > LONG_LINES:
                    out.append(f"{path.relative_to(root)}::{node.name} ({n} lines)")
    return sorted(out)


def check_length(packages: list[str], budget: int) -> bool:
    found = long_functions(ROOT, python_files(ROOT, [*packages, *ALSO_FOR_DUPLICATES]))
    print(f"length: {len(found)} functions over {LONG_LINES} lines (budget {budget})")
    if len(found) > budget:
        print("\n".join(f"  {f}" for f in found))
        print(f"!! over budget: split the new long function, do not raise {BUDGET_FILE.name}")
        return False
    if len(found) < budget:
        print(f"   below budget: set [length] max_over_50 = {len(found)} in {BUDGET_FILE.name}")
    return True


def check_duplicates(packages: list[str], budget: int) -> bool:
    blocks = duplicate_blocks(ROOT, python_files(ROOT, [*packages, *ALSO_FOR_DUPLICATES]))
    print(f"duplicates: {len(blocks)} identical runs of {MIN_DUPLICATE_LINES}+ lines (budget {budget})")
    if len(blocks) > budget:
        print("\n".join(format_block(b) for b in blocks))
        print(f"!! over budget: mend the new copy (one home per concept), do not raise {BUDGET_FILE.name}")
        return False
    if len(blocks) < budget:
        print(f"   below budget: set [duplicates] max = {len(blocks)} in {BUDGET_FILE.name}")
    return True


def check_complexity(packages: list[str], allowed: dict[str, list[str]]) -> bool:
    found = complexity_findings(ROOT, packages)
    listed = {(func, rule) for func, rules in allowed.items() for rule in rules}
    new, gone = sorted(found - listed), sorted(listed - found)
    print(f"complexity: {len(found)} findings of {', '.join(COMPLEXITY_RULES)} (allowed {len(listed)})")
    for func, rule in gone:
        print(f"   split, well done: remove {rule} of {func} from {BUDGET_FILE.name}")
    if new:
        print("\n".join(f"  {func}: {rule}" for func, rule in new))
        print("!! over the limits: split these functions; the allow list only shrinks")
    return not new


def main(packages: list[str]) -> int:
    if not packages:
        sys.exit("usage: budgets.py PACKAGE... (the service packages, as `make budgets` passes them)")
    budgets = tomllib.loads(BUDGET_FILE.read_text(encoding="utf-8"))
    ok = check_duplicates(packages, budgets["duplicates"]["max"])
    ok = check_complexity(packages, budgets["complexity"]["allowed"]) and ok
    ok = check_length(packages, budgets["length"]["max_over_50"]) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
