"""A calibration CSV file's rows: decoding, the header, each row checked into an ObservationIn by line."""

from __future__ import annotations

import csv
import hashlib
import io
from dataclasses import dataclass

from worker.core.calibration import MAX_CSV_BYTES, ObservationError, ObservationIn

# ---------------------------------------------------------------------------
# CSV rows
# ---------------------------------------------------------------------------

CSV_COLUMNS = ("coverage", "answer_kept", "origin", "compaction_id", "idempotency_key")
POSITIONAL_COLUMNS = CSV_COLUMNS[:4]
TRUE_WORDS = frozenset({"true", "t", "1", "yes", "y", "kept"})
FALSE_WORDS = frozenset({"false", "f", "0", "no", "n", "lost"})


# The rows one import takes. MAX_CSV_BYTES was to mean about this many, but rows of "0,1" fit 16.7
# million into it: parsed whole (about 280 bytes a row), 4.7 GB before the first insert, and one
# transaction holding the observations' lock for all of them.
MAX_CSV_ROWS = 2_000_000


class CsvFormatError(ValueError):
    """The file as a whole cannot be read (encoding, header); nothing was imported."""


def decode_csv(data: bytes, source: str) -> str:
    """The file's text (UTF-8, a byte-order mark dropped); CsvFormatError names ``source`` if it is not,
    or if it is longer than MAX_CSV_BYTES (a reader stops at one byte past it)."""
    if len(data) > MAX_CSV_BYTES:
        raise CsvFormatError(f"{source} is over {MAX_CSV_BYTES} bytes; import it in parts")
    try:
        return data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        raise CsvFormatError(f"{source} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def content_digest(content: str) -> str:
    """What names a file's rows (with their lines) when they carry no key: its decoded text, with CRLF
    line ends taken as LF and one last newline. A spreadsheet saving the file again (a byte-order
    mark, CRLF) changed its bytes, and every row was stored a second time."""
    # With one last newline: a file imported before (keyed by its bytes) is the same file, in the usual
    # form (UTF-8 without a byte-order mark, LF, a last newline); a key that changed stored it again.
    normal = content.replace("\r\n", "\n").rstrip("\n") + "\n"
    return hashlib.sha256(normal.encode("utf-8", "surrogatepass")).hexdigest()[:16]


def _parse_label(cell: str) -> bool:
    word = cell.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ObservationError(f"answer_kept {cell!r} is not one of true/false, 1/0, yes/no, kept/lost")


def _parse_row(values: dict[str, str], default_origin: str, line_key: str) -> ObservationIn:
    raw_coverage = values.get("coverage", "")
    try:
        coverage = float(raw_coverage)
    except ValueError:
        raise ObservationError(f"coverage {raw_coverage!r} is not a number") from None
    compaction_id: int | None = None
    raw_id = values.get("compaction_id", "")
    if raw_id:
        # Past 19 digits it is no compaction id (bigint), and int() refuses 4,300 digits and more.
        if not raw_id.isascii() or not raw_id.isdigit() or len(raw_id) > 19:
            raise ObservationError(
                f"compaction_id {raw_id[:40]!r} is not a positive integer of at most 19 digits"
            )
        compaction_id = int(raw_id)
    key = values.get("idempotency_key") or None
    if key is None and compaction_id is None:
        key = line_key  # re-importing the same file reports its rows as duplicates
    return ObservationIn(
        coverage=coverage,
        answer_kept=_parse_label(values.get("answer_kept", "")),
        origin=values.get("origin") or default_origin,
        compaction_id=compaction_id,
        idempotency_key=key,
        origin_given=bool(values.get("origin")),
    )


def _width_error(cells: list[str], columns: tuple[str, ...] | None) -> str | None:
    """Why a data row has the wrong number of cells for the header (or, without one, the positions)."""
    if columns is None and not 2 <= len(cells) <= len(POSITIONAL_COLUMNS):
        return f"expected 2 to 4 columns (coverage,answer_kept,origin[,compaction_id]), got {len(cells)}"
    if columns is not None and len(cells) > len(columns):
        return f"expected at most {len(columns)} columns (as in the header), got {len(cells)}"
    return None


@dataclass
class ParsedCsv:
    good: list[tuple[int, ObservationIn]]  # (line, observation)
    errors: list[tuple[int, str]]  # (line, message)
    rows: int  # data rows seen (blank and comment lines excluded)
    comments: list[int]  # lines skipped as comments: reported, since a data row may start with # too


def parse_observations_csv(content: str, *, default_origin: str, file_digest: str) -> ParsedCsv:
    """Rows of ``coverage,answer_kept,origin[,compaction_id]``, by line: the good ones and the errors.

    A first line naming the columns is a header (then columns may come in any order, and an
    ``idempotency_key`` column is allowed). Blank lines and lines starting with ``#`` are skipped (the
    latter are listed: a row whose first value starts with # is one of them). A blank origin becomes
    ``default_origin``. Line numbers are the file's, counted from 1.
    """
    reader = csv.reader(io.StringIO(content, newline=""))
    good: list[tuple[int, ObservationIn]] = []
    errors: list[tuple[int, str]] = []
    comments: list[int] = []
    columns: tuple[str, ...] | None = None
    rows = 0
    previous_end = 0
    while True:
        start = previous_end + 1
        try:
            record = next(reader)
        except StopIteration:
            break
        except csv.Error as exc:
            if reader.line_num == previous_end:  # no progress: stop rather than loop
                errors.append((start, f"unreadable CSV: {exc}"))
                break
            previous_end = reader.line_num
            rows += 1
            spanned = (
                f" (lines {start} to {reader.line_num} were read as one value before the reader gave up: "
                "none of them was imported)"
                if reader.line_num > start
                else ""
            )
            errors.append((start, f"unreadable CSV: {exc}{spanned}"))
            continue
        previous_end = reader.line_num
        cells = [cell.strip() for cell in record]
        if not any(cells):
            continue
        if reader.line_num > start:  # a quoted value crossed a line end: no value here may hold one
            if cells[0].startswith("#"):  # a comment still (a header may come after it)
                comments.append(start)
            else:
                rows += 1
            if len(comments) + rows > MAX_CSV_ROWS:
                raise _too_many()
            errors.append((start, _spanning(start, reader.line_num)))
            continue
        if cells[0].startswith("#"):
            comments.append(start)
            # Counted against the cap too: a 64 MiB file of "#" lines listed 33 million line numbers.
            if len(comments) + rows > MAX_CSV_ROWS:
                raise _too_many()
            continue
        if columns is None and rows == 0 and cells[0].lower() in CSV_COLUMNS and not _is_number(cells[0]):
            columns = _header(cells, start)
            continue
        rows += 1
        if len(comments) + rows > MAX_CSV_ROWS:
            raise _too_many()
        width_error = _width_error(cells, columns)
        if width_error is not None:
            errors.append((start, width_error))
            continue
        try:
            values = dict(zip(columns or POSITIONAL_COLUMNS, cells, strict=False))
            good.append((start, _parse_row(values, default_origin, f"csv:{file_digest}:{start}")))
        except ObservationError as exc:
            errors.append((start, str(exc)))
    return ParsedCsv(good, errors, rows, comments)


def _too_many() -> CsvFormatError:
    return CsvFormatError(
        f"the file holds more than {MAX_CSV_ROWS:,} rows (comment lines included); import it in parts"
    )


def _spanning(start: int, end: int) -> str:
    return (
        f"lines {start} to {end} were read as one row: a quote opened on line {start} is closed only on "
        f'line {end} (a stray "?); none of those lines was imported'
    )


def _is_number(cell: str) -> bool:
    try:
        float(cell)
    except ValueError:
        return False
    return True


def _header(cells: list[str], line: int) -> tuple[str, ...]:
    names = tuple(cell.lower() for cell in cells)
    unknown = [name for name in names if name not in CSV_COLUMNS]
    if unknown:
        raise CsvFormatError(
            f"line {line}: unknown column(s) {', '.join(map(repr, unknown))}; "
            f"expected {', '.join(CSV_COLUMNS)}"
        )
    missing = [name for name in ("coverage", "answer_kept") if name not in names]
    if missing:
        raise CsvFormatError(f"line {line}: the header has no {' or '.join(missing)} column")
    if len(set(names)) != len(names):
        raise CsvFormatError(f"line {line}: the header repeats a column")
    return names
