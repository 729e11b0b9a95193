"""MODEL, --model-config and --inputs specs: how the CLI names a model and the call it is traced on.

A MODEL spec (`model.py`) is one of

    gpt2                                a zoo model (`fxzero.zoo.MODELS`)
    pkg.module:factory                  a callable in an importable module
    path/to/file.py:ClassName           a callable in a Python file
    transformers:ClassName              a Hugging Face model built from its config (`hf.py`):
                                        --model-config '{"n_layer": 2}' or path/to/config.json
    NAME(key=value, ...)                any of the above, called with keyword arguments

The arguments are Python literals (`'gpt-tiny(n_blocks=2)'`, `'models.py:Net(widths=(8, 16))'`);
a Hugging Face model takes them as config fields. Models are built under
`torch.device("meta")`, so naming a 7B model allocates nothing, and nothing is downloaded.

An --inputs spec (`inputs.py`) is the call the model is traced on, `model(*args, **kwargs)`:
tensors as `DTYPE[SHAPE]`, with `:LOW..HIGH` for integer dtypes (the value range of token ids,
HIGH exclusive), positional first, then `NAME=DTYPE[SHAPE]` and constants `NAME=false`:
`'int64[2,128]:0..50257'`, `'input_ids=int64[2,128]:0..50257 labels=int64[2,128]:0..50257
use_cache=false'`. Items are separated by spaces or `;`, or given as repeated options.

Every mistake raises `SpecError`, a ValueError whose message is one line a person can act on.
"""

from fxzero.modelspec.errors import SpecError
from fxzero.modelspec.inputs import (
    CallSpec,
    Constant,
    ExampleCall,
    InputSpec,
    example_call,
    example_inputs,
    parse_call,
    parse_inputs,
)
from fxzero.modelspec.model import ModelSpec, build_model, parse_model

__all__ = ["CallSpec", "Constant", "ExampleCall", "InputSpec", "ModelSpec", "SpecError", "build_model",
           "example_call", "example_inputs", "parse_call", "parse_inputs", "parse_model"]
