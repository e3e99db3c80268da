"""Each train.py setting is declared once (training.config.sections, through training.config.schema): the parser,
the typed sections, the recipe keys and the checkpoint's lists agree because they are read from that declaration."""

from __future__ import annotations

import dataclasses
import json

import pytest

from tests.conftest import REPO_ROOT
from training.config.flags import NOT_SETTINGS, build_parser, load_recipe, parse_args
from training.config.schema import FIXED_ORDER, SHAPE, TOKEN_ORDER, TRAJECTORY, declarations
from training.config.sections import SECTIONS, TrainConfig, carried

RECIPES = sorted((REPO_ROOT / "recipes").glob("*/*.json"))


def spellings() -> dict[str, str]:
    """Every flag spelling of train.py (canonical and alias, without "--") → its dest."""
    return {o[2:]: a.dest for a in build_parser()._actions for o in a.option_strings if o.startswith("--")}


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.name)
def test_every_recipe_key_is_a_train_flag(recipe):
    raw = json.loads(recipe.read_text())
    keys = [
        key for section in ("model", "parallel", "training") for key in raw.get(section, {}) if not key.startswith("_")
    ]
    assert [k for k in keys if k not in spellings()] == []


def test_each_field_has_exactly_one_declaration():
    """A field is a setting, a copy of one declared in another section, a flag another module declares, or the
    recipe's "deepspeed" section; each flag dest is declared by exactly one field."""
    declared = [name for _, name, _ in declarations(SECTIONS)]
    assert sorted(declared) == sorted(set(declared)), "a setting declared twice"
    dests = {a.dest for a in build_parser()._actions} - set(NOT_SETTINGS)
    for kind in SECTIONS.values():
        for f in dataclasses.fields(kind):
            if "copy_of" in f.metadata:
                assert "setting" in {g.name: g for g in dataclasses.fields(f.metadata["copy_of"])}[f.name].metadata
            elif f.name != "deepspeed_overrides":
                assert ("setting" in f.metadata) != ("flag_from" in f.metadata), f.name
                assert f.name in dests, f.name
    fields = {f.name for kind in SECTIONS.values() for f in dataclasses.fields(kind)}
    assert dests - fields == set(), "a flag no section holds"


def test_defaults_agree():
    """The parser's default of every flag is its field's, and no flags build the default configuration."""
    defaults = vars(build_parser().parse_args([]))
    for kind in SECTIONS.values():
        for f in dataclasses.fields(kind):
            if f.name != "deepspeed_overrides":
                assert defaults[f.name] == f.default, f.name
    assert TrainConfig.from_flags(parse_args([])) == TrainConfig()
    cfg = TrainConfig.from_flags(parse_args(["--mp", "2", "--lr", "0.5", "--seed", "7"]))
    assert TrainConfig.from_flags(cfg.to_flags()) == cfg
    assert cfg.optimization.seed == cfg.data.seed == 7  # one flag, two sections


def test_the_seeds_names_are_aliases(tmp_path):
    """--mp / --enable_parallel_optimizer and the recipe keys model_parallel / optimizer_shard are one setting each;
    a refusal names the spelling the user typed."""
    from common.errors import UserError

    seed = parse_args(["--mp", "2", "--enable_parallel_optimizer", "1"])
    canonical = parse_args(["--model_parallel", "2", "--optimizer_shard", "1"])
    assert (seed.model_parallel, seed.optimizer_shard) == (canonical.model_parallel, canonical.optimizer_shard)
    assert not hasattr(seed, "mp") and not hasattr(seed, "enable_parallel_optimizer")
    for key in ("mp", "model_parallel"):
        (tmp_path / "r.json").write_text(json.dumps({"parallel": {key: 4}}))
        assert load_recipe(str(tmp_path / "r.json"))["model_parallel"] == 4
    with pytest.raises(UserError, match=r"^--mp 0 must be >= 1$"):
        parse_args(["--mp", "0"])


def test_the_checkpoints_lists_come_from_the_declarations():
    """What a checkpoint carries: the model's shape under ModelConfig's names, the data order as the data code
    records it, the trajectory as carried_settings records it."""
    from types import SimpleNamespace

    from model.config import ModelConfig
    from training.checkpoint.carried_settings import trajectory
    from training.core.data import data_order

    assert set(carried(SHAPE).values()) <= {f.name for f in dataclasses.fields(ModelConfig)}
    assert carried(SHAPE)["encoder_layer"] == "encoder_layers"
    args = SimpleNamespace(max_tokens=0, batch_multiple=16, pad_multiple=8, num_batch_buckets=2, batch_size=32, seed=1)
    assert set(data_order(args)) - {"batching"} == set(carried(FIXED_ORDER))
    assert set(data_order(SimpleNamespace(**{**vars(args), "max_tokens": 100}))) - {"batching"} == set(
        carried(TOKEN_ORDER)
    )
    assert list(trajectory(TrainConfig(), 10)) == list(carried(TRAJECTORY))
