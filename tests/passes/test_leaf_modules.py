"""DeepSpeed's ZeRO-3 leaf modules (`deepspeed.utils.set_z3_leaf_modules`, the config's
`zero_optimization.leaf_module`): the flags as DeepSpeed sets them, and units that never split a
leaf ([Note: leaf modules are never split across units] in `fxzero/leaf_modules.py`)."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn as nn

import fxzero
from fxzero.config import LeafModules, UnitsPolicy
from fxzero.config.notices import IneffectiveSetting
from fxzero.leaf_modules import apply_leaf_modules
from fxzero.units import plan_units
from fxzero.utils import (get_z3_leaf_modules, set_z3_leaf_modules, set_z3_leaf_modules_by_name,
                          set_z3_leaf_modules_by_suffix, unset_z3_leaf_modules, z3_leaf_module, z3_leaf_parameter)

pytestmark = pytest.mark.timeout(120)


class Expert(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))


class Moe(nn.Module):
    """Two experts mixed by a router's softmax (dense: every expert sees every token)."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(8, 2)
        self.experts = nn.ModuleList([Expert(), Expert()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights = self.router(x).softmax(-1)
        return sum(weights[..., i:i + 1] * e(x) for i, e in enumerate(self.experts))


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.moe = nn.LayerNorm(8), Moe()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.moe(self.norm(x))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.extra = Moe()  # (outside the blocks: part of the root unit unless a leaf)
        self.head = nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for block in self.blocks:
            h = block(h)
        return self.head(self.extra(h))


def _units(model: nn.Module, policy: UnitsPolicy = UnitsPolicy()) -> dict[str, list[str]]:
    return {lay.name: [s.fqn for s in lay.slots] for lay in plan_units(model, policy, 2)}


# -- the flags, as DeepSpeed sets them ------------------------------------------------------------


def test_set_by_class_by_name_and_by_suffix_and_unset():
    model = Net()
    flagged = set_z3_leaf_modules(model, [Moe])
    assert flagged == [model.blocks[0].moe, model.blocks[1].moe, model.extra] == get_z3_leaf_modules(model)
    assert unset_z3_leaf_modules(model, ["Moe"]) == flagged and get_z3_leaf_modules(model) == []
    assert set_z3_leaf_modules(model, [f"{Moe.__module__}.Moe"]) == flagged  # (the fully qualified name)
    unset_z3_leaf_modules(model, [Moe])
    modules, missing = set_z3_leaf_modules_by_name(model, ["extra", "nothing"], raise_if_not_found=False)
    assert modules == [model.extra] and missing == ["nothing"] and z3_leaf_module(model.extra)
    modules, missing = set_z3_leaf_modules_by_suffix(model, ["moe.router"], flag=True)
    assert modules == [model.blocks[0].moe.router, model.blocks[1].moe.router] and missing == []
    with pytest.raises(ValueError, match=r"no module of the classes \['Mixtral'\] in the model \(Net\)"):
        set_z3_leaf_modules(model, ["Mixtral"])
    with pytest.raises(ValueError, match=r"no module named \['nothing'\]"):
        set_z3_leaf_modules_by_name(model, ["nothing"])
    with pytest.raises(TypeError, match="a list of module classes or class names"):
        set_z3_leaf_modules(model, Moe)


# -- units ---------------------------------------------------------------------------------------


def test_a_leaf_outside_every_unit_is_a_unit_of_its_own():
    model = Net()
    before = _units(model)
    assert "extra" not in before and "extra.router.weight" in before["root"]
    set_z3_leaf_modules(model, [Moe])
    after = _units(model)
    # (the blocks' leaves are inside their blocks' units already; the one outside is now its own unit)
    assert {k: v for k, v in after.items() if k != "extra" and k != "root" and k != "root:tail"} == \
        {k: v for k, v in before.items() if k.startswith("blocks")}
    assert after["extra"] == [n for n, _ in model.extra.named_parameters(prefix="extra")]
    assert not any(n.startswith("extra.") for n in after["root"])


def test_a_units_policy_does_not_split_a_leaf_and_says_so_once():
    model = Net()
    policy = UnitsPolicy(module_classes=(Expert,))
    assert "blocks.0.moe.experts.1" in _units(model, policy)
    set_z3_leaf_modules(model, [Moe])
    with pytest.warns(IneffectiveSetting) as caught:
        units = _units(model, policy)
    assert [str(w.message).split("one unit: ", 1)[1].split(". To")[0] for w in caught] == [
        "'blocks.0.moe' (Moe; the policy matches ['blocks.0.moe.experts.0', 'blocks.0.moe.experts.1'] inside it); "
        "'blocks.1.moe' (Moe; the policy matches ['blocks.1.moe.experts.0', 'blocks.1.moe.experts.1'] inside it); "
        "'extra' (Moe; the policy matches ['extra.experts.0', 'extra.experts.1'] inside it)"]
    assert "blocks.0.moe" in units and not any(".experts." in name for name in units)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (a policy that makes the leaf itself a unit: nothing to say)
        assert "blocks.1.moe" in _units(model, UnitsPolicy(module_classes=(Moe,)))


def test_a_leaf_model_is_one_unit():
    model = Net()
    model._z3_leaf = True  # (code written for DeepSpeed may set DeepSpeed's attribute itself)
    assert list(_units(model)) == ["root"]


# -- the config, and the engine ------------------------------------------------------------------


def test_the_config_section_reads_as_deepspeed_reads_it():
    assert fxzero.Config().leaf_modules == LeafModules()  # (DeepSpeed's default classes, flagged always)
    cfg = fxzero.Config.from_deepspeed({"zero_optimization": {"stage": 3, "leaf_module": {
        "classes": "Moe", "names": ["extra"], "name_suffixes": ["moe.router", "moe.router"]}}})
    assert cfg.leaf_modules == LeafModules(classes=("Moe",), names=("extra",), name_suffixes=("moe.router",))
    kept = fxzero.Config.from_deepspeed({"zero_optimization": {"leaf_module": {"names": ["extra"]}}}).leaf_modules
    assert kept.classes == LeafModules().classes and kept.names == ("extra",)  # (DeepSpeed's default classes kept)
    with pytest.raises(ValueError, match=r"unknown key 'zero_optimization.leaf_module.class'; did you mean 'classes'"):
        fxzero.Config.from_deepspeed({"zero_optimization": {"leaf_module": {"class": ["Moe"]}}})
    with pytest.raises(ValueError, match=r"leaf_module.names must be a name or a list of names, got 3"):
        fxzero.Config.from_deepspeed({"zero_optimization": {"leaf_module": {"names": 3}}})


def test_unmatched_entries_beyond_deepspeeds_defaults_are_warned_about():
    model = Net()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # (DeepSpeed's default classes: absent from most models, said nothing)
        assert apply_leaf_modules(model, LeafModules()) == []
    with pytest.warns(UserWarning, match=r"no module matches the names \['nothing'\]"):
        assert apply_leaf_modules(model, LeafModules(names=("nothing", "extra"))) == [model.extra]
    with pytest.warns(UserWarning, match=r"no module of the classes \['Mixtral'\] in the model \(Net\)"):
        apply_leaf_modules(Net(), LeafModules(classes=("Mixtral",)))


def _train(leaf: LeafModules, steps: int = 3) -> tuple[list[float], fxzero.Engine]:
    torch.manual_seed(0)
    model = Net()
    engine = fxzero.compile(model, fxzero.Config(stage=3, leaf_modules=leaf, optimizer=fxzero.AdamW(lr=1e-2),
                                                 cost_model=None))
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x, y = torch.randn(6, 4, generator=g), torch.randint(0, 3, (6,), generator=g)
        loss = nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    return losses, engine


def test_the_engine_flags_the_configs_leaves_and_trains_as_without_them():
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # (no classes: flags none, and says nothing)
        plain, engine = _train(LeafModules(classes=()))
    assert "extra" not in [lay.name for lay in engine.layouts]
    leaves, engine = _train(LeafModules(names=("extra",)))
    assert "extra" in [lay.name for lay in engine.layouts]
    assert leaves == plain  # (the same arithmetic, grouped otherwise)
    model = engine.module
    assert get_z3_leaf_modules(model) == [model.extra]
    assert all(z3_leaf_parameter(p) and p.ds_z3_leaf_module is model.extra for p in model.extra.parameters())
    assert not any(z3_leaf_parameter(p) for p in model.blocks.parameters())
