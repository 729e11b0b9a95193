"""Random layer-token drop (random-LTD): DeepSpeed's data routing, in fxzero's programs.

- `scheduler`: `RandomLTDScheduler`, the kept count per step (DeepSpeed's, by its state keys);
- `layer`: `RandomLayerTokenDrop`, the routed forward (gather, layer, scatter) and the in-place
  routing of a layer converted after initialize;
- `routing`: the engine's side (which layers route, the kept count into each call);
- `helper`: `convert_to_random_ltd`, `save_without_random_ltd`, `remove_random_ltd_state_dict`.

DeepSpeed's module paths (`deepspeed.runtime.data_pipeline.data_routing.helper`, `.basic_layer`,
`.scheduler`) name these under `fxzero run` (`fxzero/deepspeed_alias.py`). See docs/random_ltd.md.
"""
