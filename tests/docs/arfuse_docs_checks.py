"""Checks of the documentation as a book, and of the project's own prose elsewhere (run by
tests/docs/test_docs.py, in CI through scripts/test):

- wording: docs/, README.md, results/'s notes (README.md, NOTES.txt, the measurement scripts) and
  the code comments under kernels/ server/ client/ examples/ tests/ scripts/ deploy/ bench/
  describe the system in the present tense. A work log's wording belongs in CHANGELOG.md or
  nowhere: ordinal work rounds, machine leases and loans, numbered device calls and runs, device
  time, dates in prose (a date inside a results/ folder name or link is a name, not prose), and
  citations of documents the repository does not hold (a design.md, an issue number). The
  technical senses stay allowed: the API's `Session` RPC, a client's session, session ids and
  streams, `arfuse-session`; a "helper" function, process or binary in code; a duration such as
  "the slowest call 3.5 ms"; a verb such as "runs 2-64 ranks".
- links: every relative link (and image) of docs/, README.md, CHANGELOG.md and results/README.md
  points to a file or folder inside the repository that exists, and an anchor into a Markdown
  page names one of its headings.
- mentions: a page named in the text as `docs/<page>.md` exists, and nothing points into the
  old `docs/results/` (raw results live under results/).
- the book: every page under docs/ is reachable from the index, docs/README.md.
"""
import ast
import io
import re
import subprocess
import tokenize
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

_ORDINALS = ("first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|"
             "twelfth|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|"
             "nineteenth|twentieth|\\d+(?:st|nd|rd|th)")
_MONTHS = ("January|February|March|April|May|June|July|August|September|October|November|"
           "December")
# What may follow a number after "run(s)" or "call(s)" when the word is a verb or a count, not
# a run number: "run 20 verified ops", "runs 2-64 ranks"; the pattern's lookbehinds allow a
# backend or op as the verb's subject ("mnnvl runs 32 and 64 ranks", "NormOp runs 2 of them").
_COUNTED = (r"(?:ranks?|ops?|tokens?|times|processes|steps|layers|replays|iterations|"
            r"rounds|GPUs?|ms|s|µs|us|x|threads?|blocks?|clients?|sidecars?|shapes?|tests?)\b")
# (pattern, what it is). Case-insensitive; hyphens count as spaces ("twelfth-session/").
WORK_LOG_PATTERNS = [
    (re.compile(rf"\b(?:{_ORDINALS})[\s_-]+(?:work[\s_-]+)?(?:session|round|lease|loan|"
                rf"device[\s_-]+call)s?\b(?!\s+tickets?)", re.I), "an ordinal work round"),
    # "this session" stays allowed: the API's pages say it of a client's Session.
    (re.compile(r"\b(?:previous|earlier|later|next|whole|work|lab|GPU|device|helper) "
                r"sessions?(?:'s)?\b", re.I), "a work session"),
    (re.compile(r"\bsession's (?:final|last|own (?:code|runs)|runs|GPU|figures)\b", re.I),
     "a work session"),
    (re.compile(r"\bsessions? of \d{4}-\d{2}-\d{2}\b", re.I), "a dated work session"),
    (re.compile(r"\bleas(?:e|es|ed)\b", re.I), "a machine lease"),
    (re.compile(r"\b(?:loan|loans|loaned)\b|\b(?:was|were|is|are) lent\b", re.I), "a machine loan"),
    # "call 5", "calls 1-4", "call2", "run 3", "run7/"; not a duration ("the slowest call
    # 3.5 ms") nor a verb or a count ("runs 2-64 ranks").
    (re.compile(rf"(?<!mnnvl )(?<!trtllm )(?<!backend )(?<!NormOp )\b(?:run|call)s?[ #]?\d+(?:\s*[-–]\s*\d+)?\b(?![.,\-–]\d)"
                rf"(?!\s+(?:\w+\s+)?{_COUNTED})", re.I), "a numbered device call or run"),
    (re.compile(r"\bdevice[\s-]time\b|\bdevice calls?\b", re.I), "device time"),
    # A date in prose; one inside a results/ folder name ("2026-12-01-c-instream") or after
    # "results/" is a name.
    (re.compile(r"(?<![\w/-])(?<!results/)\d{4}-\d{2}-\d{2}\b(?!-[a-z])", re.I), "a date in prose"),
    (re.compile(rf"\b(?:{_MONTHS}) \d{{1,2}}(?:st|nd|rd|th)?(?:, \d{{4}})?\b"), "a date in prose"),
    (re.compile(r"\bdesign(?:\.md)? §|\bdesign\.md\b|\bissues? #?\d+\b", re.I),
     "a document the repository does not hold"),
]
# Docs and results only: words that are technical in code ("test helpers", "the fused backends
# carry") but lab notes in a book.
PROSE_ONLY_PATTERNS = [
    (re.compile(r"\bhelpers?\b(?!\s+(?:function|process|binar(?:y|ies)|thread|script)s?\b)",
                re.I), "a helper (say what did the work)"),
    (re.compile(r"\.devpack\b|\bcarry limit|\bnvidia-h200(?:-x\d)?\b", re.I),
     "the lab's staging and machine kinds"),
]
_HELPER_ALLOWED = re.compile(r"\b(?:test|memory-model|spin|device|sentinel|TP-group|the tests')"
                             r" helpers?\b", re.I)

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


def _line_problems(line, path, n, prose=True):
    patterns = WORK_LOG_PATTERNS + (PROSE_ONLY_PATTERNS if prose else [])
    problems = []
    for pattern, what in patterns:
        for m in pattern.finditer(line):
            if what.startswith("a helper") and _HELPER_ALLOWED.search(line):
                continue
            problems.append(Problem(path, n, f"{what}: \"{m.group(0)}\" in: {line.strip()}"))
            break
    return problems


def wording_problems(text: str, path: str = "<text>"):
    """Work-log wording anywhere in the page, code blocks included (a path such as
    `tenth-session/call2/` reads as a work log too)."""
    problems = []
    for n, line in enumerate(text.splitlines(), 1):
        problems += _line_problems(line, path, n)
    return problems


def results_notes():
    """The prose of results/: its README, each folder's NOTES.txt and measurement scripts (the
    raw logs and JSON are kept as the tools wrote them)."""
    res = REPO / "results"
    return sorted([p for p in res.rglob("*") if p.is_file() and
                   (p.name in ("README.md", "NOTES.txt") or p.suffix == ".sh")])


# ---- code comments ----

COMMENT_ROOTS = ("kernels", "common", "config", "server", "client", "tools", "examples", "tests",
                 "scripts", "deploy", "bench")
# The checks' own examples of what they refuse.
COMMENT_EXCLUDED = ("tests/docs/",)
_C_EXT = {".cc", ".h", ".cu", ".cuh", ".cpp", ".hpp", ".c", ".proto"}
_HASH_EXT = {".sh", ".cmake", ".yaml", ".yml", ".toml"}


def comment_kind(path: Path):
    """"c" (// and /* */), "py" (# and docstrings), "hash" (# in shell, CMake, YAML) or None."""
    if path.suffix in _C_EXT:
        return "c"
    if path.suffix == ".py":
        return "py"
    if path.name == "CMakeLists.txt" or path.suffix in _HASH_EXT:
        return "hash"
    if path.suffix:
        return None
    try:
        with path.open(errors="replace") as f:
            first = f.readline()
    except OSError:
        return None
    if first.startswith("#!"):
        return "py" if "python" in first else "hash"
    return None


def c_comments(text: str):
    """(line, text) of every // and /* */ comment line, skipping string and character literals
    (raw strings included)."""
    out, i, n, line = [], 0, len(text), 1
    while i < n:
        ch = text[i]
        if ch == "\n":
            line += 1
            i += 1
        elif text.startswith("//", i):
            j = text.find("\n", i)
            j = n if j < 0 else j
            out.append((line, text[i + 2:j]))
            i = j
        elif text.startswith("/*", i):
            j = text.find("*/", i + 2)
            j = n if j < 0 else j
            for k, part in enumerate(text[i + 2:j].split("\n")):
                out.append((line + k, part))
            line += text.count("\n", i, j)
            i = j + 2
        elif ch == "R" and text.startswith('R"', i) and (i == 0 or not (text[i - 1].isalnum()
                                                                     or text[i - 1] == "_")):
            m = re.match(r'R"([^(\s]{0,16})\(', text[i:i + 20])
            if not m:
                i += 1
                continue
            end = text.find(")" + m.group(1) + '"', i)
            end = n if end < 0 else end
            line += text.count("\n", i, end)
            i = end + len(m.group(1)) + 2
        elif ch in "\"'":
            if ch == "'" and i > 0 and text[i - 1].isalnum():  # a digit separator: 1'000
                i += 1
                continue
            j = i + 1
            while j < n and text[j] != ch and text[j] != "\n":
                j += 2 if text[j] == "\\" else 1
            i = j + 1
        else:
            i += 1
    return out


def py_comments(text: str):
    """(line, text) of every # comment and every docstring line."""
    out = []
    try:
        for tok in tokenize.generate_tokens(io.StringIO(text).readline):
            if tok.type == tokenize.COMMENT:
                out.append((tok.start[0], tok.string[1:]))
    except (tokenize.TokenError, SyntaxError):
        pass
    try:
        tree = ast.parse(text)
    except SyntaxError:
        return out
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = node.body[0] if node.body else None
            if (isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                    and isinstance(doc.value.value, str)):
                for k, part in enumerate(doc.value.value.split("\n")):
                    out.append((doc.lineno + k, part))
    return sorted(out)


def hash_comments(text: str):
    """(line, text) of every # comment of a shell script, CMake file or YAML file (quoted strings,
    $# and ${#...} are not comments)."""
    out = []
    for n, raw in enumerate(text.splitlines(), 1):
        s = re.sub(r"'[^']*'|\"(?:[^\"\\]|\\.)*\"", lambda m: " " * len(m.group(0)), raw)
        m = re.search(r"(?:^|\s)#(?![!{])", s)
        if m:
            out.append((n, raw[m.end():]))
    return out


def comments(path: Path):
    kind = comment_kind(path)
    if kind is None:
        return []
    text = path.read_text(errors="replace")
    return {"c": c_comments, "py": py_comments, "hash": hash_comments}[kind](text)


def comment_files(repo: Path = REPO):
    """The tracked files under COMMENT_ROOTS whose comments the wording rule covers."""
    try:
        listed = subprocess.run(["git", "-C", str(repo), "ls-files", *COMMENT_ROOTS],
                                capture_output=True, text=True, check=True).stdout.split()
        files = [repo / f for f in listed]
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file
        files = [p for r in COMMENT_ROOTS for p in (repo / r).rglob("*")]
    return sorted(p for p in files if p.is_file() and comment_kind(p) is not None and
                  not p.relative_to(repo).as_posix().startswith(COMMENT_EXCLUDED))


def comment_problems(path: Path, name: str = None):
    """Work-log wording in a code file's comments (the prose-only words are technical in code)."""
    name = name or path.as_posix()
    problems = []
    for n, text in comments(path):
        problems += _line_problems(text, name, n, prose=False)
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
