"""Checks every GPU benchmark applies before it reports a number as "graphs", and the answer
comparison between two runs of the same requests.

A capture that fails can leave an executor serving eagerly; a benchmark that then labels its
numbers "graphs" reports eager numbers under the wrong name. So a benchmark that asked for CUDA
graphs reads the executor's own account (`describe()`, or the worker info in `/health`): which
`[rows, tokens]` shapes were captured (`graph_shapes`) against the length buckets it serves
(`buckets`). Fields a worker does not report are unknown, never assumed: on a CUDA device an
unknown capture is a failure, on CPU (where graphs are an eager stand-in) it is reported as
unknown. Likewise a latency the answer cache served is not a forward: `cache_hits` reads the
server's own count of them from `/metrics`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

ANSWER_CACHE_SAMPLE = "clef_answer_cache_total"


def cache_hits(metrics_text: str) -> int | None:
    """Requests the answer cache answered (`result="hit"`), from a `/metrics` exposition;
    None when the server exports no such series (a figure then cannot be vouched for)."""
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            if sample.name == ANSWER_CACHE_SAMPLE and sample.labels.get("result") == "hit":
                return int(sample.value)
    return None


def captured_shapes(info: Mapping[str, Any]) -> list[tuple[int, int]] | None:
    """The `[rows, tokens]` shapes the executor captured, or None when it does not say."""
    shapes = info.get("graph_shapes")
    if shapes is None:
        return None
    return [(int(rows), int(tokens)) for rows, tokens in shapes]


def capture_problems(info: Mapping[str, Any], *, graphs_requested: bool,
                     on_cuda: bool) -> list[str]:
    """Why numbers from this executor must not be reported as "graphs" (empty: they may be).

    With graphs requested on CUDA: the executor must say it replays graphs, list its captured
    shapes, and have captured every length bucket for one row (`[1, tokens]`). On CPU only the
    listed shapes are checked, when listed.
    """
    if not graphs_requested:
        return []
    problems: list[str] = []
    if on_cuda and not info.get("cuda_graphs"):
        problems.append("CUDA graphs were asked for but the executor serves without them "
                        "(a capture failed and it fell back to eager)")
    shapes = captured_shapes(info)
    if shapes is None:
        if on_cuda:
            problems.append("the executor does not report graph_shapes: cannot confirm that "
                            "every shape was captured")
        return problems
    if not shapes:
        problems.append("graph_shapes is empty: nothing was captured")
    single = {tokens for rows, tokens in shapes if rows == 1}
    missing = [int(length) for length in info.get("buckets") or () if int(length) not in single]
    if missing:
        problems.append(f"length buckets never captured for one row: {missing}")
    return problems


def capture_report(info: Mapping[str, Any]) -> dict[str, Any]:
    """What a result records about the capture: known values, or None where unknown."""
    shapes = captured_shapes(info)
    memory = info.get("graph_memory_bytes")
    captured = info.get("captured_shapes")
    return {"cuda_graphs": info.get("cuda_graphs"), "buckets": info.get("buckets"),
            "batch_layout": info.get("batch_layout"),
            "graph_shapes": [list(s) for s in shapes] if shapes is not None else None,
            "captured_shapes": [list(s) for s in captured] if captured is not None else None,
            "graph_memory_bytes": int(memory) if memory is not None else None}


def split_by_question(probabilities: Sequence[float],
                      option_counts: Sequence[int]) -> list[list[float]]:
    """Flat per-option probabilities (question order) cut into one list per question."""
    if sum(option_counts) != len(probabilities):
        raise ValueError(f"{len(probabilities)} probabilities for {sum(option_counts)} options")
    out, offset = [], 0
    for count in option_counts:
        out.append(list(probabilities[offset:offset + count]))
        offset += count
    return out


def _argmax(values: Sequence[float]) -> int:
    return max(range(len(values)), key=values.__getitem__)


def top2_margin(values: Sequence[float]) -> float:
    """How far the best option is ahead of the second (the whole value for one option)."""
    ordered = sorted(values, reverse=True)
    return ordered[0] - (ordered[1] if len(ordered) > 1 else 0.0)


def compare_questions(reference: Mapping[str, Sequence[Sequence[float]]],
                      other: Mapping[str, Sequence[Sequence[float]]]) -> dict[str, Any]:
    """Two runs' per-question probabilities, keyed by request: the largest absolute
    difference, whether every question's argmax is equal, and for each question where it is
    not, both argmaxes and both runs' top-2 margins (a flip between near-tied options is
    rounding; a flip with a wide margin is a bug)."""
    worst = 0.0
    differ: list[dict[str, Any]] = []
    questions = 0
    for key, ref_questions in reference.items():
        got_questions = other[key]
        if len(got_questions) != len(ref_questions):
            raise ValueError(f"{key}: {len(ref_questions)} questions against "
                             f"{len(got_questions)}")
        for index, (ref, got) in enumerate(zip(ref_questions, got_questions, strict=True)):
            questions += 1
            worst = max(worst, *(abs(a - b) for a, b in zip(ref, got, strict=True)))
            if _argmax(ref) != _argmax(got):
                differ.append({"request": key, "question": index,
                               "argmax": [_argmax(ref), _argmax(got)],
                               "top2_margin": [round(top2_margin(ref), 6),
                                               round(top2_margin(got), 6)]})
    return {"questions": questions, "max_abs_probability_diff": worst,
            "argmax_equal": not differ, "argmax_differences": differ}
