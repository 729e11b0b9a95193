"""The artifact directory: what `fxzero compile` (and `fxzero train`) record for the viewers.

Record, then view: `record()` turns the compiler's live products into plain JSON values once;
`graph`, `schedule` and the plots read only those, from memory or from a directory:

    DIR/manifest.json    what was compiled: model spec, parameters, world, stage, inputs, times
    DIR/schedule.json    the Schedule, exactly `Schedule.dumps()` (what the runtime executes)
    DIR/pass_trace.json  per pass: changed?, nodes before/after, node kinds, seconds, summary
    DIR/graph.json       the rewritten joint graph: one record per node (kind, unit, phase, ...)
    DIR/graph.txt        the same graph as Python code (`GraphModule.code`), for reading
    DIR/memory.json      model states and live bytes per instruction (fxzero.liveness)
    DIR/run.json         `fxzero train` only: losses, step times, per-rank memory, spans
    DIR/timeline.json    `fxzero train` only: when each instruction of the last step ran, per rank
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any, Optional

import torch
import torch.fx as fx

from fxzero import estimate
from fxzero._compat import OpOverload
from fxzero.liveness import program_live_bytes
from fxzero.schedule import Schedule

__all__ = ["ArtifactError", "Artifacts", "FILES", "record"]

FORMAT = "fxzero-artifacts"
VERSION = 1
FILES = {
    "manifest": "manifest.json",
    "schedule": "schedule.json",
    "pass_trace": "pass_trace.json",
    "graph": "graph.json",
    "code": "graph.txt",
    "memory": "memory.json",
    "run": "run.json",
    "timeline": "timeline.json",
}


class ArtifactError(ValueError):
    """A path that is not (or no longer) a readable artifact directory."""


@dataclasses.dataclass
class Artifacts:
    """Everything the viewers need, as plain values."""

    manifest: dict
    schedule: Schedule
    pass_trace: list[dict]
    graph: dict
    """{"nodes": [{"name", "op", "target", "kind", "unit", "owner", "phase", "inputs", ...}]}"""
    memory: dict
    code: str = ""
    run: Optional[dict] = None
    timeline: Optional[dict] = None
    """The recorded timeline (`fxzero train`): {"clock", "step", "ranks": [{"rank",
    "instructions": [[program, index, start, end], ...], "step_program": [start, end]}]};
    read by `fxzero.viz.timing.recorded`."""
    directory: Optional[str] = None
    """Where it was read from or written to, if anywhere."""

    @property
    def units(self) -> list[str]:
        return [u.name for u in self.schedule.units]

    def write(self, directory: str) -> list[str]:
        """Write every file into `directory` (created if needed); returns the paths written.

        Raises:
            ArtifactError: `directory` exists, is not empty and is not an artifact directory.
        """
        if os.path.exists(directory):
            if not os.path.isdir(directory):
                raise ArtifactError(f"{directory} is a file; choose a directory for the artifacts")
            if os.listdir(directory) and not os.path.exists(os.path.join(directory, FILES["manifest"])):
                raise ArtifactError(
                    f"{directory} is not empty and holds no fxzero artifacts; refusing to write "
                    "into it: choose a new or empty directory"
                )
        os.makedirs(directory, exist_ok=True)
        contents = {
            "manifest": _dumps(self.manifest),
            "schedule": self.schedule.dumps(),
            "pass_trace": _dumps(self.pass_trace),
            "graph": json.dumps(self.graph, separators=(",", ":")),
            "code": self.code,
            "memory": json.dumps(self.memory, separators=(",", ":")),
        }
        # run.json and timeline.json only come from `fxzero train`: drop those of an earlier
        # train into DIR, so a directory never mixes two runs.
        for key, value, dumps in (("run", self.run, _dumps), ("timeline", self.timeline, _compact)):
            if value is not None:
                contents[key] = dumps(value)
            else:
                _remove(os.path.join(directory, FILES[key]))
        paths = []
        for key, text in contents.items():
            path = os.path.join(directory, FILES[key])
            _write_text(path, text)
            paths.append(path)
        self.directory = directory
        return paths

    @classmethod
    def read(cls, path: str) -> "Artifacts":
        """Read an artifact directory (or any file inside one).

        Raises:
            ArtifactError: with one line saying what is wrong and how to make one.
        """
        directory = path
        if os.path.isfile(path):
            if os.path.basename(path) not in FILES.values():
                raise ArtifactError(
                    f"{path} is not an fxzero artifact: expected a directory written by "
                    "`fxzero compile MODEL -o DIR`, or a MODEL spec"
                )
            directory = os.path.dirname(path) or "."
        if not os.path.isdir(directory):
            raise ArtifactError(f"{path}: no such file or directory")
        manifest_path = os.path.join(directory, FILES["manifest"])
        if not os.path.exists(manifest_path):
            raise ArtifactError(
                f"{path} is not an fxzero artifact directory (no {FILES['manifest']}); "
                "write one with `fxzero compile MODEL -o DIR`"
            )
        manifest = _load_json(manifest_path)
        if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
            raise ArtifactError(f"{manifest_path} is not an fxzero manifest (no \"format\": \"{FORMAT}\")")
        if manifest.get("version") != VERSION:
            raise ArtifactError(
                f"{directory} holds artifacts of format version {manifest.get('version')!r}, this "
                f"fxzero reads version {VERSION}; compile the model again"
            )
        try:
            schedule = Schedule.from_json(_load_json(os.path.join(directory, FILES["schedule"])))
        except (KeyError, TypeError) as e:
            raise ArtifactError(f"{directory}/{FILES['schedule']} is not a valid schedule ({e!r})") from e
        except ValueError as e:
            if isinstance(e, ArtifactError):
                raise
            raise ArtifactError(f"{directory}/{FILES['schedule']}: {e}") from e
        run_path = os.path.join(directory, FILES["run"])
        timeline_path = os.path.join(directory, FILES["timeline"])
        code_path = os.path.join(directory, FILES["code"])
        code = ""
        if os.path.exists(code_path):
            with open(code_path) as f:
                code = f.read()
        return cls(
            manifest=manifest,
            schedule=schedule,
            pass_trace=_load_json(os.path.join(directory, FILES["pass_trace"])),
            graph=_load_json(os.path.join(directory, FILES["graph"])),
            memory=_load_json(os.path.join(directory, FILES["memory"])),
            code=code,
            run=_load_json(run_path) if os.path.exists(run_path) else None,
            timeline=_load_json(timeline_path) if os.path.exists(timeline_path) else None,
            directory=directory,
        )


def _dumps(value: Any) -> str:
    return json.dumps(value, indent=1)


def _compact(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def _write_text(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def _remove(path: str) -> None:
    if os.path.exists(path):
        os.remove(path)


def _load_json(path: str) -> Any:
    if not os.path.exists(path):
        raise ArtifactError(f"{path} is missing: the artifact directory is incomplete; compile again")
    try:
        with open(path) as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ArtifactError(f"{path} is not valid JSON ({e}); compile again") from e


# ---------------------------------------------------------------------------------------------
# Recording


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _jsonable(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    return repr(value)


def _target_name(node: fx.Node) -> str:
    if node.op != "call_function":
        return node.op
    target = node.target
    name = getattr(target, "__name__", None) or str(target)
    if isinstance(target, OpOverload):
        ns = target.namespace
        name = target._schema.name.split("::")[-1]
        return f"{ns}.{name}"
    return name


def _meta_shape(node: fx.Node) -> tuple[Optional[list[int]], Optional[str]]:
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):  # (a symbolic size, of a program serving every length, as its expression)
        return [d if isinstance(d, int) else str(d) for d in val.shape], str(val.dtype).removeprefix("torch.")
    return None, None


def _owners(nodes: list[fx.Node]) -> dict[fx.Node, str]:
    """The unit each node belongs to, for drawing: its own unit for IR nodes; for plain compute,
    the unit whose parameters it reads, else that of its latest input (the activation chain
    runs through one unit's layers at a time), else that of its first user."""
    pos = {n: i for i, n in enumerate(nodes)}
    owner: dict[fx.Node, str] = {}
    for n in nodes:
        unit = n.meta.get("fxzero", {}).get("unit")
        if unit is not None:
            owner[n] = unit
            continue
        reading = [owner[i] for i in n.all_input_nodes if i in owner and i.meta.get("fxzero", {}).get("kind") in ("param_view", "wait")]
        if reading:
            owner[n] = reading[-1]
            continue
        known = [i for i in n.all_input_nodes if i in owner]
        if known:
            owner[n] = owner[max(known, key=pos.__getitem__)]
    for n in reversed(nodes):
        if n not in owner:
            users = sorted((u for u in n.users if u in owner), key=pos.__getitem__)
            if users:
                owner[n] = owner[users[0]]
    return owner


STEP_PREFIX = "step/"
"""The step program's nodes are recorded after the joint graph's, their names prefixed."""


def graph_record(gm: fx.GraphModule, root_unit: str, step: Optional[fx.GraphModule] = None) -> dict:
    """One JSON record per node of the rewritten joint graph, then of the step program (if given:
    its nodes named `step/<name>`, phase "step")."""
    records = _records(gm, root_unit)
    if step is not None:
        for rec in _records(step, root_unit):
            if rec["op"] == "output":
                continue
            rec["name"] = STEP_PREFIX + rec["name"]
            rec["inputs"] = [STEP_PREFIX + i for i in rec["inputs"]]
            rec["phase"] = "step"
            records.append(rec)
    return {"nodes": records}


def _records(gm: fx.GraphModule, root_unit: str) -> list[dict]:
    nodes = list(gm.graph.nodes)
    owners = _owners(nodes)
    records = []
    for n in nodes:
        meta = n.meta.get("fxzero", {})
        kind = meta.get("kind") or ("compute" if n.op == "call_function" else n.op)
        shape, dtype = _meta_shape(n)
        rec = {
            "name": n.name,
            "op": n.op,
            "target": _target_name(n),
            "kind": kind,
            "unit": meta.get("unit"),
            "owner": owners.get(n, root_unit),
            "phase": meta.get("phase"),
            "inputs": [i.name for i in n.all_input_nodes],
            "shape": shape,
            "dtype": dtype,
        }
        if "fqn" in meta:
            rec["fqn"] = meta["fqn"]
        if meta.get("cast"):  # a flatten that casts the gradients to the reduce dtype
            rec["cast"] = True
        records.append(rec)
    return records


def memory_record(compiled, stage: int, optimizer=None, mixed_precision=None) -> dict:
    """Model states (runtime accounting, for `optimizer`'s states: default AdamW's; under
    `mixed_precision`, its dtypes) and per-instruction live bytes of every program."""
    schedule = compiled.schedule
    persistent = frozenset(getattr(schedule, "persistent", ()))
    kwargs = {"optimizer": optimizer} if optimizer is not None else {}
    if mixed_precision is not None:
        kwargs.update(precision="mixed", mixed_precision=mixed_precision)
    states = estimate.runtime_model_states(schedule.units, stage, persistent=persistent, **kwargs)
    programs: dict[str, dict[str, list[int]]] = {}
    layouts = {u.name: u for u in schedule.units}
    held = {"forward": frozenset({"input"}), "backward": frozenset({"saved", "grad_output"})}
    for name in ("forward", "backward"):
        program = compiled.programs[name]
        placeholders = [n.name for n in program.gm.graph.nodes if n.op == "placeholder"]
        kinds = {p: k for p, (k, _) in zip(placeholders, program.inputs)}
        programs[name] = program_live_bytes(schedule.program(name), program.gm, kinds, layouts, held=held[name])
    grads_at_end = programs["backward"]["gradients"][-1] if programs["backward"]["gradients"] else 0
    n_step = len(schedule.program("step").instructions)
    programs["step"] = {"activations": [0] * n_step, "gradients": [grads_at_end] * n_step}
    buffers = sum(
        (n.meta["val"].numel() * n.meta["val"].element_size())
        for n in compiled.programs["forward"].gm.graph.nodes
        if n.op == "placeholder" and n.meta.get("fxzero", {}).get("kind") == "buffer"
        and isinstance(n.meta.get("val"), torch.Tensor)
    )
    return {
        "model_states": {"params": states.params, "grads": states.grads, "optimizer": states.optimizer, "buffers": buffers},
        "programs": programs,
    }


def predicted_peak_bytes(compiled, config) -> int:
    """The step's predicted peak memory per rank: the model states the rank holds plus the largest
    sum, at any instruction of any program, of gathered parameter buffers, live activations
    (saved and transient) and gradients. What the program itself holds, not the process: an
    interpreter's own memory (torch's libraries, allocator slack) comes on top of it."""
    record = memory_record(compiled, compiled.schedule.stage, config.optimizer, config.mixed_precision)
    peak = 0
    for name, live in record["programs"].items():
        gathered = compiled.schedule.program(name).gathered_bytes
        for i, g in enumerate(gathered):
            peak = max(peak, g + live["activations"][i] + live["gradients"][i])
    return sum(record["model_states"].values()) + peak


def record(
    compiled,
    *,
    model: str,
    inputs,
    config,
    seconds: float,
    command: str = "compile",
    model_config: Optional[dict] = None,
) -> Artifacts:
    """Turn a `CompiledProgram` into Artifacts (nothing is written yet).

    Args:
        inputs: the call it was traced on: a `fxzero.modelspec.CallSpec`, or a sequence of
            `InputSpec` (positional inputs).
        model_config: a Hugging Face model's config (JSON), recorded with the model spec.
    """
    from fxzero import __version__
    from fxzero.modelspec import CallSpec

    schedule = compiled.schedule
    layouts = schedule.units
    manifest = {
        "format": FORMAT,
        "version": VERSION,
        "fxzero_version": __version__,
        "command": command,
        "model": model,
        **({"model_config": model_config} if model_config is not None else {}),
        "params": sum(u.numel for u in layouts),
        "units": len(layouts),
        "world_size": schedule.world_size,
        "stage": schedule.stage,
        "inputs": inputs.to_json() if isinstance(inputs, CallSpec) else [s.to_json() for s in inputs],
        "config": _jsonable(config),
        "compile_seconds": round(seconds, 3),
        "pass_seconds": round(sum(r.seconds for r in compiled.pass_trace), 3),
        "nodes": len(compiled.joint.graph.nodes),
        "instructions": {p.name: len(p.instructions) for p in schedule.programs},
        "fingerprint": schedule.fingerprint,
    }
    root_unit = layouts[0].name if layouts else "root"
    return Artifacts(
        manifest=manifest,
        schedule=schedule,
        pass_trace=[r.to_json() for r in compiled.pass_trace],
        graph=graph_record(compiled.joint, root_unit, compiled.programs["step"].gm if "step" in compiled.programs else None),
        memory=memory_record(compiled, schedule.stage, getattr(config, "optimizer", None),
                             getattr(config, "mixed_precision", None)),
        code=compiled.joint.code,
    )
