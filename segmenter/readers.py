"""Document readers: txt, md, pdf and docx bytes -> `Document` (text plus page and heading positions).

Pure functions: no model, no database, no file writes. The user's file name is only ever shown,
never used as a path (`display_name`). Every library failure surfaces as one of the named errors
in `segmenter.errors`, with a message that says what to do.

Positions are character offsets into `Document.text`:

    text      "Intro...\\n\\n# Chapter 2\\n\\nBody on page 3..."
    pages     (PageStart(0, 1), PageStart(1834, 2), ...)   page of a char = last start <= char
    headings  (Heading(10, 1, "Chapter 2"), ...)           a heading line starts at char_start
"""
from __future__ import annotations

import bisect
import io
import os
import re
import unicodedata
import zipfile
from dataclasses import dataclass, field
from typing import Callable, NamedTuple, Union

from segmenter.errors import (
    CorruptDocument,
    DocumentError,
    DocumentTooLarge,
    EmptyDocument,
    EncryptedDocument,
    NoTextLayer,
    UnsupportedFormat,
)

Source = Union[str, os.PathLike, bytes, bytearray, memoryview]

MIB = 1024 * 1024
DEFAULT_MAX_BYTES = 64 * MIB  # generous for text-heavy files; image-heavy PDFs beyond it are rare uploads
DEFAULT_MAX_PAGES = 2000  # about 1M tokens of prose, beyond any context window we target
MAX_UNPACK_RATIO = 20  # a .docx may unpack to 20x max_bytes (XML compresses ~5-10x); more is a zip bomb
PDF_HEADER_WINDOW = 1024  # the PDF spec lets "%PDF-" appear anywhere in the first 1024 bytes
MAX_NAME_CHARS = 120  # long enough for real titles, short enough for a UI chip
MAX_EXTENSION_CHARS = 10  # keep ".markdown" when truncating a long name
FALLBACK_NAME = "document"
BLOCK_SEPARATOR = "\n\n"  # between pages, paragraphs and tables: the segmenter's paragraph break
TABLE_CELL_SEPARATOR = " | "
BINARY_CONTROL_FRACTION = 0.02  # real text has almost no control characters; random bytes ~25 %
UTF16_NUL_FRACTION = 0.3  # ASCII-heavy UTF-16 has a NUL in (nearly) every other byte
UTF16_SAMPLE_BYTES = 4096
_BINARY_CONTROLS = re.compile(r"[\x00-\x08\x0e-\x1f\x7f-\x9f]")  # C0/C1 controls except \t \n \v \f \r
SUPPORTED_EXTENSIONS = {  # extension -> Document.format
    ".txt": "txt", ".text": "txt", ".md": "md", ".markdown": "md", ".pdf": "pdf", ".docx": "docx",
}
_BOMS = (  # longest first: the UTF-32-LE BOM starts with the UTF-16-LE one
    (b"\xff\xfe\x00\x00", "utf-32"), (b"\x00\x00\xfe\xff", "utf-32"),
    (b"\xef\xbb\xbf", "utf-8-sig"), (b"\xff\xfe", "utf-16"), (b"\xfe\xff", "utf-16"),
)
_MAGIC = (  # what a file really is, for the hint in an error message
    (b"%PDF-", "a PDF"), (b"PK\x03\x04", "a zip archive (e.g. .docx, .xlsx)"),
    (b"\xd0\xcf\x11\xe0", "an old Office file (.doc, .xls)"), (b"\x89PNG", "a PNG image"),
    (b"\xff\xd8\xff", "a JPEG image"), (b"GIF8", "a GIF image"),
)
_ATX_HEADING = re.compile(r" {0,3}(#{1,6})(?:[ \t]+(.*?))??(?:[ \t]+#+)?[ \t]*")
_CODE_FENCE = re.compile(r" {0,3}(```|~~~)")
_HEADING_STYLE = re.compile(r"heading\s*(\d)", re.IGNORECASE)


class PageStart(NamedTuple):
    """Page `page` (1-based) begins at `char_start` in `Document.text`."""

    char_start: int
    page: int


class Heading(NamedTuple):
    """A heading line begins at `char_start`; level 0 is a document title, 1.. nesting depth."""

    char_start: int
    level: int
    title: str


@dataclass(frozen=True, slots=True)
class Document:
    """Text of one uploaded file with positions of its pages and headings.

    `pages` and `headings` are sorted by `char_start` (pages strictly), all offsets within the text.
    `pages` is empty for formats without pages (txt, md, docx); `page_count` counts every page of a
    PDF, blank ones included. `warnings` are non-fatal problems worth showing the user.
    """

    name: str
    format: str
    text: str
    pages: tuple[PageStart, ...] = ()
    headings: tuple[Heading, ...] = ()
    page_count: int | None = None
    warnings: tuple[str, ...] = ()

    def __post_init__(self):
        starts = [page.char_start for page in self.pages]
        if starts != sorted(set(starts)) or any(not 0 <= s <= len(self.text) for s in starts):
            raise ValueError(f"page starts must be strictly increasing offsets into the text: {starts}")
        starts = [heading.char_start for heading in self.headings]
        if starts != sorted(starts) or any(not 0 <= s <= len(self.text) for s in starts):
            raise ValueError(f"heading starts must be sorted offsets into the text: {starts}")

    def page_at(self, char: int) -> int | None:
        """Page number holding character `char`, or None when the document has no pages."""
        index = bisect.bisect_right(self.pages, char, key=lambda page: page.char_start) - 1
        return self.pages[max(index, 0)].page if self.pages else None


@dataclass(frozen=True, slots=True)
class _Limits:
    max_bytes: int
    max_pages: int


@dataclass(slots=True)
class _TextBuilder:
    """Joins text blocks with BLOCK_SEPARATOR and records where each block starts."""

    parts: list[str] = field(default_factory=list)
    length: int = 0
    pages: list[PageStart] = field(default_factory=list)
    headings: list[Heading] = field(default_factory=list)

    def add(self, block: str) -> int:
        """Append a non-empty block; return its start offset in the joined text."""
        if self.parts:
            self.parts.append(BLOCK_SEPARATOR)
            self.length += len(BLOCK_SEPARATOR)
        start = self.length
        self.parts.append(block)
        self.length += len(block)
        return start

    def text(self) -> str:
        return "".join(self.parts)


# ---------------------------------------------------------------------------------------------
# Entry point, names, limits


def read_document(source: Source, name: str | None = None, *, max_bytes: int = DEFAULT_MAX_BYTES,
                  max_pages: int = DEFAULT_MAX_PAGES) -> Document:
    """Read a txt / md / pdf / docx file given as a path or as bytes.

    The format comes from the extension of `name` (default: the path's base name) and is checked
    against the content. Raises DocumentTooLarge past `max_bytes` or `max_pages` (PDF),
    EmptyDocument when there is no text, and the other `segmenter.errors` for anything unreadable.
    """
    if max_bytes <= 0 or max_pages <= 0:
        raise ValueError(f"limits must be positive, got max_bytes={max_bytes}, max_pages={max_pages}")
    if name is None:
        if isinstance(source, (bytes, bytearray, memoryview)):
            raise ValueError("a name with an extension (e.g. 'report.pdf') is required when reading bytes")
        name = os.path.basename(os.fspath(source))
    shown = display_name(name)
    kind = _format_of(shown)
    data = _load(source, shown, max_bytes)
    if not data:
        raise EmptyDocument(f"{shown} contains no text: the file is empty (0 bytes). "
                            "Check that you picked the right file.")
    _check_content(kind, data, shown)
    document = _READERS[kind](data, shown, _Limits(max_bytes, max_pages))
    if not document.text.strip():
        raise EmptyDocument(f"{shown} contains no text (only whitespace or empty paragraphs). "
                            "Check that you picked the right file.")
    return document


def display_name(name: str) -> str:
    """A safe display name: last path component, NFC, no control/format characters, bounded length.

    The result is for showing only; it is never used as a path.
    """
    base = re.split(r"[\\/]", name)[-1]
    base = unicodedata.normalize("NFC", base)
    base = "".join(ch for ch in base if not unicodedata.category(ch).startswith("C"))
    base = " ".join(base.split())
    if not base.strip("."):
        return FALLBACK_NAME
    if len(base) > MAX_NAME_CHARS:
        stem, extension = os.path.splitext(base)
        if len(extension) > MAX_EXTENSION_CHARS:
            stem, extension = base, ""
        base = stem[: MAX_NAME_CHARS - len(extension) - 1].rstrip() + "…" + extension
    return base


def _format_of(name: str) -> str:
    extension = os.path.splitext(name)[1].lower()
    if extension not in SUPPORTED_EXTENSIONS:
        supported = ", ".join(sorted(SUPPORTED_EXTENSIONS))
        what = f"{extension} files" if extension else "files without an extension"
        raise UnsupportedFormat(
            f"{name}: {what} are not supported. Upload one of {supported}; "
            "save other formats (e.g. .doc, .rtf, .odt) as .docx or .pdf first."
        )
    return SUPPORTED_EXTENSIONS[extension]


def _size(n_bytes: int) -> str:
    """Human-readable size: "2.0 MiB", "3.5 KiB", "12 bytes"."""
    for unit, scale in (("MiB", MIB), ("KiB", 1024)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.1f} {unit}"
    return f"{n_bytes} bytes"


def file_size(n_bytes: int) -> str:
    """A size as file managers show it (decimal units, at most one decimal): "63.6 MB", "20 MB"."""
    for unit, scale in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3)):
        if n_bytes >= scale:
            return f"{n_bytes / scale:.1f}".removesuffix(".0") + f" {unit}"
    return f"{n_bytes} bytes"


def _too_large(name: str, n_bytes: int, max_bytes: int) -> DocumentTooLarge:
    return DocumentTooLarge(
        f"{name} is {file_size(n_bytes)}; this app reads files up to {file_size(max_bytes)}. "
        "Split it into smaller files, or save the part you need as a file of its own."
    )


def _load(source: Source, name: str, max_bytes: int) -> bytes:
    """File bytes, refusing anything over max_bytes before reading it."""
    if isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    else:
        size = os.stat(source).st_size
        if size > max_bytes:
            raise _too_large(name, size, max_bytes)
        with open(source, "rb") as handle:
            data = handle.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise _too_large(name, len(data), max_bytes)
    return data


def _sniff(data: bytes) -> str | None:
    """What the bytes look like (for hints), or None."""
    if b"%PDF-" in data[:PDF_HEADER_WINDOW]:
        return "a PDF"
    return next((what for magic, what in _MAGIC if data.startswith(magic)), None)


def _check_content(kind: str, data: bytes, name: str) -> None:
    """Refuse a .pdf / .docx whose bytes are not a PDF / zip, naming what they look like."""
    looks_like = _sniff(data)
    hint = f" (it looks like {looks_like})" if looks_like else ""
    if kind == "pdf" and looks_like != "a PDF":
        raise CorruptDocument(f"{name} is not a PDF file{hint}: it lacks the %PDF- header. "
                              "Upload the original PDF, or give the file its real extension.")
    if kind == "docx" and data.startswith(b"\xd0\xcf\x11\xe0"):
        raise UnsupportedFormat(f"{name} is an old Word 97-2003 .doc file, not .docx. "
                                "Open it in Word or LibreOffice and save it as .docx.")
    if kind == "docx" and not data.startswith(b"PK\x03\x04"):
        raise CorruptDocument(f"{name} is not a .docx file{hint}: a .docx is a zip archive and this is not. "
                              "Upload the original Word file, or give the file its real extension.")


# ---------------------------------------------------------------------------------------------
# Plain text and Markdown


def _read_txt(data: bytes, name: str, limits: _Limits) -> Document:
    return Document(name=name, format="txt", text=decode_text(data, name))


def _read_md(data: bytes, name: str, limits: _Limits) -> Document:
    text = decode_text(data, name)
    return Document(name=name, format="md", text=text, headings=tuple(markdown_headings(text)))


def decode_text(data: bytes, name: str) -> str:
    """Decode text bytes: BOM (UTF-8/16/32), BOM-less UTF-16, UTF-8, then cp1252, then latin-1.

    Newlines become "\\n". Raises UnsupportedFormat for binary content (a known file signature,
    NUL bytes outside UTF-16, or more than BINARY_CONTROL_FRACTION control characters).
    """
    if any(data.startswith(magic) for magic, _ in _MAGIC):
        raise _binary(name, data)  # NOTE: an uncompressed PDF is pure ASCII; only its signature gives it away
    encoding = next((enc for bom, enc in _BOMS if data.startswith(bom)), None) or _utf16_without_bom(data)
    if encoding is None and b"\x00" in data:
        raise _binary(name, data)
    text = _decode_first(data, (encoding,) if encoding else ("utf-8", "cp1252", "latin-1"), name)
    if len(_BINARY_CONTROLS.findall(text)) > BINARY_CONTROL_FRACTION * len(text):
        raise _binary(name, data)
    return text.replace("\r\n", "\n").replace("\r", "\n")


def _decode_first(data: bytes, encodings: tuple[str, ...], name: str) -> str:
    for encoding in encodings:
        try:
            return data.decode(encoding)
        except UnicodeDecodeError:
            continue
    raise CorruptDocument(f"{name} is not valid {encodings[-1]} text. "
                          "Re-save it as UTF-8 and upload it again.")


def _utf16_without_bom(data: bytes) -> str | None:
    """'utf-16-le' / 'utf-16-be' when NULs sit in every other byte, as in ASCII-heavy UTF-16."""
    sample = data[:UTF16_SAMPLE_BYTES]
    half = max(len(sample) // 2, 1)
    even, odd = sample[0::2].count(0) / half, sample[1::2].count(0) / half
    if odd > UTF16_NUL_FRACTION and even < UTF16_NUL_FRACTION / 10:
        return "utf-16-le"
    if even > UTF16_NUL_FRACTION and odd < UTF16_NUL_FRACTION / 10:
        return "utf-16-be"
    return None


def _binary(name: str, data: bytes) -> UnsupportedFormat:
    looks_like = _sniff(data)
    what = f"it looks like {looks_like}" if looks_like else "binary data"
    return UnsupportedFormat(f"{name} is not a text file ({what}). "
                             "Upload the original file with its real extension, or export it as text first.")


def markdown_headings(text: str) -> list[Heading]:
    """ATX headings ("# Title" .. "###### Title") outside fenced code blocks, in order."""
    headings, offset, in_fence = [], 0, False
    for line in text.splitlines(keepends=True):
        if _CODE_FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and (match := _ATX_HEADING.fullmatch(line.rstrip("\n"))) and match.group(2):
            headings.append(Heading(offset, len(match.group(1)), match.group(2).strip()))
        offset += len(line)
    return headings


# ---------------------------------------------------------------------------------------------
# PDF (pypdf text layer)


def _read_pdf(data: bytes, name: str, limits: _Limits) -> Document:
    reader, n_pages = _open_pdf(data, name)
    if n_pages > limits.max_pages:
        raise DocumentTooLarge(f"{name} has {n_pages} pages, over the limit of {limits.max_pages}. "
                               "Raise the page limit (max_pages) or split the PDF.")
    builder, blank = _TextBuilder(), []
    for index in range(n_pages):
        text = _guard(name, lambda: reader.pages[index].extract_text(), f"page {index + 1}")
        text = text.replace("\r\n", "\n").replace("\r", "\n").strip()
        if not text:
            blank.append(index + 1)
            continue
        builder.pages.append(PageStart(builder.add(text), index + 1))
    if not builder.pages:
        raise NoTextLayer(f"{name} has no text layer: its {n_pages} page(s) hold only images (a scan?). "
                          "Run OCR on it (e.g. ocrmypdf) and upload the result.")
    text = builder.text()
    warnings = (f"pages without a text layer (images only?): {', '.join(map(str, blank))}",) if blank else ()
    return Document(name=name, format="pdf", text=text, pages=tuple(builder.pages),
                    headings=tuple(_pdf_outline(reader, text, builder.pages)), page_count=n_pages,
                    warnings=warnings)


def _guard(name: str, call: Callable, what: str = "the file"):
    """Run a library call; any library exception becomes CorruptDocument naming the file."""
    try:
        return call()
    except DocumentError:
        raise
    except Exception as error:  # NOTE: parsers raise anything (KeyError, struct.error...) on bad input
        raise CorruptDocument(f"{name} is damaged: {what} could not be read ({type(error).__name__}: "
                              f"{error}). Re-export or repair the file and upload it again.") from error


def _open_pdf(data: bytes, name: str):
    """(reader, page count) for a readable PDF; an empty user password is tried on encrypted files."""
    from pypdf import PdfReader

    def open_reader():
        reader = PdfReader(io.BytesIO(data))
        if reader.is_encrypted and not _decrypts_without_password(reader):
            raise EncryptedDocument(f"{name} is encrypted (password-protected), so its text layer cannot be "
                                    "read. Remove the password (e.g. save or print it as an unprotected PDF) "
                                    "and upload it again.")
        return reader, len(reader.pages)

    reader, n_pages = _guard(name, open_reader)
    if n_pages == 0:
        raise CorruptDocument(f"{name} has no pages. Re-export the PDF and upload it again.")
    return reader, n_pages


def _decrypts_without_password(reader) -> bool:
    try:
        return bool(reader.decrypt(""))
    except Exception:  # NOTE: pypdf raises DependencyError for AES without `cryptography`
        return False


def _pdf_outline(reader, text: str, pages: list[PageStart]) -> list[Heading]:
    """Headings from the PDF outline (bookmarks), placed at the title's line on its page.

    A title not found on its page is placed at the page start; entries pointing at pages without
    text are dropped. A broken outline yields no headings (the text is still good).
    """
    page_start = {page.page: page.char_start for page in pages}
    page_end = {page.page: end for page, end in zip(pages, [p.char_start for p in pages[1:]] + [len(text)])}
    entries: list[tuple[int, int, str]] = []

    def walk(items, level: int) -> None:
        for item in items:
            if isinstance(item, list):
                walk(item, level + 1)  # a nested list holds the children of the entry before it
            elif (page := reader.get_destination_page_number(item) + 1) in page_start:
                entries.append((page, level, " ".join(str(item.title).split())))

    try:
        walk(reader.outline, 1)
    except Exception:  # NOTE: outlines are optional metadata; malformed ones are common
        return []
    headings = [Heading(_locate(text, title, page_start[page], page_end[page]), level, title)
                for page, level, title in entries if title]
    return sorted(headings, key=lambda heading: heading.char_start)


def _locate(text: str, title: str, start: int, end: int) -> int:
    """Start of the line holding `title` within [start, end), else `start`."""
    found = text.find(title, start, end)
    return start if found < 0 else max(text.rfind("\n", start, found) + 1, start)


# ---------------------------------------------------------------------------------------------
# DOCX (python-docx): headings by style, paragraphs and tables in document order


def _read_docx(data: bytes, name: str, limits: _Limits) -> Document:
    _check_docx_archive(data, name, limits.max_bytes)
    builder = _guard(name, lambda: _docx_blocks(data))
    return Document(name=name, format="docx", text=builder.text(), headings=tuple(builder.headings))


def _check_docx_archive(data: bytes, name: str, max_bytes: int) -> None:
    """Refuse zips that are not Word documents or that would unpack to far more than max_bytes."""
    def inspect_zip():
        with zipfile.ZipFile(io.BytesIO(data)) as archive:
            return set(archive.namelist()), sum(info.file_size for info in archive.infolist())

    names, unpacked = _guard(name, inspect_zip)
    if "word/document.xml" not in names:
        raise CorruptDocument(f"{name} is a zip archive but not a Word document (no word/document.xml). "
                              "Upload the original .docx; Excel or PowerPoint files are not supported.")
    if unpacked > MAX_UNPACK_RATIO * max_bytes:
        raise DocumentTooLarge(f"{name} unpacks to {_size(unpacked)}, over {MAX_UNPACK_RATIO}x the upload "
                               f"limit of {_size(max_bytes)}. "
                               "Raise the limit (max_bytes) or split the document.")


def _docx_blocks(data: bytes) -> _TextBuilder:
    import docx
    from docx.table import Table

    builder = _TextBuilder()
    for block in docx.Document(io.BytesIO(data)).iter_inner_content():
        text = _table_text(block) if isinstance(block, Table) else block.text.strip()
        if not text:
            continue
        start = builder.add(text)
        level = None if isinstance(block, Table) else _docx_heading_level(block)
        if level is not None:
            builder.headings.append(Heading(start, level, " ".join(text.split())))
    return builder


def _docx_heading_level(paragraph) -> int | None:
    """0 for the "Title" style, N for "Heading N", None for body paragraphs."""
    style = paragraph.style
    names = (style.name or "", style.style_id or "") if style is not None else ()
    if any(style_name.lower() == "title" for style_name in names):
        return 0
    match = next((m for style_name in names if (m := _HEADING_STYLE.fullmatch(style_name))), None)
    return int(match.group(1)) if match else None


def _table_text(table) -> str:
    """One line per row, cells joined by TABLE_CELL_SEPARATOR; merged cells appear once."""
    lines = []
    for row in table.rows:
        cells, seen = [], set()
        for cell in row.cells:
            if id(cell._tc) not in seen:  # a merged cell repeats across the columns it spans
                seen.add(id(cell._tc))
                cells.append(" ".join(cell.text.split()))
        if any(cells):
            lines.append(TABLE_CELL_SEPARATOR.join(cells))
    return "\n".join(lines)


_READERS: dict[str, Callable[[bytes, str, _Limits], Document]] = {
    "txt": _read_txt, "md": _read_md, "pdf": _read_pdf, "docx": _read_docx,
}
