"""docs/deepspeed_config.md against the key table, and the config reader against the table.

The doc's generated part must be `markdown_table()`'s output. The reader is checked from
outside, key by key, with the table as the claim: a "no effect" key is accepted and named in
the warning; an "unsupported" key is accepted with each value it honours and refused, naming
it, with any other; "auto" resolves where the table says it does and is refused elsewhere.
"""

from __future__ import annotations

import pathlib
import re
from typing import Any

import pytest

from fxzero.config.deepspeed import read_deepspeed
from fxzero.config.deepspeed_defaults import DEFAULTS
from fxzero.config.deepspeed_keys import (
    KEYS, NO_EFFECT, OPTIMIZER_PARAMS, OPTIMIZER_TYPES, UNSUPPORTED, Key, markdown_table)
from fxzero.config.schedules import SCHEDULES
from tools.deepspeed_keys_doc import DOC, split

DOC_TEXT = pathlib.Path(DOC).read_text()

# Every key the reader takes, with its Key: the table's, by path, and each optimizer type's params,
# by "<type>:optimizer.params.<name>" (the type they are given with: one of the table's types).
ALL_KEYS: dict[str, Key] = dict(KEYS)
for _table, _params in OPTIMIZER_PARAMS.items():
    for _name, _key in _params.items():
        ALL_KEYS[f"{OPTIMIZER_TYPES[_table][-1]}:optimizer.params.{_name}"] = _key


def path_of(case: str) -> str:
    """The key's path in a DeepSpeed config ("optimizer.params.lr" for "AdamW:optimizer.params.lr")."""
    return case.rpartition(":")[2]

# A value DeepSpeed users write for a "no effect" key (its default where one is needed); keys not
# listed try the fallbacks in order until the reader accepts one.
PLAUSIBLE: dict[str, Any] = {
    "zero_optimization.reduce_bucket_size": 500_000_000,
    "zero_optimization.allgather_bucket_size": 500_000_000,
    "zero_optimization.stage3_prefetch_bucket_size": 50_000_000,
    "zero_optimization.stage3_max_live_parameters": 1_000_000_000,
    "zero_optimization.stage3_model_persistence_threshold": 2**63 - 1,
    "zero_optimization.sub_group_size": 1_000_000_000,
    "zero_optimization.offload_param.buffer_size": 100_000_000,
    "zero_optimization.offload_param.max_in_cpu": 1_000_000_000,
    "zero_optimization.stage3_module_granularity_threshold": 0,
    "zero_optimization.parameter_alignment": 1,
    "zero_optimization.leaf_module": {},
    "zero_optimization.offload_optimizer.cpuadam_cores_perc": 0.8,
    "seq_parallel_communication_data_type": "fp32",
    "activation_checkpointing": {"partition_activations": False},
    "aio": {"block_size": 1_048_576, "queue_depth": 8},
    "checkpoint": {"tag_validation": "Warn"},
    "pipeline": {},
    "timers": {"throughput": {"enabled": True}},
    "log_level": "info",
    "vocabulary_size": 50_257,
    "steps_per_print": 10,
}
FALLBACKS = (False, True, 0, {})
REFUSED = (True, 2, {"enabled": True})  # tried on every "unsupported" key, unless it honours one

KNOWN_BUGS: dict[tuple[str, str], str] = {}  # (key, value as repr) -> what the reader does instead


def nested(case: str, value: Any) -> dict[str, Any]:
    """{"a": {"b": value}} for "a.b"; an optimizer param sits in the params of its type's optimizer."""
    kind, _, path = case.rpartition(":")
    if path.startswith("optimizer.params."):
        return {"optimizer": {"type": kind, "params": {path.rsplit(".", 1)[1]: value}}}
    for part in reversed(path.split(".")):
        value = {part: value}
    return value


def _case(path: str, value: Any):
    bug = KNOWN_BUGS.get((path, repr(value)))
    marks = [pytest.mark.xfail(reason=bug, strict=True, raises=ValueError)] if bug else []
    return pytest.param(path, value, id=f"{path}={value!r}", marks=marks)


def _of_kind(kind: str) -> list[str]:
    return [p for p, k in ALL_KEYS.items() if k.kind == kind]


def _honoured(path: str) -> list[Any]:
    return list(ALL_KEYS[path].honoured_values)


# -- the doc ----------------------------------------------------------------------------------

@pytest.mark.timeout(60)
def test_the_docs_generated_part_is_the_table_in_code():
    _, generated, _ = split(DOC_TEXT)
    assert generated == markdown_table(), (
        "docs/deepspeed_config.md is stale against fxzero/config/deepspeed_keys.py: run "
        ".venv/bin/python tools/deepspeed_keys_doc.py")


@pytest.mark.timeout(60)
def test_every_key_optimizer_param_and_schedule_is_in_the_doc():
    missing = [c for c in ALL_KEYS if f"`{path_of(c)}`" not in DOC_TEXT]
    missing += [f'scheduler "{t}"' for t in SCHEDULES if f'`"{t}"`' not in DOC_TEXT]
    missing += [t for types in OPTIMIZER_TYPES.values() for t in types if f'`"{t}"`' not in DOC_TEXT]
    assert not missing, f"not in docs/deepspeed_config.md: {missing}"


@pytest.mark.timeout(60)
def test_rows_say_what_happens_and_what_auto_becomes():
    table = markdown_table()
    for row in (
        "| `zero_optimization.reduce_bucket_size` | no effect (warned once) | `500000000` | `500000000` |",
        "| `train_batch_size` | used | `null` | implied by the other two |",
        '| `amp` | error unless `{}` or `{"enabled": false}` (or any section whose every `enabled` is '
        'false) |  | error |',
        "| `zero_optimization.zero_quantized_weights` | error unless `false` | `false` | `false` |",
        "| `zero_optimization.stage` | used | `0` | `0` |",
        "| `gradient_clipping` | used | `1.0` | `1.0` |",
        "| `steps_per_print` | used | `null` | `null` |",
        "| `zero_optimization.offload_param.buffer_count` | used | `5` | error |",
        "| `aio` | no effect (warned once) |  | accepted |",
        "| `zero_optimization` | section |  | error |",
        "| `optimizer.params.bias_correction` | used |  | error |",
        "| `FusedAdam` | `lr` `0.001`, `betas` `[0.9, 0.999]`, `eps` `1e-08`, `weight_decay` `0.0`,",
        "| `torch.optim.AdamW` | `lr` `0.001`, `betas` `[0.9, 0.999]`, `eps` `1e-08`, `weight_decay` `0.01`,",
        '| `"OneCycle"` | `cycle_min_lr` | required |',
        '| `"WarmupLR"` | `warmup_max_lr` | `null` |',
    ):
        assert row in table, row
    keys_part = table.split("### Optimizer defaults")[0]
    key_rows = [line for line in keys_part.splitlines() if line.startswith("| `") and not line.startswith('| `"')]
    assert len(key_rows) == len(ALL_KEYS)  # one row per key (per optimizer type's table), sections included
    assert "### Optimizer params (`optimizer.type` `\"Adagrad\"`)" in table


# -- the reader, checked against the table ----------------------------------------------------

@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", _of_kind(NO_EFFECT))
def test_a_no_effect_key_is_accepted_and_named(path):
    candidates = ([PLAUSIBLE[path]] if path in PLAUSIBLE else []) + list(FALLBACKS)
    refusals = []
    for value in candidates:
        try:
            reading = read_deepspeed(nested(path, value))
        except ValueError as e:
            refusals.append(f"{value!r}: {e}")
            continue
        named = [m for m in reading.ineffective if f"'{path_of(path)}'" in m]
        assert len(named) == 1, f"{path}={value!r} was accepted but not named once: {reading.ineffective}"
        assert ALL_KEYS[path].why in named[0]
        return
    pytest.fail(f"{path} is 'no effect' but every value tried was refused: {refusals}")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path,value", [_case(p, v) for p in _of_kind(UNSUPPORTED) for v in _honoured(p)])
def test_an_unsupported_key_with_an_honoured_value_is_accepted_silently(path, value):
    reading = read_deepspeed(nested(path, value))
    assert not [m for m in reading.ineffective if path_of(path) in m]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", _of_kind(UNSUPPORTED))
def test_an_unsupported_key_with_another_value_is_an_error_naming_it(path):
    tried = [v for v in REFUSED if not ALL_KEYS[path].honours(v)]
    assert tried, f"{path} honours every value tried: add one it does not"
    for value in tried:
        with pytest.raises(ValueError, match=re.escape(path_of(path))):
            read_deepspeed(nested(path, value))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", [p for p, k in KEYS.items() if k.has_auto])
def test_auto_resolves_where_the_table_says_and_is_printed(path):
    reading = read_deepspeed(nested(path, "auto"))
    if KEYS[path].kind == NO_EFFECT and path not in DEFAULTS:  # nothing to resolve to: its warning names it
        assert [m for m in reading.ineffective if f"'{path}'" in m]
        return
    assert [line for line in reading.resolved if line.startswith(f'{path}: "auto" -> ')]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("path", [p for p, k in ALL_KEYS.items() if not k.has_auto and "auto" not in _honoured(p)])
def test_auto_is_an_error_naming_the_key_elsewhere(path):
    with pytest.raises(ValueError, match=re.escape(path_of(path)) + ' is "auto"'):
        read_deepspeed(nested(path, "auto"))
