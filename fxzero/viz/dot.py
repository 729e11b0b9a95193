"""The rewritten program as a graphviz DOT drawing.

Layout: top-level clusters, the forward, the backward and the step program, side by side
(edges from forward values to their backward readers, the saved activations, do not constrain
the layout, so the backward is drawn beside the forward, not under it). Inside each, one
cluster per unit holds the nodes of that unit in that program. Nodes are coloured by kind
(`KIND_STYLE`); the edges of collectives (shard -> all_gather -> wait, flat grads ->
reduce_scatter -> wait, -> free) are drawn thick in the collective's colour.

`collapse=True` keeps every IR node (all-gather, wait, free, reduce-scatter, fetch, offload)
but folds each unit's compute in each program into one box that counts its ops, so a GPT-2
graph of ~1700 nodes becomes ~150 boxes. `unit=NAME` draws one unit in full detail, with the
values it reads from other units shown as small grey sources.
"""

from __future__ import annotations

import collections
from typing import Iterable, Optional

from fxzero.viz.fmt import human_bytes

__all__ = ["KIND_STYLE", "PHASES", "to_dot"]

PHASES = ("forward", "backward", "step")

# kind -> (fill colour, font colour, shape, legend label)
KIND_STYLE: dict[str, tuple[str, str, str, str]] = {
    "compute": ("#ffffff", "#222222", "box", "compute"),
    "param_view": ("#ececec", "#555555", "box", "param view"),
    "all_gather": ("#2f6db5", "#ffffff", "box", "all-gather"),
    "wait": ("#9ec5ec", "#102a4c", "box", "wait"),
    "free": ("#e15759", "#ffffff", "box", "free"),
    "flatten_grads": ("#ffd5a8", "#4a2a00", "box", "flatten grads"),
    "reduce_scatter": ("#f28e2b", "#ffffff", "box", "reduce-scatter"),
    "fetch": ("#59a14f", "#ffffff", "box", "fetch"),
    "offload": ("#9c6ab5", "#ffffff", "box", "offload"),
    "optim_step": ("#4e9a8f", "#ffffff", "box", "optimizer step"),
    "cast": ("#edc948", "#3d2f00", "box", "cast"),
    "unit": ("#f1ce63", "#3d2f00", "cylinder", "unit shard"),
    "buffer": ("#d9d9d9", "#222222", "cylinder", "buffer"),
    "input": ("#ffffff", "#222222", "ellipse", "input"),
    "grad_output": ("#ffffff", "#222222", "ellipse", "grad output"),
    "grad": ("#ffd5a8", "#4a2a00", "cylinder", "gradient shard"),
    "optim_state": ("#c7e0dc", "#1f3d39", "cylinder", "optimizer state"),
    "output": ("#dddddd", "#222222", "ellipse", "output"),
}
IR_KINDS = ("all_gather", "wait", "free", "flatten_grads", "reduce_scatter", "fetch", "offload", "unit",
            "optim_step", "cast")
PHASE_FILL = {"forward": "#eef4fb", "backward": "#fdf1ea", "step": "#eef7ee"}
EDGE_COLOUR = {"all_gather": "#2f6db5", "reduce_scatter": "#f28e2b", "free": "#e15759",
               "fetch": "#59a14f", "offload": "#9c6ab5"}


def _q(text: str) -> str:
    return '"' + str(text).replace("\\", "\\\\").replace('"', '\\"') + '"'


def _attrs(**kw) -> str:
    return "[" + ", ".join(f"{k}={_q(v)}" for k, v in kw.items() if v is not None) + "]"


def _node_style(kind: str) -> dict:
    fill, font, shape, _ = KIND_STYLE.get(kind, KIND_STYLE["compute"])
    style = "filled" if shape != "box" else "rounded,filled"
    return {"shape": shape, "style": style, "fillcolor": fill, "fontcolor": font}


def _short_target(target: str) -> str:
    return target.split(".", 1)[-1] if target.startswith(("aten.", "fxzero.")) else target


def _label(n: dict, unit_bytes: dict[str, int]) -> str:
    kind = n["kind"]
    if kind == "flatten_grads" and n.get("cast"):
        return f"flatten + cast to {n.get('dtype')}\n{n.get('unit')}"
    if kind in ("all_gather", "reduce_scatter", "flatten_grads", "fetch", "offload"):
        size = unit_bytes.get(n.get("unit"))
        return f"{KIND_STYLE.get(kind, KIND_STYLE['compute'])[3]}\n{n.get('unit')}" + (f"\n{human_bytes(size)}" if size else "")
    if kind in ("optim_step", "cast", "grad", "optim_state"):
        return f"{KIND_STYLE[kind][3]}\n{n.get('unit')}"
    if kind in ("wait", "free"):
        return kind
    if kind == "param_view":
        return ".".join((n.get("fqn") or n["name"]).split(".")[-2:])
    if kind == "unit":
        return f"shard\n{n.get('unit')}"
    if kind in ("input", "grad_output", "buffer"):
        return f"{KIND_STYLE[kind][3]}\n{n['name']}"
    if kind == "output":
        return "outputs"
    shape = "x".join(map(str, n["shape"])) if n.get("shape") else ""
    return _short_target(n["target"]) + (f"\n{shape}" if shape else "")


def _edge_style(src: dict, dst: dict) -> dict:
    """Collective edges thick and coloured; saved activations (forward -> backward) dashed."""
    for kind in (dst["kind"], src["kind"]):
        if kind == "free":
            return {"color": EDGE_COLOUR["free"], "style": "dashed", "penwidth": "1.2"}
    for kind in (src["kind"], dst["kind"]):
        if kind in EDGE_COLOUR:
            return {"color": EDGE_COLOUR[kind], "penwidth": "2.5"}
    if src["kind"] == "wait" and dst["kind"] == "param_view":
        return {"color": EDGE_COLOUR["all_gather"], "penwidth": "1.2"}
    if src.get("phase") == "forward" and dst.get("phase") == "backward" and src["kind"] != "unit":
        return {"color": "#b0b0b0", "style": "dashed", "constraint": "false"}
    if src["kind"] == "unit" and dst.get("phase") == "backward":
        return {"color": EDGE_COLOUR["all_gather"], "penwidth": "2", "constraint": "false"}
    return {}


def _legend(kinds: Iterable[str]) -> list[str]:
    present = [k for k in KIND_STYLE if k in set(kinds)]
    lines = ['  subgraph cluster_legend {', '    label="node kinds"; style="rounded"; color="#bbbbbb"; fontsize=10; rank=same;']
    for k in present:
        lines.append(f"    {_q('legend_' + k)} {_attrs(label=KIND_STYLE[k][3], **_node_style(k))};")
    for a, b in zip(present, present[1:]):
        lines.append(f"    {_q('legend_' + a)} -> {_q('legend_' + b)} [style=invis];")
    lines.append("  }")
    return lines


def _group_key(n: dict, collapse: bool) -> str:
    """The drawn node a graph node belongs to: itself, or its unit's compute box."""
    if collapse and n["kind"] in ("compute", "param_view"):
        return f"box:{n.get('phase')}:{n['owner']}"
    return n["name"]


def to_dot(
    graph: dict,
    *,
    unit_bytes: dict[str, int],
    title: str,
    collapse: bool = False,
    unit: Optional[str] = None,
) -> str:
    """DOT source for a recorded graph (`Artifacts.graph`).

    Args:
        graph: {"nodes": [...]} as recorded by `fxzero.artifacts.graph_record`.
        unit_bytes: gathered bytes per unit, for the collective labels.
        title: the drawing's caption.
        collapse: fold each unit's compute, per program, into one box.
        unit: draw only this unit's nodes, in full detail.
    """
    nodes = graph["nodes"]
    by_name = {n["name"]: n for n in nodes}
    # Unit placeholders (the shards) are left out: each all-gather names the unit it gathers,
    # and a shard node, read in both programs, would pin every unit's cluster to the top.
    drawable = [n for n in nodes if n["kind"] != "unit"]
    if unit is not None:
        shown = {n["name"] for n in drawable if n["owner"] == unit}
    else:
        shown = {n["name"] for n in drawable}

    groups: dict[str, list[dict]] = collections.OrderedDict()
    for n in nodes:
        if n["name"] in shown:
            groups.setdefault(_group_key(n, collapse), []).append(n)

    # Where each drawn node goes: (phase, unit) cluster, or the top level.
    placed: dict[tuple[Optional[str], Optional[str]], list[str]] = collections.OrderedDict()
    for key, members in groups.items():
        first = members[0]
        phase = first.get("phase") if first.get("phase") in PHASES else None
        owner = first["owner"] if first["kind"] not in ("input", "grad_output", "output", "buffer") else None
        placed.setdefault((phase, owner), []).append(key)

    lines = [
        "digraph fxzero {",
        f"  graph {_attrs(label=title, labelloc='t', fontname='Helvetica', fontsize='14', rankdir='TB', newrank='true', nodesep='0.12', ranksep='0.22')};",
        '  node [fontname="Helvetica", fontsize=9, height=0.22, margin="0.06,0.02"];',
        '  edge [color="#8c8c8c", arrowsize=0.5];',
    ]
    lines += _legend({n["kind"] for n in nodes if n["name"] in shown})

    def node_line(key: str, indent: str) -> str:
        members = groups[key]
        if key.startswith("box:"):
            counts = collections.Counter(_short_target(m["target"]) for m in members if m["kind"] == "compute")
            top = ", ".join(f"{t} x{c}" if c > 1 else t for t, c in counts.most_common(3))
            label = f"{members[0]['owner']}: {sum(counts.values())} ops\n{top}"
            return f"{indent}{_q(key)} {_attrs(label=label, tooltip=key, **_node_style('compute'))};"
        n = members[0]
        return f"{indent}{_q(key)} {_attrs(label=_label(n, unit_bytes), tooltip=n['name'] + ' = ' + n['target'], **_node_style(n['kind']))};"

    # Emitted backward first: dot then lays the forward program out on the left.
    for phase in ("step", "backward", "forward", None):
        keys_by_unit = [(owner, keys) for (p, owner), keys in placed.items() if p == phase]
        if not keys_by_unit:
            continue
        indent = "  "
        if phase is not None:
            lines.append(f"  subgraph {_q('cluster_' + phase)} {{")
            lines.append(f"    label={_q(phase + ' program')}; style=\"filled,rounded\"; fillcolor={_q(PHASE_FILL[phase])}; color=\"#cccccc\"; fontsize=12;")
            indent = "    "
        for owner, keys in keys_by_unit:
            if owner is not None and phase is not None:
                lines.append(f"{indent}subgraph {_q(f'cluster_{phase}_{owner}')} {{")
                lines.append(f"{indent}  label={_q(owner)}; style=\"rounded,filled\"; fillcolor=\"#ffffff\"; color=\"#7f7f7f\"; fontsize=10;")
                lines += [node_line(k, indent + "  ") for k in keys]
                lines.append(f"{indent}}}")
            else:
                lines += [node_line(k, indent) for k in keys]
        if phase is not None:
            lines.append("  }")

    # Program order: an invisible chain through the IR nodes (and compute boxes) of each
    # program, so units stack top to bottom in the order they run, instead of all hanging
    # from their shards at the top.
    # Compute boxes are left out of the chain: a box spans its unit's whole program, so its
    # place is set by its edges. The two programs start on the same rank, side by side.
    heads = []
    for phase in PHASES:
        chain = [k for k, members in groups.items()
                 if members[0].get("phase") == phase and members[0]["kind"] in IR_KINDS]
        for a, b in zip(chain, chain[1:]):
            lines.append(f"  {_q(a)} -> {_q(b)} [style=invis, weight=4];")
        heads += chain[:1]
    if len(heads) >= 2:
        chain = " -> ".join(_q(h) for h in heads)
        lines.append(f"  {{rank=same; {chain} [style=invis];}}")

    # Edges between drawn nodes (deduplicated when collapsed); sources outside a --unit view
    # appear as small grey nodes.
    seen: set[tuple[str, str]] = set()
    outside: dict[str, dict] = {}
    for n in nodes:
        if n["name"] not in shown:
            continue
        dst = _group_key(n, collapse)
        for src_name in n["inputs"]:
            src = by_name[src_name]
            if src["kind"] == "unit":
                continue
            if src_name in shown:
                skey = _group_key(src, collapse)
            else:
                skey = "outside:" + src_name
                outside[skey] = src
            if skey == dst or (skey, dst) in seen:
                continue
            seen.add((skey, dst))
            lines.append(f"  {_q(skey)} -> {_q(dst)} {_attrs(**_edge_style(src, n))};")
    for key, src in outside.items():
        label = f"{src['name']}\n(from {src['owner']})"
        lines.append(f"  {_q(key)} {_attrs(label=label, shape='ellipse', style='dashed', fontcolor='#777777', color='#aaaaaa', fontsize='8')};")
    lines.append("}")
    return "\n".join(lines) + "\n"
