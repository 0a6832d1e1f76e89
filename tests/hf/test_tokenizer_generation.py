"""The exported tokenizer encodes as nagmoe trains (BOS first, special-token text as text) and the exported model
generates what `nagmoe generate` generates (issue 42, "Tokenizer" and "Generation")."""
import json

import pytest
import torch

PROMPTS = ["ROMEO:", "What light through yonder", "I am", "<|bos|> is text here, and so"]


def validation_lines(corpus, n=100):
    lines = []
    for doc in reversed(open(corpus).read().splitlines()):
        lines += [line for line in json.loads(doc)["text"].splitlines() if line.strip()]
        if len(lines) >= n:
            break
    return lines[:n - 1] + ["A line that says <|bos|> and <|endoftext|> in plain text"]


def ours(run, text):
    return [run.bos_id, *run.tokenizer.encode(text, add_special_tokens=False).ids]


def test_hf_ids_are_bos_plus_ours_and_decode_round_trips(exported_run, micro_data):
    from transformers import AutoTokenizer

    from nagmoe.eval.generate import load_run

    run_dir, out = exported_run
    run = load_run(run_dir)
    tok = AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    lines = validation_lines(micro_data[1])
    assert len(lines) == 100
    for line in lines:
        ids = tok(line).input_ids
        assert ids == ours(run, line), line
        assert tok.decode(ids[1:]) == line
    assert tok.bos_token_id == tok.eos_token_id == tok.pad_token_id == run.bos_id
    assert tok.model_max_length == run.config.model.max_seq_len


def test_another_bos_spelling_is_kept(tmp_path):
    """A run prepared with an existing tokenizer whose BOS is `<|endoftext|>` exports that spelling first."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from nagmoe.eval.generate import LoadedRun
    from nagmoe.hf.export import hf_tokenizer

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(["to be or not to be, that is the question"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    tok.encode_special_tokens = True
    bos = tok.token_to_id("<|endoftext|>")

    class _Cfg:
        class model:
            max_seq_len = 128
    run = LoadedRun(None, tok, bos, _Cfg, "")
    hf = hf_tokenizer(run)
    hf.save_pretrained(tmp_path)
    from transformers import AutoTokenizer

    again = AutoTokenizer.from_pretrained(tmp_path)
    for text in ("to be, or not", "a <|endoftext|> inside", "<|bos|>"):
        assert again(text).input_ids == [bos, *tok.encode(text, add_special_tokens=False).ids]
        assert again.decode(again(text).input_ids[1:]) == text
    assert again.bos_token == "<|endoftext|>"


@pytest.fixture(scope="module")
def both(exported_run):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nagmoe.eval.generate import load_run

    run_dir, out = exported_run
    run = load_run(run_dir)
    model = AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True).eval()
    return run, model, AutoTokenizer.from_pretrained(out, trust_remote_code=True)


def hf_new_tokens(row, prompt_len, eos):
    new = row[prompt_len:].tolist()
    return new[:new.index(eos)] if eos in new else new


@pytest.mark.parametrize("use_cache", [True, False])
def test_greedy_generation_equals_nagmoe_generate(both, use_cache):
    from nagmoe.eval.generate import generate_ids

    run, model, tok = both
    for prompt in PROMPTS:
        ids = ours(run, prompt)
        want = generate_ids(run.model, ids, 32, temperature=0.0, stop_id=run.bos_id)
        got = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, use_cache=use_cache)
        assert hf_new_tokens(got[0], len(ids), run.bos_id) == want, prompt
        assert len(want) >= 8  # a real continuation, not an immediate stop


def test_a_left_padded_batch_equals_the_prompts_one_at_a_time(both):
    run, model, tok = both
    batch = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    assert int((batch.attention_mask == 0).sum()) > 0
    got = model.generate(**batch, max_new_tokens=32, do_sample=False)
    width = batch.input_ids.shape[1]
    for row, prompt in zip(got, PROMPTS):
        alone = model.generate(**tok(prompt, return_tensors="pt"), max_new_tokens=32, do_sample=False)
        assert hf_new_tokens(row, width, run.bos_id) == hf_new_tokens(alone[0], len(tok(prompt).input_ids), run.bos_id)


def test_padded_logits_equal_unpadded_logits(both):
    """Below generate: the real positions of a left-padded forward equal the row alone (CCA's convs and value shift
    see zeros where the padding is, as at a sequence start)."""
    run, model, tok = both
    batch = tok(PROMPTS, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        padded = model(**batch, use_cache=False).logits
        for i, prompt in enumerate(PROMPTS):
            alone = model(**tok(prompt, return_tensors="pt"), use_cache=False).logits[0]
            n = alone.shape[0]
            assert torch.allclose(padded[i, -n:], alone, atol=1e-4, rtol=0), prompt
