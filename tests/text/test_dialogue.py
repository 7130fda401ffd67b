"""The chat demo's conversations: speeches alternate user and assistant within a scene; directions,
scene breaks and over-long speeches end or skip turns; the JSONL's held-out tail is prepare --chat's split."""

import io
import json

from glassformer.text.corpus import Document
from glassformer.text.dialogue import MAX_CHARS, VAL_FRACTION, conversations, speeches, write_jsonl

PLAY = """ACT I.

SCENE I. Elsinore. A platform before the Castle.

[Enter Francisco and Bernardo.]

Ber.
Who's there?

Fran.
Nay, answer me: stand, and unfold yourself.

Ber.
Long live the king!

[Aside.]

Ber.
Bernardo he.

Fran.
You come most carefully upon your hour.
[Exit.]

SCENE II. Elsinore. A room of state in the Castle.

Hor.
Hail to your lordship!

Ham.
I am glad to see you well:
Horatio,--or I do forget myself.
"""


def _doc(name: str, text: str) -> Document:
    data = text.encode()
    return Document(name=name, size=len(data), open_bytes=lambda: io.BytesIO(data))


def test_speeches_name_speakers_and_break_at_scenes():
    got = list(speeches(PLAY))
    assert got[0] is None and got[1] is None  # ACT I., SCENE I.
    assert got[2] == ("Ber", "Who's there?")
    assert ("Fran", "You come most carefully upon your hour.") in got  # the inline direction removed
    assert ("Ham", "I am glad to see you well:\nHoratio,--or I do forget myself.") in got


def test_conversations_alternate_within_a_scene_and_join_a_speaker_split_by_a_direction():
    convs = list(conversations(PLAY))
    first = convs[0]["messages"]
    assert [m["role"] for m in first] == ["user", "assistant", "user", "assistant"]
    assert first[2]["content"] == "Long live the king!\nBernardo he."  # one speaker's two blocks, one turn
    assert first[3]["content"] == "You come most carefully upon your hour."
    assert convs[1]["messages"] == [{"role": "user", "content": "Hail to your lordship!"},
                                    {"role": "assistant", "content": "I am glad to see you well:\nHoratio,--or I do "
                                                                     "forget myself."}]
    assert len(convs) == 2  # SCENE II. starts a new conversation


def test_a_conversation_stays_under_the_size_and_skips_a_longer_speech():
    long = "Ber.\n" + "O " * MAX_CHARS + "\n\n"
    text = "Hor.\nOne.\n\nMar.\nTwo.\n\n" + long + "Hor.\nThree.\n\nMar.\nFour.\n"
    convs = [c["messages"] for c in conversations(text)]
    assert [[m["content"] for m in c] for c in convs] == [["One.", "Two."], ["Three.", "Four."]]
    assert all(sum(len(m["content"]) for m in c) <= MAX_CHARS for c in convs)


def test_the_held_out_plays_come_last_as_many_as_prepare_holds_out(tmp_path):
    scene = "".join(f"Hor.\nLine {i}.\n\nMar.\nReply {i}.\n\nSCENE {i}.\n\n" for i in range(30))
    counts = write_jsonl(tmp_path / "c.jsonl", train=[_doc("a_gut.txt", scene), _doc("a_gut_f.txt", scene)],
                         val=[_doc("b_gut.txt", scene.replace("Line", "Held"))])
    lines = [json.loads(line) for line in (tmp_path / "c.jsonl").read_text().splitlines()]
    assert counts["train"] + counts["val"] == len(lines) and counts["val"] == round(len(lines) * VAL_FRACTION) > 0
    assert all(c["messages"][0]["content"].startswith("Held") for c in lines[-counts["val"]:])
    assert all(c["messages"][0]["content"].startswith("Line") for c in lines[:counts["train"]])
    assert (counts["train"], counts["val"]) == (30, 3)  # the folio copy adds nothing; 3 of 30 held out = 10%
