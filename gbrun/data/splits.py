"""A task's three splits, each named once for every place that spells it:
the dataset writers and their messages (`name`), GraphBolt's Task and
metadata.yaml (`attribute`), the files of an OnDiskDataset and the fields
of gbrun.data.links.LinkTask (`prefix`), DGL's partitions (`mask`), and
the writers' own arguments (`argument`). Loads no torch."""
import dataclasses


@dataclasses.dataclass(frozen=True)
class Split:
    name: str       # "validation": how the writers key and name it
    attribute: str  # "validation_set": task.validation_set, metadata.yaml's key
    prefix: str     # "valid": valid_seed_nodes.npy, LinkTask.valid
    mask: str       # "val_mask": the partitions' node data, as node_split takes it
    argument: str   # "val_idx": the writer's argument, named in its messages


TRAIN = Split("train", "train_set", "train", "train_mask", "train_idx")
VALIDATION = Split("validation", "validation_set", "valid", "val_mask", "val_idx")
TEST = Split("test", "test_set", "test", "test_mask", "test_idx")
# In the order a Job's item sets hold them.
TABLE = (TRAIN, VALIDATION, TEST)
# The splits a model is scored on.
EVALUATED = (VALIDATION, TEST)

ATTRIBUTES = tuple(split.attribute for split in TABLE)
MASKS = tuple(split.mask for split in TABLE)
