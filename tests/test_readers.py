"""segmenter.readers: every format on tiny fixtures generated here, every named failure."""
import io
import zipfile

import docx
import pytest
from pypdf import PdfReader, PdfWriter

from segmenter import (
    CorruptDocument,
    Document,
    DocumentTooLarge,
    EmptyDocument,
    EncryptedDocument,
    Heading,
    NoTextLayer,
    PageStart,
    UnsupportedFormat,
    display_name,
    read_document,
)
from files import make_pdf

# ---------------------------------------------------------------------------------------------
# Fixture builders


THREE_PAGES = [["Chapter One", "The first page (with parens)."], [],
               ["Second text page.", "Another line here."]]
THREE_PAGES_TEXT = "Chapter One\nThe first page (with parens).\n\nSecond text page.\nAnother line here."


def rewrite_pdf(data: bytes, edit) -> bytes:
    """Copy a PDF through pypdf's writer after `edit(writer)` (outline, encryption)."""
    writer = PdfWriter(clone_from=PdfReader(io.BytesIO(data)))
    edit(writer)
    buffer = io.BytesIO()
    writer.write(buffer)
    return buffer.getvalue()


def make_docx() -> bytes:
    document = docx.Document()
    document.add_heading("Annual report", level=0)
    document.add_paragraph("Intro paragraph.")
    document.add_heading("Results", level=1)
    table = document.add_table(rows=2, cols=3)
    for row, values in enumerate([["Year", "Revenue", "Note"], ["2024", "10", "up"]]):
        for column, value in enumerate(values):
            table.cell(row, column).text = value
    table.cell(1, 1).merge(table.cell(1, 2))
    document.add_paragraph("")
    document.add_heading("Details", level=2)
    document.add_paragraph("After the table.")
    buffer = io.BytesIO()
    document.save(buffer)
    return buffer.getvalue()


def make_zip(files: dict[str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in files.items():
            archive.writestr(name, data)
    return buffer.getvalue()


# ---------------------------------------------------------------------------------------------
# Plain text


TEXT = "Café – “quoted” costs 5 €.\nSecond line."


@pytest.mark.parametrize("data", [
    TEXT.encode("utf-8"),
    TEXT.encode("utf-8-sig"),
    TEXT.encode("utf-16"),  # with BOM
    TEXT.encode("utf-16-be").join([b"\xfe\xff", b""]),
    TEXT.encode("utf-16-le"),  # no BOM: detected from the NUL pattern
    TEXT.encode("utf-16-be"),
    TEXT.encode("cp1252"),
    TEXT.replace("\n", "\r\n").encode("utf-8"),
], ids=["utf8", "utf8-bom", "utf16-bom", "utf16be-bom", "utf16le-nobom", "utf16be-nobom", "cp1252", "crlf"])
def test_txt_encodings(data):
    assert read_document(data, "notes.txt") == Document(name="notes.txt", format="txt", text=TEXT)


def test_latin1_bytes_undefined_in_cp1252():
    text = "naïve text " * 10 + "\x81"  # 0x81 is undefined in cp1252; one control char is tolerated
    assert read_document(text.encode("latin-1"), "a.txt").text == text


@pytest.mark.parametrize("data, hint", [
    (bytes(range(256)) * 4, "binary data"),
    (b"\x89PNG\r\n\x1a\n" + bytes(range(256)), "a PNG image"),
    (make_pdf([["hello"]]), "a PDF"),
])
def test_binary_renamed_txt_is_refused(data, hint):
    with pytest.raises(UnsupportedFormat) as error:
        read_document(data, "photo.txt")
    what = hint if hint == "binary data" else f"it looks like {hint}"
    assert str(error.value) == (f"photo.txt is not a text file ({what}). Upload the original file with "
                                "its real extension, or export it as text first.")


@pytest.mark.parametrize("data, name", [(b"", "empty.txt"), (b"", "empty.pdf"), (b"", "empty.docx")])
def test_empty_file(data, name):
    with pytest.raises(EmptyDocument, match=f"^{name} contains no text: the file is empty"):
        read_document(data, name)


def test_whitespace_only_text_is_empty():
    with pytest.raises(EmptyDocument, match="contains no text"):
        read_document(b"  \n\t\n", "blank.md")


# ---------------------------------------------------------------------------------------------
# Markdown


def test_markdown_headings_outside_code_fences():
    text = "Preamble\n# Title #\n\nBody.\n```\n# not a heading\n```\n  ### Deep\n#hashtag\n##\n"
    assert read_document(text.encode(), "guide.md") == Document(
        name="guide.md", format="md", text=text,
        headings=(Heading(9, 1, "Title"), Heading(50, 3, "Deep")),
    )


# ---------------------------------------------------------------------------------------------
# PDF


def test_generated_pdf_is_valid_for_pypdf_strict():
    reader = PdfReader(io.BytesIO(make_pdf(THREE_PAGES)), strict=True)
    assert [page.extract_text() for page in reader.pages] == [
        "Chapter One\nThe first page (with parens).", "", "Second text page.\nAnother line here."]


def test_pdf_pages_and_blank_page_warning():
    assert read_document(make_pdf(THREE_PAGES), "book.pdf") == Document(
        name="book.pdf", format="pdf", text=THREE_PAGES_TEXT,
        pages=(PageStart(0, 1), PageStart(43, 3)), page_count=3,
        warnings=("pages without a text layer (images only?): 2",),
    )


def test_pdf_outline_becomes_headings():
    def outline(writer):
        writer.add_outline_item(title="Chapter One", page_number=0)
        parent = writer.add_outline_item(title="Part Two", page_number=2)
        writer.add_outline_item(title="Another line here.", page_number=2, parent=parent)
        writer.add_outline_item(title="Blank page", page_number=1)

    document = read_document(rewrite_pdf(make_pdf(THREE_PAGES), outline), "book.pdf")
    assert document.headings == (Heading(0, 1, "Chapter One"), Heading(43, 1, "Part Two"),
                                 Heading(61, 2, "Another line here."))


def test_pdf_without_text_layer():
    with pytest.raises(NoTextLayer) as error:
        read_document(make_pdf([[], []]), "scan.pdf")
    assert str(error.value) == ("scan.pdf has no text layer: its 2 page(s) hold only images (a scan?). "
                                "Run OCR on it (e.g. ocrmypdf) and upload the result.")


def test_encrypted_pdf():
    data = rewrite_pdf(make_pdf(THREE_PAGES), lambda writer: writer.encrypt("secret", algorithm="RC4-128"))
    with pytest.raises(EncryptedDocument) as error:
        read_document(data, "secret.pdf")
    assert isinstance(error.value, NoTextLayer)
    assert str(error.value) == (
        "secret.pdf is encrypted (password-protected), so its text layer cannot be read. "
        "Remove the password (e.g. save or print it as an unprotected PDF) and upload it again.")


def test_pdf_with_owner_password_only_is_readable():
    data = rewrite_pdf(make_pdf(THREE_PAGES), lambda writer: writer.encrypt("", "owner", algorithm="RC4-128"))
    assert read_document(data, "locked.pdf").text == THREE_PAGES_TEXT


@pytest.mark.parametrize("data", [
    b"%PDF-1.4\n" + bytes(range(256)) * 8,
    make_pdf(THREE_PAGES)[:200],
])
def test_corrupt_pdf(data):
    with pytest.raises(CorruptDocument, match=r"^broken\.pdf is damaged: the file could not be read \("):
        read_document(data, "broken.pdf")


def test_pdf_extension_on_text_content():
    with pytest.raises(CorruptDocument) as error:
        read_document(b"just some text", "fake.pdf")
    assert str(error.value) == ("fake.pdf is not a PDF file: it lacks the %PDF- header. "
                                "Upload the original PDF, or give the file its real extension.")


def test_pdf_page_limit():
    with pytest.raises(DocumentTooLarge) as error:
        read_document(make_pdf(THREE_PAGES), "book.pdf", max_pages=2)
    assert str(error.value) == ("book.pdf has 3 pages, over the limit of 2. "
                                "Raise the page limit (max_pages) or split the PDF.")


# ---------------------------------------------------------------------------------------------
# DOCX


def test_docx_headings_paragraphs_and_table_in_order():
    text = ("Annual report\n\nIntro paragraph.\n\nResults\n\nYear | Revenue | Note\n2024 | 10 up"
            "\n\nDetails\n\nAfter the table.")
    assert read_document(make_docx(), "report.docx") == Document(
        name="report.docx", format="docx", text=text,
        headings=(Heading(0, 0, "Annual report"), Heading(33, 1, "Results"), Heading(78, 2, "Details")),
    )


@pytest.mark.parametrize("data, message", [
    (bytes(range(256)) * 4, "corrupt.docx is not a .docx file: a .docx is a zip archive and this is not."),
    (make_pdf([["x"]]), "corrupt.docx is not a .docx file (it looks like a PDF): a .docx is a zip archive"),
    (b"PK\x03\x04" + bytes(range(256)), "corrupt.docx is damaged: the file could not be read (BadZipFile"),
    (make_zip({"hello.txt": b"hi"}), "corrupt.docx is a zip archive but not a Word document"),
    (make_zip({"word/document.xml": b"<not xml", "[Content_Types].xml": b"<"}), "corrupt.docx is damaged"),
])
def test_corrupt_docx(data, message):
    with pytest.raises(CorruptDocument) as error:
        read_document(data, "corrupt.docx")
    assert str(error.value).startswith(message)


def test_old_word_doc_renamed_docx():
    with pytest.raises(UnsupportedFormat, match="old Word 97-2003 .doc file"):
        read_document(b"\xd0\xcf\x11\xe0\xa1\xb1\x1a\xe1" + bytes(64), "old.docx")


def test_docx_zip_bomb_is_refused():
    data = make_zip({"word/document.xml": bytes(2 * 1024 * 1024)})
    with pytest.raises(DocumentTooLarge, match="unpacks to 2.0 MiB, over 20x the upload limit"):
        read_document(data, "bomb.docx", max_bytes=64 * 1024)


# ---------------------------------------------------------------------------------------------
# Entry point: formats, limits, names


@pytest.mark.parametrize("name, what", [("letter.doc", ".doc files"), ("notes.RTF", ".rtf files"),
                                        ("README", "files without an extension")])
def test_unsupported_extension(name, what):
    with pytest.raises(UnsupportedFormat) as error:
        read_document(b"data", name)
    assert str(error.value) == (
        f"{name}: {what} are not supported. Upload one of .docx, .markdown, .md, .pdf, .text, .txt; "
        "save other formats (e.g. .doc, .rtf, .odt) as .docx or .pdf first.")


@pytest.mark.parametrize("as_source, name", [(lambda path: path, None), (str, None),
                                             (lambda path: path.read_bytes(), "big.txt")])
def test_size_limit(tmp_path, as_source, name):
    path = tmp_path / "big.txt"
    path.write_bytes(b"a" * 2048)
    with pytest.raises(DocumentTooLarge) as error:
        read_document(as_source(path), name, max_bytes=1024)
    assert str(error.value) == ("big.txt is 2 KB; this app reads files up to 1 KB. "
                                "Split it into smaller files, or save the part you need as a file of its own.")
    assert read_document(as_source(path), name, max_bytes=2048).text == "a" * 2048


def test_file_sizes_read_as_a_file_manager_shows_them():
    """Issue #19: the size limit's message states sizes in the user's terms."""
    from segmenter.readers import file_size

    assert [file_size(n) for n in (12, 2048, 20 * 10**6, 63_611_504, 3 * 10**9)] == [
        "12 bytes", "2 KB", "20 MB", "63.6 MB", "3 GB"]


def test_path_input_takes_its_base_name(tmp_path):
    path = tmp_path / "Notes.MD"
    path.write_text("# Hi\n\nthere", encoding="utf-8")
    assert read_document(path) == Document(name="Notes.MD", format="md", text="# Hi\n\nthere",
                                           headings=(Heading(0, 1, "Hi"),))


def test_bytes_need_a_name():
    with pytest.raises(ValueError, match="a name with an extension"):
        read_document(b"text")


@pytest.mark.parametrize("raw, shown", [
    ("../../etc/passwd.txt", "passwd.txt"),
    ("C:\\Users\\me\\report.pdf", "report.pdf"),
    ("evil\u202egpj.txt", "evilgpj.txt"),  # right-to-left override removed
    ("a\x00b\n.md", "ab.md"),
    ("cafe\u0301.txt", "caf\u00e9.txt"),  # NFC
    ("  spaced \t  name .txt", "spaced name .txt"),
    ("..", "document"),
    ("", "document"),
    ("dir/", "document"),
    ("x" * 300 + ".pdf", "x" * 115 + "….pdf"),
])
def test_display_name(raw, shown):
    assert display_name(raw) == shown


def test_name_is_only_displayed():
    document = read_document(b"hello", "../../etc/passwd.txt")
    assert (document.name, document.format, document.text) == ("passwd.txt", "txt", "hello")


def test_document_positions_are_checked():
    with pytest.raises(ValueError, match="page starts must be strictly increasing"):
        Document(name="a", format="pdf", text="abc", pages=(PageStart(2, 1), PageStart(1, 2)))
    with pytest.raises(ValueError, match="heading starts must be sorted"):
        Document(name="a", format="md", text="abc", headings=(Heading(9, 1, "x"),))


def test_page_at():
    document = Document(name="a", format="pdf", text="x" * 30, pages=(PageStart(0, 1), PageStart(10, 3)))
    assert [document.page_at(char) for char in (0, 9, 10, 29)] == [1, 1, 3, 3]
    assert Document(name="a", format="txt", text="x").page_at(0) is None
