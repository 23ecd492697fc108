"""Small document files built in tests: PDFs with pages, DOCX files with headings (no fixtures on disk)."""
from __future__ import annotations

import io

import docx


def _pdf_string(line: str) -> bytes:
    return b"(" + line.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)").encode("latin-1") + b")"


def make_pdf(pages: list[list[str]]) -> bytes:
    """A minimal valid PDF 1.4, one page per entry, each line drawn in Helvetica (Type1) with
    BT/Tf/Td/Tj/ET; an empty entry is a page with a drawn line and no text. Exact xref offsets."""
    kids = b" ".join(b"%d 0 R" % (4 + 2 * index) for index in range(len(pages)))
    objects = [
        b"<< /Type /Catalog /Pages 2 0 R >>",
        b"<< /Type /Pages /Kids [%s] /Count %d >>" % (kids, len(pages)),
        b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>",
    ]
    for index, lines in enumerate(pages):
        shows = [(b"0 -16 Td " if k else b"") + _pdf_string(line) + b" Tj" for k, line in enumerate(lines)]
        content = b"\n".join([b"BT /F1 12 Tf 72 720 Td", *shows, b"ET"]) if lines else b"0 0 m 200 200 l S"
        objects.append(b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] "
                       b"/Resources << /Font << /F1 3 0 R >> >> /Contents %d 0 R >>" % (5 + 2 * index))
        objects.append(b"<< /Length %d >>\nstream\n%s\nendstream" % (len(content), content))
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for number, body in enumerate(objects, start=1):
        offsets.append(len(out))
        out += b"%d 0 obj\n%s\nendobj\n" % (number, body)
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objects) + 1)
    out += b"".join(b"%010d 00000 n \n" % offset for offset in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objects) + 1, xref)
    return bytes(out)


def make_docx(blocks: list[tuple[int | None, str]]) -> bytes:
    """A DOCX of (heading level, text) blocks: level None is a body paragraph."""
    document = docx.Document()
    for level, text in blocks:
        if level is None:
            document.add_paragraph(text)
        else:
            document.add_heading(text, level=level)
    buffer = io.BytesIO()
    document.save(buffer)
    return buffer.getvalue()
