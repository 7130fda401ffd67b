"""Run the teaching notebooks (notebooks/*.ipynb) top to bottom through nbclient.

    python scripts/run_notebooks.py                 # full length (`make notebooks`)
    python scripts/run_notebooks.py --fast 02 05    # GLASSFORMER_NOTEBOOK_FAST=1, only these
    python scripts/run_notebooks.py --clear         # strip outputs from the committed notebooks

Each notebook runs in a working folder of its own (OUT/<name>/, where it writes its run folders and
pages), on the `python3` kernel of the Python running this script, and its executed copy is written
to OUT/<name>.ipynb. The committed notebooks are never changed. Exits 1 if any cell raised.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
FAST_VAR = "GLASSFORMER_NOTEBOOK_FAST"


def notebook_paths(names: list[str] | None = None) -> list[Path]:
    """The committed notebooks, in order; `names` keeps those whose file name starts with one of them."""
    paths = sorted(NOTEBOOKS.glob("[0-9][0-9]-*.ipynb"))
    if names:
        paths = [p for p in paths if any(p.name.startswith(n) for n in names)]
    return paths


def run_notebook(nb, workdir: Path, *, fast: bool, timeout: int = 900):
    """Execute a notebook (an nbformat node, filled with outputs in place) in `workdir`; raises
    nbclient's CellExecutionError at the first cell that raises.

    The kernel inherits this process's environment, so the fast switch is set here for the
    kernel's start and put back afterwards."""
    from nbclient import NotebookClient

    workdir.mkdir(parents=True, exist_ok=True)
    old = os.environ.get(FAST_VAR)
    os.environ[FAST_VAR] = "1" if fast else "0"
    try:
        # kernel_name python3 is ipykernel's spec installed with the package (sys.prefix/share/jupyter),
        # which jupyter_client starts with this very interpreter.
        client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                                resources={"metadata": {"path": str(workdir)}})
        client.execute()
    finally:
        if old is None:
            os.environ.pop(FAST_VAR, None)
        else:
            os.environ[FAST_VAR] = old


def clear_outputs(path: Path) -> bool:
    """Remove every output and execution count from a notebook file; True if it changed."""
    import nbformat

    nb = nbformat.read(path, as_version=4)
    changed = False
    for cell in nb.cells:
        if cell.cell_type == "code" and (cell.outputs or cell.execution_count is not None):
            cell.outputs, cell.execution_count, changed = [], None, True
    if changed:
        nbformat.write(nb, path)
    return changed


def main(argv: list[str] | None = None) -> int:
    import nbformat
    from nbclient.exceptions import CellExecutionError

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("names", nargs="*", help="run only notebooks whose file name starts with one of these (e.g. 02)")
    ap.add_argument("--fast", action="store_true", help=f"set {FAST_VAR}=1: tiny presets, few steps")
    ap.add_argument("--out", default=str(ROOT / "notebooks-out"), help="executed copies and working folders")
    ap.add_argument("--clear", action="store_true", help="strip outputs from the committed notebooks instead of running them")
    args = ap.parse_args(argv)
    if args.clear:
        for path in notebook_paths(args.names):
            print(f"{path.name}: {'cleared' if clear_outputs(path) else 'clean'}")
        return 0
    out = Path(args.out)
    failed = []
    for path in notebook_paths(args.names):
        t0 = time.perf_counter()
        nb = nbformat.read(path, as_version=4)
        try:
            run_notebook(nb, out / path.stem, fast=args.fast)
            status = "ok"
        except CellExecutionError as e:
            status = "FAILED"
            failed.append(path.name)
            print(str(e)[-3000:], file=sys.stderr)
        nbformat.write(nb, out / path.name)  # a failed one too: its outputs up to the failing cell
        print(f"{path.name}: {status} in {time.perf_counter() - t0:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
