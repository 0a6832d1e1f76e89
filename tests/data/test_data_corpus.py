"""Documents: the Shakespeare scenes, .txt paragraphs, slicing, the hashed validation split."""
import pytest

from nagmoe.data.corpus import (check_slicing, is_val_document, iter_documents, resolve_corpus, slice_range)
from nagmoe.base.errors import UserError


def test_shakespeare_is_one_document_per_scene():
    corpus = resolve_corpus("shakespeare")
    assert len(corpus.files) == 38
    docs = list(iter_documents(corpus, 0, 19))  # 2 of the 38 plays
    assert 20 < len(docs) < 80
    assert all(d.startswith("# ") and d.endswith("\n") and "  \n" not in d for d in docs)


def test_txt_files_give_one_document_per_paragraph(tmp_path):
    (tmp_path / "a.txt").write_text("first para\nline two\n\n\nsecond\n\nthird\n")
    assert list(iter_documents(resolve_corpus(str(tmp_path / "a.txt")))) == [
        "first para\nline two", "second", "third"]


def test_slices_are_contiguous_balanced_and_complete():
    for n in (1, 5, 38, 100):
        for k in (1, 2, 3, 7):
            ranges = [slice_range(n, i, k) for i in range(k)]
            assert [x for r in ranges for x in r] == list(range(n))
            assert max(map(len, ranges)) - min(map(len, ranges)) <= 1
    corpus = resolve_corpus("shakespeare")
    with pytest.raises(UserError, match="exceeds the 38 input files"):
        check_slicing(corpus, 0, 39)


def test_validation_split_is_a_deterministic_hash_with_the_asked_fraction():
    docs = [f"document number {i}" for i in range(20_000)]
    held = [d for d in docs if is_val_document(d, 0.1)]
    assert 0.09 < len(held) / len(docs) < 0.11
    assert held == [d for d in docs if is_val_document(d, 0.1)]
    assert set(held) <= {d for d in docs if is_val_document(d, 0.2)}  # nested as the fraction grows
