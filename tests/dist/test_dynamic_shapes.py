"""Any sequence length, one program ([Note: any size, one program] in `fxzero/ir/shapes.py`): on 2
gloo ranks at ZeRO-3, batches of another length every step, and each rank its own length in a
step, train as eager AdamW does on the same rows (each step the mean of the ranks' losses),
losses and parameters to rtol 1e-5; each rank compiles twice (its first length, then one
program symbolic in the length) whatever the number of lengths.

The HelloDeepSpeed-shaped Roberta MLM (`tools/dynamic_padding.py`: HF RobertaModel, a head over
`nonzero`'s positions with `index_select`, CrossEntropyLoss) trains the same way with batches
padded to their longest row, as that script's collate function pads them.
"""

from __future__ import annotations

import pytest
import torch

import fxzero
from fxzero import zoo
from tests.dist.harness import ADAMW, run_ranks
from tests.dist.reference import assert_losses_close, assert_state_close, clone_state_dict, lm_loss, make_gpt_batches

pytestmark = pytest.mark.timeout(400)

LENGTHS = [(12, 12), (9, 16), (16, 7), (5, 11), (14, 14), (3, 8)]
"""Each step's sequence length on rank 0 and on rank 1 (the tiny GPT's rows hold 16 tokens)."""


def _counting(engine) -> list:
    """The engine's compiles, counted (each is one trace and one schedule)."""
    calls, compile_program = [], engine._compile

    def counted(*args):
        calls.append(1)
        return compile_program(*args)

    engine._compile = counted
    return calls


def _gpt_problem():
    torch.manual_seed(0)
    state = clone_state_dict(zoo.build("gpt-tiny"))
    return state, make_gpt_batches(zoo.GPT_SIZES["tiny"], len(LENGTHS), 4, seed=3)


def _rows(batch, step: int, rank: int):
    x, y = batch
    n = LENGTHS[step][rank]
    return x[2 * rank : 2 * rank + 2, :n], y[2 * rank : 2 * rank + 2, :n]


def _train_gpt(rank: int, world_size: int):
    state, batches = _gpt_problem()
    engine = fxzero.compile(zoo.build("gpt-tiny"), fxzero.Config(stage=3, optimizer=fxzero.AdamW(**ADAMW),
                                                                 cost_model=None), state_dict=state)
    compiles = _counting(engine)
    losses, programs = [], []
    for step, batch in enumerate(batches):
        x, y = _rows(batch, step, rank)
        loss = lm_loss(engine(x), y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
        programs.append(engine.program)
    stacked = torch.stack(losses)
    torch.distributed.all_reduce(stacked)
    return {"losses": (stacked / world_size).tolist(), "compiles": len(compiles),
            "dynamic": [p.shapes.dynamic for p in programs], "same": [p is programs[-1] for p in programs],
            "state": {k: v.clone() for k, v in engine.full_state_dict().items()}}


def test_one_program_serves_every_length_on_ranks_of_different_lengths():
    ranks = run_ranks(_train_gpt, 2, timeout_s=300)
    state, batches = _gpt_problem()
    model = zoo.build("gpt-tiny")
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    want = []
    for step, batch in enumerate(batches):
        loss = sum(lm_loss(model(x), y) for x, y in (_rows(batch, step, r) for r in range(2))) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    for got in ranks:
        assert got["compiles"] == 2, got["compiles"]  # the first length, then one program for the others
        assert got["dynamic"] == [False] + [True] * (len(LENGTHS) - 1) and all(got["same"][1:]), got
    assert_losses_close(ranks[0]["losses"], want, "lengths changing every step, per rank")
    assert_state_close(ranks[0]["state"], clone_state_dict(model), "lengths changing every step, per rank")


def _mlm_problem():
    from tools.dynamic_padding import RobertaMLM, make_rows, roberta_config

    cfg = roberta_config(layers=2, heads=2, ff=64, hidden=32, vocab=128, max_len=40)
    torch.manual_seed(0)
    state = clone_state_dict(RobertaMLM(cfg))
    rows = make_rows(5 * 2 * 3, min_len=4, max_len=40, vocab=128, mask_prob=0.2, seed=7)
    return cfg, state, rows


def _mlm_batch(rows, step: int, rank: int):
    from tools.dynamic_padding import collate

    return collate(rows[(step * 2 + rank) * 3 : (step * 2 + rank + 1) * 3])  # each rank's rows, its longest


def _train_mlm(rank: int, world_size: int):
    from tools.dynamic_padding import RobertaMLM

    cfg, state, rows = _mlm_problem()
    model = RobertaMLM(cfg)
    model.load_state_dict(state)
    engine = fxzero.compile(model, fxzero.Config(stage=3, optimizer=fxzero.AdamW(**ADAMW), cost_model=None))
    compiles = _counting(engine)
    losses, lengths = [], []
    for step in range(5):
        batch = _mlm_batch(rows, step, rank)
        lengths.append(batch["src_tokens"].shape[1])
        loss = engine(**batch)
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach())
    stacked = torch.stack(losses)
    torch.distributed.all_reduce(stacked)
    return {"losses": (stacked / world_size).tolist(), "compiles": len(compiles), "lengths": lengths,
            "estimated": engine.program.shapes.estimated,
            "state": {k: v.clone() for k, v in engine.full_state_dict().items()}}


def test_the_hello_deepspeed_mlm_head_trains_with_dynamic_padding_as_eager():
    pytest.importorskip("transformers")
    from tools.dynamic_padding import RobertaMLM

    ranks = run_ranks(_train_mlm, 2, timeout_s=360)
    cfg, state, rows = _mlm_problem()
    model = RobertaMLM(cfg)
    model.load_state_dict(state)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    want = []
    for step in range(5):
        loss = sum(model(**_mlm_batch(rows, step, r)) for r in range(2)) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        want.append(loss.item())
    assert ranks[0]["lengths"] != ranks[1]["lengths"] and len(set(ranks[0]["lengths"])) > 2, ranks[0]["lengths"]
    for got in ranks:
        assert got["compiles"] == 2 and got["estimated"], got  # nonzero's count: a data-dependent size
    assert_losses_close(ranks[0]["losses"], want, "Roberta MLM, nonzero head, dynamic padding")
    assert_state_close(ranks[0]["state"], clone_state_dict(model), "Roberta MLM, nonzero head, dynamic padding")
