"""What a GPU benchmark checks before it reports "graphs", and its per-question comparison
(benchlib/gpu_checks.py)."""

from __future__ import annotations

import pytest

from benchlib.gpu_checks import (
    cache_hits,
    capture_problems,
    capture_report,
    compare_questions,
    split_by_question,
    top2_margin,
)

CAPTURED = {"cuda_graphs": True, "buckets": [64, 128, 256],
            "graph_shapes": [[1, 64], [1, 128], [1, 256], [4, 64], [2, 128]],
            "graph_memory_bytes": 1 << 30}


def test_every_bucket_captured_passes() -> None:
    assert capture_problems(CAPTURED, graphs_requested=True, on_cuda=True) == []


def test_a_fallback_to_eager_is_not_graphs() -> None:
    fell_back = {**CAPTURED, "cuda_graphs": False}
    problems = capture_problems(fell_back, graphs_requested=True, on_cuda=True)
    assert any("fell back to eager" in p for p in problems)


def test_a_bucket_missing_from_the_captured_shapes_is_named() -> None:
    partial = {**CAPTURED, "graph_shapes": [[1, 64], [4, 128], [1, 256]]}
    problems = capture_problems(partial, graphs_requested=True, on_cuda=True)
    assert problems == ["length buckets never captured for one row: [128]"]
    assert capture_problems({**CAPTURED, "graph_shapes": []}, graphs_requested=True,
                            on_cuda=True)[0].startswith("graph_shapes is empty")


def test_unknown_captured_shapes_fail_on_cuda_and_are_unknown_on_cpu() -> None:
    unknown = {"cuda_graphs": True, "buckets": [64], "graph_memory_bytes": 0}
    assert any("does not report graph_shapes" in p
               for p in capture_problems(unknown, graphs_requested=True, on_cuda=True))
    cpu = {"cuda_graphs": False, "buckets": [64]}
    assert capture_problems(cpu, graphs_requested=True, on_cuda=False) == []
    assert capture_report(cpu)["graph_shapes"] is None
    assert capture_report(cpu)["graph_memory_bytes"] is None  # unknown, not 0
    # eager runs are never held to the capture
    assert capture_problems({}, graphs_requested=False, on_cuda=True) == []


def test_split_by_question_checks_the_option_count() -> None:
    assert split_by_question([0.1, 0.9, 0.2, 0.3, 0.5], [2, 3]) == [[0.1, 0.9], [0.2, 0.3, 0.5]]
    with pytest.raises(ValueError):
        split_by_question([0.1, 0.9], [3])


def test_argmax_is_compared_per_question_with_margins_where_it_differs() -> None:
    eager = {"a": [[0.2, 0.8], [0.5, 0.3, 0.2]], "b": [[0.9, 0.1]]}
    # One argmax over all options of "a" (0.8 in both) would call these equal; per question,
    # the second question of "a" flips between two near-tied options.
    graphs = {"a": [[0.21, 0.79], [0.39, 0.41, 0.2]], "b": [[0.9, 0.1]]}
    result = compare_questions(eager, graphs)
    assert result["questions"] == 3
    assert result["argmax_equal"] is False
    assert result["max_abs_probability_diff"] == pytest.approx(0.11)
    assert result["argmax_differences"] == [
        {"request": "a", "question": 1, "argmax": [0, 1],
         "top2_margin": [pytest.approx(0.2), pytest.approx(0.02)]}]
    assert compare_questions(eager, eager)["argmax_equal"] is True


def test_cache_hits_are_read_from_the_exposition_and_unknown_without_the_series() -> None:
    text = ("# HELP clef_answer_cache Answer cache lookups.\n"
            "# TYPE clef_answer_cache counter\n"
            'clef_answer_cache_total{result="hit"} 7.0\n'
            'clef_answer_cache_total{result="coalesced"} 2.0\n'
            'clef_answer_cache_total{result="miss"} 40.0\n')
    assert cache_hits(text) == 7
    assert cache_hits(text.replace("} 7.0", "} 0.0")) == 0
    assert cache_hits("# TYPE other counter\nother_total 1.0\n") is None


def test_top2_margin() -> None:
    assert top2_margin([0.1, 0.6, 0.3]) == pytest.approx(0.3)
    assert top2_margin([1.0]) == 1.0


def test_the_in_memory_model_refuses_a_loader_it_cannot_replace(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """If the worker's loader moves, the Flash-shaped benchmarks stop rather than time the tiny
    demo snapshot under the Flash label."""
    import benchlib.flash_model as flash_model

    monkeypatch.setattr(flash_model, "LOADER_MODULE", "benchlib.paths")
    with pytest.raises(RuntimeError, match="load_backbone, load_head"):
        flash_model.install(flash_model.InMemoryModel("small"))
