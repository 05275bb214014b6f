"""Incremental detokenization with the tiny model's byte-level BPE tokenizer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenfleet.worker.engine.detokenizer import IncrementalDetokenizer

TEXT = "Hello world, the fleet"  # H|ell|o| wor|ld|,| the| fleet
MULTI_BYTE = "héllo 😀 wörld €"  # é, 😀, ö and € are split over several byte tokens


@pytest.fixture(scope="module")
def tok(tiny_llama_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_llama_dir)


def stream(tok: Any, ids: list[int], **kwargs: Any) -> tuple[list[str], IncrementalDetokenizer]:
    """One piece per token, the finish() flush glued to the last one (as the engine does)."""
    detok = IncrementalDetokenizer(tok, **kwargs)
    pieces = []
    for t in ids:
        pieces.append(detok.push(t))
        if detok.stopped:
            break
    if not detok.stopped:
        pieces[-1] += detok.finish()
    return pieces, detok


def test_pieces_concatenate_to_the_whole_decode(tok: Any) -> None:
    ids = tok.encode(TEXT)
    pieces, _ = stream(tok, ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == TEXT == tok.decode(ids)


def test_multi_byte_characters_split_across_tokens_are_held_back(tok: Any) -> None:
    ids = tok.encode(MULTI_BYTE)
    assert "\ufffd" in tok.decode(ids[1:2])  # really split
    pieces, _ = stream(tok, ids)
    assert "".join(pieces) == MULTI_BYTE
    assert not any("\ufffd" in p for p in pieces)
    assert "" in pieces  # some token released nothing until its character completed


def test_invalid_bytes_are_flushed_at_finish(tok: Any) -> None:
    ids = tok.encode("€")[:2]  # an incomplete character: decodes to U+FFFD for ever
    pieces, _ = stream(tok, ids)
    assert "".join(pieces) == tok.decode(ids)
    assert pieces[0] == ""


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_any_token_sequence_round_trips(tok: Any, data: st.DataObject) -> None:
    ids = data.draw(st.lists(st.integers(0, len(tok) - 1), min_size=1, max_size=30))
    skip = data.draw(st.booleans())
    pieces, _ = stream(tok, ids, skip_special_tokens=skip)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)


def test_special_tokens_are_skipped_or_kept(tok: Any) -> None:
    ids = [*tok.encode("Hello"), tok.eos_token_id]
    assert "".join(stream(tok, ids)[0]) == "Hello"
    assert "".join(stream(tok, ids, skip_special_tokens=False)[0]) == "Hello<|endoftext|>"


def test_stop_string_spanning_tokens_is_cut_and_not_emitted(tok: Any) -> None:
    ids = tok.encode(TEXT)
    pieces, detok = stream(tok, ids, stop=["o wo"])
    assert detok.stopped
    assert pieces == ["H", "ell", "", ""]  # "o" held back, then the stop completed
    assert detok.emitted == "Hell"


def test_stop_string_at_the_start(tok: Any) -> None:
    pieces, detok = stream(tok, tok.encode(TEXT), stop=["He"])
    assert detok.stopped and pieces == ["", ""] and detok.emitted == ""


def test_held_back_text_is_released_when_no_stop_follows(tok: Any) -> None:
    pieces, detok = stream(tok, tok.encode(TEXT), stop=["o!", "d?"])
    assert not detok.stopped
    assert pieces[:5] == ["H", "ell", "", "o wor", "l"]  # "o", then "d", waited
    assert "".join(pieces) == TEXT


def test_earliest_stop_string_wins(tok: Any) -> None:
    _, detok = stream(tok, tok.encode(TEXT), stop=["the", "world"])
    assert detok.emitted == "Hello "


def test_stop_string_inside_a_multi_byte_run(tok: Any) -> None:
    pieces, detok = stream(tok, tok.encode(MULTI_BYTE), stop=["😀"])
    assert detok.stopped and "".join(pieces) == "héllo "


def test_tokens_after_a_stop_release_nothing(tok: Any) -> None:
    detok = IncrementalDetokenizer(tok, stop=["ell"])
    pieces = [detok.push(t) for t in tok.encode(TEXT)]
    assert "".join(pieces) == "H"
    assert detok.finish() == ""


def test_replaying_ids_reproduces_the_state(tok: Any) -> None:
    """How a resumed request continues its text: replay the published ids, then go on."""
    ids = tok.encode(MULTI_BYTE + " " + TEXT)
    whole, _ = stream(tok, ids, stop=["fleet!"])
    for cut in range(1, len(ids)):
        replay = IncrementalDetokenizer(tok, stop=["fleet!"])
        published = [replay.push(t) for t in ids[:cut]]
        rest = [replay.push(t) for t in ids[cut:]]
        rest[-1] += replay.finish()
        assert published == whole[:cut]
        assert rest == whole[cut:]
