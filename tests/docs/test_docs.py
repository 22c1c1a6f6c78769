"""The documentation reads as a book: present-tense wording (docs/, README.md, results/'s notes and
the code comments), links that resolve inside the repository, every page reachable from
docs/README.md (tests/docs/arfuse_docs_checks.py)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import arfuse_docs_checks as checks  # noqa: E402


def _report(problems):
    return "\n".join(str(p) for p in problems)


@pytest.mark.parametrize("page", checks.wording_pages(), ids=checks.rel)
def test_no_work_log_wording(page):
    problems = checks.wording_problems(page.read_text(), checks.rel(page))
    assert not problems, ("work-log wording (history goes to CHANGELOG.md):\n" +
                          _report(problems))


@pytest.mark.parametrize("page", checks.results_notes(), ids=checks.rel)
def test_no_work_log_wording_in_results_notes(page):
    problems = checks.wording_problems(page.read_text(), checks.rel(page))
    assert not problems, ("work-log wording in results/ (say what was measured, on which "
                          "machine, with which command and commit):\n" + _report(problems))


def test_no_work_log_wording_in_code_comments():
    files = checks.comment_files()
    assert len(files) > 100, "the comment scan found almost no code files"
    problems = [p for f in files for p in checks.comment_problems(f, checks.rel(f))]
    assert not problems, ("work-log wording or a citation of a document outside the repository "
                          "in code comments:\n" + _report(problems))


@pytest.mark.parametrize("page", checks.link_pages(), ids=checks.rel)
def test_links_resolve_inside_the_repository(page):
    problems = checks.link_problems(page.read_text(), page)
    assert not problems, "broken links:\n" + _report(problems)


@pytest.mark.parametrize("page", checks.wording_pages(), ids=checks.rel)
def test_pages_named_by_path_exist(page):
    problems = checks.mention_problems(page.read_text(), checks.rel(page))
    assert not problems, "stale page names:\n" + _report(problems)


def test_mentions_of_missing_pages_and_old_results_are_found(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "kernels.md").write_text("# K\n")
    text = ("see docs/kernels.md\nsee docs/benchmarks.md\nlogs in `docs/results/tp.log`\n"
            "```\ndocs/gone.md in a code block\n```\n")
    problems = checks.mention_problems(text, "p.md", repo=tmp_path)
    assert [p.line for p in problems] == [2, 3], _report(problems)
    assert "docs/benchmarks.md does not exist" in problems[0].text
    assert "docs/results/ moved to results/" in problems[1].text


def test_every_docs_page_is_reachable_from_the_index():
    assert checks.unreachable_pages() == [], "link these pages from docs/README.md"


# ---- the checks themselves catch what they must, and only that ----

@pytest.mark.parametrize("text, what", [
    ("as measured in the tenth session of 2026-11-30", "an ordinal work round"),
    ("the twelfth session's runs", "an ordinal work round"),
    ("logs in `docs/results/eleventh-session/call2/`", "an ordinal work round"),
    ("(third round of the A/B)", "an ordinal work round"),
    ("one run of the fourth lease", "an ordinal work round"),
    ("the 4th session", "an ordinal work round"),
    ("not measured in the previous session", "a work session"),
    ("three runs on one lease", "a machine lease"),
    ("builds alternating on two leases", "a machine lease"),
    ("only one H200 was lent", "a machine loan"),
    ("(docs/results/gpu-runs-2026-11-30-j.txt, call 2)", "a numbered device call"),
    ("calls 1-4 found that", "a numbered device call"),
    ("its device time was spent", "device time"),
    ("the twelfth session's figures", "an ordinal work round"),
    ("Results: results/2026-12-01-a-serving-blocks/run8/", "a numbered device call or run"),
    ("as run 5 showed", "a numbered device call or run"),
    ("runs 1-4 found that", "a numbered device call or run"),
    ("(call2 of the set)", "a numbered device call or run"),
    ("measured on 2026-12-01 on one H200", "a date in prose"),
    ("measured on December 1, 2026", "a date in prose"),
    ("the rules of design.md §4", "a document the repository does not hold"),
    ("validation rules (design §5)", "a document the repository does not hold"),
    ("the holes of issue 26", "a document the repository does not hold"),
    ("as in the previous session", "a work session"),
    ("a helper found it", "a helper"),
    ("packed into .devpack/stage.tar.xz", "the lab's staging"),
])
def test_work_log_wording_is_found_and_named(text, what):
    problems = checks.wording_problems(f"# Page\n\n{text}\n", "p.md")
    assert problems, text
    assert problems[0].line == 3 and what in problems[0].text, problems


@pytest.mark.parametrize("text", [
    "The `Session` RPC opens a session; every call carries the session id.",
    "Regions belong to the session that made them; a session's regions are released.",
    "the release store and the acquire load; releases are cumulative",
    "the first call of a session; the second call waits",
    "one call per op; a recall of the API",
    "Per-session caps: 64 regions.",
    "unknown region or plan in this session",
    "the slowest call 3.5 ms",
    "FlashInfer's mnnvl backend runs 2-64 ranks; NormOp runs 2 of them",
    "both re-attach and run 20 verified ops",
    "results/2026-12-01-c-instream/NOTES.txt and `2026-11-30-j-shared-spin/69b5bbc/`",
    "the first session ticket of TLS; the session stream; arfuse-session",
    "SGLang PR #23402 and #28789",
    "the test helpers, a helper process, the memory-model helpers",
])
def test_api_wording_is_allowed(text):
    assert checks.wording_problems(text) == []


def test_links_to_missing_files_outside_and_bad_anchors_are_found(tmp_path):
    repo = tmp_path / "repo"
    (repo / "docs").mkdir(parents=True)
    (repo / "docs" / "b.md").write_text("# B\n\n## The part `x`, 2\n")
    page = repo / "docs" / "a.md"
    text = "\n".join([
        "# A",
        "[ok](b.md) [ok anchor](b.md#the-part-x-2) [same page](#a) [web](https://x.org/y)",
        "[same page, no such heading](#b)",
        "[missing](c.md)",
        "[outside](../../elsewhere/design.md)",
        "[bad anchor](b.md#nothing-here)",
        "![missing picture](figures/p.png)",
        "[absolute](/etc/passwd)",
        "```",
        "[in code](nowhere.md)",
        "```",
        "`[in a code span](nowhere.md)`",
    ])
    problems = checks.link_problems(text, page, repo=repo)
    assert [p.line for p in problems] == [3, 4, 5, 6, 7, 8], _report(problems)
    assert "no heading #b here" in problems[0].text
    assert "does not exist" in problems[1].text and "c.md" in problems[1].text
    assert "outside the repository" in problems[2].text
    assert "no heading #nothing-here" in problems[3].text
    assert "figures/p.png does not exist" in problems[4].text
    assert "absolute link" in problems[5].text


def test_github_anchors():
    assert checks.github_slug("Numerics (identical on CPU and GPU)") == \
        "numerics-identical-on-cpu-and-gpu"
    assert checks.github_slug("4x H200 (NVLink), world size 4") == "4x-h200-nvlink-world-size-4"
    assert checks.github_slug("`arfusectl`") == "arfusectl"
    assert checks.anchors("# A\n## A\n```\n# not a heading\n```\n") == {"a", "a-1"}


# ---- code comments: every language's comments are read, strings and code are not ----

_PLANTED = {
    "kernels/k.cu": ('// The fused op (design.md §1).\nconst char* s = "run 5 of issue 26";\n'
                     '/* measured in the tenth session\n   on 2026-11-30 */\nint x = 1;\n'),
    "server/s.cc": ('auto r = R"(issue 7)";  // fine\n// see run7/ for the numbers\n'),
    "client/python/p.py": ('"""Client (issue 25)."""\nx = "design.md"\n'
                           'def f():\n    """As in call 3."""\n    return 1  # a lease\n'),
    "scripts/s": ('#!/usr/bin/env bash\n# staged for the twelfth session\necho "#not a comment"\n'
                  'n=$#  # fine\n'),
    "tests/CMakeLists.txt": ("# Reliability (issue 6)\nadd_test(NAME x COMMAND y)\n"),
    "tests/t.cc": ("// the test helpers of a gRPC session; the slowest call 3.5 ms\n"),
}


def test_work_log_wording_in_comments_is_found_in_every_language(tmp_path):
    for name, text in _PLANTED.items():
        path = tmp_path / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    found = {}
    for name in _PLANTED:
        for p in checks.comment_problems(tmp_path / name, name):
            found.setdefault(name, []).append(p.line)
    assert found == {
        "kernels/k.cu": [1, 3, 4],
        "server/s.cc": [2],
        "client/python/p.py": [1, 4, 5],
        "scripts/s": [2],
        "tests/CMakeLists.txt": [1],
    }, found


def test_comment_files_cover_the_code_and_leave_out_the_checks():
    names = {checks.rel(p) for p in checks.comment_files()}
    for expected in ("kernels/host/reference_core.h", "server/daemon/options.cc",
                     "client/python/arfuse/_native.py", "scripts/gpu-stage",
                     "tests/python/conftest.py"):
        assert expected in names
    assert not any(n.startswith("tests/docs/") for n in names)
