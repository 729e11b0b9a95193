"""Viewers of recorded artifacts: graphviz drawings, the schedule table, Chrome traces, plots.

Every function here takes `fxzero.artifacts.Artifacts` (plain recorded values), never the
compiler's live objects: record, then view.
"""
