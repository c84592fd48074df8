"""The house's budgets: three counts that may only go down, checked by `make lint` (so `make check`, CI).

- **Duplicates.** Runs of 6 or more identical lines (comments, docstrings, imports and function
  signatures left out) shared by two or more files of the service packages and bench: pylint's
  clone detector (`duplicate-code`, R0801, the `symilar` engine). Their number must not exceed
  `[duplicates] max` in `budgets.toml`.
- **Long and branchy service functions.** ruff's C901 (cyclomatic complexity over 12), PLR0912
  (over 12 branches) and PLR0915 (over 50 statements) over the service packages. Each finding must
  be on the allow list `[complexity.allowed]` in `budgets.toml`: functions to split; never add one.
- **Shape copies.** Pairs of places in the service packages and bench that share a run of
  `SHAPE_WINDOW` logical lines of one shape: the same code with other names, strings and numbers.
  Our own detector, `shape_pairs` (its docstring states the rule). Their number must not exceed
  `[shapes] max` in `budgets.toml`.
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
import hashlib
import io
import json
import keyword
import subprocess
import sys
import tokenize
import tomllib
from collections import defaultdict
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

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


# -- shape copies ----------------------------------------------------------------------------

SHAPE_WINDOW = 6
SHAPE_MAX_PLACES = 8  # a window of one shape in more places than this is a house idiom, not a copy
SHAPE_MIN_KINDS = 3  # a window of fewer distinct line shapes is a table (declarations, rows), not logic
_NOT_CODE = ("import", "from", "class", "@")  # what a logical line starts with
_SKIPPED = {tokenize.COMMENT, tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING}
_FSTRING_START = getattr(tokenize, "FSTRING_START", -1)  # Python 3.12 splits an f-string in parts
_FSTRING_END = getattr(tokenize, "FSTRING_END", -1)

Line = tuple[int, int, str]  # first and last physical line (1-based), the normalised text
Place = tuple[str, int, int]  # file, first line, last line
ShapePair = tuple[Place, Place]


def _placeholder(tok: tokenize.TokenInfo) -> str:
    if tok.type == tokenize.NAME:
        return tok.string if keyword.iskeyword(tok.string) else "N"
    if tok.type == tokenize.NUMBER:
        return "0"
    return tok.string  # an operator


def _logical_lines(source: str) -> Iterator[tuple[int, int, list[str]]]:
    """Each logical line as (first line, last line, its tokens normalised); comments, indentation and
    the breaks inside brackets left out. Adjacent strings (one implicit concatenation, an f-string's
    parts) are one "S"."""
    words: list[str] = []
    first = depth = 0
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in _SKIPPED:
            continue
        if tok.type in (tokenize.NEWLINE, tokenize.ENDMARKER):
            if words:
                yield first, tok.start[0], words
            words = []
            continue
        if not words:
            first = tok.start[0]
        depth += (tok.type == _FSTRING_START) - (tok.type == _FSTRING_END)
        if tok.type in (tokenize.STRING, _FSTRING_END) or depth:
            if not (words and words[-1] == "S"):
                words.append("S")
            continue
        words.append(_placeholder(tok))


def shape_lines(source: str) -> list[Line]:
    """The logical lines of code that count for shape copies, names as "N", numbers as "0", strings
    as "S", keywords (``True``, ``None``, ``return`` ...) and operators kept. Left out: imports,
    string-only lines (docstrings, attribute docstrings), declarations (``name: type`` with or
    without ``= value``: the fields of dataclasses, models and named tuples are data, not logic),
    and the ``class`` and decorator lines around them (a run of small classes is not a copy)."""
    out = []
    for first, last, words in _logical_lines(source):
        if words[0] in _NOT_CODE or set(words) == {"S"} or words[:2] == ["N", ":"]:
            continue
        out.append((first, last, " ".join(words)))
    return out


def _windows(name: str, lines: list[Line]) -> Iterator[tuple[str, Place]]:
    """(digest, place) for each run of SHAPE_WINDOW lines that is logic, not a table."""
    for i in range(len(lines) - SHAPE_WINDOW + 1):
        run = lines[i : i + SHAPE_WINDOW]
        if len({text for _, _, text in run}) < SHAPE_MIN_KINDS:
            continue
        digest = hashlib.blake2b("\n".join(t for _, _, t in run).encode(), digest_size=16).hexdigest()
        yield digest, (name, run[0][0], run[-1][1])


def _touch(a: Place, b: Place) -> bool:
    """Same file, and the line ranges overlap or are adjacent."""
    return a[0] == b[0] and a[1] <= b[2] + 1 and b[1] <= a[2] + 1


def _merge(matches: list[ShapePair]) -> list[ShapePair]:
    """Matches of one pair of files, merged while both sides overlap or adjoin: one pair of places."""
    merged: list[ShapePair] = []
    for a, b in sorted(matches):
        for k, (ma, mb) in enumerate(merged):
            if _touch(a, ma) and _touch(b, mb):
                merged[k] = (
                    (a[0], min(a[1], ma[1]), max(a[2], ma[2])),
                    (b[0], min(b[1], mb[1]), max(b[2], mb[2])),
                )
                break
        else:
            merged.append((a, b))
    return merged


def shape_pairs(root: Path, files: list[Path]) -> list[ShapePair]:
    """Pairs of places that share a run of SHAPE_WINDOW logical lines of one shape, sorted.

    The rule. Each file is read with the standard tokenizer; comments, docstrings (any line that is
    only a string) and imports are left out, and every name becomes "N", every string "S", every
    number "0" (keywords and operators stay). Each run of SHAPE_WINDOW consecutive logical lines is
    hashed; two places with the same hash are a match, and the matches of two files that overlap or
    adjoin on both sides are merged into one pair. Not counted, as boilerplate: a run with fewer than
    SHAPE_MIN_KINDS distinct line shapes (a table of declarations or keyword arguments, a list of
    rows: data, not logic), a run found in more than SHAPE_MAX_PLACES places (a house idiom), and a
    run that overlaps its other place in the same file (a period shorter than the run).
    """
    places: dict[str, list[Place]] = defaultdict(list)
    for path in files:
        name = str(path.relative_to(root))
        for digest, place in _windows(name, shape_lines(path.read_text(encoding="utf-8"))):
            places[digest].append(place)
    by_files: dict[tuple[str, str], list[ShapePair]] = defaultdict(list)
    for found in places.values():
        if len(found) > SHAPE_MAX_PLACES:
            continue
        for i, a in enumerate(found):
            for b in found[i + 1 :]:
                if not _touch(a, b):
                    by_files[(a[0], b[0])].append((a, b))
    return sorted(pair for matches in by_files.values() for pair in _merge(matches))


def format_shape_pair(pair: ShapePair) -> str:
    (fa, sa, ea), (fb, sb, eb) = pair
    return f"  {fa}:{sa}-{ea} ~ {fb}:{sb}-{eb}"


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


# each count: its budget's setting in budgets.toml ([name] key), what it counts, how to mend an excess
_COUNTS: dict[str, tuple[str, str, str]] = {
    "duplicates": (
        "max",
        f"identical runs of {MIN_DUPLICATE_LINES}+ lines",
        "mend the new copy (one home per concept)",
    ),
    "shapes": (
        "max",
        f"pairs of places sharing {SHAPE_WINDOW} lines of one shape",
        "one home for the logic (a helper, a table)",
    ),
    "length": ("max_over_50", f"functions over {LONG_LINES} lines", "split the new long function"),
}


def check_count(name: str, found: list[str], budgets: dict[str, Any]) -> bool:
    """``found`` (a line a finding) against the budget of count ``name``: over it, list them and say how to
    mend them (False); under it, say how to lower the budget."""
    key, what, mend = _COUNTS[name]
    budget = budgets[name][key]
    print(f"{name}: {len(found)} {what} (budget {budget})")
    if len(found) > budget:
        print("\n".join(found))
        print(f"!! over budget: {mend}, do not raise {BUDGET_FILE.name}")
        return False
    if len(found) < budget:
        print(f"   below budget: set [{name}] {key} = {len(found)} in {BUDGET_FILE.name}")
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
    files = python_files(ROOT, [*packages, *ALSO_FOR_DUPLICATES])
    ok = check_count("duplicates", [format_block(b) for b in duplicate_blocks(ROOT, files)], budgets)
    ok = check_count("shapes", [format_shape_pair(p) for p in shape_pairs(ROOT, files)], budgets) and ok
    ok = check_complexity(packages, budgets["complexity"]["allowed"]) and ok
    ok = check_count("length", [f"  {f}" for f in long_functions(ROOT, files)], budgets) and ok
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
