#!/usr/bin/env python3
"""The README's two set-up commands, for .ci/run.

  check_readme_commands.py commands              print the two commands of README.md's first bash block
  check_readme_commands.py after LOG1 LOG2       after .ci/run ran them (LOGn: the output of command n):
      the first built lily and the second did not (pip's own log lines), and the Metal checks' clang is the
      one pip installed into this environment, not a system clang.

Why a log check rather than a second fresh venv that runs everything again: CI has 2 cores and the build
alone takes ~4 minutes; .ci/run itself runs in a fresh venv, so one pass covers "fresh machine" and
"no rebuild" together.
"""
from __future__ import annotations

import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# pip prints this when it builds a wheel from the source tree ("Building wheel for lily (pyproject.toml)")
BUILD_LINE = re.compile(r"^\s*Building wheel for lily\b", re.M)


def readme_commands() -> list[str]:
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    m = re.search(r"```bash\n(.*?)```", text, re.S)
    if not m:
        raise SystemExit("README.md has no ```bash block with the set-up commands")
    cmds = [ln for ln in m.group(1).splitlines() if ln.strip() and not ln.lstrip().startswith("#")]
    if len(cmds) != 2:
        raise SystemExit(f"README.md's first bash block should hold two commands, found {len(cmds)}: {cmds}")
    return cmds


def check_after(log1: str, log2: str) -> list[str]:
    errors = []
    if not BUILD_LINE.search(open(log1, errors="replace").read()):
        errors.append(f"the first command's log ({log1}) has no 'Building wheel for lily' line: "
                      "pip's wording changed, so the no-rebuild check below would prove nothing")
    hit = BUILD_LINE.search(open(log2, errors="replace").read())
    if hit:
        errors.append(f"the second command rebuilt the extension ({log2}: {hit.group(0).strip()!r})")
    sys.path.insert(0, os.path.join(ROOT, "tools", "msl"))
    import mslc
    if os.environ.get("MSL_CLANG"):
        errors.append("MSL_CLANG is set: the check must use the clang that the README's commands install")
    elif not mslc.CLANG or not os.path.realpath(mslc.CLANG[0]).startswith(os.path.realpath(sys.prefix)):
        errors.append(f"the Metal checks' clang {mslc.CLANG} is not the one pip installed into {sys.prefix}")
    else:
        print("Metal checks' clang:", " ".join(mslc.CLANG))
    return errors


def main(argv: list[str]) -> int:
    if argv[:1] == ["commands"]:
        print("\n".join(readme_commands()))
        return 0
    if argv[:1] == ["after"] and len(argv) == 3:
        errors = check_after(argv[1], argv[2])
        for e in errors:
            print("FAIL:", e, file=sys.stderr)
        if not errors:
            print("README commands: the first built lily, the second did not rebuild it")
        return 1 if errors else 0
    print(__doc__, file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
