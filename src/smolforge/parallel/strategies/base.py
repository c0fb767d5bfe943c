"""The strategy interface every data-parallel strategy implements (`smolforge.train.strategy.Strategy`).

It lives in `train/` because the training loop depends on it and `train` sits below `parallel`;
this module is where a strategy author starts reading. How to add one: a file here with a
`Strategy` subclass, and one line in `smolforge.parallel.strategies.STRATEGIES`.
"""

from smolforge.train.strategy import Strategy

__all__ = ["Strategy"]
