"""Write a ShareGPT-format training corpus of Python source code from the CPython standard library, for
``cats train data --answers given`` (teacher-forced hidden states over existing text).

Each entry asks for one part of one standard-library module and answers with that part's source, fenced as Python:
the text the target reads is real code in the chat format it answers in. Licence of the text: the Python Software
Foundation License 2.0 (permissive; the interpreter ships it as ``LICENSE.txt`` beside the library, and this script
copies it next to its output). Files are split into parts of at most ``--part-chars`` characters at line ends.

Entries are ordered by a hash of (file, part), so any prefix of the output (``cats train data --limit N``) is a
random mix of modules. A file whose path hashes into the last ``--held-out`` per mille goes to the held-out file
instead, never to the training file: held-out evaluation reads modules no training sample came from.

    python benchmarks/stdlib_corpus.py --out ~/.cache/cats/corpus
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
import sysconfig
from pathlib import Path

SKIPPED_FOLDERS = {"test", "tests", "idlelib", "site-packages", "__pycache__", "lib2to3", "turtledemo", "ensurepip"}


def _key(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little")


def parts_of(source: str, part_chars: int) -> list[str]:
    """``source`` cut at line ends into parts of at most ``part_chars`` characters (a longer line is its own part)."""
    parts, current = [], ""
    for line in source.splitlines(keepends=True):
        if current and len(current) + len(line) > part_chars:
            parts.append(current)
            current = ""
        current += line
    if current.strip():
        parts.append(current)
    return [part for part in parts if part.strip()]


def entry(relative: str, index: int, count: int, part: str) -> dict:
    where = f"part {index + 1} of {count} of " if count > 1 else ""
    question = f"Show me {where}the Python standard library module `{relative}`."
    answer = f"```python\n{part.rstrip()}\n```"
    return {"id": f"{relative}#{index}", "conversations": [{"from": "human", "value": question},
                                                           {"from": "gpt", "value": answer}]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--source", type=Path, default=Path(sysconfig.get_paths()["stdlib"]),
                        help="standard library folder (default: this interpreter's)")
    parser.add_argument("--out", type=Path, required=True, help="output folder")
    parser.add_argument("--part-chars", type=int, default=1600)
    parser.add_argument("--held-out", type=int, default=50, help="per mille of files held out (default 50)")
    args = parser.parse_args(argv)
    files = sorted(path for path in args.source.rglob("*.py")
                   if not SKIPPED_FOLDERS.intersection(path.relative_to(args.source).parts[:-1]))
    train, held_out = [], []
    for path in files:
        relative = path.relative_to(args.source).as_posix()
        try:
            source = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        parts = parts_of(source, args.part_chars)
        into = held_out if _key(relative) % 1000 < args.held_out else train
        into.extend((_key(f"{relative}#{i}"), entry(relative, i, len(parts), part)) for i, part in enumerate(parts))
    args.out.mkdir(parents=True, exist_ok=True)
    for name, entries in (("stdlib-train.json", train), ("stdlib-heldout.json", held_out)):
        (args.out / name).write_text(json.dumps([e for _, e in sorted(entries, key=lambda item: item[0])]) + "\n")
    licence = args.source / "LICENSE.txt"
    if licence.is_file():
        shutil.copyfile(licence, args.out / "LICENSE-Python.txt")
    version = sys.version.split()[0]
    (args.out / "README.md").write_text(
        f"# Python standard library corpus\n\n"
        f"- Source: the `.py` files of the CPython {version} standard library in `{args.source}` ({len(files)} files; "
        f"folders {', '.join(sorted(SKIPPED_FOLDERS))} left out).\n"
        f"- Licence: Python Software Foundation License 2.0 (permissive), copied as `LICENSE-Python.txt`.\n"
        f"- Made by `python benchmarks/stdlib_corpus.py --out {args.out} --part-chars {args.part_chars} "
        f"--held-out {args.held_out}` (CATS): ShareGPT JSON, one entry per part of at most {args.part_chars} "
        f"characters; a human turn asking for that part of the module and a `gpt` turn with its source.\n"
        f"- `stdlib-train.json`: {len(train)} parts; `stdlib-heldout.json`: {len(held_out)} parts of other files "
        f"(about {args.held_out / 10:g} % of the files, chosen by a hash of their path).\n")
    print(f"{args.out}: {len(train)} training parts, {len(held_out)} held-out parts from {len(files)} files of "
          f"Python {sys.version.split()[0]} ({args.source})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
