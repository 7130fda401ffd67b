"""--log sinks: TensorBoard's event files, read back by tensorboard's own reader, hold the values
metrics.jsonl holds under the same keys; so does wandb's offline run log, read back through wandb's
own protobuf records; bad values refused."""

from __future__ import annotations

import importlib.util

import pytest

from glassformer.cli import main
from glassformer.errors import UserError
from glassformer.train.loggers import check_specs, flatten, parse_spec
from glassformer.train.metrics import read_metrics

from ..support import data  # noqa: F401  (a fixture)

ARGS = ["--preset", "tiny", "--max-steps", "4", "--batch-size", "4", "--seq-len", "32", "--eval-every", "2",
        "--eval-tokens", "256", "--log-every", "1", "--warmup-steps", "2", "--no-progress", "--seed", "2",
        "--threads", "1", "--stats-every", "2"]


def jsonl_values(run) -> dict[str, dict[int, float]]:
    """metrics.jsonl as tag -> {step: value}, flattened as the sinks flatten it."""
    out: dict[str, dict[int, float]] = {}
    for rec in read_metrics(run / "metrics.jsonl"):
        for key, v in flatten(rec).items():
            out.setdefault(key, {})[rec["step"]] = v
    return out


@pytest.mark.skipif(importlib.util.find_spec("tensorboard") is None, reason="the tensorboard extra is not installed")
def test_tensorboard_events_hold_the_jsonl_values(data, tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(out), *ARGS, "--log", "tensorboard"]) == 0
    acc = EventAccumulator(str(out / "tb"), size_guidance={"scalars": 0})
    acc.Reload()
    want = jsonl_values(out)
    for key in ("loss", "lr", "grad_norm", "val_loss", "val_bpb", "stats/grad_norm/blocks.1.ffn.w_down.weight",
                "stats/update_rms_ratio/embed.weight", "stats/stream_rms/blocks.0.resid_out",
                "stats/attn_entropy/blocks.1.attn/0"):
        assert key in want, key
    assert set(acc.Tags()["scalars"]) == set(want)
    for tag, by_step in want.items():
        got = {e.step: e.value for e in acc.Scalars(tag)}
        assert got.keys() == by_step.keys(), tag
        assert got == pytest.approx(by_step, rel=1e-6), tag  # the events hold float32


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None, reason="the wandb extra is not installed")
def test_wandb_offline_run(data, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(out), *ARGS, "--log", "wandb:glassformer-test"]) == 0
    # run.finish() can return before wandb's service process has written the run's log (it was seen
    # holding only its 7-byte header); teardown waits for that process to exit, as the command line's
    # exit does through wandb's atexit hook.
    import wandb

    wandb.teardown()
    log, = (out / "wandb").glob("offline-run-*/run-*.wandb")
    got: dict[str, dict[int, float]] = {}
    for items in wandb_history(log):
        step = items.pop("_step")
        for key, v in items.items():
            if not key.startswith("_"):  # wandb's own _runtime, _timestamp
                got.setdefault(key, {})[step] = v
    want = jsonl_values(out)
    assert "stats/grad_norm/blocks.1.ffn.w_down.weight" in want and set(got) == set(want)
    for tag, by_step in want.items():
        assert got[tag] == pytest.approx(by_step, rel=1e-9), tag


def wandb_history(path) -> list[dict]:
    """The history rows of an offline run's transaction log, parsed by wandb's own protobuf Record:
    the file is a 7-byte header, then LevelDB's log format (32 KiB blocks of records, each a
    4-byte checksum, 2-byte length, 1-byte type: 1 whole, 2 first, 3 middle, 4 last piece)."""
    import json
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    raw, off, piece, rows = path.read_bytes(), 7, b"", []
    while off + 7 <= len(raw):
        if 32768 - off % 32768 < 7:  # a block's tail too short for a record header is padding
            off += 32768 - off % 32768
            continue
        _, length, kind = struct.unpack("<IHB", raw[off:off + 7])
        data, off = raw[off + 7:off + 7 + length], off + 7 + length
        if kind == 0:  # zero padding to the block's end
            off += -off % 32768
            continue
        piece = data if kind in (1, 2) else piece + data
        if kind in (1, 4):
            rec = pb.Record()
            rec.ParseFromString(piece)
            if rec.WhichOneof("record_type") == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item})
    return rows


def test_bad_values_are_refused():
    assert parse_spec("tensorboard:logs/tb") == ("tensorboard", "logs/tb")
    for bad in ("tensorbord", "wandb:", "csv:x"):
        with pytest.raises(UserError, match="--log"):
            parse_spec(bad)


@pytest.mark.skipif(importlib.util.find_spec("wandb") is not None, reason="wandb is installed here")
def test_a_missing_package_names_its_extra(data, tmp_path, capsys):
    with pytest.raises(UserError, match=r"glassformer\[wandb\]"):
        check_specs(["wandb"])
    out = tmp_path / "run"
    assert main(["train", "--data", str(data), "--out", str(out), *ARGS, "--log", "wandb"]) == 2
    assert "glassformer[wandb]" in capsys.readouterr().err
    assert not (out / "metrics.jsonl").exists()  # refused before the run wrote anything
