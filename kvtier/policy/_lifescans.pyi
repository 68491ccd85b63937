"""The life table's scans in C (``_lifescans.c``; ``kvtier.policy.lifescans`` is the reference)."""

import numpy as np
import numpy.typing as npt

def smooth(
    events: npt.NDArray[np.float64],
    expo: npt.NDArray[np.float64],
    mean: npt.NDArray[np.float64],
    prior: float,
    pooled: float,
    mean_pull: float,
    window: float,
    /,
) -> None: ...
def windows(
    h: npt.NDArray[np.float64],
    steps: int,
    surv: npt.NDArray[np.float64],
    held: npt.NDArray[np.float64],
    /,
) -> None: ...
