"""A built wheel carries every file the package needs at run time, the page's static files too."""

import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_contains_every_package_file(tmp_path):
    try:
        import setuptools  # noqa: F401
        import wheel  # noqa: F401
    except ImportError:
        pytest.skip("setuptools and wheel are needed to build the wheel offline")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    str(ROOT), "-w", str(tmp_path)], check=True, capture_output=True)
    (whl,) = tmp_path.glob("glassformer-*.whl")
    names = set(zipfile.ZipFile(whl).namelist())
    src = ROOT / "src"
    wanted = {p.relative_to(src).as_posix() for p in (src / "glassformer").rglob("*")
              if p.is_file() and "__pycache__" not in p.parts and not p.name.endswith(".pyc")}
    assert wanted - names == set()
    assert any(n.startswith("glassformer/viewer/static/") for n in names)
    entry = zipfile.ZipFile(whl).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "glassformer = glassformer.cli:console" in entry
