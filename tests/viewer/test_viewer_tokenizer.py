"""The explorer's tokenizer view (section 10, static/tokenizer.js): its data (source.tokenizer_view)
ends in the `tokenizers` library's ids, and in a real browser the view's final ids are the page's
token ids and the library's, with a space drawn ␣ and a newline ↵, in a saved page and a live one."""

from __future__ import annotations

import json

import pytest

from glassformer.viewer import source
from glassformer.viewer.server import make_server
from glassformer.worked import model as worked

from .test_viewer_browser import browser, open_page  # noqa: F401 (a fixture)
from .test_viewer_sample import parts  # noqa: F401 (a fixture)

TEXT = "The king and\nqueen walk  to 42 castles"
TEXTS = [TEXT, "  the\n\nqueen<|endoftext|>walks 1234 é", "knight\twaits!", " a"]


@pytest.mark.parametrize("text", TEXTS)
def test_view_ends_in_the_library_ids(parts, text):  # noqa: F811
    tok = parts[1]
    view = source.tokenizer_view(tok, text)
    assert view["ids"] == tok.tk.encode(text).ids == [i for c in view["chunks"] for i in c["ids"]]
    assert view["bytes"] == list(text.encode("utf-8")) == [b for c in view["chunks"] for b in c["bytes"]]
    for c in view["chunks"]:
        assert c["pieces"] == [tok.id_to_piece(i).replace(" ", "␣").replace("\n", "↵").replace("\t", "⇥") for i in c["ids"]]
        if c["added"]:
            assert c["merges"] == [] and c["ids"] == [tok.tk.token_to_id(c["text"])]
            continue
        # The merges, replayed from the bytes (each joins two neighbours), end in the chunk's pieces.
        last = c["merges"][-1]["pieces"] if c["merges"] else c["start"]
        assert last == c["pieces"] and len(c["start"]) == len(c["bytes"])
        assert all(len(m["pieces"]) == len(c["start"]) - k - 1 for k, m in enumerate(c["merges"]))
    labels = [c["label"] for c in view["chunks"]]
    assert "".join(labels) == view["label"]
    assert ("␣" in view["label"]) == (" " in text) and ("↵" in view["label"]) == ("\n" in text)


def test_a_tokenizer_that_is_not_byte_level_bpe_is_said_so():
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace

    word_piece = HFTokenizer(WordLevel({"I": 0, "like": 1, "[UNK]": 2}, unk_token="[UNK]"))
    word_piece.pre_tokenizer = Whitespace()
    view = source.tokenizer_view(word_piece, "I like cats")
    assert set(view) == {"text", "error"} and "byte-level BPE" in view["error"]
    assert "this is a WordLevel tokenizer" in view["error"] and "--steps" not in view["error"]


def test_the_worked_models_word_tokenizer_shows_its_words_and_ids():
    # Not an error: the toy tokenizer looks each word up whole, and the view says so.
    view = source.tokenizer_view(worked.TOKENIZER, "I like cats too")
    assert view["kind"] == "words" and "error" not in view
    assert view["ids"] == worked.TOKENIZER.encode("I like cats too") == [w["id"] for w in view["words"]]
    assert [w["text"] for w in view["words"]] == ["I", "like", "cats", "too"] and view["vocab_size"] == 6
    assert "unknown word 'mice'" in source.tokenizer_view(worked.TOKENIZER, "I like mice")["error"]


@pytest.fixture(scope="module")
def saved(parts, tmp_path_factory):  # noqa: F811
    model, tok, _ = parts
    return source.write_page(tmp_path_factory.mktemp("tokenizer") / "page.html", model, tok, TEXT, model_name="tiny")


def view_ids(page) -> list[int]:
    return page.evaluate("JSON.parse(document.getElementById('tokenizer-ids').dataset.ids)")


@pytest.mark.browser
def test_saved_page_shows_the_steps(browser, saved, parts):  # noqa: F811
    tok = parts[1]
    page = open_page(browser, saved.as_uri())
    section = page.locator("#view-tokenizer")
    # Before the sections that read its ids (after the map and the walk, which picture the whole model);
    # layout.js numbers the sections in page order.
    title = section.locator("h2").text_content()
    lanes = int(page.locator("#view-lanes h2 .n").text_content())
    assert section.is_visible() and title.endswith(" Tokenizer: from text to ids") and int(title.split()[0]) == lanes - 1
    page_ids = page.evaluate("window.Glass.TR().ids")
    assert view_ids(page) == page_ids == tok.tk.encode(TEXT).ids
    chips = page.locator("#tokenizer-ids .tz-id").evaluate_all("cs => cs.map(c => [c.querySelector('.tz-piece').textContent, Number(c.querySelector('code').textContent)])")
    assert [i for _, i in chips] == page_ids
    assert [label for label, _ in chips] == page.evaluate("window.Glass.P().labels")  # the token chips' labels
    assert any(label.startswith("␣") for label, _ in chips) and any("↵" in label for label, _ in chips)
    assert section.locator(".tz-text").text_content() == "The␣king␣and↵queen␣walk␣␣to␣42␣castles"
    assert section.locator(".tz-merges li").count() > len(chips)  # each chunk's start and its merges
    # The selected token's chunk is marked; another token moves the mark.
    page.locator('#tokens .tok[data-token="0"]').click()
    assert page.locator("#tokenizer .tz-chunk.sel").get_attribute("data-chunk") == "0"
    assert page.events["errors"] == []
    page.close()


@pytest.mark.browser
def test_live_page_follows_the_sentence(browser, parts):  # noqa: F811
    tok = parts[1]
    server = make_server(parts[2], port=0)
    server.start_in_thread()
    try:
        page = open_page(browser, server.url)
        first = view_ids(page)
        assert first == page.evaluate("window.Glass.TR().ids") == tok.tk.encode(parts[2].default_text).ids
        page.fill("#sentence", "the queen walks  to 7 knights")
        page.click("#run")
        page.wait_for_function("document.body.dataset.ready === '2'")
        assert view_ids(page) == page.evaluate("window.Glass.TR().ids") == tok.tk.encode("the queen walks  to 7 knights").ids
        assert page.locator("#view-tokenizer .tz-text").text_content() == "the␣queen␣walks␣␣to␣7␣knights"
        assert page.events["errors"] == []
        page.close()
    finally:
        server.stop()


@pytest.mark.browser
def test_word_level_tokenizer_shows_its_words(browser, tmp_path):  # noqa: F811
    page = open_page(browser, source.write_worked_page(tmp_path / "worked.html").as_uri())
    assert page.locator("#view-tokenizer #tokenizer-error").count() == 0 and page.locator("#view-tokenizer .bad").count() == 0
    assert json.loads(page.locator("#tokenizer-ids").get_attribute("data-ids")) == worked.TOKENIZER.encode(worked.SENTENCE)
    assert "word-level" in page.locator("#view-tokenizer .lede").text_content()
    assert page.locator("#view-tokenizer").is_visible() and page.events["errors"] == []
    page.close()
