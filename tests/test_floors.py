"""scripts/floors.py reads pyproject.toml's dependency floors and tells whether an environment is at
them (`make test-floors`); and the source needs no newer torch than the declared floor."""

import importlib.util
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("floors", REPO / "scripts" / "floors.py")
floors = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(floors)

PYPROJECT = """\
[project]
name = "x"
dependencies = [
  "torch>=2.13.0",
  "Jinja2 >= 3.1.6",  # a comment, as pyproject.toml's own
  "numpy>=2.0,<3; python_version >= '3.11'",
]

[project.optional-dependencies]
hf = ["transformers[torch]>=5.25.0", "huggingface_hub>=2.4.0"]
llamacpp = ["llama-cpp-python==0.3.36"]
dev = ["pytest>=9.2", "transformers>=5.25"]
"""


def write(tmp_path, text=PYPROJECT):
    path = tmp_path / "pyproject.toml"
    path.write_text(text)
    return path


def test_floors_come_from_the_core_and_every_extra():
    got = floors.floors(tomllib.loads(PYPROJECT))
    assert got == {"torch": "2.13.0", "jinja2": "3.1.6", "numpy": "2.0", "transformers": "5.25.0",
                   "huggingface-hub": "2.4.0", "pytest": "9.2"}  # the pin is not a floor


@pytest.mark.parametrize("text, name, floor, pin", [
    ("torch>=2.13.0", "torch", "2.13.0", None),
    ("lm_eval >= 0.4.13", "lm-eval", "0.4.13", None),
    ("transformers[torch,sentencepiece]>=5.25.0", "transformers", "5.25.0", None),
    ("numpy>=2.0,<3; python_version >= '3.11'", "numpy", "2.0", None),  # the marker's >= is not the floor
    ("llama-cpp-python==0.3.36", "llama-cpp-python", None, "0.3.36"),
    ("foo", "foo", None, None),
])
def test_parse_requirement(text, name, floor, pin):
    assert floors.parse_requirement(text) == (name, floor, pin)


def test_a_dependency_without_a_floor_is_named():
    with pytest.raises(floors.FloorsError, match=r"'tqdm' in \[dev\] declares no floor"):
        floors.floors(tomllib.loads('[project]\ndependencies = []\n[project.optional-dependencies]\ndev = ["tqdm"]\n'))


def test_two_floors_for_one_package_are_named():
    text = '[project]\ndependencies = ["torch>=2.13"]\n[project.optional-dependencies]\ndev = ["torch>=2.8"]\n'
    with pytest.raises(floors.FloorsError, match=r"torch has the floor 2.13 in dependencies but 2.8 in \[dev\]"):
        floors.floors(tomllib.loads(text))


@pytest.mark.parametrize("a, b", [("2.13.0+cpu", "2.13.0"), ("3.1", "3.1.0"), ("1.0", "1")])
def test_versions_equal_by_their_public_part(a, b):
    assert floors.version_key(a) == floors.version_key(b)


def test_versions_order():
    ordered = ["1.0.dev1", "1.0a1", "1.0b2", "1.0rc1", "1.0", "1.0+cu121", "1.0.post1", "1.0.1", "1.1", "1.10"]
    keys = [floors.version_key(v) for v in ordered]
    assert all(keys[i] <= keys[i + 1] for i in range(len(keys) - 1))
    assert keys[4] == keys[5] and keys.count(keys[4]) == 2


def test_an_unreadable_version_is_named():
    with pytest.raises(floors.FloorsError, match="cannot read the version 'latest'"):
        floors.version_key("latest")


FLOORS = {"torch": "2.13.0", "numpy": "2.4.6"}


@pytest.mark.parametrize("installed, code, line", [
    ({"torch": "2.13.0+cpu", "numpy": "2.4.6"}, 0, "torch 2.13.0+cpu: at its floor"),
    ({"torch": "2.14.0", "numpy": "2.4.6"}, 1, "torch 2.14.0: newer than its floor 2.13.0"),
    ({"torch": "2.12.1", "numpy": "2.5.0"}, 2, "torch 2.12.1: older than its floor 2.13.0"),
    ({"torch": "2.14.0", "numpy": None}, 2, "numpy: missing (floor 2.4.6)"),
])
def test_check_exit_codes(installed, code, line):
    got, lines = floors.check(FLOORS, installed)
    assert got == code
    assert line in lines and len(lines) == 2


def test_constraints_pin_every_floor(tmp_path):
    out = tmp_path / "constraints.txt"
    assert floors.main(["--pyproject", str(write(tmp_path)), "--constraints", str(out)]) == 0
    assert out.read_text().splitlines() == ["huggingface-hub==2.4.0", "jinja2==3.1.6", "numpy==2.0",
                                            "pytest==9.2", "torch==2.13.0", "transformers==5.25.0"]


def test_requirement_prints_the_install_line(tmp_path, capsys):
    assert floors.main(["--pyproject", str(write(tmp_path)), "--requirement", "torch"]) == 0
    assert capsys.readouterr().out == "torch>=2.13.0\n"
    assert floors.main(["--pyproject", str(write(tmp_path)), "--requirement", "scipy"]) == 2
    assert capsys.readouterr().err == "floors: pyproject.toml declares no floor for scipy\n"


def test_check_asks_another_interpreter(tmp_path):
    """The PYTHON argument is asked in a process of its own; here it is this interpreter, with pytest
    at, under and over its installed version, and a package that is not installed."""
    import importlib.metadata
    have = importlib.metadata.version("pytest")
    for floor_line, code in [(f"pytest>={have}", 0), ("pytest>=0.1", 1), ("pytest>=999", 2),
                             ("no-such-package-here>=1.0", 2)]:
        path = write(tmp_path, f'[project]\ndependencies = ["{floor_line}"]\n')
        done = subprocess.run([sys.executable, str(REPO / "scripts" / "floors.py"), "--pyproject", str(path),
                               "--check", sys.executable], capture_output=True, text=True)
        assert done.returncode == code, (floor_line, done.stdout, done.stderr)


# ----------------------------------------------------------------------------- this project's floors

def project():
    return tomllib.loads((REPO / "pyproject.toml").read_text())


def test_the_test_venv_holds_every_floor():
    """`make test` installs .[dev]: every extra's floored package must be in dev, or the floors check
    of that venv would find it missing and nothing would have tested its floor."""
    groups = project()["project"]["optional-dependencies"]
    dev = {floors.parse_requirement(r)[0] for r in groups["dev"]}
    for extra, reqs in groups.items():
        for r in reqs:
            name, floor, _ = floors.parse_requirement(r)
            assert floor is None or name in dev, f"{name} (extra {extra}) has a floor but is not in dev"


# Features the source uses that arrived in a given torch release, found by the name the source uses.
TORCH_FEATURES = {
    "guard_filter_fn": "2.8",  # torch.compile's options (generation/compiled.py)
}


@pytest.mark.parametrize("feature", sorted(TORCH_FEATURES))
def test_the_torch_floor_covers_the_features_used(feature):
    users = [p.relative_to(REPO).as_posix() for p in (REPO / "src").rglob("*.py")
             if re.search(rf"\b{feature}\b", p.read_text())]
    if not users:
        pytest.skip(f"the source no longer uses {feature}")
    floor = floors.floors(project())["torch"]
    assert floors.version_key(floor) >= floors.version_key(TORCH_FEATURES[feature]), \
        f"{', '.join(users)} use {feature}, which needs torch {TORCH_FEATURES[feature]}; the floor is {floor}"


def test_the_makefile_takes_the_torch_floor_from_pyproject():
    assert not re.search(r"torch\s*>=", (REPO / "Makefile").read_text())
    ci = (REPO / ".ci" / "run").read_text().splitlines()
    assert ci.index("make test-floors") > ci.index("make test")
