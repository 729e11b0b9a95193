"""A pytest plugin (`-p forkserver_preload`) for DeepSpeed's unit tests run under `fxzero run`.

DeepSpeed's harness (`unit/common.py`, unchanged) starts each test's ranks as children of a
multiprocessing forkserver, which by default has imported nothing: every rank of every test then
imports torch and `deepspeed` (fxzero, through the shim) from scratch, about 4 s on 2 cores. This
plugin has the server import them once, and what torch imports lazily at a first trace, as
tests/dist/harness.py's own server does ([Note: ranks fork from a server that has imported
torch]); a rank still starts clean, with no process group, no thread pool and none of the
test's state."""

import multiprocessing

multiprocessing.set_forkserver_preload(["torch", "deepspeed", "torch._dynamo", "torch._functorch.eager_transforms",
                                        "torch.fx.experimental.proxy_tensor"])
