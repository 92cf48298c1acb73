#!/usr/bin/env python3
"""Every `lbagent` command the book and the README show must still parse:
collect each command (in code blocks and inline code: `lbagent SUB [SUB2]`
or `cargo run --release -- SUB ...`), then run `BIN SUB [SUB2] --help` for
each distinct one; exit 1 naming those that fail.

  tools/docs/commands.py BIN         run them
  tools/docs/commands.py --list      print them only
"""
import re, subprocess, sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# design/layout.md is a file tree ("the lbagent package: ..."), not commands.
FILES = sorted(p for p in (ROOT / "docs/src").rglob("*.md") if p.name != "layout.md") + [ROOT / "README.md", ROOT / "CONTRIBUTING.md"]
START = re.compile(r"(?:^|[\s`$(])(?:lbagent|cargo run --release --)\s+([a-z][a-z-]*)(?:\s+([a-z][a-z-]*))?(?=[\s`]|$)")
SUBS2 = {"route", "qpstest"}  # subcommands with subcommands of their own


def commands():
    found = {}
    for f in FILES:
        text = f.read_text()
        chunks = re.findall(r"^```[a-z]*\n(.*?)^```", text, re.S | re.M)
        chunks += re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M))
        for chunk in chunks:
            for line in chunk.splitlines():
                for m in START.finditer(line):
                    sub, sub2 = m.group(1), m.group(2)
                    cmd = (sub, sub2) if sub in SUBS2 and sub2 else (sub,)
                    found.setdefault(cmd, f.relative_to(ROOT))
    return found


def main():
    found = commands()
    if sys.argv[1:] == ["--list"]:
        for cmd, where in sorted(found.items()):
            print(" ".join(cmd), "\t", where)
        return
    binary = sys.argv[1]
    bad = 0
    for cmd, where in sorted(found.items()):
        r = subprocess.run([binary, *cmd, "--help"], capture_output=True, text=True)
        if r.returncode != 0:
            bad += 1
            err = (r.stderr or r.stdout).strip().splitlines()[:1]
            print(f"{where}: `lbagent {' '.join(cmd)} --help` failed ({r.returncode}): {' '.join(err)}", file=sys.stderr)
    if bad:
        sys.exit(1)
    print(f"commands: {len(found)} distinct lbagent commands in the book and the README, each --help parses")


if __name__ == "__main__":
    main()
