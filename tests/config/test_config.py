"""Config system: inheritance, overrides of every type, validation messages, cycles, suggestions."""
import textwrap

import pytest

from nagmoe.config import ConfigError, dump_yaml, load_config


def write(tmp_path, name, text):
    p = tmp_path / name
    p.write_text(textwrap.dedent(text))
    return str(p)


def test_two_level_inheritance_and_override_order(tmp_path):
    write(tmp_path, "base.yaml", """
        model: {d_model: 64, n_layers: 2, vocab_size: 100, attention: {n_heads: 2}}
        train: {seed: 1, lr_gate: 0.002}
    """)
    write(tmp_path, "mid.yaml", """
        inherit: base.yaml
        model: {n_layers: 3}
        train: {seed: 2}
    """)
    (tmp_path / "sub").mkdir()
    leaf = write(tmp_path, "sub/leaf.yaml", """
        inherit: ../mid.yaml
        model: {residual: prenorm}
    """)
    cfg = load_config(leaf, ["train.seed=7", "model.n_layers=5", "model.n_layers=6"])
    assert cfg.model.d_model == 64  # from the grandparent
    assert cfg.model.attention.n_heads == 2  # nested merge keeps siblings
    assert cfg.model.residual == "prenorm"  # leaf
    assert cfg.train.lr_gate == 0.002
    assert cfg.train.seed == 7  # override beats every file
    assert cfg.model.n_layers == 6  # later override wins


def test_overrides_of_every_type(tmp_path):
    cfg = load_config(None, [
        "model.d_model=96", "model.attention.n_heads=3",  # int
        "train.lr_matrix=3e-2",  # float
        "train.flop_budget=1.5e12",  # optional float
        "model.attention.qk_norm=false",  # bool
        "log.wandb=off",  # string that YAML 1.1 would turn into a bool
        "model.residual=prenorm",  # choice
        "model.moe.expert_hidden=null",  # optional int -> None
        "train.max_steps=1_000",  # int with underscore
        "data.corpus=123",  # str field given digits stays a string
    ])
    assert cfg.model.d_model == 96 and cfg.model.attention.n_heads == 3
    assert cfg.train.lr_matrix == pytest.approx(0.03)
    assert cfg.train.flop_budget == pytest.approx(1.5e12)
    assert cfg.model.attention.qk_norm is False
    assert cfg.log.wandb == "off"
    assert cfg.model.moe.expert_hidden is None
    assert cfg.train.max_steps == 1000
    assert cfg.data.corpus == "123"


def test_yaml_off_is_a_string(tmp_path):
    p = write(tmp_path, "c.yaml", "log: {wandb: off}\n")
    assert load_config(p).log.wandb == "off"


@pytest.mark.parametrize("overrides, key", [
    (["model.moe.top_k=9", "model.ffn=moe", "model.nag.C=32"], "model.moe.top_k"),
    (["model.ffn=moe", "model.moe.n_experts=16", "model.nag.C=8"], "model.nag.C"),
    (["model.d_model=100", "model.attention.n_heads=3"], "model.d_model"),
    (["model.d_model=0"], "model.d_model"),
    (["model.n_layers=-2"], "model.n_layers"),
    (["model.nag.warmup_tokens=100000", "train.max_steps=2", "train.batch_tokens=1024",
      "data.seq_len=256"], "model.nag.warmup_tokens"),
    (["model.residual=postnorm"], "model.residual"),
    (["model.d_model=abc"], "model.d_model"),
    (["model.attention.qk_norm=maybe"], "model.attention.qk_norm"),
    (["train.lr_matrix=fast"], "train.lr_matrix"),
    (["model.mod.skip_rate=1.5"], "model.mod.skip_rate"),
    (["model.mod.threshold=quantile"], "model.mod.threshold"),
    (["model.mod.threshold=fixed"], "model.mod.p_thres"),
    (["model.mod.threshold=fixed", "model.mod.p_thres=1.2"], "model.mod.p_thres"),
    (["model.mod.p_thres=0.3"], "model.mod.p_thres"),
    (["model.mod.skip_rate=0.5", "model.mod.max_sublayer_skip=0.4"], "model.mod.max_sublayer_skip"),
    (["model.mod.max_sublayer_skip=0"], "model.mod.max_sublayer_skip"),
    (["model.attention.kind=cca", "model.attention.q_compression=3"], "model.attention.q_compression"),
])
def test_invalid_values_name_the_key(overrides, key):
    with pytest.raises(ConfigError) as e:
        load_config(None, overrides)
    assert key in str(e.value)
    assert "\n" not in str(e.value)


def test_unknown_key_suggests_close_match(tmp_path):
    with pytest.raises(ConfigError, match=r"did you mean 'model\.moe\.top_k'"):
        load_config(None, ["model.moe.topk=2"])
    p = write(tmp_path, "c.yaml", "model: {n_layer: 3}\n")
    with pytest.raises(ConfigError, match=r"unknown config key 'model\.n_layer'.*model\.n_layers"):
        load_config(p)


def test_inherit_cycle_rejected(tmp_path):
    write(tmp_path, "a.yaml", "inherit: b.yaml\n")
    b = write(tmp_path, "b.yaml", "inherit: a.yaml\n")
    with pytest.raises(ConfigError, match="inherit cycle"):
        load_config(b)


def test_missing_parent_and_bad_yaml(tmp_path):
    p = write(tmp_path, "c.yaml", "inherit: nothere.yaml\n")
    with pytest.raises(ConfigError, match="nothere.yaml"):
        load_config(p)
    q = write(tmp_path, "d.yaml", "model: [unclosed\n")
    with pytest.raises(ConfigError, match="invalid YAML"):
        load_config(q)


def test_dump_round_trips(tmp_path, repo_root):
    cfg = load_config(f"{repo_root}/configs/tiny.yaml", ["model.n_layers=3"])
    p = write(tmp_path, "resolved.yaml", dump_yaml(cfg))
    assert load_config(p) == cfg
