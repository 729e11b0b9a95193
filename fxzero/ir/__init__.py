"""The IR shared by the compiler and the runtime: plain data and the fxzero:: operators.

- `ops`: the `fxzero::` custom operators the passes insert (fake kernels, side effects declared);
- `tags`: node kinds and phases in `node.meta["fxzero"]`;
- `alias`: the one walk from a view to the storage it lives in;
- `sizes`: elements, bytes and FLOPs of traced values;
- `layout`: `UnitLayout`, a unit's flat buffer and each rank's shard;
- `signature`: `JointSignature`, what a traced joint graph's inputs and outputs are;
- `program`: `Program`, one executable graph and its inputs and outputs;
- `instruction`, `lower`: `Instruction`, a node lowered to data for the schedule and runtime.

Nothing here imports the compiler (trace, passes, schedule) or the runtime.
"""
