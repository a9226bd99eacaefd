"""nbtrain: run and steer distributed PyTorch training from a notebook, on Dask.

>>> cluster = nbtrain.connect()                       # embedded local cluster
>>> job = cluster.submit(MyRecipe(), world_size=2, steps=100)
>>> job.status, job.metrics, job.stop()
"""

from nbtrain.config import Settings
from nbtrain.core.job import JobSpec, JobState
from nbtrain.engine.cluster import Cluster, connect
from nbtrain.engine.job import JobFailedError, JobHandle
from nbtrain.runtime.context import RankContext
from nbtrain.runtime.errors import RankFailure
from nbtrain.runtime.faults import Fault
from nbtrain.runtime.recipe import Recipe

__all__ = [
    "Cluster",
    "Fault",
    "JobFailedError",
    "JobHandle",
    "JobSpec",
    "JobState",
    "RankContext",
    "RankFailure",
    "Recipe",
    "Settings",
    "connect",
]
__version__ = "0.1.0"
