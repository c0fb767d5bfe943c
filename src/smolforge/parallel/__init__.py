"""What data-parallel training shares besides the strategies, with no Ray in it.

- `strategies/` the strategy plug-ins (a name -> class registry)
- `rendezvous`  rank 0 serves the group's store on its address; every rank joins the group there
- `transfer`    directories as checksummed payloads, so checkpoints travel without a shared filesystem
- `codecs`      how gradients travel: fp32, fp16, blockwise int8 and int4, sparse top-k low-bit; error feedback
- `rank_task`   what a rank is asked to do (`RankTask`, `Seat`) and hands back (`RankResult`), typed
- `summary`     the job summary, derived from the ranks' results

The rank actors themselves (Ray) are in `cluster/workloads/data_parallel/`.
"""
