"""Split learning as a job kind (`kind: split`, `smolforge launch --mode split`).

`runner` (the `SplitRunner`: places the trunk, starts the client, follows both, places the trunk again
when its node dies), `trunk` (the trunk server as a Ray actor, and where it goes), `client_side` (the
client trainer as a Ray actor, and its connection that follows the trunk), `artifacts` (the trunk's
checkpoints to and from the coordinator's store, in pieces). The training itself is `smolforge.split`'s,
which has no Ray.
"""
