"""Teacher→student distillation: teacher backends (hf, ollama), the top-k logit store, KD losses,
streaming students, adapter aggregation, the pipeline planner and the cluster tasks.

Cluster-free pieces import without Ray; `smolforge.distill.orchestration` holds the Ray side.
"""

from smolforge.distill.aggregate import aggregate_student_outputs
from smolforge.distill.losses import KDConfig, mixed_loss
from smolforge.distill.store import CorruptShardError, TeacherRecord, read_shard, store_summary, write_shard

__all__ = ["KDConfig", "mixed_loss", "CorruptShardError", "TeacherRecord", "read_shard", "store_summary",
           "write_shard", "aggregate_student_outputs"]
