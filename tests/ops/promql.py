"""The metric names a PromQL expression reads, and the series names a /metrics page exports.

Not a PromQL parser: enough to find every metric name in the project's dashboard and
rules. Strings, label matchers, ranges and grouping clauses are removed first; what is
left that looks like a name and is not a function call or a keyword is a metric.
"""

from __future__ import annotations

import re

from prometheus_client.parser import text_string_to_metric_families

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_NAME = re.compile(r"(?<![\w:.$])([a-zA-Z_:][\w:]*)(?![\w:]|\s*\()")
KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "atan2", "start", "end"}
SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("", "_sum", "_count", "_created"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
}


def metric_names(expression: str) -> set[str]:
    text = _STRING.sub(" ", expression)
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    return {name for name in _NAME.findall(text) if name.lower() not in KEYWORDS}


def exported_series(exposition: str) -> set[str]:
    """Every series name a scrape of this /metrics text can hold, samples or not."""
    names: set[str] = set()
    for family in text_string_to_metric_families(exposition):
        names |= {family.name + suffix for suffix in SUFFIXES.get(family.type, ("",))}
        names |= {sample.name for sample in family.samples}
    return names
