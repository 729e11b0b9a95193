"""The side-by-side benchmark behind `tools/bench.py`: fxzero against what users would pick instead.

One module per job:

- `spec.py`: the run's frozen description (model, batch, steps, optimizer), shared by every
  system and passed to each rank as JSON.
- `systems.py`: the table of systems (name -> runner module and its options) and the checks
  that say whether a system can run in this Python environment.
- `common.py`: what every rank does alike: build the model from the same seed, draw the same
  batches, time steps, read peak RSS and loopback traffic.
- `commcount.py`: counts the bytes every torch.distributed collective moves, by wrapping the
  collectives in each rank process.
- `ddp.py`, `fsdp2.py`, `deepspeed_zero3.py`, `fxzero_engine.py`: one runner per system; each
  builds a `Trainer` whose `step(x, y)` is one training step.
- `worker.py`: the entry point of one rank process (`python -m tools.bench.worker`).
- `launch.py`: starts the ranks of one run as fresh processes and collects their results.
- `report.py`: turns the runs into per-system figures and the final summary line.
"""
