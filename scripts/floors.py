#!/usr/bin/env python3
"""The dependency floors pyproject.toml declares, and whether an environment is at them.

A floor is a requirement's ``>=`` version, in the core dependencies or any extra; a ``==`` pin
(llama-cpp-python) is exact, not a floor, and is left to the target that installs it.

    floors.py --check [PYTHON]     one line per package; exit 0: every installed version is its floor
                                   (a suite run there ran on the floors), 1: some is newer (a run at
                                   the floors is still needed), 2: some is older or missing
    floors.py --constraints FILE   writes name==floor lines, a pip constraints file
    floors.py --requirement NAME   prints NAME>=floor, for an install line (the Makefile's torch)

Versions compare by their public part: torch 2.13.0+cpu is at a floor of 2.13.0. Standard library
only, so the Makefile can run it with the interpreter that builds the venvs.
"""

import argparse
import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = ROOT / "pyproject.toml"

_REQUIREMENT = re.compile(r"^\s*([A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?)\s*(?:\[[^\]]*\])?\s*(.*)$")
_SPECIFIER = re.compile(r"^\s*(===|==|!=|~=|>=|<=|>|<)\s*([^\s,]+)\s*$")
_VERSION = re.compile(r"^v?(\d+(?:\.\d+)*)(.*)$", re.IGNORECASE)
_PRE = re.compile(r"^[-_.]?(a|alpha|b|beta|c|rc|pre|preview)[-_.]?(\d*)", re.IGNORECASE)
_POST = re.compile(r"^(?:[-_.]?(?:post|rev|r)[-_.]?(\d*)|-(\d+))", re.IGNORECASE)
_DEV = re.compile(r"^[-_.]?dev[-_.]?(\d*)$", re.IGNORECASE)
_PRE_RANK = {"a": 0, "alpha": 0, "b": 1, "beta": 1, "c": 2, "rc": 2, "pre": 2, "preview": 2}


class FloorsError(Exception):
    """A pyproject.toml or a version this script cannot read; its text is the one line to print."""


def normalize(name: str) -> str:
    """PEP 503's name: lower case, runs of - _ . as one -, so lm_eval and LM-Eval are one package."""
    return re.sub(r"[-_.]+", "-", name).lower()


def version_key(version: str) -> tuple:
    """An ordering key for a PEP 440 version's public part (its +local part dropped).

    Trailing zeros do not count (3.1 == 3.1.0); a dev release sorts before its pre-releases, those
    before the release, the release before its post-releases."""
    public = version.strip().split("+", 1)[0]
    m = _VERSION.match(public)
    if not m:
        raise FloorsError(f"cannot read the version {version!r}")
    release = [int(x) for x in m.group(1).split(".")]
    while len(release) > 1 and release[-1] == 0:
        release.pop()
    rest = m.group(2)
    pre, post, dev = (3, 0), (-1, 0), (1, 0)  # no pre-release sorts after any; no post before any
    if p := _PRE.match(rest):
        pre, rest = (_PRE_RANK[p.group(1).lower()], int(p.group(2) or 0)), rest[p.end():]
    if p := _POST.match(rest):
        post, rest = (0, int(p.group(1) or p.group(2) or 0)), rest[p.end():]
    if p := _DEV.match(rest):
        dev, rest = (0, int(p.group(1) or 0)), ""
        if pre == (3, 0) and post == (-1, 0):
            pre = (-1, 0)  # 1.0.dev1 comes before 1.0a1
    if rest:
        raise FloorsError(f"cannot read the version {version!r}")
    return tuple(release), pre, post, dev


def parse_requirement(text: str) -> tuple[str, str | None, str | None]:
    """(normalized name, its >= floor or None, its == pin or None) of one PEP 508 line.

    Environment markers (after ;) do not change a floor: the floor holds wherever it applies."""
    m = _REQUIREMENT.match(text.split(";", 1)[0])
    if not m:
        raise FloorsError(f"cannot read the requirement {text!r}")
    floor = pin = None
    specifiers = m.group(2).strip()
    for part in specifiers.split(",") if specifiers else []:
        s = _SPECIFIER.match(part)
        if not s:
            raise FloorsError(f"cannot read the requirement {text!r}")
        op, version = s.groups()
        if op == ">=":
            floor = version
        elif op == "==" and "*" not in version:
            pin = version
    return normalize(m.group(1)), floor, pin


def requirements(pyproject: dict) -> list[tuple[str, str]]:
    """(group, requirement) for every declared dependency: group "" is the core, else the extra."""
    project = pyproject.get("project", {})
    found = [("", r) for r in project.get("dependencies", [])]
    for extra, reqs in project.get("optional-dependencies", {}).items():
        found += [(extra, r) for r in reqs]
    return found


def floors(pyproject: dict) -> dict[str, str]:
    """{normalized name: floor} over the core dependencies and every extra.

    A dependency must declare a floor (>=) or a pin (==), and one package must have one floor in
    every group that names it: otherwise which version is tested would depend on what is installed."""
    result: dict[str, str] = {}
    where: dict[str, str] = {}
    for group, text in requirements(pyproject):
        name, floor, pin = parse_requirement(text)
        label = f"[{group}]" if group else "dependencies"
        if floor is None and pin is None:
            raise FloorsError(f"pyproject.toml: {text!r} in {label} declares no floor (>=) or pin (==)")
        if floor is None:
            continue
        if name in result and version_key(result[name]) != version_key(floor):
            raise FloorsError(f"pyproject.toml: {name} has the floor {result[name]} in {where[name]} "
                              f"but {floor} in {label}; give it one floor")
        result.setdefault(name, floor)
        where.setdefault(name, label)
    return result


def read_floors(path: Path = PYPROJECT) -> dict[str, str]:
    try:
        with open(path, "rb") as f:
            return floors(tomllib.load(f))
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise FloorsError(f"cannot read {path}: {e}") from None


_INSTALLED = """
import importlib.metadata as m, json, sys
out = {}
for name in json.loads(sys.argv[1]):
    try:
        out[name] = m.version(name)
    except m.PackageNotFoundError:
        out[name] = None
print(json.dumps(out))
"""


def installed_versions(names: list[str], python: str | None = None) -> dict[str, str | None]:
    """{name: installed version or None} in this interpreter, or in the one at `python`."""
    if python is None:
        import importlib.metadata as metadata
        result = {}
        for name in names:
            try:
                result[name] = metadata.version(name)
            except metadata.PackageNotFoundError:
                result[name] = None
        return result
    try:
        done = subprocess.run([python, "-c", _INSTALLED, json.dumps(names)],
                              capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError) as e:
        detail = getattr(e, "stderr", None) or str(e)
        raise FloorsError(f"cannot ask {python} for its packages: {detail.strip().splitlines()[-1]}") from None
    return json.loads(done.stdout)


def check(floor_of: dict[str, str], installed: dict[str, str | None]) -> tuple[int, list[str]]:
    """(exit code, one line per package): 0 all at their floors, 1 some newer, 2 some older or missing."""
    lines, code = [], 0
    for name in sorted(floor_of):
        floor, have = floor_of[name], installed.get(name)
        if have is None:
            lines.append(f"{name}: missing (floor {floor})")
            code = 2
            continue
        have_key, floor_key = version_key(have), version_key(floor)
        if have_key == floor_key:
            lines.append(f"{name} {have}: at its floor")
        elif have_key > floor_key:
            lines.append(f"{name} {have}: newer than its floor {floor}")
            code = max(code, 1)
        else:
            lines.append(f"{name} {have}: older than its floor {floor}")
            code = 2
    return code, lines


def constraints(floor_of: dict[str, str]) -> str:
    """A pip constraints file holding every package at its floor."""
    return "".join(f"{name}=={floor_of[name]}\n" for name in sorted(floor_of))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--check", nargs="?", const="", metavar="PYTHON",
                        help="compare the floors with what PYTHON (default: this interpreter) has installed")
    action.add_argument("--constraints", metavar="FILE", help="write name==floor lines to FILE")
    action.add_argument("--requirement", metavar="NAME", help="print NAME>=floor")
    parser.add_argument("--pyproject", type=Path, default=PYPROJECT, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        floor_of = read_floors(args.pyproject)
        if args.requirement is not None:
            name = normalize(args.requirement)
            if name not in floor_of:
                raise FloorsError(f"pyproject.toml declares no floor for {args.requirement}")
            print(f"{name}>={floor_of[name]}")
            return 0
        if args.constraints is not None:
            Path(args.constraints).write_text(constraints(floor_of))
            return 0
        names = sorted(floor_of)
        code, lines = check(floor_of, installed_versions(names, args.check or None))
    except FloorsError as e:
        print(f"floors: {e}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    where = args.check or sys.executable
    print({0: f"{where}: every dependency is at its declared floor",
           1: f"{where}: some dependencies are newer than their floors; the floors need a run of their own",
           2: f"{where}: some dependencies are older than their floors or missing (see above)"}[code])
    return code


if __name__ == "__main__":
    sys.exit(main())
