"""Worker groups: Ray actors that form a torch.distributed process group and train together.

- `rendezvous` rank 0's address and a free port (found through Ray), then `init_process_group`
- `transfer`   directories as checksummed payloads, so checkpoints travel without a shared filesystem
- `dp_task`    the data-parallel worker actor that runs the training engine as one rank
- `worker_group` placing N of those actors (a placement group), starting them, tearing them down

This is the only place below `cluster/` that imports Ray.
"""
