"""Conversation data: JSONL reading and its bad input, masks, whole-conversation windows,
`prepare --chat` (token files, loss masks, meta.json's "chat")."""

from __future__ import annotations

import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest

from glassformer.cli import main
from glassformer.errors import UserError
from glassformer.text import conversations as C
from glassformer.text.chat_template import CHAT_TOKENS, CHATML_TEMPLATE
from glassformer.text.data import TokenFile, get_batch, read_meta
from glassformer.text.tokenizer import Tokenizer

from ..support import WORDS


def conversation(rng: random.Random, turns: int = 2, system: bool = False) -> dict:
    """A user line of a few words; the assistant echoes it after "yes," (a pattern a tiny model learns)."""
    msgs = [{"role": "system", "content": "be brief"}] if system else []
    for _ in range(turns):
        line = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 5)))
        msgs += [{"role": "user", "content": line}, {"role": "assistant", "content": "yes, " + line}]
    return {"messages": msgs}


def write_jsonl(path: Path, n: int, seed: int = 0, **kw) -> Path:
    rng = random.Random(seed)
    path.write_text("".join(json.dumps(conversation(rng, rng.randint(1, 3), **kw)) + "\n" for _ in range(n)))
    return path


def chat_tokenizer() -> Tokenizer:
    rng = random.Random(5)
    tok = Tokenizer.train([" ".join(rng.choice(WORDS) for _ in range(2000)) + " yes, be brief"], 300)
    tok.add_chat_tokens()
    tok.chat_template = CHATML_TEMPLATE
    tok.chat_templates = {"default": CHATML_TEMPLATE}
    return tok


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize("line, match", [
    ("{not json", "not JSON"),
    ('{"turns": []}', 'no "messages"'),
    ('{"messages": [{"role": "narrator", "content": "x"}]}', "role 'narrator'"),
    ('{"messages": [{"role": "user", "content": 3}]}', "needs string content"),
    ('{"messages": [{"role": "user"}]}', "needs string content"),
    ('{"messages": []}', "non-empty list"),
])
def test_bad_lines_name_file_and_line(tmp_path, capsys, line, match):
    good = json.dumps(conversation(random.Random(0)))
    path = tmp_path / "c.jsonl"
    path.write_text(f"{good}\n\n{good}\n{line}\n{good}\n")  # the bad one is line 4 (blank lines count)
    with pytest.raises(UserError, match=match) as e:
        C.read_jsonl(path, "c.jsonl")
    assert str(e.value).startswith("c.jsonl:4: ")
    out = tmp_path / "out"
    assert main(["prepare", "--chat", str(path), "--out", str(out), "--vocab-size", "300"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: c.jsonl:4: ") and err.count("\n") == 1 and match in err, err
    assert "Traceback" not in err and not out.exists()


def test_no_assistant_turn_warns_with_the_count_and_trains_none_of_it(tmp_path, capsys):
    tok = chat_tokenizer()
    rng = random.Random(1)
    convs = [C.Conversation(conversation(rng)["messages"], f"x:{i}") for i in range(3)]
    silent = [C.Conversation([{"role": "user", "content": "hello there"}], f"y:{i}") for i in range(2)]
    packed = C.encode_split(tok, convs + silent, 128, "assistant")
    assert packed.no_assistant == 2 and packed.conversations == 5
    ids, mask = C.encode_conversation(tok, silent[0], "assistant")
    assert len(ids) > 3 and not any(mask)
    # through prepare: the warning, on stderr, counts them
    path = tmp_path / "c.jsonl"
    rows = [conversation(random.Random(i)) for i in range(8)]
    for at in (1, 4, 8):  # two in training, one held out
        rows.insert(at, {"messages": [{"role": "user", "content": "hi"}]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    tok.save_folder(tmp_path / "tok")
    assert main(["prepare", "--chat", str(path), "--out", str(tmp_path / "o"), "--tokenizer", str(tmp_path / "tok"),
                 "--context", "256", "--val-fraction", "0.3"]) == 0
    err = capsys.readouterr().err
    meta = read_meta(tmp_path / "o")
    n = meta["chat"]["no_assistant_turn"]
    assert n == {"train": 2, "val": 1}
    assert "warning: 2 train conversation(s) have no assistant turn" in err
    assert "warning: 1 val conversation(s) have no assistant turn" in err


def test_too_long_conversations_are_dropped_with_a_count():
    tok = chat_tokenizer()
    rng = random.Random(2)
    short = [C.Conversation(conversation(rng, turns=1)["messages"], f"x:{i}") for i in range(4)]
    long = C.Conversation([{"role": "user", "content": " ".join(WORDS * 3)},
                           {"role": "assistant", "content": "yes"}], "x:9")
    packed = C.encode_split(tok, short[:2] + [long] + short[2:], 100, "assistant")
    assert packed.dropped_long == 1 and packed.conversations == 4
    long_ids, _ = C.encode_conversation(tok, long, "all")
    assert len(long_ids) > 100
    assert len(packed.ids) % 101 == 0 and tok.decode(packed.ids).count(CHAT_TOKENS[0] + "user") == 4


# ----------------------------------------------------------------------------- masks and packing


def test_masks_are_the_assistant_replies_and_all_means_all():
    tok = chat_tokenizer()
    conv = C.Conversation(conversation(random.Random(3), turns=2, system=True)["messages"], "x:1")
    ids, mask = C.encode_conversation(tok, conv, "assistant")
    assert len(ids) == len(mask)
    scored = tok.decode([i for i, m in zip(ids, mask) if m])
    replies = [m["content"] + CHAT_TOKENS[1] for m in conv.messages if m["role"] == "assistant"]
    assert scored == "".join(replies)
    _, every = C.encode_conversation(tok, conv, "all")
    assert every == [1] * len(ids)


def test_blocks_hold_whole_conversations_separated_by_end_of_text():
    eot = 0
    convs = [([5] * n, [1] * n) for n in (3, 4, 2, 6, 7)]
    ids, mask, dropped = C.pack(convs, context=8, eot_id=eot)
    assert dropped == 0 and len(ids) % 9 == 0 and len(ids) == len(mask)
    blocks = [ids[i:i + 9] for i in range(0, len(ids), 9)]
    runs = []
    for b in blocks:  # split each block at end-of-text: every piece is one whole conversation
        assert b[-1] == eot  # a block ends with a separator or padding
        runs += [len(piece) for piece in bytes(b).split(b"\x00") if piece]
    assert runs == [3, 4, 2, 6, 7]
    assert sum(mask) == 22 and all(m == 0 for i, m in zip(ids, mask) if i == eot)
    assert C.pack([([5] * 9, [1] * 9)], 8, eot)[2] == 1  # 9 tokens + its separator: longer than 8+1


def test_batches_start_at_blocks_and_mask_targets():
    block, T = 9, 8
    ids = np.arange(5 * block, dtype=np.uint16)
    mask = (ids % 2).astype(np.uint8)
    x, y = get_batch(ids, 16, T, seed=3, step=0, mask=mask, block=block)
    assert x.shape == y.shape == (16, T)
    assert bool((x[:, 0] % block == 0).all())  # every window starts at a block
    want = (x + 1).masked_fill(((x + 1) % 2) == 0, -1)
    assert bool((y == want).all()) and bool((y == -1).any())
    x0, y0 = get_batch(ids, 16, T, seed=3, step=0)  # plain data: unchanged, no -1
    assert bool((y0 >= 0).all()) and not bool((x0[:, 0] % block == 0).all())


# ----------------------------------------------------------------------------- prepare --chat


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("chat")
    write_jsonl(root / "c.jsonl", 60)
    out = root / "data"
    assert main(["prepare", "--chat", str(root / "c.jsonl"), "--out", str(out), "--vocab-size", "300",
                 "--context", "256"]) == 0
    return out


def test_prepare_chat_writes_aligned_masks_and_meta(chat_folder):
    meta = read_meta(chat_folder)
    tok = Tokenizer.from_folder(chat_folder)
    assert tok.chat_template == CHATML_TEMPLATE  # the default template was written with the tokenizer
    assert all(tok.tk.token_to_id(t) is not None for t in CHAT_TOKENS)
    assert meta["chat"]["train_on"] == "assistant"
    assert meta["chat"]["template_sha256"] == hashlib.sha256(CHATML_TEMPLATE.encode()).hexdigest()
    assert meta["chat"]["conversations"] == {"train": 54, "val": 6}
    for split in ("train", "val"):
        ids = TokenFile(chat_folder / f"{split}.bin", meta["dtype"]).array
        mask = TokenFile(chat_folder / f"{split}.mask.bin", "uint8").array
        assert len(ids) == len(mask) == meta[f"{split}_tokens"] and len(ids) % 257 == 0
        assert set(np.unique(mask).tolist()) == {0, 1}
        assert int(mask.sum()) == meta["chat"]["scored_tokens"][split]
        text = tok.decode(ids[mask.astype(bool)])
        assert CHAT_TOKENS[0] not in text and text.count(CHAT_TOKENS[1]) > 0  # replies and their end-of-turn
        assert meta[f"{split}_bytes"] == len(text.replace(CHAT_TOKENS[1], "").encode())
    # the held-out conversations are the file's last ones
    last = json.loads((chat_folder.parent / "c.jsonl").read_text().splitlines()[-1])["messages"][-1]["content"]
    val = tok.decode(TokenFile(chat_folder / "val.bin", meta["dtype"]).array)
    assert last in val


def test_prepare_chat_train_on_all_and_given_tokenizer(tmp_path, chat_folder):
    base = tmp_path / "base"
    base.mkdir()
    given = Tokenizer.train(["the king and queen " * 50], 300)
    given.save(base / "tokenizer.json")
    assert main(["prepare", "--chat", str(chat_folder.parent / "c.jsonl"), "--out", str(tmp_path / "all"),
                 "--tokenizer", str(base), "--train-on", "all", "--context", "256"]) == 0
    meta = read_meta(tmp_path / "all")
    assert meta["chat"]["train_on"] == "all" and meta["tokenizer"] == "given"
    assert meta["vocab_size"] == given.vocab_size + 2 and meta["chat"]["chat_tokens_added"] == list(CHAT_TOKENS)
    mask = TokenFile(tmp_path / "all" / "train.mask.bin", "uint8").array
    ids = TokenFile(tmp_path / "all" / "train.bin", meta["dtype"]).array
    assert bool((mask[ids != meta["eot_id"]] == 1).all())  # every conversation token trained
    assert Tokenizer.from_folder(tmp_path / "all").chat_template == CHATML_TEMPLATE


def test_a_folder_holds_out_whole_files(tmp_path):
    folder = tmp_path / "chats"
    (folder / "sub").mkdir(parents=True)
    for i in range(5):
        write_jsonl((folder / "sub" if i % 2 else folder) / f"part{i}.jsonl", 10, seed=i)
    (folder / "notes.txt").write_text("not a conversation file")
    corpus = C.chat_corpus(folder, 0.2)
    assert len(corpus.train) + len(corpus.val) == 50
    held = {c.where.rsplit(":", 1)[0] for c in corpus.val}
    assert held == set(corpus.meta["val_files"]) and len(held) == 1 and len(corpus.val) == 10  # one whole file: 20%
    assert not held & {c.where.rsplit(":", 1)[0] for c in corpus.train}
    assert C.chat_corpus(folder, 0.2).meta == corpus.meta  # the same split every time


def test_add_chat_tokens_on_a_plain_corpus(tmp_path):
    from ..support import synthetic_text

    (tmp_path / "c.txt").write_text(synthetic_text(400, 1))
    assert main(["prepare", "--corpus", str(tmp_path / "c.txt"), "--out", str(tmp_path / "o"), "--vocab-size", "300",
                 "--context", "32", "--add-chat-tokens"]) == 0
    tok = Tokenizer.from_folder(tmp_path / "o")
    assert tok.vocab_size == 302 == read_meta(tmp_path / "o")["vocab_size"]
    assert tok.chat_template == CHATML_TEMPLATE and (tmp_path / "o" / "chat_template.jinja").is_file()
    assert not (tmp_path / "o" / "train.mask.bin").exists()  # plain text: every token trained
