#!/usr/bin/env python3
"""Moves everything that writes a store out of deltafind/store/ into deltafind/importer/, once.

Run from anywhere in a clean checkout: `python tools/dev/move_importer.py [--dry-run]`. It `git mv`s each
importer file (and the provider contract to deltafind/provider.py), rewrites every import and every
mention of the old module and file paths in the tracked files, updates the import-direction test's
LAYERS and the README's architecture, sorts the rewritten imports with ruff and prints what it did.
Files in deltafind/store/ it does not know stay there, with a warning; a second run is refused.
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()

# Decided by who imports each file: what only the import (setup, hubs, GGUF, DSpark, synthetic stores)
# uses moves; what the read path or the models use stays. store/ never imports importer/.
TO_IMPORTER = [
    "setup", "sources", "checkpoint", "plan", "spine_writer", "placement",
    "hub", "hub_gguf", "hub_streaming", "gguf_source", "gguf_arch",
    "dspark_import", "synthetic", "synthetic_families", "synthetic_k3",
]  # --to-importer NAME adds a file another branch added
STAYS = (
    "__init__", "manifest", "reader", "record_read", "drive_queue", "experts", "cache", "read_budget",
    "resident", "prefetch_gate", "spine", "quant", "remote", "remote_experts", "heat", "trace", "doctor", "dspark",
)
# The models' contract with whoever serves their experts: below both the store and the importer.
TO_TOP = ("provider",)

IMPORTER_INIT = '''"""Writes expert stores: setup from HF folders, GGUF files and hubs (streamed installs too), the tensor
plan and spine writer, placement and rebalance, DSpark import and synthetic stores.

It may import `deltafind.store`, whose format it writes; the store never imports it.
"""
'''
STORE_INIT = ('"""The read path of an expert store: manifest, readers, drive queues, cache, prefetch, resident layers,\n'
              'heat and traces. What writes a store is `deltafind.importer`, which this package never imports."""\n')

# (file, old, new), after the path rewrite: edits that are not one. A missing `old` is reported, never guessed at.
LAYERS_EDITS = (
    ('    ("deltafind.models", "deltafind.device"),\n',
     '    ("deltafind.models", "deltafind.device", "deltafind.importer"),  # importer: writes what store reads\n'),
    ('    ("deltafind.tokenizer", "deltafind.config", "deltafind.errors", "deltafind.log"),\n',
     '    ("deltafind.tokenizer", "deltafind.config", "deltafind.errors", "deltafind.log", "deltafind.provider"),\n'),
    ("# models see only the provider contract and the block-format tags it carries (store/quant.py)\n"
     'NARROWER = {("deltafind.models", "deltafind.store"): ("deltafind.provider", "deltafind.store.quant")}\n',
     "# of the store, models see only the block-format tags the provider contract carries (store/quant.py)\n"
     'NARROWER = {("deltafind.models", "deltafind.store"): ("deltafind.store.quant",)}\n'),
)
README_ROW = """\
       ├─ importer/   writes a store: setup (HF folders; GGUF whole or split, by gguf-py's tables:
       │     gguf_source.py, gguf_arch.py; hubs: hub.py, hub_gguf.py for ORG/NAME:QUANT, streamed
       │     installs: hub_streaming.py), the tensor plan (plan.py), the spine writer, placement
       │     and rebalance, DSpark import, synthetic stores
       ├─ store/      the read path: manifest (whole or striped records), per-drive read queues
       │     (1 MiB pieces, demand before prefetch), byte-budgeted cache, dense layers held
       │     whole + pin tier (resident.py; reads in flight reserved in the cache:
       │     read_budget.py), prefetch and its per-layer gate, heat, router trace, doctor
"""
TEXT_EDITS = (
    ("tests/unit/test_daemon_service.py", LAYERS_EDITS),
    ("README.md", (("config and `deltafind.provider` only; the store never imports models or device:\n",
                    "config and `deltafind.provider` only; the importer may import the store, whose\n"
                    "format it writes, never the reverse; the store never imports models or device:\n"),)),
    ("deltafind/provider.py", (
        ("tells the store's import which checkpoint tensors are experts", "tells the importer which checkpoint tensors are experts"),
        ("This module must not import anything from the rest of `deltafind.store`.",
         "It sits below the store and the importer, which both use it, and imports nothing of deltafind."),
    )),
)


def git(*args: str, check: bool = True) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=check, capture_output=True, text=True).stdout


def new_module(name: str) -> str | None:
    """deltafind.store.<name> -> its new dotted path, or None when it stays."""
    if name in TO_IMPORTER:
        return f"deltafind.importer.{name}"
    if name in TO_TOP:
        return f"deltafind.{name}"
    return None


def new_file(name: str) -> str:
    return new_module(name).replace(".", "/") + ".py"


DROPPED: list[str] = []  # comments inside a split `from deltafind.store import (...)`

IMPORT_FROM_STORE = re.compile(r"^([ \t]*)from deltafind\.store import (\([^)]*\)|[^\n]*)", re.M)


def split_from_store(m: re.Match) -> str:
    """`from deltafind.store import a, b as c`: one statement per destination package."""
    indent, body = m.group(1), m.group(2)
    comment = ""
    if not body.startswith("("):
        body, _, comment = body.partition("#")
        comment = f"  #{comment.rstrip()}" if comment else ""
    names = [re.sub(r"#.*", "", n).strip() for n in re.sub(r"#[^\n]*", "", body).strip("()").split(",")]
    names = [n for n in names if n]
    groups: dict[str, list[str]] = {}
    for n in names:
        target = new_module(n.split()[0])
        groups.setdefault(target.rpartition(".")[0] if target else "deltafind.store", []).append(n)
    if list(groups) == ["deltafind.store"]:
        return m.group(0)
    if body.startswith("(") and "#" in body:
        DROPPED.append(m.group(0))
    lines = [f"{indent}from {pkg} import {', '.join(ns)}" for pkg, ns in groups.items()]
    lines[0] += comment
    return "\n".join(lines)


RELATIVE = re.compile(r"^([ \t]*)from (\.+)([\w.]*) import ", re.M)


def absolute_relatives(text: str, package: str) -> str:
    """Relative imports that reach deltafind.store become absolute, so the path rewrite below sees them."""
    def fix(m: re.Match) -> str:
        base = package.split(".")[: len(package.split(".")) - len(m.group(2)) + 1]
        target = ".".join([*base, *filter(None, [m.group(3)])])
        if target != "deltafind.store" and not target.startswith("deltafind.store."):
            return m.group(0)
        return f"{m.group(1)}from {target} import "
    return RELATIVE.sub(fix, text)


def rewrite(text: str, path: str) -> str:
    moved = "|".join(sorted((*TO_IMPORTER, *TO_TOP), key=len, reverse=True))
    if path.endswith(".py"):
        if path.startswith("deltafind/"):
            package = ".".join(Path(path).with_suffix("").parts[:-1])
            text = absolute_relatives(text, package)
        text = IMPORT_FROM_STORE.sub(split_from_store, text)
    text = re.sub(rf"\bdeltafind\.store\.({moved})\b", lambda m: new_module(m.group(1)), text)
    text = re.sub(rf"\bdeltafind/store/({moved})\.py\b", lambda m: new_file(m.group(1)), text)
    text = re.sub(rf"(?<![\w./-])store/({moved})\.py\b",
                  lambda m: new_file(m.group(1)) if m.group(1) in TO_TOP else f"importer/{m.group(1)}.py", text)
    if not path.endswith(".py"):  # prose only: in code `store.plan` may be an attribute of a variable
        text = re.sub(rf"(?<![\w./-])store\.({moved})\b",
                      lambda m: new_module(m.group(1)) if m.group(1) in TO_TOP else f"importer.{m.group(1)}", text)
    return text


def imports_importer(path: Path) -> list[int]:
    """Lines of `path` (in deltafind.store) that import deltafind.importer, lazy imports too."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [("deltafind." if node.level == 2 else "deltafind.store." if node.level == 1 else "") + (node.module or "")]
        else:
            continue
        if any(n == "deltafind.importer" or n.startswith("deltafind.importer.") for n in names):
            lines.append(node.lineno)
    return lines


def readme_row(text: str, warn: list[str]) -> str:
    m = re.search(r"^ *├─ store/ .*?\n(?= *├─ )", text, re.M | re.S)
    if not m:
        warn.append("README.md: no `├─ store/` row found in the architecture; add the importer/ row by hand:\n" + README_ROW)
        return text
    print(f"README.md: the architecture's store row, replaced by an importer/ row and a store/ row, was:\n{m.group(0)}")
    return text[: m.start()] + README_ROW + text[m.end():]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dry-run", action="store_true", help="print what would move and change, touch nothing")
    ap.add_argument("--to-importer", nargs="+", default=[], metavar="NAME",
                    help="also move deltafind/store/NAME.py (a file this script does not know that writes a store)")
    args = ap.parse_args()
    TO_IMPORTER.extend(n.removesuffix(".py") for n in args.to_importer)
    store = ROOT / "deltafind" / "store"
    if (ROOT / "deltafind" / "importer").exists() or (ROOT / "deltafind" / "provider.py").exists():
        print("refused: deltafind/importer/ or deltafind/provider.py exists already; the move has been done", file=sys.stderr)
        return 2
    if git("status", "--porcelain", "--untracked-files=no").strip():
        print("refused: the checkout has uncommitted changes; commit them first so the move is one diff", file=sys.stderr)
        return 2

    present = {p.stem for p in store.glob("*.py")}
    known = {*TO_IMPORTER, *TO_TOP, *STAYS}
    warn = [f"deltafind/store/{n}.py is not known to this script: it stays in store/; check who imports it"
            for n in sorted(present - known)]
    warn += [f"deltafind/store/{n}.py is gone: nothing to move" for n in sorted({*TO_IMPORTER, *TO_TOP} - present)]
    moves = {f"deltafind/store/{n}.py": new_file(n) for n in (*TO_IMPORTER, *TO_TOP) if n in present}

    changed: dict[str, str] = {}
    for path in git("ls-files").splitlines():
        p = ROOT / path
        if path == SELF or not p.is_file() or p.is_symlink():
            continue
        try:
            old = p.read_text()
        except UnicodeDecodeError:
            continue
        new = rewrite(old, path)
        if path == "README.md":
            new = readme_row(new, warn)
        if path == "deltafind/store/__init__.py":
            new = STORE_INIT
        if new != old:
            changed[path] = new

    print(f"moves ({len(moves)}):")
    for src, dst in moves.items():
        print(f"  git mv {src} {dst}")
    print(f"rewritten ({len(changed)} files): {', '.join(sorted(changed))}")
    warn += [f"comments dropped from this import, put them back by hand if they matter:\n{d}" for d in DROPPED]
    if args.dry_run:
        for w in warn:
            print(f"WARNING: {w}")
        return 0

    for path, text in changed.items():
        (ROOT / path).write_text(text)
    (ROOT / "deltafind" / "importer").mkdir()
    (ROOT / "deltafind" / "importer" / "__init__.py").write_text(IMPORTER_INIT)
    for src, dst in moves.items():
        git("mv", src, dst)
    git("add", "deltafind/importer/__init__.py")
    for path, edits in TEXT_EDITS:
        p = ROOT / path
        text = p.read_text()
        for old, new in edits:
            if old in text:
                text = text.replace(old, new, 1)
            else:
                warn.append(f"{path}: did not find {old.strip()!r}; make this edit by hand: {new.strip()!r}")
        p.write_text(text)

    ruff = [sys.executable, "-m", "ruff"] if importlib.util.find_spec("ruff") else [shutil.which("ruff") or "ruff"]
    py = [p for p in (*changed, *moves.values()) if p.endswith(".py")]
    py = [moves.get(p, p) for p in py if (ROOT / moves.get(p, p)).exists()]
    sort = subprocess.run([*ruff, "check", "--select", "I", "--fix", "--quiet", *py], cwd=ROOT, capture_output=True, text=True)
    print(f"ruff: sorted the imports of {len(py)} Python files" + (f" ({sort.stdout.strip()})" if sort.returncode else ""))

    up = [f"{p.relative_to(ROOT)}:{line}" for p in sorted(store.glob("*.py")) for line in imports_importer(p)]
    warn += [f"the store imports the importer (move that file too, or split it): {u}" for u in up]
    for w in warn:
        print(f"WARNING: {w}")
    print("done; next: ruff check deltafind tests, the import test (tests/unit/test_daemon_service.py), then commit")
    return 1 if up else 0


if __name__ == "__main__":
    sys.exit(main())
