"""`fxzero plan`: which configuration to train a model with on a cluster we do not have.

- `extrapolate`: a deep model priced from its program at 2 and 3 blocks, or from where its
  blocks are alike ([Note: pricing by depth]);
- `grid`: the configurations considered, each a DeepSpeed config and a `fxzero.Config`
  ([Note: the plan's grid]);
- `search`: compile, price and rank them ([Note: what the plan compiles]).
"""

from fxzero.plan.extrapolate import (BASE_DEPTHS, NextTokenLoss, Priced, compile_at_depth, extrapolate, micro_and_step,
                                     price, repeated_blocks, steady_depth)
from fxzero.plan.grid import Candidate, micro_batches, python_snippet
from fxzero.plan.search import Plan, Row, plan, rank

__all__ = ["BASE_DEPTHS", "Candidate", "NextTokenLoss", "Plan", "Priced", "Row", "compile_at_depth", "extrapolate",
           "micro_and_step", "micro_batches", "plan", "price", "python_snippet", "rank", "repeated_blocks",
           "steady_depth"]
