"""Token shards (text/shards.py) in llm.c's format, read back by a reader written from that format's
description alone, and a ShardSet read as one array by the batch rule."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from glassformer.errors import UserError
from glassformer.text.data import get_batch
from glassformer.text.shards import ShardSet, read_header, shard_name, write_shard

from ..support import llmc_read


@pytest.mark.parametrize("dtype,top", [("uint16", 65535), ("uint32", 200_000)])
def test_a_shard_reads_back_in_llmcs_format(tmp_path, dtype, top):
    ids = np.random.default_rng(0).integers(0, top, 1234)
    write_shard(tmp_path / "s.bin", ids, dtype)
    assert (llmc_read(tmp_path / "s.bin") == ids).all()
    assert read_header(tmp_path / "s.bin") == (dtype, 1234)


def test_a_shard_set_reads_as_one_array_and_batches_as_one_file(tmp_path):
    ids = np.random.default_rng(1).integers(0, 500, 1000).astype(np.uint16)
    cuts = [0, 300, 301, 700, 1000]  # a one-id shard too
    paths = []
    for i, (a, b) in enumerate(zip(cuts, cuts[1:])):
        paths.append(tmp_path / shard_name("train", i))
        write_shard(paths[-1], ids[a:b], "uint16")
    s = ShardSet(paths)
    assert len(s) == 1000 and s.array is s
    for a, b in [(0, 1000), (299, 302), (250, 750), (999, 1000), (5, 5)]:
        assert (s[a:b] == ids[a:b]).all()
    assert s[300] == ids[300] and s[-1] == ids[-1]
    for step in range(3):
        for rank in range(2):
            got, want = get_batch(s, 8, 32, 0, step, rank, 2), get_batch(ids, 8, 32, 0, step, rank, 2)
            assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


def test_a_bad_shard_is_one_line_naming_it(tmp_path):
    write_shard(tmp_path / "ok.bin", np.arange(10), "uint16")
    raw = (tmp_path / "ok.bin").read_bytes()
    (tmp_path / "magic.bin").write_bytes(b"\x01\x02\x03\x04" + raw[4:])
    (tmp_path / "cut.bin").write_bytes(raw[:-2])
    (tmp_path / "tiny.bin").write_bytes(raw[:100])
    for name, words in [("magic.bin", "magic"), ("cut.bin", "counts 10 ids"), ("tiny.bin", "shorter")]:
        with pytest.raises(UserError, match=words) as e:
            read_header(tmp_path / name)
        assert name in str(e.value) and "\n" not in str(e.value)


def test_check_ids_names_the_shard_and_the_position_in_it(tmp_path):
    from glassformer.text.data import check_ids

    paths = [tmp_path / shard_name("train", i) for i in range(2)]
    write_shard(paths[0], np.arange(100) % 50, "uint16")
    bad = np.arange(80) % 50
    bad[7], bad[60] = 300, 900
    write_shard(paths[1], bad, "uint16")
    with pytest.raises(UserError, match=r"train_000001\.bin holds token id 900 \(first bad one at position 7\)"):
        check_ids(ShardSet(paths), 256)
    check_ids(ShardSet(paths), 901)
