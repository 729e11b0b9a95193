"""The textbook ZeRO chapter's DeepSpeed script (scaled down for CPU), with only its import changed.

    torchrun --nproc_per_node=2 examples/deepspeed_textbook.py   # from examples/, or pass the config path

The config is the chapter's ds_config.json with train_batch_size made consistent with two ranks
(16 per rank x 1 accumulation step x 2 ranks = 32). `initialize` returns DeepSpeed's real order,
(engine, optimizer, training_dataloader, lr_scheduler); the chapter's listing swaps the last two.
"""
import os
import sys

import torch, torch.nn as nn
import fxzero as deepspeed
from torch.utils.data import Dataset

CONFIG = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "ds_config.json")


class SimpleLLM(nn.Module):
    def __init__(self, vocab_size=512, d_model=64):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, d_model)
        self.layers = nn.Sequential(*[nn.Linear(d_model, d_model) for _ in range(24)])
        self.lm_head = nn.Linear(d_model, vocab_size)
    def forward(self, x):
        return self.lm_head(self.layers(self.embed(x)))

class DummyDataset(Dataset):
    def __len__(self): return 256
    def __getitem__(self, idx): return torch.randint(0, 512, (32,)), torch.randint(0, 512, (32,))

deepspeed.init_distributed()
model = SimpleLLM()
model_engine, optimizer, dataloader, lr_scheduler = deepspeed.initialize(
    args=None, model=model, model_parameters=model.parameters(), training_data=DummyDataset(), config=CONFIG)
criterion = nn.CrossEntropyLoss()
for epoch in range(2):
    for step, (inputs, targets) in enumerate(dataloader):
        inputs, targets = inputs.to(model_engine.device), targets.to(model_engine.device)
        outputs = model_engine(inputs)
        loss = criterion(outputs.view(-1, 512), targets.view(-1))
        model_engine.backward(loss)
        model_engine.step()
        if model_engine.local_rank == 0 and step % 10 == 0:
            print(f"Epoch {epoch} | Step {step} | Loss {loss.item():.4f}")
