"""Logger sinks beside metrics.jsonl: `--log tensorboard[:DIR]` and `--log wandb[:PROJECT]`
(docs/training.md#tensorboard-and-weights--biases).

Every record the run writes to metrics.jsonl goes to each sink too, under the same keys,
nested ones joined by "/" ("stats/grad_norm/blocks.0.attn.wq.weight", a list's items by their
index: "stats/attn_entropy/blocks.0.attn/1"), at the record's step. The packages are optional
(extras `tensorboard`, `wandb`) and imported only when asked for.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError

KINDS = ("tensorboard", "wandb")


def parse_spec(spec: str) -> tuple[str, str | None]:
    """(kind, argument or None) of one --log value.

    >>> parse_spec("tensorboard"), parse_spec("wandb:my-project")
    (('tensorboard', None), ('wandb', 'my-project'))
    """
    kind, sep, arg = spec.partition(":")
    if kind not in KINDS:
        raise UserError(f"--log {spec}: the sinks are tensorboard[:DIR] and wandb[:PROJECT]")
    if sep and not arg:
        raise UserError(f"--log {spec}: give a {'folder' if kind == 'tensorboard' else 'project'} after the colon, or leave it out")
    return kind, arg or None


def flatten(record: dict, prefix: str = "") -> dict[str, float]:
    """The numbers of a metrics record under "/"-joined keys; 'step' and None values left out
    (True counts as 1.0).

    >>> flatten({"step": 3, "loss": 2.5, "skipped": True, "stats": {"attn_entropy": {"blocks.0.attn": [0.1, None]}}})
    {'loss': 2.5, 'skipped': 1.0, 'stats/attn_entropy/blocks.0.attn/0': 0.1}
    """
    out: dict[str, float] = {}
    for key, value in record.items():
        name = f"{prefix}{key}"
        if not prefix and key == "step" or value is None:
            continue
        if isinstance(value, dict):
            out.update(flatten(value, name + "/"))
        elif isinstance(value, (list, tuple)):
            out.update(flatten({str(i): v for i, v in enumerate(value)}, name + "/"))
        elif isinstance(value, (bool, int, float)):
            out[name] = float(value)
    return out


def _missing(extra: str, package: str) -> UserError:
    return UserError(f"--log {extra} needs the {package} package: pip install 'glassformer[{extra}]'")


class TensorBoardSink:
    """Scalars into TensorBoard event files in `folder`; a resumed run first drops the events
    after its checkpoint's step (they are about to be redone), as metrics.jsonl does."""

    def __init__(self, folder: Path, resumed_step: int | None):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            raise _missing("tensorboard", "tensorboard") from None
        self.writer = SummaryWriter(str(folder), purge_step=resumed_step + 1 if resumed_step else None)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, v in values.items():
            self.writer.add_scalar(key, v, global_step=step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    """A Weights & Biases run (WANDB_MODE=offline keeps it on disk) in the run folder's wandb/."""

    def __init__(self, project: str, folder: Path, config: dict):
        try:
            import wandb
        except ImportError:
            raise _missing("wandb", "wandb") from None
        self.run = wandb.init(project=project, dir=str(folder), config=config, name=folder.name)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self) -> None:
        self.run.finish()


def check_specs(specs: list[str]) -> None:
    """Each --log value parsed and its package found, before the run writes anything."""
    import importlib.util

    for kind, _ in (parse_spec(s) for s in specs):
        if importlib.util.find_spec(kind) is None:
            raise _missing(kind, kind)


def make_sinks(specs: list[str], run_folder: Path, config: dict, resumed_step: int | None) -> list:
    """The sinks of the --log values (each checked first, so a bad one fails before any is opened)."""
    parsed = [parse_spec(s) for s in specs]
    sinks = []
    for kind, arg in parsed:
        if kind == "tensorboard":
            sinks.append(TensorBoardSink(Path(arg) if arg else run_folder / "tb", resumed_step))
        else:
            sinks.append(WandbSink(arg or "glassformer", run_folder, config))
    return sinks


class LoggedMetrics:
    """metrics.jsonl and the sinks, behind MetricsLog's interface (write, close): every record
    the loop writes reaches each of them."""

    def __init__(self, metrics, sinks: list):
        self.metrics, self.sinks = metrics, sinks
        self.path = metrics.path

    def write(self, record: dict) -> None:
        self.metrics.write(record)
        values = flatten(record)
        for sink in self.sinks:
            sink.log(int(record.get("step", 0)), values)

    def close(self) -> None:
        self.metrics.close()
        for sink in self.sinks:
            sink.close()
