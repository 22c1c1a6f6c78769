"""The documentation reads as a book: present-tense wording, links that resolve inside the
repository, every page reachable from docs/README.md (tests/docs/arfuse_docs_checks.py)."""
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
