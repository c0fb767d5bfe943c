"""What one `Trainer.step` asks of its strategy's peers, and how a rank's part of a step's loss is kept.

The step's loss tokens are summed over the ranks once (`step_targets`, which normalises the gradient);
the logged loss then needs only the loss summed (`step_loss`), not a second count of the same tokens.
A stand-in strategy records every reduce and answers as a group of two identical ranks would.
"""

from __future__ import annotations

import torch

from smolforge.train.loop import Trainer
from smolforge.train.step_loss import NONE, StepLoss, final_loss
from smolforge.train.strategy import Strategy


class TwoLikeMe(Strategy):
    """A rank of two whose peer holds the same numbers: every reduce doubles them, and is recorded."""

    def __init__(self):
        super().__init__()
        self.reduced: list[list[float]] = []

    def reduce(self, values: list[float], device: torch.device) -> list[float]:
        self.reduced.append(list(values))
        return [2 * v for v in values]


def test_a_step_reduces_its_tokens_once_and_its_loss_once():
    torch.manual_seed(0)
    model = torch.nn.Linear(1, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    strategy = TwoLikeMe()
    trainer = Trainer(model, optimizer, scheduler, device=torch.device("cpu"), strategy=strategy,
                      forward=lambda m, b: m(b["attention_mask"].float().unsqueeze(-1)),
                      loss_sum=lambda logits, b: (logits.float() ** 2).sum(), precision="fp32")
    labels = torch.zeros(2, 5, dtype=torch.long)
    labels[:, :2] = -100  # 2 x 3 loss tokens after the shift
    batch = {"input_ids": torch.zeros(2, 5, dtype=torch.long), "attention_mask": torch.ones(2, 5, dtype=torch.long),
             "labels": labels}
    stats = trainer.step(0, [batch])
    mine = strategy.last_loss
    assert mine is not None and mine.step == 0 and mine.tokens == 6.0
    # one reduce of the tokens (the step's count: 12), one of the loss: never the tokens again
    assert strategy.reduced == [[6.0], [mine.loss_sum]], strategy.reduced
    assert abs(stats.loss - 2 * mine.loss_sum / 12.0) < 1e-9, (stats.loss, mine)


def test_final_loss_merges_every_ranks_part_of_the_last_step_only():
    """A fast worker's two parts of the last step add up (one way to add a part: `then`, from `NONE`); a rank
    whose last counted part is of an earlier step adds nothing; the mean is over the parts' tokens."""
    fast = NONE.then(10, 30.0, 10.0).then(11, 20.0, 10.0).then(11, 40.0, 10.0)
    assert fast == StepLoss(11, 60.0, 20.0) and fast.then(10, 1.0, 1.0) == fast
    slow = StepLoss(10, 25.0, 10.0)
    assert final_loss([fast, slow, None]) == 3.0  # (20 + 40) / (10 + 10)
    assert final_loss([StepLoss(11, 9.0, 3.0), fast]) == 69.0 / 23.0 and final_loss([None]) is None
