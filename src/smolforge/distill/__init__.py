"""Teacher→student distillation, the pure parts: teacher backends (hf, ollama, reference), the top-k
logit store, KD losses, streaming students, adapter aggregation, the planner and the run settings.

Nothing here imports Ray (an import-linter contract keeps it so): running teachers and students on
the cluster is `smolforge.cluster.distill`.
"""

from smolforge.distill.aggregate import aggregate_student_outputs
from smolforge.distill.losses import KDConfig, mixed_loss
from smolforge.distill.store import CorruptShardError, TeacherRecord, read_shard, store_summary, write_shard

__all__ = ["KDConfig", "mixed_loss", "CorruptShardError", "TeacherRecord", "read_shard", "store_summary",
           "write_shard", "aggregate_student_outputs"]
