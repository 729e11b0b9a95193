"""DeepSpeed's config defaults, read out of its released source, as JSON.

fxzero reads a DeepSpeed config with DeepSpeed's default wherever a key is missing
(`fxzero/config/deepspeed_defaults.py`). Those defaults are a claim about another project's code,
so they are checked against that code: this script opens DeepSpeed's sdist (the tarball released
on PyPI), reads its Python with `ast` (never importing it: it needs CUDA builders and a process
group) and writes what each key defaults to when the config leaves it out:

- top-level keys: each `get_scalar_param(param_dict, KEY, KEY_DEFAULT)` (and `dict.get`) in
  `deepspeed/runtime/config.py`, with the constants of `deepspeed/runtime/constants.py`;
- `zero_optimization`, its `offload_param` / `offload_optimizer`, `fp16` and `bf16`: the fields of
  the pydantic models DeepSpeed validates them with (`DeepSpeedZeroConfig`, ...), their defaults,
  and the field names DeepSpeed also accepts for an aliased key (`populate_by_name`);
- the defaults of each optimizer class DeepSpeed builds for an "optimizer" section (FusedAdam,
  DeepSpeedCPUAdam, DeepSpeedCPUAdagrad, ...: their `__init__` signatures), and of torch.optim's
  classes, which DeepSpeed builds for "torch_adam": true, for "Adagrad" and for any other name
  (read from the installed torch, whose version is recorded);
- the top-level and ZeRO keys DeepSpeed 0.19 refuses outright (features it removed).

The sdist's sha256 is recorded with the figures. The committed output,
`tests/data/deepspeed-0.19.8-defaults.json`, is what `tests/passes/test_deepspeed_defaults.py`
compares fxzero's table with; tests never need the sdist.

    .venv/bin/python tools/deepspeed_defaults.py                 # print, and rewrite the JSON
    .venv/bin/python tools/deepspeed_defaults.py --check         # exit 1 if the JSON differs
    .venv/bin/python tools/deepspeed_defaults.py path/to/deepspeed-X.tar.gz --out other.json
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import inspect
import json
import pathlib
import sys
import tarfile
from typing import Any, Optional

ROOT = pathlib.Path(__file__).resolve().parents[1]
SDIST = pathlib.Path("/tmp/fx/ds_src/deepspeed-0.19.8.tar.gz")
OUT = ROOT / "tests" / "data" / "deepspeed-0.19.8-defaults.json"

SECTIONS = {  # config section -> the model DeepSpeed validates it with (runtime/config.py's get_*_config)
    "zero_optimization": "DeepSpeedZeroConfig",
    "fp16": "DeepSpeedFP16Config",
    "bf16": "DeepSpeedBF16Config",
}
MODEL_FILES = ("deepspeed/runtime/zero/config.py", "deepspeed/runtime/zero/offload_config.py",
               "deepspeed/runtime/precision_config.py")
OPTIMIZER_CLASSES = {  # DeepSpeed's optimizer classes that an "optimizer" section can build
    "FusedAdam": "deepspeed/ops/adam/fused_adam.py",
    "DeepSpeedCPUAdam": "deepspeed/ops/adam/cpu_adam.py",
    "DeepSpeedCPUAdagrad": "deepspeed/ops/adagrad/cpu_adagrad.py",
    "FusedLamb": "deepspeed/ops/lamb/fused_lamb.py",
    "FusedLion": "deepspeed/ops/lion/fused_lion.py",
    "DeepSpeedCPULion": "deepspeed/ops/lion/cpu_lion.py",
}
DICT_PREFIXES = {"param_dict": "", "data_types_params": "data_types.", "checkpoint_params": "checkpoint."}
"""The names runtime/config.py gives the config (and its sections) where it reads a key."""


class Unknown(Exception):
    """An expression this reader does not evaluate (left out of the output)."""


# -- reading the sdist ------------------------------------------------------------------------

def read_sdist(path: pathlib.Path) -> tuple[str, dict[str, str]]:
    """(sha256, {"deepspeed/...py": source, "version.txt": ...}) of the sdist's package sources."""
    data = path.read_bytes()
    sources = {}
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            parts = member.name.split("/", 1)
            if member.isfile() and len(parts) == 2 and (parts[1] == "version.txt" or (
                    parts[1].startswith("deepspeed/") and parts[1].endswith(".py"))):
                sources[parts[1]] = tar.extractfile(member).read().decode()
    if "deepspeed/runtime/config.py" not in sources:
        raise SystemExit(f"{path}: no deepspeed/runtime/config.py inside; is it DeepSpeed's sdist?")
    return hashlib.sha256(data).hexdigest(), sources


def evaluate(node: ast.AST, env: dict[str, Any]) -> Any:
    """A constant expression of DeepSpeed's config code: literals, names bound in `env`,
    `pp_int(x)` (an int printed prettily), `sys.maxsize`, unary minus, tuples and lists."""
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, (ast.Tuple, ast.List)):
        return [evaluate(e, env) for e in node.elts]
    if isinstance(node, ast.Dict):
        return {evaluate(k, env): evaluate(v, env) for k, v in zip(node.keys, node.values)}
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        return -evaluate(node.operand, env)
    if isinstance(node, ast.Name) and node.id in env:
        return env[node.id]
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
        if (node.value.id, node.attr) == ("sys", "maxsize"):
            return sys.maxsize
        if node.value.id in env and isinstance(env[node.value.id], dict) and node.attr in env[node.value.id]:
            return env[node.value.id][node.attr]  # an Enum member: its value
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "pp_int":
        return int(evaluate(node.args[0], env))
    raise Unknown(ast.unparse(node))


def module_constants(source: str) -> dict[str, Any]:
    """Every top-level NAME = <constant expression> (the last one wins, as at import), and each
    Enum class as {member: value}."""
    env: dict[str, Any] = {}
    for stmt in ast.parse(source).body:
        if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name):
            try:
                env[stmt.targets[0].id] = evaluate(stmt.value, env)
            except Unknown:
                pass
        elif isinstance(stmt, ast.ClassDef) and any("Enum" in ast.unparse(b) for b in stmt.bases):
            members = {}
            for item in stmt.body:
                if isinstance(item, ast.Assign) and isinstance(item.targets[0], ast.Name):
                    try:
                        members[item.targets[0].id] = evaluate(item.value, env)
                    except Unknown:
                        pass
            env[stmt.name] = members
    return env


# -- top-level keys (runtime/config.py) -------------------------------------------------------

def _prefix(node: ast.AST, env: dict[str, Any]) -> Optional[str]:
    """The section a dict expression is: "" for the config, "torch_autocast." for
    param_dict[TORCH_AUTOCAST], ...; None for anything else."""
    if isinstance(node, ast.Name):
        return DICT_PREFIXES.get(node.id)
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "param_dict":
        try:
            return f"{evaluate(node.slice, env)}."
        except Unknown:
            return None
    return None


def _defaults_of(fn: ast.FunctionDef, env: dict[str, Any]) -> dict[str, Any]:
    names = [a.arg for a in fn.args.args]
    out = {}
    for name, default in zip(names[len(names) - len(fn.args.defaults):], fn.args.defaults):
        try:
            out[name] = evaluate(default, env)
        except Unknown:
            pass
    return out


def top_level_keys(source: str, consts: dict[str, Any]) -> dict[str, Any]:
    """{key path: default} for each key runtime/config.py reads with a default: through
    get_scalar_param(<dict>, KEY, DEFAULT) or <dict>.get(KEY, DEFAULT), KEY and DEFAULT being
    constants, the reading function's own keyword defaults, or the arguments a call passes it."""
    tree = ast.parse(source)
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    found: dict[str, Any] = {}

    def reads(fn: ast.FunctionDef, env: dict[str, Any]) -> None:
        for call in ast.walk(fn):
            if not isinstance(call, ast.Call):
                continue
            if isinstance(call.func, ast.Name) and call.func.id == "get_scalar_param" and len(call.args) == 3:
                where, key, default = call.args
            elif (isinstance(call.func, ast.Attribute) and call.func.attr == "get" and len(call.args) == 2):
                where, (key, default) = call.func.value, call.args
            else:
                continue
            prefix = _prefix(where, env)
            try:
                name, value = evaluate(key, env), evaluate(default, env)
            except Unknown:
                continue
            if prefix is not None and isinstance(name, str) and not isinstance(value, dict):
                found.setdefault(prefix + name, value)

    for fn in functions.values():
        reads(fn, {**consts, **_defaults_of(fn, consts)})
    # a reader called with other keys than its defaults: get_communication_data_type(param_dict, K, D)
    for call in ast.walk(tree):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id in functions \
                and len(call.args) > 1:
            fn = functions[call.func.id]
            names = [a.arg for a in fn.args.args]
            try:
                bound = {names[i]: evaluate(a, consts) for i, a in enumerate(call.args) if i > 0}
            except Unknown:
                continue
            reads(fn, {**consts, **_defaults_of(fn, consts), **bound})
    return found


# -- pydantic sections --------------------------------------------------------------------------

def models(sources: dict[str, str]) -> dict[str, dict[str, Any]]:
    """{class name: {"fields": {key: default}, "names": {field name: key}, "nested": {key: class}}}
    for each pydantic config class in MODEL_FILES. A field's key is its alias where it has one;
    DeepSpeed accepts the field name too (populate_by_name)."""
    out: dict[str, dict[str, Any]] = {}
    classes = [node for path in MODEL_FILES for node in ast.parse(sources[path]).body
               if isinstance(node, ast.ClassDef)]
    names = {c.name for c in classes}
    for cls in classes:
        consts = module_constants(sources[next(p for p in MODEL_FILES if f"class {cls.name}(" in sources[p])])
        fields, aliases, nested = {}, {}, {}
        for item in cls.body:
            if not (isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)):
                continue
            field, key, value = item.target.id, item.target.id, item.value
            annotation = ast.unparse(item.annotation)
            if isinstance(value, ast.Call) and ast.unparse(value.func) == "Field":
                kwargs = {k.arg: k.value for k in value.keywords}
                if "alias" in kwargs:
                    key = evaluate(kwargs["alias"], consts)
                    aliases[field] = key
                if "default_factory" in kwargs:
                    factory = ast.unparse(kwargs["default_factory"])
                    value = None
                    fields[key] = {}
                    if factory in names:
                        nested[key] = factory
                    continue
                value = value.args[0] if value.args else kwargs.get("default")
            try:
                fields[key] = evaluate(value, consts) if value is not None else None
            except Unknown:
                continue
            for candidate in names:
                if candidate in annotation.replace("Optional[", "").replace("]", "").split(" | "):
                    nested[key] = candidate
        out[cls.name] = {"fields": fields, "names": aliases, "nested": nested}
    return out


def section_keys(all_models: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], dict[str, str]]:
    """({key path: default}, {accepted field-name path: key path}) under SECTIONS, nested
    sections included (a nested section's own default is its field's: None where absent)."""
    keys, names = {}, {}

    def visit(cls: str, prefix: str) -> None:
        model = all_models[cls]
        for key, default in model["fields"].items():
            keys[prefix + key] = default
            if key in model["nested"]:
                visit(model["nested"][key], f"{prefix}{key}.")
        for field, alias in model["names"].items():
            names[prefix + field] = prefix + alias

    for section, cls in SECTIONS.items():
        visit(cls, section + ".")
    return keys, names


# -- optimizers ---------------------------------------------------------------------------------

def _jsonable(value: Any) -> Any:
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str, list)):
        return value
    raise Unknown(repr(value))


def deepspeed_optimizers(sources: dict[str, str]) -> dict[str, dict[str, Any]]:
    """Each of OPTIMIZER_CLASSES' `__init__` keyword defaults (its params argument left out)."""
    out = {}
    for name, path in OPTIMIZER_CLASSES.items():
        cls = next(n for n in ast.parse(sources[path]).body if isinstance(n, ast.ClassDef) and n.name == name)
        init = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
        out[name] = _defaults_of(init, {})
    return out


def torch_optimizers() -> tuple[str, dict[str, dict[str, Any]]]:
    """(torch's version, {"torch.optim.X": keyword defaults}) for each optimizer class of the
    installed torch.optim: DeepSpeed builds torch.optim.AdamW / Adam for "torch_adam": true,
    torch.optim.Adagrad for "Adagrad" without offload, and getattr(torch.optim, type) for a type
    it does not know."""
    import torch

    out = {}
    for name in sorted(dir(torch.optim)):
        cls = getattr(torch.optim, name)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.Optimizer)) or cls is torch.optim.Optimizer:
            continue
        defaults = {}
        for p in list(inspect.signature(cls.__init__).parameters.values())[2:]:
            if p.default is not inspect.Parameter.empty:
                try:
                    defaults[p.name] = _jsonable(p.default)
                except Unknown:
                    defaults[p.name] = repr(p.default)
        out[f"torch.optim.{name}"] = defaults
    return torch.__version__, out


def optimizer_dispatch(sources: dict[str, str], consts: dict[str, Any]) -> dict[str, Any]:
    """The "optimizer" section's own defaults: its "type" (no optimizer unless one is given),
    the names DeepSpeed builds itself, and the params it reads before building (adam_w_mode,
    torch_adam: runtime/engine.py's `optimizer_parameters.pop(KEY, DEFAULT)`)."""
    config = module_constants(sources["deepspeed/runtime/config.py"])
    env = {**consts, **config}
    pops = {}
    for call in ast.walk(ast.parse(sources["deepspeed/runtime/engine.py"])):
        if isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "pop" \
                and ast.unparse(call.func.value) == "optimizer_parameters" and len(call.args) == 2:
            try:
                pops[evaluate(call.args[0], env)] = evaluate(call.args[1], env)
            except Unknown:
                pass
    return {"type": consts["OPTIMIZER_TYPE_DEFAULT"], "deepspeed_optimizers": config["DEEPSPEED_OPTIMIZERS"],
            "params_read_before_building": dict(sorted(pops.items()))}


def removed_keys(source: str, name: str) -> list[str]:
    """The keys of the top-level dict `name` (DeepSpeed's removed keys, each with its message)."""
    for stmt in ast.parse(source).body:
        if isinstance(stmt, ast.Assign) and [ast.unparse(t) for t in stmt.targets] == [name]:
            return sorted(evaluate(k, {}) for k in stmt.value.keys)
    raise SystemExit(f"runtime/config.py has no {name}")


# -- the whole table ----------------------------------------------------------------------------

def extract(sdist: pathlib.Path) -> dict[str, Any]:
    sha256, sources = read_sdist(sdist)
    consts = module_constants(sources["deepspeed/runtime/constants.py"])
    keys = top_level_keys(sources["deepspeed/runtime/config.py"], consts)
    zero_keys, names = section_keys(models(sources))
    keys.update(zero_keys)
    config = sources["deepspeed/runtime/config.py"]
    torch_version, torch_optims = torch_optimizers()
    return {
        "deepspeed": {"sdist": sdist.name, "sha256": sha256, "version": sources["version.txt"].strip()},
        "torch": torch_version,
        "keys": dict(sorted(keys.items())),
        "field_names": dict(sorted(names.items())),
        "optimizer": optimizer_dispatch(sources, consts),
        "optimizers": {**deepspeed_optimizers(sources), **torch_optims},
        "removed": {"top_level": removed_keys(config, "_REMOVED_TOP_LEVEL_CONFIG_KEYS"),
                    "zero_optimization": removed_keys(config, "_REMOVED_ZERO_CONFIG_KEYS")},
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sdist", nargs="?", type=pathlib.Path, default=SDIST, help=f"default: {SDIST}")
    parser.add_argument("--out", type=pathlib.Path, default=OUT, help=f"default: {OUT.relative_to(ROOT)}")
    parser.add_argument("--check", action="store_true", help="exit 1 if --out differs; write nothing")
    args = parser.parse_args()
    text = json.dumps(extract(args.sdist), indent=1) + "\n"
    if args.check:
        if not args.out.exists() or args.out.read_text() != text:
            print(f"{args.out} differs from what {args.sdist} gives: rerun without --check", file=sys.stderr)
            return 1
        return 0
    print(text, end="")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
