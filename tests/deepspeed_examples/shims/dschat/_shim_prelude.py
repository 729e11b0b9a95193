"""Run at the start of every rank (tests/deepspeed_examples/record/sitecustomize.py imports it):
what DeepSpeed-Chat, written for transformers 4, needs of transformers 5, under either system.

`dschat/utils/model/model_utils.py` imports `no_init_weights` from `transformers.modeling_utils`;
transformers 5 moved it to `transformers.initialization` (the same context manager). Nothing else
is changed.
"""

import transformers.modeling_utils as _modeling_utils

if not hasattr(_modeling_utils, "no_init_weights"):
    from transformers.initialization import no_init_weights

    _modeling_utils.no_init_weights = no_init_weights
