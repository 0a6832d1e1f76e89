"""Task files (our JSONL, nanochat's CORE bundle layout), few-shot prompts, centred accuracy, and scoring on a
constructed model whose answers are known: it predicts "the next token repeats the current one"."""
import json

import pytest
import torch

from nagmoe.config import AttentionConfig, ModelConfig
from nagmoe.base.errors import UserError
from nagmoe.eval.core import common_prefix, evaluate_task, example_rows
from nagmoe.eval.offline_task import build_next_line_task, is_text_line
from nagmoe.eval.tasks import (Task, centred_accuracy, fewshot_examples, read_core_bundle, read_jsonl_task,
                               render_prompts)
from nagmoe.model import build_model

VOCAB = 64
BOS = 0


def encode(text: str) -> list:
    """Character-level ids 1..63 (BOS = 0)."""
    return [1 + (ord(c) % (VOCAB - 1)) for c in text]


@pytest.fixture(scope="module")
def repeat_model():
    """A real pre-norm transformer whose sublayers write nothing (zero-initialised output projections) and whose
    unembedding rows are the (normalised) embedding rows, so logits ~ softcap·cos(e_current, e_v): it always
    predicts the current token again."""
    torch.manual_seed(0)
    cfg = ModelConfig(residual="prenorm", vocab_size=VOCAB, d_model=64, n_layers=1, max_seq_len=256,
                      attention=AttentionConfig(kind="mha", n_heads=2, impl="math"))
    model = build_model(cfg).eval()
    with torch.no_grad():
        e = model.wte.weight
        model.lm_head.weight.copy_(40.0 * e / e.norm(dim=-1, keepdim=True))
    return model


def _write(path, rows):
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


# ----------------------------------------------------------------------------------------------------------
def test_centred_accuracy_is_zero_at_chance_and_one_when_perfect():
    assert centred_accuracy(0.25, 25.0) == pytest.approx(0.0)
    assert centred_accuracy(1.0, 25.0) == pytest.approx(1.0)
    assert centred_accuracy(0.5, 25.0) == pytest.approx(1 / 3)
    assert centred_accuracy(0.3, 0.0) == pytest.approx(0.3)


def test_jsonl_header_inferred_type_and_default_baseline(tmp_path):
    task = read_jsonl_task(_write(tmp_path / "plain.jsonl", [
        {"query": "q1", "choices": ["a", "b"], "gold": 0},
        "",
        {"query": "q2", "choices": ["a", "b", "c", "d"], "gold": 3, "extra": "ignored"}]))
    assert (task.label, task.task_type, task.num_fewshot, task.continuation_delimiter) == \
        ("plain", "multiple_choice", 0, " ")
    assert task.random_baseline == pytest.approx(100 * (1 / 2 + 1 / 4) / 2)
    assert task.lines == [1, 3]

    task = read_jsonl_task(_write(tmp_path / "h.jsonl", [
        {"task": {"label": "mine", "num_fewshot": 2, "continuation_delimiter": " => ", "random_baseline": 10}},
        {"context": "a", "continuation": "b"}, {"context": "c", "continuation": "d"}]))
    assert (task.label, task.task_type, task.num_fewshot, task.continuation_delimiter, task.random_baseline) == \
        ("mine", "language_modeling", 2, " => ", 10.0)


@pytest.mark.parametrize("bad_line, needle", [
    ("{not json", "not valid JSON"),
    (json.dumps({"query": "q", "choices": ["a", "b"], "gold": 2}), "'gold'"),
    (json.dumps({"query": "q", "choices": ["only one"], "gold": 0}), "'choices'"),
    (json.dumps({"context_options": ["a", "b"], "gold": 0}), "bad multiple_choice example"),
    (json.dumps({"something": 1}), "bad multiple_choice example"),
    (json.dumps([1, 2]), "expected a JSON object"),
])
def test_malformed_line_is_a_user_error_naming_file_and_line(tmp_path, bad_line, needle):
    path = _write(tmp_path / "bad.jsonl", [{"query": "q", "choices": ["a", "b"], "gold": 0}, "", bad_line])
    with pytest.raises(UserError) as e:
        read_jsonl_task(path)
    assert f"{path}:3:" in str(e.value) and needle in str(e.value)


def test_bad_header_and_empty_file(tmp_path):
    with pytest.raises(UserError, match=r"h\.jsonl:1: unknown task header key 'shots'"):
        read_jsonl_task(_write(tmp_path / "h.jsonl", [{"task": {"shots": 2}}, {"context": "a", "continuation": "b"}]))
    with pytest.raises(UserError, match="no examples"):
        read_jsonl_task(_write(tmp_path / "e.jsonl", [""]))
    with pytest.raises(UserError, match="not found"):
        read_jsonl_task(str(tmp_path / "missing.jsonl"))


def test_core_bundle_layout(tmp_path):
    """core.yaml + eval_meta_data.csv + eval_data/ as in nanochat's bundle."""
    (tmp_path / "eval_data" / "sub").mkdir(parents=True)
    (tmp_path / "core.yaml").write_text(
        "icl_tasks:\n"
        "  - label: toy_mc\n    dataset_uri: sub/mc.jsonl\n    num_fewshot: [3]\n    icl_task_type: multiple_choice\n"
        "    continuation_delimiter: ' '\n"
        "  - label: toy_lm\n    dataset_uri: lm.jsonl\n    num_fewshot: [0]\n    icl_task_type: language_modeling\n")
    (tmp_path / "eval_meta_data.csv").write_text("Eval Task,Task Category,Random baseline\ntoy_mc,x,50\ntoy_lm,y,0\n")
    _write(tmp_path / "eval_data" / "sub" / "mc.jsonl", [{"query": "q", "choices": ["a", "b"], "gold": 1}] * 5)
    _write(tmp_path / "eval_data" / "lm.jsonl", [{"context": "c", "continuation": "d"}])
    mc, lm = read_core_bundle(str(tmp_path))
    assert (mc.label, mc.num_fewshot, mc.random_baseline, len(mc.examples)) == ("toy_mc", 3, 50.0, 5)
    assert (lm.label, lm.task_type, lm.random_baseline) == ("toy_lm", "language_modeling", 0.0)


def test_fewshot_prompts_exclude_the_item_and_are_deterministic():
    examples = [{"query": f"Q{i}", "choices": [f"right{i}", f"wrong{i}"], "gold": 0} for i in range(6)]
    task = Task("t", "multiple_choice", examples, num_fewshot=2, continuation_delimiter=" -> ")
    shots = fewshot_examples(task, 3)
    assert len(shots) == 2 and examples[3] not in shots and shots == fewshot_examples(task, 3)
    prompts = render_prompts(task, 3)
    expected_prefix = "".join(f"{s['query']} -> {s['choices'][0]}\n\n" for s in shots)
    assert prompts == [expected_prefix + "Q3 -> right3", expected_prefix + "Q3 -> wrong3"]

    lm = Task("lm", "language_modeling", [{"context": "ctx  ", "continuation": "cont"}], continuation_delimiter=" ")
    assert render_prompts(lm, 0) == ["ctx", "ctx cont"]


def test_scored_spans_cover_exactly_the_continuations():
    mc = Task("mc", "multiple_choice", [{"query": "abc", "choices": ["dd", "eee"], "gold": 0}],
              continuation_delimiter=":")
    rows = example_rows(mc, 0, encode, BOS)
    assert [r.ids[r.start:r.end] for r in rows] == [encode("dd"), encode("eee")]
    schema = Task("s", "schema", [{"context_options": ["xy", "zzz"], "continuation": "end", "gold": 1}],
                  continuation_delimiter=" ")
    rows = example_rows(schema, 0, encode, BOS)
    assert [r.ids[r.start:r.end] for r in rows] == [encode(" end")] * 2  # the shared suffix holds the delimiter
    # a choice that is a prefix of another keeps a span of at least one token
    rows = example_rows(Task("p", "multiple_choice", [{"query": "q", "choices": ["a", "ab"], "gold": 0}],
                             continuation_delimiter=""), 0, encode, BOS)
    assert all(r.end > r.start for r in rows)
    # left cropping keeps the continuation and shifts the span
    long = Task("l", "language_modeling", [{"context": "x" * 50, "continuation": "yz"}], continuation_delimiter="")
    (row,) = example_rows(long, 0, encode, BOS, max_len=10)
    assert len(row.ids) == 10 and row.ids[row.start:row.end] == encode("yz")
    with pytest.raises(UserError, match="does not fit"):
        example_rows(long, 0, encode, BOS, max_len=2)
    assert common_prefix([[1, 2, 3], [1, 2, 4]]) == 2


def test_obviously_right_answers_score_accuracy_one(repeat_model):
    """The repeat-the-current-token model: the repeated choice/continuation is obviously right."""
    mc = Task("mc", "multiple_choice", [
        {"query": "aaaa", "choices": ["kqzx", "aaaa", "bcbc"], "gold": 1},
        {"query": "mmm", "choices": ["mmmmm", "nopqr"], "gold": 0},
        {"query": "zz", "choices": ["abc", "def", "zzz"], "gold": 2}], num_fewshot=1, continuation_delimiter="",
        random_baseline=100 / 3)
    result = evaluate_task(repeat_model, mc, encode, BOS)
    assert (result.accuracy, result.examples) == (1.0, 3) and result.centred == pytest.approx(1.0)

    schema = Task("s", "schema", [{"context_options": ["ppp", "qqq", "rst"], "continuation": "qqqq", "gold": 1},
                                  {"context_options": ["www", "abc"], "continuation": "cccc", "gold": 1}],
                  continuation_delimiter="")
    assert evaluate_task(repeat_model, schema, encode, BOS).accuracy == 1.0

    lm = Task("lm", "language_modeling", [{"context": "xxxx", "continuation": "xxx"},
                                          {"context": "gg", "continuation": "gggg"}], continuation_delimiter="")
    assert evaluate_task(repeat_model, lm, encode, BOS).accuracy == 1.0
    wrong = Task("lm", "language_modeling", [{"context": "xxxx", "continuation": "xyx"}], continuation_delimiter="")
    assert evaluate_task(repeat_model, wrong, encode, BOS).accuracy == 0.0


def test_max_examples_takes_a_fixed_shuffled_subset(repeat_model):
    examples = [{"query": "a" * (i + 1), "choices": ["a", "b"], "gold": 0} for i in range(10)]
    task = Task("mc", "multiple_choice", examples, continuation_delimiter="", random_baseline=50)
    r = evaluate_task(repeat_model, task, encode, BOS, max_examples=4)
    assert r.examples == 4 and r.accuracy == 1.0


def test_offline_next_line_task_is_deterministic_and_well_formed():
    scenes = [f"# Play\n\n### SCENE {s}\n\n**SPEAKER{s}**\n" +
              "\n".join(f"Scene {s} speaks its line number {i} aloud." for i in range(8)) for s in range(5)]
    task = build_next_line_task(scenes, n_items=12, seed=3)
    again = build_next_line_task(scenes, n_items=12, seed=3)
    assert task.examples == again.examples and len(task.examples) == 12
    assert task.random_baseline == 25.0 and task.continuation_delimiter == "\n"
    for ex in task.examples:
        true_line = ex["choices"][ex["gold"]]
        scene = next(s for s in scenes if true_line in s.splitlines())
        lines = scene.splitlines()
        assert ex["query"] == "\n".join(lines[max(0, lines.index(true_line) - 4):lines.index(true_line)])
        others = [c for i, c in enumerate(ex["choices"]) if i != ex["gold"]]
        assert len(set(ex["choices"])) == 4 and not any(c in scene.splitlines() for c in others)
    assert build_next_line_task(scenes, n_items=12, seed=4).examples != task.examples
    assert not is_text_line("**ROMEO**") and not is_text_line("_Exit_") and not is_text_line("### SCENE II.")
    with pytest.raises(UserError, match="at least 2 scenes"):
        build_next_line_task(scenes[:1])
