"""Engine replicas on a Ray cluster: offline generation (`ReplicatedLLM`, `specmoe generate
--replicas N`) and serving (`specmoe serve --replicas N`, Ray Serve).

Ray is optional (`pip install 'specmoe[ray]'`): nothing here imports it at module level.
"""

from .offline import ReplicatedLLM, Result
from .options import ReplicaOptions

__all__ = ["ReplicaOptions", "ReplicatedLLM", "Result"]
