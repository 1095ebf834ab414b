"""Following growing result files: the byte bookkeeping of ResultTail and ResultFollower."""

from __future__ import annotations

from batchgen.client._follow import ResultFollower, ResultTail


def test_first_request_asks_for_everything_then_for_the_rest() -> None:
    tail = ResultTail("file-1")
    assert "Range" not in tail.request().headers
    tail.start(200)
    assert tail.feed(b'{"a": 1}\n{"b"') == ['{"a": 1}']
    assert tail.offset == 9
    assert tail.request().headers["Range"] == "bytes=9-"
    assert 416 in tail.request().accept_statuses


def test_partial_content_continues_at_the_offset() -> None:
    tail = ResultTail("file-1")
    tail.start(200)
    tail.feed(b"one\ntw")
    tail.start(206)  # the server sent from byte 4 on; the half line is sent again
    assert tail.feed(b"two\nthr") == ["two"]
    assert tail.feed(b"ee\n") == ["three"]
    assert tail.offset == len(b"one\ntwo\nthree\n")


def test_a_whole_file_again_skips_what_was_read_even_across_chunks() -> None:
    tail = ResultTail("file-1")
    tail.start(200)
    tail.feed(b"one\ntwo\n")
    tail.start(200)  # a server that ignores Range
    assert tail.feed(b"one\n") == []
    assert tail.feed(b"tw") == []
    assert tail.feed(b"o\nthree\nfo") == ["three"]
    assert tail.offset == len(b"one\ntwo\nthree\n")


def test_nothing_new() -> None:
    tail = ResultTail("file-1")
    tail.start(200)
    tail.feed(b"one\n")
    tail.start(416)
    assert tail.feed(b'{"error": {"message": "range not satisfiable"}}') == []
    assert tail.offset == 4


def test_finish_hands_out_an_unfinished_last_line() -> None:
    tail = ResultTail("file-1")
    tail.start(200)
    assert tail.feed(b"one\r\n\n  \ntwo") == ["one"]  # CRLF and blank lines are fine
    assert tail.finish() == ["two"]
    assert tail.finish() == []


def test_utf8_split_between_chunks() -> None:
    tail = ResultTail("file-1")
    tail.start(200)
    data = '{"text": "héllo"}\n'.encode()
    cut = data.index(b"\xa9")  # inside the two bytes of é
    assert tail.feed(data[:cut]) == []
    assert tail.feed(data[cut:]) == ['{"text": "héllo"}']


def test_follower_adds_files_as_the_batch_names_them() -> None:
    follower = ResultFollower(errors=True)
    assert follower.tails({"status": "validating", "output_file_id": None}) == []
    [output] = follower.tails({"output_file_id": "file-out", "error_file_id": None})
    tails = follower.tails({"output_file_id": "file-out", "error_file_id": "file-err"})
    assert tails[0] is output and [t.file_id for t in tails] == ["file-out", "file-err"]
    assert [t.file_id for t in ResultFollower().tails({"output_file_id": "o", "error_file_id": "e"})] == ["o"]
