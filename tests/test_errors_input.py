"""Bad arguments to parallelize and bad batches at run time are named in the user's terms: a
mesh that is not a DeviceMesh, a batch missing one of the example batch's keys."""
import pytest
import torch
import torch.nn as nn

import fxmegatron
from fxmegatron.errors import BatchError, MeshError


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.head = nn.Linear(8, 16)

    def forward(self, input_ids, labels):
        return nn.functional.cross_entropy(self.head(self.emb(input_ids)).flatten(0, 1), labels.flatten())


IDS = torch.randint(0, 16, (2, 4), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("mesh", ["cpu", (2, 2)], ids=["device-name", "shape"])
def test_mesh_that_is_not_a_device_mesh(mesh):
    with pytest.raises(MeshError, match=rf"mesh must be a torch.distributed.device_mesh.DeviceMesh \(or None: one "
                                        rf"process\), got {type(mesh).__name__} "):
        fxmegatron.parallelize(Tiny(), mesh, (IDS, IDS))


def test_batch_missing_a_key_is_named():
    pm = fxmegatron.parallelize(Tiny(), None, {"input_ids": IDS, "labels": IDS})
    with pytest.raises(BatchError, match=r"the batch is missing key 'labels' \(the example batch given to "
                                         r"parallelize has key 'input_ids', key 'labels'\)") as err:
        pm({"input_ids": IDS})
    assert isinstance(err.value, TypeError)      # what it always raised, for callers that catch that
    with pytest.raises(BatchError, match=r"has key 'mask', which the example batch has not"):
        pm({"input_ids": IDS, "labels": IDS, "mask": IDS})
    with pytest.raises(BatchError, match=r"the batch is missing element 1 \(the example batch given to parallelize "
                                         r"has element 0, element 1\)"):
        fxmegatron.parallelize(Tiny(), None, (IDS, IDS))((IDS,))
