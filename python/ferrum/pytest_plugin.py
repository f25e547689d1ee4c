"""pytest plugin: evaluate a model with ordinary pytest tests.

Registered through the ``pytest11`` entry point ``ferrum.pytest_plugin`` when ferrum is
installed (``-p ferrum.pytest_plugin`` loads it explicitly). Options:

  --ferrum-model PATH_OR_ID   model to load (default: SmolLM2-135M-Instruct Q4_1)
  --ferrum-device DEVICE      cpu or opencl[:platform[:device]] (default: cpu)
  --ferrum-threads N          CPU threads (default: all cores)
  --ferrum-kv-dtype DTYPE     f16 (default), f32 or int8
  --ferrum-report FILE.json   write every evaluation's metrics and items there

Fixtures (session-scoped, the model is loaded once): ``ferrum_llm`` (the ``ferrum.LLM``) and
``perplexity``, ``loglikelihood``, ``exact_match`` (the ``ferrum.eval`` functions with the
model bound). Every evaluation they run is recorded: a failing test's report shows the items
(prompt, expected, output, ...) of the evaluations it ran or received from a fixture, and
``--ferrum-report`` writes them all. ferrum itself is imported only when a fixture is first
used, so loading the plugin costs nothing in projects that do not use it.
"""
from __future__ import annotations

import dataclasses
import functools
import json
from typing import List, Optional

import pytest

_RECORDS = pytest.StashKey[list]()        # config: every evaluation of the session
_ITEM_RECORDS = pytest.StashKey[list]()   # item: the evaluations run while it ran
_current_item: List[Optional[pytest.Item]] = [None]


def pytest_addoption(parser):
    group = parser.getgroup("ferrum", "ferrum model evaluation")
    group.addoption("--ferrum-model", default=None, metavar="PATH_OR_ID",
                    help="model for the ferrum_llm fixture: directory, .gguf / llama2.c .bin file or "
                         "hub id (default: SmolLM2-135M-Instruct Q4_1)")
    group.addoption("--ferrum-device", default="cpu", metavar="DEVICE",
                    help="cpu or opencl[:platform[:device]] (default: cpu)")
    group.addoption("--ferrum-threads", type=int, default=None, metavar="N",
                    help="CPU threads (default: all cores)")
    group.addoption("--ferrum-kv-dtype", default="f16", choices=["f16", "f32", "int8"],
                    help="KV cache dtype (default: f16)")
    group.addoption("--ferrum-report", default=None, metavar="FILE.json",
                    help="write every evaluation's metrics and items, per test, to this JSON file")


def pytest_configure(config):
    config.stash[_RECORDS] = []


def pytest_report_header(config):
    model = config.getoption("ferrum_model") or "default (SmolLM2-135M-Instruct Q4_1)"
    return (f"ferrum: model {model}, device {config.getoption('ferrum_device')}, "
            f"threads {config.getoption('ferrum_threads') or 'all'}, kv {config.getoption('ferrum_kv_dtype')}")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current_item[0] = item
    try:
        return (yield)
    finally:
        _current_item[0] = None


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        records = _records_of(item)
        if records:
            report.sections.append(("ferrum evaluation", "\n\n".join(r.table() for r in records)))
    return report


def _records_of(item) -> list:
    """The evaluations a test ran, and those it received as fixture values (a module-scoped
    fixture's exact_match result, say)."""
    records = list(item.stash.get(_ITEM_RECORDS, []))
    by_result = {id(r.result): r for r in item.config.stash.get(_RECORDS, [])}
    for value in getattr(item, "funcargs", {}).values():
        r = by_result.get(id(value))
        if r is not None and r not in records:
            records.append(r)
    return records


def pytest_sessionfinish(session):
    path = session.config.getoption("ferrum_report")
    if not path:
        return
    config = session.config
    report = {
        "model": config.getoption("ferrum_model"), "device": config.getoption("ferrum_device"),
        "threads": config.getoption("ferrum_threads"), "kv_dtype": config.getoption("ferrum_kv_dtype"),
        "evaluations": [r.as_dict() for r in config.stash.get(_RECORDS, [])],
    }
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, ensure_ascii=False)
        f.write("\n")


@dataclasses.dataclass
class _Record:
    """One evaluation call: which test ran it, its metrics and its items (one dict each)."""
    test: Optional[str]
    kind: str
    metrics: dict
    items: List[dict]
    result: object

    def as_dict(self) -> dict:
        return {"test": self.test, "kind": self.kind, "metrics": self.metrics, "items": self.items}

    def table(self) -> str:
        metrics = ", ".join(f"{k} {_cell(v)}" for k, v in self.metrics.items())
        columns = list(self.items[0]) if self.items else []
        rows = [columns] + [[_cell(item[c]) for c in columns] for item in self.items]
        widths = [max(len(row[i]) for row in rows) for i in range(len(columns))]
        lines = [f"{self.kind}: {metrics}"]
        lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        return "\n".join(lines)


CELL_CHARS = 48


def _cell(value) -> str:
    """A table cell: text as it is when that is unambiguous (else its repr), long text cut in the
    middle (a few-shot prompt's question is at its end, an output's answer at its start)."""
    if isinstance(value, float):
        return f"{value:.4f}"
    plain = isinstance(value, str) and value and value.isprintable() and value == value.strip()
    text = value if plain else repr(value)
    if len(text) <= CELL_CHARS:
        return text
    head = (CELL_CHARS - 3) // 2
    return text[:head] + "..." + text[-(CELL_CHARS - 3 - head):]


def _text_or_ids(value):
    return value if isinstance(value, str) else [int(t) for t in value]


def _perplexity_record(args, kwargs, r):
    text = args[0] if args else kwargs.get("text_or_token_ids")
    metrics = {"perplexity": r.perplexity, "nll": r.nll, "num_tokens": r.num_tokens, "num_windows": r.num_windows}
    return metrics, [{"text": _text_or_ids(text), "perplexity": r.perplexity, "num_tokens": r.num_tokens}]


def _loglikelihood_record(args, kwargs, results):
    pairs = list(args[0] if args else kwargs.get("pairs"))
    items = [{"context": _text_or_ids(c), "continuation": _text_or_ids(x), "logprob": r.logprob,
              "is_greedy": r.is_greedy, "num_tokens": r.num_tokens} for (c, x), r in zip(pairs, results)]
    metrics = {"num_items": len(items), "num_greedy": sum(r.is_greedy for r in results),
               "total_logprob": sum(r.logprob for r in results)}
    return metrics, items


def _exact_match_record(args, kwargs, r):
    items = [{"prompt": i.prompt, "expected": i.expected, "output": i.output, "correct": i.correct} for i in r.items]
    return {"accuracy": r.accuracy, "num_correct": r.num_correct, "num_items": len(items)}, items


_RECORDERS = {"perplexity": _perplexity_record, "loglikelihood": _loglikelihood_record,
              "exact_match": _exact_match_record}


def _recorded(config, llm, kind: str):
    """ferrum.eval.<kind> bound to `llm`, recording each call's metrics and items."""
    from ferrum import eval as ferrum_eval
    evaluate = getattr(ferrum_eval, kind)

    @functools.wraps(evaluate)
    def run(*args, **kwargs):
        result = evaluate(llm, *args, **kwargs)
        item = _current_item[0]
        metrics, items = _RECORDERS[kind](args, kwargs, result)
        record = _Record(item.nodeid if item is not None else None, kind, metrics, items, result)
        config.stash[_RECORDS].append(record)
        if item is not None:
            item.stash.setdefault(_ITEM_RECORDS, []).append(record)
        return result
    return run


@pytest.fixture(scope="session")
def ferrum_llm(pytestconfig):
    """The model named by --ferrum-model, loaded once per test session."""
    import ferrum
    return ferrum.LLM(pytestconfig.getoption("ferrum_model"), device=pytestconfig.getoption("ferrum_device"),
                      num_threads=pytestconfig.getoption("ferrum_threads"),
                      kv_dtype=pytestconfig.getoption("ferrum_kv_dtype"))


@pytest.fixture(scope="session")
def perplexity(pytestconfig, ferrum_llm):
    """``perplexity(text_or_ids, window=None, stride=None)`` on the session's model."""
    return _recorded(pytestconfig, ferrum_llm, "perplexity")


@pytest.fixture(scope="session")
def loglikelihood(pytestconfig, ferrum_llm):
    """``loglikelihood([(context, continuation), ...])`` on the session's model."""
    return _recorded(pytestconfig, ferrum_llm, "loglikelihood")


@pytest.fixture(scope="session")
def exact_match(pytestconfig, ferrum_llm):
    """``exact_match([(prompt, expected), ...], **options)`` on the session's model."""
    return _recorded(pytestconfig, ferrum_llm, "exact_match")
