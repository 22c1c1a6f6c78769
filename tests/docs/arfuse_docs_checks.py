"""Checks of the documentation as a book (run by tests/docs/test_docs.py, in CI through
scripts/test):

- wording: docs/ and README.md describe the system in the present tense; a work log's wording
  (ordinal work rounds such as "the tenth session", machine leases and loans, numbered device
  calls, "device time") belongs in CHANGELOG.md or nowhere. The API's own `Session` RPC and
  "session id" are not work-log wording and stay allowed.
- links: every relative link (and image) of docs/, README.md, CHANGELOG.md and results/README.md
  points to a file or folder inside the repository that exists, and an anchor into a Markdown
  page names one of its headings.
- mentions: a page named in the text as `docs/<page>.md` exists, and nothing points into the
  old `docs/results/` (raw results live under results/).
- the book: every page under docs/ is reachable from the index, docs/README.md.
"""
import os
import re
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|"
             "twelfth|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|"
             "nineteenth|twentieth|\\d+(?:st|nd|rd|th)")
# (pattern, what it is). Case-insensitive; hyphens count as spaces ("twelfth-session/").
WORK_LOG_PATTERNS = [
    (re.compile(rf"\b(?:{_ORDINALS})[\s_-]+(?:work[\s_-]+)?(?:session|round|lease)s?\b", re.I),
     "an ordinal work round"),
    # "this session" stays allowed: the API's pages say it of a client's Session.
    (re.compile(r"\b(?:previous|earlier|later|next|whole) session(?:'s)?\b", re.I),
     "a work session"),
    (re.compile(r"\bsessions? of \d{4}-\d{2}-\d{2}\b", re.I), "a dated work session"),
    (re.compile(r"\bleas(?:e|es|ed)\b", re.I), "a machine lease"),
    (re.compile(r"\b(?:loan|loans|loaned)\b|\b(?:was|were|is|are) lent\b", re.I), "a machine loan"),
    # "call 5", "calls 1-4"; not a duration such as "the slowest call 3.5 ms".
    (re.compile(r"\bcalls? \d+(?!\.\d)\b", re.I), "a numbered device call"),
    (re.compile(r"\bdevice[\s-]time\b", re.I), "device time"),
]

_FENCE = re.compile(r"^\s*(```|~~~)")
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_REF_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$")
_CODE_SPAN = re.compile(r"`+[^`]*`+")
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # http:, https:, mailto:, ...


@dataclass(frozen=True)
class Problem:
    path: str
    line: int
    text: str

    def __str__(self):
        return f"{self.path}:{self.line}: {self.text}"


def rel(path: Path) -> str:
    return path.resolve().relative_to(REPO).as_posix()


def wording_pages():
    """The pages the wording rule covers: docs/**/*.md and README.md."""
    return sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])


def link_pages():
    """The pages whose links are checked."""
    extra = [REPO / "CHANGELOG.md", REPO / "results" / "README.md"]
    return sorted(set(wording_pages() + [p for p in extra if p.exists()]))


def prose_lines(text: str):
    """(line number, line) outside fenced code blocks."""
    fenced = False
    for n, line in enumerate(text.splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            yield n, line


def wording_problems(text: str, path: str = "<text>"):
    """Work-log wording anywhere in the page, code blocks included (a path such as
    `tenth-session/call2/` reads as a work log too)."""
    problems = []
    for n, line in enumerate(text.splitlines(), 1):
        for pattern, what in WORK_LOG_PATTERNS:
            m = pattern.search(line)
            if m:
                problems.append(Problem(path, n, f"{what}: \"{m.group(0)}\" in: {line.strip()}"))
    return problems


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"`([^`]*)`", r"\1", heading.strip().lower())
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str):
    """Every heading's anchor (repeated headings get -1, -2, ... as on GitHub)."""
    seen = {}
    out = set()
    for _, line in prose_lines(text):
        m = re.match(r"^\s{0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = github_slug(m.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f"{slug}-{count}")
    return out


def links(text: str):
    """(line number, target) of every inline, image and reference link outside code."""
    for n, line in prose_lines(text):
        stripped = _CODE_SPAN.sub("", line)
        for m in _INLINE_LINK.finditer(stripped):
            yield n, m.group(1)
        m = _REF_LINK.match(stripped)
        if m:
            yield n, m.group(1)


def link_problems(text: str, page: Path, repo: Path = REPO):
    """Relative links that leave the repository, name a missing file, or a missing anchor."""
    problems = []
    name = page.as_posix() if not page.is_absolute() else page.resolve().relative_to(
        repo.resolve()).as_posix()
    for n, target in links(text):
        if _EXTERNAL.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        if not path_part:
            if anchor and anchor not in anchors(text):
                problems.append(Problem(name, n, f"link {target}: no heading #{anchor} here"))
            continue
        if path_part.startswith("/"):
            problems.append(Problem(name, n, f"absolute link {target}: link relative to the page"))
            continue
        else:
            dest = (page.parent / path_part).resolve()
        try:
            dest.relative_to(repo.resolve())
        except ValueError:
            problems.append(Problem(name, n, f"link {target} points outside the repository"))
            continue
        if not dest.exists():
            problems.append(Problem(name, n, f"link {target}: {path_part} does not exist"))
            continue
        if anchor and dest.suffix == ".md" and dest.is_file():
            if anchor not in anchors(dest.read_text()):
                problems.append(Problem(name, n, f"link {target}: no heading #{anchor} in "
                                                 f"{dest.relative_to(repo.resolve()).as_posix()}"))
    return problems


_DOC_MENTION = re.compile(r"(?<![\w./-])docs/([\w-]+\.md)\b")
_OLD_RESULTS = re.compile(r"(?<![\w./-])docs/results\b")


def mention_problems(text: str, path: str = "<text>", repo: Path = REPO):
    """Pages named by path in prose or code spans that do not exist; mentions of docs/results/."""
    problems = []
    for n, line in prose_lines(text):
        for m in _DOC_MENTION.finditer(line):
            if not (repo / "docs" / m.group(1)).is_file():
                problems.append(Problem(path, n, f"docs/{m.group(1)} does not exist: {line.strip()}"))
        if _OLD_RESULTS.search(line):
            problems.append(Problem(path, n, f"docs/results/ moved to results/: {line.strip()}"))
    return problems


def unreachable_pages(index: Path = None):
    """Pages under docs/ that no chain of links from docs/README.md reaches."""
    index = index or REPO / "docs" / "README.md"
    docs = (REPO / "docs").resolve()
    reached, todo = set(), [index.resolve()]
    while todo:
        page = todo.pop()
        if page in reached or not page.exists():
            continue
        reached.add(page)
        for _, target in links(page.read_text()):
            if _EXTERNAL.match(target):
                continue
            path_part = target.partition("#")[0]
            if not path_part or path_part.startswith("/"):
                continue
            dest = (page.parent / path_part).resolve()
            if dest.suffix == ".md" and dest.is_file() and docs in dest.parents:
                todo.append(dest)
    return sorted(rel(p) for p in (REPO / "docs").rglob("*.md") if p.resolve() not in reached)
