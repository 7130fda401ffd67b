"""`python -m glassformer.harness ARGS`: the harness's own command line (`lm_eval ARGS`) with the
model name `glassformer` registered first, for harness versions that do not read the
`lm_eval.models` entry point (docs/eval.md#the-harnesss-command-line-and-python-api)."""

from __future__ import annotations


def main() -> None:
    from lm_eval.__main__ import cli_evaluate

    from . import lm  # noqa: F401  (registers `glassformer`)

    cli_evaluate()


if __name__ == "__main__":
    main()
