"""`deepspeed.pipe` for programs that import it beside a data-parallel path: fxzero has no
pipeline parallelism, so building a `PipelineModule` is an error saying so; `LayerSpec` is the
plain recipe it is in DeepSpeed (a module class and its arguments, built on demand)."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

__all__ = ["LayerSpec", "PipelineModule"]


class LayerSpec:
    """A layer to build later: `LayerSpec(nn.Linear, 4, 4).build()` is `nn.Linear(4, 4)`."""

    def __init__(self, typename: type, *module_args: Any, **module_kwargs: Any) -> None:
        if not issubclass(typename, nn.Module):
            raise TypeError(f"LayerSpec expects an nn.Module class, got {typename!r}")
        self.typename, self.module_args, self.module_kwargs = typename, module_args, module_kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)


class PipelineModule(nn.Module):
    """DeepSpeed's pipeline-parallel module: fxzero is data parallel (ZeRO) only."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise NotImplementedError("deepspeed.pipe.PipelineModule: fxzero has no pipeline parallelism (it is data "
                                  "parallel, ZeRO, only); build the model as one nn.Module (nn.Sequential of the "
                                  "layers) and pass it to deepspeed.initialize")
