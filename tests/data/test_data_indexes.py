"""Issue 40, "data indexes are schemas": index.json, part.json and a CORE bundle's core.yaml may come from someone
else. A file outside the data dir (`../x`, `/abs/x`, `sub/x`), a crafted dtype, ids outside the vocabulary or a
malformed field exit 2 with one line naming the file and the field, before anything is trained on; `--merge` links
only the regular files it verified; the data pipeline writes through no planted name. Every test copies the
session's prepared micro data (never modifies it) and runs the real entry points: `nagmoe train` /
`nagmoe prepare-data` (in-process through `nagmoe.cli.main`, once as a process), the loader, the unigram baseline
and the eval task reader."""
import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest

from nagmoe.cli import main
from nagmoe.base.errors import UserError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TRAVERSALS = ("../x.bin", "/abs/x.bin", "sub/x.bin")


# ----------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------
def read(path):
    with open(path) as f:
        return json.load(f)


def write(path, obj):
    with open(path, "w") as f:
        json.dump(obj, f)


def sha(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def refused(capsys, argv, *fragments):
    """`nagmoe ARGV` exits 2 with exactly one error line holding every fragment, and no traceback."""
    code = main(argv)
    out, err = capsys.readouterr()
    assert code == 2, (code, err[-2000:])
    assert "Traceback" not in out + err
    errors = [line for line in err.splitlines() if ": error: " in line]
    assert len(errors) == 1, err
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def target_path(root, data_dir, file):
    """Where `file` of an index in data_dir points, for the three traversals (all outside data_dir's own names)."""
    if file.startswith("/abs/"):
        return os.path.join(str(root), "abs", os.path.basename(file))
    return os.path.join(data_dir, file)


@pytest.fixture
def micro_overrides(request):
    plugin = request.config.pluginmanager.get_plugin(os.path.join(REPO, "tests", "conftest.py"))
    return list(plugin.MICRO_OVERRIDES)


@pytest.fixture
def data(micro_data, tmp_path):
    """A copy of the session's prepared micro data (vocab 512, uint16): (data_dir, index)."""
    data_dir = str(tmp_path / "data")
    shutil.copytree(micro_data[0], data_dir)
    return data_dir, read(os.path.join(data_dir, "index.json"))


@pytest.fixture
def train_argv(micro_data, micro_overrides, tmp_path):
    """argv of `nagmoe train` on tmp_path/data (fresh run dir tmp_path/run)."""
    return ["train", "--config", os.path.join(REPO, "configs", "tiny.yaml"), "--run-dir", str(tmp_path / "run"),
            "--quiet", *micro_overrides, f"data.corpus={micro_data[1]}", f"data.data_dir={tmp_path / 'data'}"]


# ----------------------------------------------------------------------------------------------------------
# index.json
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("file", TRAVERSALS)
def test_traversal_in_index_is_refused_before_any_read(data, train_argv, tmp_path, capsys, file):
    """The writer's own dir loads (migration); a shard `file` naming a valid shard outside the dir's own names is
    exit 2 naming index.json and the field, and nothing is trained (no run dir)."""
    from nagmoe.data.loader import TokenLoader

    data_dir, index = data
    next(TokenLoader(data_dir, "train", 64, 2, seed=0))  # as the current writer made it: loads
    rec = next(r for r in index["shards"] if r["split"] == "train")
    outside = target_path(tmp_path, data_dir, file)
    os.makedirs(os.path.dirname(outside), exist_ok=True)
    shutil.copyfile(os.path.join(data_dir, rec["file"]), outside)  # same bytes: size and sha256 would pass
    rec["file"] = outside if file.startswith("/abs/") else file
    write(os.path.join(data_dir, "index.json"), index)
    line = refused(capsys, train_argv, os.path.join(data_dir, "index.json"), "shards[0].file")
    assert rec["file"][:40] in line
    assert not os.path.exists(tmp_path / "run")


def test_train_process_refuses_a_traversal_index_in_one_line(data, micro_data, micro_overrides, tmp_path):
    """The same as a real `nagmoe train` process: exit 2, one line, no Traceback on stdout or stderr."""
    data_dir, index = data
    rec = index["shards"][0]
    shutil.copyfile(os.path.join(data_dir, rec["file"]), tmp_path / "x.bin")
    rec["file"] = "../x.bin"
    write(os.path.join(data_dir, "index.json"), index)
    tiny = os.path.join(REPO, "configs", "tiny.yaml")
    done = subprocess.run([sys.executable, "-m", "nagmoe", "train", "--config", tiny,
                           "--run-dir", str(tmp_path / "run"), "--quiet", *micro_overrides,
                           f"data.corpus={micro_data[1]}", f"data.data_dir={data_dir}"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO})
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stdout + done.stderr
    errors = [line for line in done.stderr.splitlines() if ": error: " in line]
    assert len(errors) == 1 and "shards[0].file" in errors[0] and "'../x.bin'" in errors[0], done.stderr
    assert not os.path.exists(tmp_path / "run")


def _rewrite_shards(data_dir, index, dtype, change):
    """Every shard rewritten in `dtype` (ids changed by `change`), its record made consistent (size, sha256)."""
    for rec in index["shards"]:
        path = os.path.join(data_dir, rec["file"])
        ids = change(np.fromfile(path, dtype=np.uint16).astype(dtype))
        ids.tofile(path)
        rec.update(dtype=np.dtype(dtype).name, sha256=sha(path))
    index["dtype"] = np.dtype(dtype).name


def _negative_int16(data_dir, index):
    _rewrite_shards(data_dir, index, np.int16, lambda a: np.where(np.arange(len(a)) % 7 == 3, -3, a).astype(np.int16))


def _float32_nan(data_dir, index):
    _rewrite_shards(data_dir, index, np.float32, lambda a: np.where(np.arange(len(a)) % 7 == 3, np.nan, a + 0.5)
                    .astype(np.float32))


def _dtype_foo(data_dir, index):
    index["dtype"] = "foo"
    for rec in index["shards"]:
        rec["dtype"] = "foo"


def _no_shards(data_dir, index):
    del index["shards"]


def _bos_past_vocab(data_dir, index):
    index["bos_id"] = index["vocab_size"]


def _negative_n_tokens(data_dir, index):
    index["shards"][0]["n_tokens"] = -1


def _vocab_true(data_dir, index):
    index["vocab_size"] = True


def _tokenizer_outside(data_dir, index):
    shutil.copyfile(os.path.join(data_dir, "tokenizer.json"), os.path.join(data_dir, "..", "tok.json"))
    index["tokenizer"] = "../tok.json"


CRAFTED = {  # case -> (tampering, fragments of the one error line)
    "int16_negative_ids": (_negative_int16, ("'dtype'", "'int16'", "'uint16'")),
    "float32_nan": (_float32_nan, ("'dtype'", "'float32'")),
    "dtype_foo": (_dtype_foo, ("'dtype'", "'foo'")),
    "no_shards": (_no_shards, ("no 'shards'",)),
    "bos_id_past_vocab": (_bos_past_vocab, ("'bos_id'", "< 512")),
    "n_tokens_negative": (_negative_n_tokens, ("shards[0]", "'n_tokens'", "-1")),
    "vocab_size_true": (_vocab_true, ("'vocab_size'", "integer", "True")),
    "tokenizer_outside": (_tokenizer_outside, ("'tokenizer'", "'../tok.json'")),
}


@pytest.mark.parametrize("case", list(CRAFTED))
def test_crafted_index_exits_2_in_one_line_before_training(data, train_argv, tmp_path, capsys, case):
    data_dir, index = data
    tamper, fragments = CRAFTED[case]
    tamper(data_dir, index)
    write(os.path.join(data_dir, "index.json"), index)
    refused(capsys, train_argv, os.path.join(data_dir, "index.json"), *fragments)
    assert not os.path.exists(tmp_path / "run")


def test_an_index_that_is_a_list_exits_2(data, train_argv, tmp_path, capsys):
    data_dir, index = data
    write(os.path.join(data_dir, "index.json"), [index])
    refused(capsys, train_argv, os.path.join(data_dir, "index.json"), "expected a JSON object, got list")
    assert not os.path.exists(tmp_path / "run")


JUNK = (None, True, -1, 0, 2 ** 70, 1.5, float("nan"), "", "../x", "train-00000-000000000000.bin", [], {}, [{}],
        "uint16", "tokenizer.json", {"n_tokens": -1})


def _paths(obj, prefix=()):
    """Every (key path) into a JSON value, the value itself first."""
    yield prefix
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list) else ()
    for k, v in items:
        yield from _paths(v, prefix + (k,))


def _crafted(obj):
    """obj with each one field (or the whole value) replaced by each junk value or removed, one at a time."""
    import copy

    for path in _paths(obj):
        for junk in (*JUNK, "<removed>"):
            if not path:
                if junk != "<removed>":
                    yield junk
                continue
            crafted = copy.deepcopy(obj)
            parent = crafted
            for k in path[:-1]:
                parent = parent[k]
            if junk == "<removed>":
                del parent[path[-1]]
            else:
                parent[path[-1]] = junk
            yield crafted


def test_any_one_field_replaced_by_junk_is_read_or_refused_in_one_line(data, parts, tmp_path):
    """Fuzz: each field of index.json (and the whole file) replaced by each junk value, or removed: opening the
    train split and reading a batch either works or is a UserError (one line at the CLI), never another exception.
    The same for part.json and a merge (one case in four)."""
    from nagmoe.data import shards
    from nagmoe.data.loader import TokenShards, iter_eval_batches

    data_dir, index = data
    for crafted in _crafted(index):
        write(os.path.join(data_dir, "index.json"), crafted)
        try:
            next(iter_eval_batches(TokenShards(data_dir, "train", verify=False), 64, 2))
        except UserError:
            pass
    _, out, part_dir, part = parts
    for n, crafted in enumerate(_crafted(part)):
        if n % 4 == 0:
            write(os.path.join(part_dir, "part.json"), crafted)
            try:
                shards.merge_parts(str(tmp_path / "merged"), [part_dir], os.path.join(out, "parts", "tokenizer.json"))
            except UserError:
                pass


def test_ids_past_the_vocabulary_are_refused_at_open_and_in_every_batch(data):
    """A shard whose ids reach past vocab_size (its sha256 recorded consistently) is refused when the loader opens
    it (the verifying pass), by every unverified batch, and by the unigram baseline."""
    from nagmoe.data.bpb import unigram_bpb
    from nagmoe.data.loader import TokenLoader, TokenShards

    data_dir, index = data
    rec = next(r for r in index["shards"] if r["split"] == "train")
    path = os.path.join(data_dir, rec["file"])
    ids = np.fromfile(path, dtype=np.uint16)
    ids[::5] = 600  # vocab 512
    ids.tofile(path)
    rec["sha256"] = sha(path)
    write(os.path.join(data_dir, "index.json"), index)
    with pytest.raises(UserError, match=r"token id 600 >= vocab_size 512") as e:
        TokenShards(data_dir, "train")  # before any batch
    assert path in str(e.value)
    loader = TokenLoader(data_dir, "train", 64, 8, seed=0, verify=False)  # sizes only: the batch check stands
    with pytest.raises(UserError, match=r"token id 600 >= vocab_size 512"):
        for _ in range(loader.batches_per_epoch):
            next(loader)
    for verify in (True, False):
        with pytest.raises(UserError, match=r"token id \d+ >= vocab_size 512"):
            unigram_bpb(data_dir, verify=verify)


def test_unigram_baseline_and_token_bytes_use_the_checked_paths(data, tmp_path):
    """bpb.py: the tokenizer is data_dir/tokenizer.json only; the baseline's shards are sized (and never read
    through a symlink), as the loader's."""
    from nagmoe.data.bpb import token_bytes, unigram_bpb

    data_dir, index = data
    assert 0 < unigram_bpb(data_dir) < 16 and len(token_bytes(data_dir)) == 512  # the writer's dir: fine
    index_path = os.path.join(data_dir, "index.json")
    shutil.copyfile(os.path.join(data_dir, "tokenizer.json"), tmp_path / "tok.json")
    write(index_path, {**index, "tokenizer": "../tok.json"})
    for call in (token_bytes, unigram_bpb):
        with pytest.raises(UserError, match="'tokenizer' must be 'tokenizer.json'"):
            call(data_dir)
    write(index_path, index)
    rec = next(r for r in index["shards"] if r["split"] == "val")
    path = os.path.join(data_dir, rec["file"])
    os.truncate(path, 10)
    with pytest.raises(UserError, match="wrong size") as e:
        unigram_bpb(data_dir, verify=False)
    assert path in str(e.value)
    os.remove(path)
    shutil.copyfile(os.path.join(REPO, "README.md"), tmp_path / "victim")
    os.symlink(tmp_path / "victim", path)
    with pytest.raises(UserError, match="symbolic link"):
        unigram_bpb(data_dir, verify=False)


# ----------------------------------------------------------------------------------------------------------
# prepare-data --merge (part.json)
# ----------------------------------------------------------------------------------------------------------
@pytest.fixture
def parts(micro_data, micro_overrides, tmp_path):
    """tmp_path/out/parts/ holding one part (part-00000-of-00001: the micro data's shards and its part.json) and the
    staged tokenizer, as `prepare-data --num-shards 1` leaves them: (argv of `--merge`, out dir, part dir, part)."""
    src = micro_data[0]
    index = read(os.path.join(src, "index.json"))
    out = tmp_path / "out"
    part_dir = out / "parts" / "part-00000-of-00001"
    part_dir.mkdir(parents=True)
    for rec in index["shards"]:
        shutil.copyfile(os.path.join(src, rec["file"]), part_dir / rec["file"])
    shutil.copyfile(os.path.join(src, "tokenizer.json"), out / "parts" / "tokenizer.json")
    part = {k: v for k, v in index.items() if k != "tokenizer"}
    part.update(slice=0, num_slices=1)
    write(part_dir / "part.json", part)
    argv = ["prepare-data", "--config", os.path.join(REPO, "configs", "tiny.yaml"), *micro_overrides,
            f"data.corpus={micro_data[1]}", f"data.data_dir={out}", "--merge"]
    return argv, str(out), str(part_dir), part


@pytest.mark.parametrize("file", TRAVERSALS)
def test_traversal_in_part_json_is_refused(parts, tmp_path, capsys, file):
    argv, out, part_dir, part = parts
    rec = part["shards"][0]
    outside = target_path(tmp_path, part_dir, file)
    os.makedirs(os.path.dirname(outside), exist_ok=True)
    shutil.copyfile(os.path.join(part_dir, rec["file"]), outside)
    rec["file"] = outside if file.startswith("/abs/") else file
    write(os.path.join(part_dir, "part.json"), part)
    refused(capsys, argv, os.path.join(part_dir, "part.json"), "shards[0].file")
    assert not os.path.exists(os.path.join(out, "index.json"))
    assert os.stat(outside).st_nlink == 1  # never linked (nor renamed) into the data dir


def test_merge_links_no_symlinked_shard(parts, tmp_path, capsys):
    argv, out, part_dir, part = parts
    rec = part["shards"][0]
    outside = tmp_path / "elsewhere.bin"
    shutil.move(os.path.join(part_dir, rec["file"]), outside)  # the same bytes, reached through a symlink
    os.symlink(outside, os.path.join(part_dir, rec["file"]))
    refused(capsys, argv, rec["file"], "symbolic link")
    assert not os.path.exists(os.path.join(out, "index.json"))
    assert os.stat(outside).st_nlink == 1 and os.path.isfile(outside)


def test_merge_refuses_a_part_json_that_is_not_an_object_and_merges_the_writers_part(parts, capsys):
    argv, out, part_dir, part = parts
    write(os.path.join(part_dir, "part.json"), [part])
    refused(capsys, argv, "part.json", "expected a JSON object, got list")
    write(os.path.join(part_dir, "part.json"), {**part, "vocab_size": "512"})
    refused(capsys, argv, "part.json", "'vocab_size' must be an integer")
    write(os.path.join(part_dir, "part.json"), part)
    assert main(argv) == 0  # the writer's own part: merged
    assert read(os.path.join(out, "index.json"))["totals"]["train"]["n_tokens"] == part["totals"]["train"]["n_tokens"]


def test_merge_without_hard_links_moves_only_its_own_files(parts, tmp_path, capsys):
    """parts/ on another file system (a symlink to /dev/shm, as to scratch): link(2) says EXDEV. A shard with a
    second name is not this preparation's file: refused, left where it is; the writer's own shards are copied in."""
    import tempfile

    argv, out, part_dir, part = parts
    if not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat(out).st_dev:
        pytest.skip("needs /dev/shm on another file system than the test's tmp dir")
    elsewhere = tempfile.mkdtemp(dir="/dev/shm", prefix="nagmoe-test-")
    try:
        shutil.move(os.path.join(out, "parts"), os.path.join(elsewhere, "parts"))
        os.symlink(os.path.join(elsewhere, "parts"), os.path.join(out, "parts"))
        shard = os.path.join(out, "parts", "part-00000-of-00001", part["shards"][0]["file"])
        os.link(shard, os.path.join(elsewhere, "other-name.bin"))
        refused(capsys, argv, shard, "not a file this preparation wrote")
        assert os.stat(shard).st_nlink == 2 and not os.path.exists(os.path.join(out, "index.json"))
        os.unlink(os.path.join(elsewhere, "other-name.bin"))
        assert main(argv) == 0, capsys.readouterr().err
        from nagmoe.data.loader import TokenLoader

        next(TokenLoader(out, "train", 64, 2, seed=0))
    finally:
        shutil.rmtree(elsewhere, ignore_errors=True)


# ----------------------------------------------------------------------------------------------------------
# Writes through planted names (the data pipeline's temporaries)
# ----------------------------------------------------------------------------------------------------------
def test_merge_writes_through_no_planted_temporary(parts, tmp_path, capsys):
    """A symlink and a hard link to a victim at the old fixed temporaries of a merge (index.json.tmp-<pid>,
    tokenizer.json.tmp-<pid>, a shard's .tmp-<pid>): exit 0, the victim unchanged."""
    argv, out, part_dir, part = parts
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    pid = os.getpid()
    os.symlink(victim, os.path.join(out, f"index.json.tmp-{pid}"))
    os.link(victim, os.path.join(out, f"tokenizer.json.tmp-{pid}"))
    rec = part["shards"][0]
    os.symlink(victim, os.path.join(out, f"{rec['file']}.tmp-{pid}"))
    assert main(argv) == 0, capsys.readouterr().err
    assert victim.read_text() == "precious\n"
    index = read(os.path.join(out, "index.json"))
    assert os.path.isfile(os.path.join(out, index["shards"][0]["file"]))


def test_prepare_and_writers_write_through_no_planted_name(micro_data, micro_overrides, tmp_path):
    """`.prepare-<pid>` planted as a symlink to a victim folder, a symlink at ShardWriter's `.bin.tmp` and at
    save_tokenizer's `.tmp-<pid>`: every victim unchanged, and the preparation complete."""
    from nagmoe.config import load_config
    from nagmoe.data import shards
    from nagmoe.data.loader import TokenLoader
    from nagmoe.data.prepare import prepare_single
    from nagmoe.data.tokenizer import load_tokenizer, save_tokenizer

    victim_dir = tmp_path / "victim_dir"
    victim_dir.mkdir()
    victim = tmp_path / "victim.txt"
    victim.write_text("precious\n")
    out = tmp_path / "out"
    out.mkdir()
    os.symlink(victim_dir, out / f".prepare-{os.getpid()}")
    cfg = load_config(os.path.join(REPO, "configs", "tiny.yaml"),
                      [*micro_overrides, f"data.corpus={micro_data[1]}", f"data.data_dir={out}",
                       f"data.tokenizer={os.path.join(micro_data[0], 'tokenizer.json')}", "data.val_fraction=0.1"])
    prepare_single(cfg)
    assert os.listdir(victim_dir) == []
    next(TokenLoader(str(out), "train", 64, 2, seed=0))

    writer_dir = tmp_path / "w"
    writer_dir.mkdir()
    os.symlink(victim, writer_dir / "train-00000.bin.tmp")
    writer = shards.ShardWriter(str(writer_dir), "train", np.uint16, 100)
    writer.add_document(np.arange(10, dtype=np.uint16))
    (rec,) = writer.close()
    assert np.array_equal(np.fromfile(writer_dir / rec["file"], dtype=np.uint16), np.arange(10))
    tok_path = tmp_path / "tok.json"
    os.symlink(victim, f"{tok_path}.tmp-{os.getpid()}")
    save_tokenizer(load_tokenizer(os.path.join(micro_data[0], "tokenizer.json")), str(tok_path))
    assert sha(tok_path) == sha(os.path.join(micro_data[0], "tokenizer.json"))
    assert victim.read_text() == "precious\n"


# ----------------------------------------------------------------------------------------------------------
# CORE bundles (eval/tasks.py)
# ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("uri", ["../../outside.jsonl", "/abs/outside.jsonl", "sub/../../../outside.jsonl"])
def test_core_bundle_dataset_uri_escaping_its_dir_is_refused(tmp_path, uri):
    from nagmoe.commands.eval import resolve_tasks

    bundle = tmp_path / "bundle" / "eval_bundle"
    (bundle / "eval_data" / "sub").mkdir(parents=True)
    task = json.dumps({"query": "q", "choices": ["a", "b"], "gold": 0}) + "\n"
    (bundle / "eval_data" / "sub" / "inside.jsonl").write_text(task)
    for where in (tmp_path / "bundle" / "outside.jsonl", tmp_path / "abs" / "outside.jsonl"):
        where.parent.mkdir(exist_ok=True)
        where.write_text(task)
    uri = str(tmp_path / "abs" / "outside.jsonl") if uri.startswith("/abs/") else uri
    entry = "  - label: {l}\n    dataset_uri: '{u}'\n    icl_task_type: multiple_choice\n    num_fewshot: [0]\n"
    (bundle / "core.yaml").write_text("icl_tasks:\n" + entry.format(l="inside", u="sub/inside.jsonl"))
    (task_inside,) = resolve_tasks([str(tmp_path / "bundle")], 0.1)  # a relative path inside: read
    assert task_inside.label == "inside"
    (bundle / "core.yaml").write_text("icl_tasks:\n" + entry.format(l="inside", u="sub/inside.jsonl")
                                      + entry.format(l="escape", u=uri))
    with pytest.raises(UserError, match=r"icl_tasks\[1\]: dataset_uri .* must be a relative path inside eval_data/"):
        resolve_tasks([str(tmp_path / "bundle")], 0.1)
