"""Grain data pipelines: prompt datasets and trajectory shards → fixed-shape batches.

`prompt_dataset` / `PromptIterator` (`agentrl.data.prompts`) and
`TrajectoryShardReader` / `TrajectoryBatcher` / `batches`
(`agentrl.data.trajectories`). Every iterator has a JSON-serialisable
`get_state()` / `set_state()` that `agentrl.train.checkpoint.TrainCheckpointer`
stores with the train state.
"""

from agentrl.data.prompts import (
    PromptIterator,
    parse_prompt_record,
    prompt_dataset,
    read_jsonl_prompts,
    write_array_record_prompts,
)
from agentrl.data.trajectories import (
    TrajectoryBatch,
    TrajectoryBatcher,
    TrajectoryShard,
    TrajectoryShardDataset,
    TrajectoryShardReader,
    batches,
)

__all__ = [
    "PromptIterator",
    "TrajectoryBatch",
    "TrajectoryBatcher",
    "TrajectoryShard",
    "TrajectoryShardDataset",
    "TrajectoryShardReader",
    "batches",
    "parse_prompt_record",
    "prompt_dataset",
    "read_jsonl_prompts",
    "write_array_record_prompts",
]
