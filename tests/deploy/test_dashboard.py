"""The Grafana dashboard (deploy/k8s/monitoring/dashboards/arfuse.json) against a real sidecar:
every metric name its PromQL expressions use is one that host-mode arfused serves on its
metrics endpoint, after one op on a group of two. No Grafana, no cluster, no GPU."""
import json
import re

import pytest

import arfuse_run as run

DASHBOARD = run.REPO / "deploy" / "k8s" / "monitoring" / "dashboards" / "arfuse.json"

# Names the dashboard may use before the sidecar exports them, each with what adds it. Nothing
# else: an unknown name fails the test, naming it.
NOT_YET_EXPORTED = {}

# PromQL words that look like names: aggregation clauses, set and vector-matching operators.
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "bool", "offset",
             "and", "or", "unless", "inf", "nan"}


def promql_metric_names(expr: str) -> set:
    """The metric names a PromQL expression selects (functions, labels, keywords and Grafana
    variables left out)."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)          # string literals
    e = re.sub(r"\{[^}]*\}", "", e)                         # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)                        # ranges and subqueries
    # Clauses with label lists ("sum by (pod) (x)" becomes "sum (x)", a call).
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)
    e = re.sub(r"\$\{?\w+\}?", "", e)                       # $pod, ${datasource}
    names = set()
    for m in re.finditer(r"(?<![\w.])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?", e):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in _KEYWORDS:
            continue
        names.add(word)
    return names


def dashboard_exprs(board: dict) -> list:
    """(where, PromQL) for every panel target and every templating query."""
    out = [(f"panel {p['id']} \"{p['title']}\" {t['refId']}", t["expr"])
           for p in board["panels"] for t in p.get("targets", [])]
    for v in board.get("templating", {}).get("list", []):
        q = v.get("query")
        if isinstance(q, str) and v.get("type") == "query":
            # label_values(metric, label): the metric is the selector.
            m = re.fullmatch(r"\s*label_values\(\s*([^,]+?)\s*,\s*\w+\s*\)\s*", q)
            out.append((f"variable {v['name']}", m.group(1) if m else q))
    return out


def exported_names(text: str) -> set:
    """Every series name a scrape holds: each family's name and, for histograms and summaries,
    its _bucket, _sum and _count series."""
    names = set()
    for m in re.finditer(r"^# TYPE (\w+) (\w+)$", text, re.M):
        names.add(m.group(1))
        if m.group(2) in ("histogram", "summary"):
            names.update(m.group(1) + s for s in ("_bucket", "_sum", "_count"))
    names.update(re.findall(r"^([a-zA-Z_:][\w:]*)(?:\{| )", text, re.M))
    return names


def unknown_names(board: dict, exported: set) -> list:
    """'name (where: expr)' for every name the dashboard uses that is neither exported nor
    allowed by NOT_YET_EXPORTED."""
    problems = []
    for where, expr in dashboard_exprs(board):
        for name in sorted(promql_metric_names(expr)):
            if name not in exported and name not in NOT_YET_EXPORTED:
                problems.append(f"{name} ({where}: {expr})")
    return problems


@pytest.fixture(scope="module")
def scrape(tmp_path_factory):
    """/metrics of rank 0 of two host-mode sidecars after one op on both."""
    return run.scrape_after_one_op(tmp_path_factory.mktemp("dashboard"))


def test_the_extractor_finds_metric_names_only():
    assert promql_metric_names(
        'histogram_quantile(0.99, sum by (le) (rate(arfuse_op_latency_seconds_bucket'
        '{pod=~"$pod",plane="eager"}[5m]))) / on(pod) group_left(version) arfuse_build_info') \
        == {"arfuse_op_latency_seconds_bucket", "arfuse_build_info"}
    assert promql_metric_names('sum by (reason) (rate(x_total{path="a{b}"}[$__rate_interval]))'
                               ' > bool 0 or vector(1)') == {"x_total"}
    assert promql_metric_names("increase(arfuse_poisonings_total[1h]) offset 5m") == \
        {"arfuse_poisonings_total"}


def test_an_unknown_name_fails_naming_it():
    board = {"panels": [{"id": 1, "title": "t", "targets": [
        {"refId": "A", "expr": 'rate(arfuse_ops_total[5m]) + rate(arfuse_no_such_total[5m])'},
        {"refId": "B", "expr": "arfuse_instream_ops_total"}]}],
             "templating": {"list": [{"name": "pod", "type": "query",
                                      "query": "label_values(arfuse_gone_info, pod)"}]}}
    problems = unknown_names(board, {"arfuse_ops_total", "arfuse_instream_ops_total"})
    assert [p.split(" ")[0] for p in problems] == ["arfuse_no_such_total", "arfuse_gone_info"]
    assert "panel 1 \"t\" A" in problems[0] and "variable pod" in problems[1]


def test_every_dashboard_metric_is_exported(scrape):
    board = json.loads(DASHBOARD.read_text())
    exported = exported_names(scrape)
    assert "arfuse_build_info" in exported and "arfuse_op_latency_seconds_bucket" in exported
    used = set().union(*(promql_metric_names(e) for _, e in dashboard_exprs(board)))
    assert len(used) >= 15, sorted(used)
    problems = unknown_names(board, exported)
    assert not problems, ("the dashboard uses metrics this sidecar does not export:\n  "
                          + "\n  ".join(problems))
    # The allow-list holds only names still missing: one the sidecar exports now is removed.
    stale = sorted(n for n in NOT_YET_EXPORTED if n in exported)
    assert not stale, f"{stale} is exported now: remove it from NOT_YET_EXPORTED"


def test_the_dashboard_has_the_live_view_panels():
    board = json.loads(DASHBOARD.read_text())
    exprs = {p["title"]: " ".join(t["expr"] for t in p["targets"]) for p in board["panels"]}
    wanted = {"fused and declined": 'arfuse_instream_ops_total{pod=~"$pod"}',
              "declined ops": 'arfuse_instream_ops_total{path="declined"',
              "by plane": "arfuse_ops_total", "generation": "arfuse_workspace_generation",
              "Poisonings": "arfuse_poisonings_total"}
    for title_part, expr_part in wanted.items():
        hits = [t for t, e in exprs.items() if title_part in t and expr_part in e]
        assert hits, f"no panel titled ...{title_part}... using {expr_part}"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), ids
