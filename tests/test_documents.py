"""Reading files into documents: a file that cannot be read is skipped with its reason (no model needed)."""

from __future__ import annotations

import os

import pytest

from ragfuse.documents import LoadedFile, SkippedFile, find_files, load_file


def _pdf(*objects: str) -> bytes:
    """A PDF whose numbered objects are ``objects`` (object 1 the catalog), with a correct xref table."""
    out = b"%PDF-1.4\n"
    offsets = []
    for i, body in enumerate(objects, 1):
        offsets.append(len(out))
        out += f"{i} 0 obj\n{body}\nendobj\n".encode()
    xref = len(out)
    out += f"xref\n0 {len(objects) + 1}\n0000000000 65535 f \n".encode()
    out += b"".join(f"{o:010d} 00000 n \n".encode() for o in offsets)
    out += f"trailer\n<< /Size {len(objects) + 1} /Root 1 0 R >>\nstartxref\n{xref}\n%%EOF\n".encode()
    return out


GOOD_PDF = _pdf(
    "<< /Type /Catalog /Pages 2 0 R >>", "<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
    "<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Contents 4 0 R"
    " /Resources << /Font << /F1 5 0 R >> >> >>",
    "<< /Length 53 >>\nstream\nBT /F1 12 Tf 72 720 Td (Hello lighthouse world) Tj ET\nendstream",
    "<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
)


@pytest.mark.parametrize("data, why", [
    # no /Catalog and a page tree that does not parse: pypdf's root recovery meets object 2 again and
    # raises LimitReachedError (a PyPdfError, not a PdfReadError)
    (_pdf("<< /Type /Xatalog /Pages 2 0 R >>", "X< /Type /Pages /Kids [] /Count 0 >>"), "loop with self reference"),
    # the page tree is a reference to itself: pypdf fails with an AttributeError of its own
    (_pdf("<< /Type /Catalog /Pages 2 0 R >>", "2 0 R"), "unreadable PDF"),
    (GOOD_PDF[: len(GOOD_PDF) // 3], "unreadable PDF"),
])
def test_a_pdf_pypdf_cannot_parse_is_skipped_with_its_reason(tmp_path, data, why):
    good = tmp_path / "good.pdf"
    good.write_bytes(GOOD_PDF)
    assert load_file(good).documents[0].text.strip() == "Hello lighthouse world"
    bad = tmp_path / "bad.pdf"
    bad.write_bytes(data)
    skipped = load_file(bad)
    assert isinstance(skipped, SkippedFile) and skipped.reason.startswith("unreadable PDF") and why in skipped.reason


@pytest.mark.parametrize("name, data", [
    ("deep.json", b"[" * 100_000),
    ("deep.jsonl", b'{"text": "fine"}\n' + b'{"a": ' * 100_000),
])
def test_json_nested_too_deeply_is_skipped_with_its_reason(tmp_path, name, data):
    path = tmp_path / name
    path.write_bytes(data)
    skipped = load_file(path)
    assert isinstance(skipped, SkippedFile) and skipped.reason == "JSON nested too deeply to read"


@pytest.mark.skipif(os.name != "posix", reason="file names are bytes on POSIX only")
def test_a_file_name_that_is_not_utf8_is_skipped_by_a_printable_name(tmp_path):
    (tmp_path / "notes.txt").write_text("The lighthouse was electrified in 1931.")
    with open(os.path.join(os.fsencode(tmp_path), b"caf\xe9-menu.txt"), "wb") as f:  # a Latin-1 name
        f.write(b"Soup of the day.")
    loaded = {f.name: load_file(f) for f in find_files([tmp_path]).files}
    assert isinstance(loaded["notes.txt"], LoadedFile)
    skipped = loaded["caf\udce9-menu.txt"]
    assert isinstance(skipped, SkippedFile) and "file name is not valid UTF-8" in skipped.reason
    assert skipped.path == f"{tmp_path}/caf\\xe9-menu.txt"
    skipped.path.encode("utf-8")  # printable on a UTF-8 terminal, storable in SQLite


def test_linked_folders_are_followed_once_and_hidden_ones_left_out(tmp_path):
    shared = tmp_path / "shared"
    (shared / "deep").mkdir(parents=True)
    (shared / "deep" / "notes.md").write_text("Linked notes.")
    docs = tmp_path / "docs"
    (docs / ".git").mkdir(parents=True)
    (docs / ".git" / "config.txt").write_text("hidden")
    (docs / ".draft.txt").write_text("hidden")
    (docs / "a.txt").write_text("A.")
    (docs / "linked").symlink_to(shared, target_is_directory=True)
    (shared / "deep" / "loop").symlink_to(docs, target_is_directory=True)  # a link back up the tree
    found = find_files([docs])
    assert not found.missing
    assert found.files == [(docs / "a.txt").resolve(), (shared / "deep" / "notes.md").resolve()]
    assert set(found.folders) == {docs.resolve(), shared.resolve(), (shared / "deep").resolve()}


def test_text_that_is_not_utf8_is_read_only_through_a_named_fallback(tmp_path):
    """A Latin-1 file is skipped with a hint by default; with a fallback encoding it is read, noted,
    and its content hash depends on the fallback (another one reads other text from the same bytes).
    A file that is valid UTF-8 is read as UTF-8 whatever the fallback."""
    text = "Caf\u00e9 cr\u00e8me, na\u00efve r\u00e9sum\u00e9."
    latin = tmp_path / "menu.txt"
    latin.write_bytes(text.encode("latin-1"))
    skipped = load_file(latin)
    assert isinstance(skipped, SkippedFile) and skipped.reason.startswith("not UTF-8 text")
    assert "--encoding" in skipped.reason
    cp1252 = load_file(latin, encoding="cp1252")
    assert isinstance(cp1252, LoadedFile) and cp1252.documents[0].text == text
    assert cp1252.notes == ["not UTF-8: read as cp1252"]
    koi8 = load_file(latin, encoding="koi8_r")
    assert isinstance(koi8, LoadedFile) and koi8.content_hash != cp1252.content_hash
    ascii_only = load_file(latin, encoding="ascii")
    assert isinstance(ascii_only, SkippedFile) and ascii_only.reason.startswith("neither UTF-8 (")
    utf8 = tmp_path / "menu-utf8.txt"
    utf8.write_text("Caf\u00e9 cr\u00e8me.", encoding="utf-8")
    read = load_file(utf8, encoding="cp1252")
    assert isinstance(read, LoadedFile) and read.documents[0].text == "Caf\u00e9 cr\u00e8me." and not read.notes
    assert read.content_hash == load_file(utf8).content_hash


def test_records_without_the_text_field_are_counted_not_dropped_in_silence(tmp_path):
    path = tmp_path / "r.jsonl"
    path.write_text('{"text": "The ferry leaves at 9."}\n{"nope": 1}\n[1, 2]\n{"text": 5}\n')
    loaded = load_file(path)
    assert isinstance(loaded, LoadedFile) and [d.text for d in loaded.documents] == ["The ferry leaves at 9."]
    assert loaded.notes == ["left out 3 records without a string field 'text'"]
    whole = tmp_path / "whole.json"
    whole.write_text('[{"text": "One."}, {"text": "Two."}]')
    assert load_file(whole).notes == []
