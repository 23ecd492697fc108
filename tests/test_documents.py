"""Uploads (chat/documents.py): a document is read and cut into segments once, at ingest,
keeping pages and headings; prefill progress is measured, not estimated (issue #18)."""
import pytest

from chat.config import AppConfig, size_text
from chat.documents import PrefillProgress, count_tokens_within, ingest, prefill_text, segment_document
from chat.errors import ConversationTooLong, NotEnoughDisk
from chat.service import ChatService, disk_too_full
from spotlight.testing import tiny_engine
from files import make_docx, make_pdf
from segmenter import read_document
from spotlight.config import SamplingConfig

PAGE_LINES = [[f"Page {page} line {line} says something about the harvest of year {1900 + line}." for line in range(5)]
              for page in (1, 2, 3)]


def test_pdf_segments_keep_their_pages(tmp_path):
    path = tmp_path / "report.pdf"
    path.write_bytes(make_pdf(PAGE_LINES))
    document = read_document(str(path), "report.pdf")
    segments = segment_document(document, tiny_engine().count_tokens)
    assert [(s.page, document.text[s.char_start:s.char_start + 11]) for s in segments] == [
        (1, "Page 1 line"), (2, "Page 2 line"), (3, "Page 3 line")]


def test_docx_segments_keep_their_headings(tmp_path):
    body = " ".join(f"Sentence {i} of the body has a few words in it." for i in range(8))  # ~400 bytes
    path = tmp_path / "manual.docx"
    path.write_bytes(make_docx([(0, "Manual"), (1, "Setup"), (None, body), (1, "Maintenance"), (None, body)]))
    document = read_document(str(path), "manual.docx")
    segments = segment_document(document, tiny_engine().count_tokens)
    assert [s.heading for s in segments] == ["Manual › Setup", "Manual › Maintenance"]


def test_prefill_text_shows_a_measured_rate_once_there_is_one():
    assert prefill_text(1024, 30000) == "Reading 1,024 of 30,000 tokens into memory"
    assert prefill_text(3072, 30000, 2048, 0.2) == "Reading 3,072 of 30,000 tokens into memory"
    assert prefill_text(3072, 30000, 2048, 8.0) == ("Reading 3,072 of 30,000 tokens into memory "
                                                    "(256 tokens/s, about 105 s left)")
    assert prefill_text(29900, 30000, 2048, 8.0) == ("Reading 29,900 of 30,000 tokens into memory "
                                                     "(256 tokens/s, almost done)")


def test_prefill_progress_measures_from_the_first_report():
    seen = []
    clock = iter([10.0, 14.0, 18.0])
    progress = PrefillProgress(lambda fraction, text: seen.append((round(fraction, 3), text)), clock=lambda: next(clock))
    for done in (1000, 2000, 3000):
        progress(done, 4000)
    assert seen == [
        (0.325, "Reading 1,000 of 4,000 tokens into memory"),
        (0.55, "Reading 2,000 of 4,000 tokens into memory (250 tokens/s, about 8 s left)"),
        (0.775, "Reading 3,000 of 4,000 tokens into memory (250 tokens/s, about 4 s left)"),
    ]


def test_ingest_reports_the_engines_prefill_chunks(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("The harvest was late that year. " * 60)
    service = ChatService(AppConfig(home=tmp_path, sampling=SamplingConfig(max_new_tokens=2)),
                          _engine=tiny_engine(prefill_chunk=256))
    session = service.create()
    seen = []
    report = ingest(service, session.id, [str(path)], progress=lambda fraction, text: seen.append(text))
    total = report.resume.computed_tokens
    done = [int(text.split()[1].replace(",", "")) for text in seen if text.startswith("Reading ") and " of " in text]
    assert report.errors == [] and [d.name for d in report.documents] == ["notes.txt"]
    assert done == [min(total, 256 * k) for k in range(1, len(done) + 1)] and done[-1] == total
    assert seen[-1] == "Done"


def test_counting_against_a_limit_stops_early_and_never_tokenises_the_whole_text():
    text = "word " * 1_000_000  # 5 MB
    calls = []

    def count(piece: str) -> int:
        calls.append(len(piece))
        return len(piece.split())

    assert count_tokens_within(count, text, 50_000) is None
    assert max(calls) <= 1 << 16 and sum(calls) < 400_000  # ~50K words of work, not 1M
    assert count_tokens_within(count, "a b c " * 30_000, 10**6) == 90_000


def test_a_document_over_the_window_is_refused_before_it_is_segmented(tmp_path):
    service = ChatService(AppConfig(home=tmp_path), _engine=tiny_engine(max_seq_len=2048))
    session = service.create()
    with pytest.raises(ConversationTooLong) as error:
        service.attach_text(session.id, "big.txt", "All work and no play. " * 5000)
    assert str(error.value) == (
        "big.txt is longer than the 1,905 tokens left in this conversation: with Spotlight off the model reads "
        "at most 2,048 tokens at once (about 5 pages). Turn Spotlight on to read beyond that, attach a shorter "
        "excerpt, or start a new chat for it.")
    assert service.documents(session.id) == []


def test_a_document_whose_cache_would_not_fit_the_disk_budget_is_refused_before_it_is_read(tmp_path):
    engine = tiny_engine(spotlight=True)  # 288 bytes per cached token: K/V rows and key codes
    service = ChatService(AppConfig(home=tmp_path, disk_budget_bytes=1_000_000), _engine=engine)
    session = service.create()
    text = "All work and no play. " * 200  # 4,400 bytes, a token each (+ the prompt): ~1.3 MB of cache
    with pytest.raises(NotEnoughDisk) as error:
        service.attach_text(session.id, "big.txt", text)
    assert str(error.value) == (
        "big.txt needs about 1.3 MB of disk for this conversation's cache (what makes questions about it fast), "
        "more than the 1.0 MB the cache may use. Start the app with --disk-budget-gb 1 to allow more, or attach "
        "a shorter excerpt.")
    assert service.documents(session.id) == []
    service.attach_text(session.id, "small.txt", text[:2000])  # what fits is attached


def test_the_disk_messages_say_what_is_needed_and_what_to_do():
    assert disk_too_full("book.pdf", 13_100_000_000, 2_400_000_000) == (
        "book.pdf needs about 13.1 GB of disk for its cache, and the disk that holds the data directory has 2.4 GB "
        "free. Free some disk space (deleting conversations you no longer need frees their cache), then attach it "
        "again.")
    assert [size_text(n) for n in (850_000, 4_200_000, 310_000_000, 13_100_000_000)] == [
        "850 KB", "4.2 MB", "310 MB", "13.1 GB"]


def test_impossible_checkpoint_and_disk_settings_are_refused_in_words():
    with pytest.raises(ValueError) as error:
        AppConfig(checkpoint_tokens=0)
    assert str(error.value) == "checkpoint_tokens must be at least 1, got 0"
    with pytest.raises(ValueError) as error:
        AppConfig(disk_budget_bytes=-5)
    assert str(error.value) == "the disk budget for the cache must be positive, got -5 bytes"
