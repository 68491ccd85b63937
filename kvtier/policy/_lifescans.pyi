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
    finish: bool,
    /,
) -> None: ...
def exposure(
    xd: npt.NDArray[np.float64],
    ev: npt.NDArray[np.float64],
    opened: npt.NDArray[np.float64],
    done: npt.NDArray[np.int64],
    openw: npt.NDArray[np.float64],
    tail: npt.NDArray[np.float64],
    f: npt.NDArray[np.float64],
    expo: npt.NDArray[np.float64],
    events: npt.NDArray[np.float64],
    /,
) -> None: ...
def running_min(dens: npt.NDArray[np.float64], out: npt.NDArray[np.float64], /) -> None: ...
def retire(
    open_: npt.NDArray[np.float64],
    old: npt.NDArray[np.float64],
    old_sb: npt.NDArray[np.float64],
    slot: int,
    start: float,
    /,
) -> None: ...
