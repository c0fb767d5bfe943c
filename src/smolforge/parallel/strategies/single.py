"""One process, no peers: the default for `smolforge train` and a data-parallel group of one."""

from smolforge.train.strategy import SingleProcess

__all__ = ["SingleProcess"]
