"""`deepspeed` under `fxzero run`: this package, first on PYTHONPATH, makes `import deepspeed` (and
every `deepspeed.X`) resolve to fxzero in any process, spawned ones included
(`fxzero/deepspeed_alias.py`). Importing it replaces it with fxzero itself."""

import sys

from fxzero.deepspeed_alias import install

install()
sys.modules[__name__] = sys.modules["fxzero"]
