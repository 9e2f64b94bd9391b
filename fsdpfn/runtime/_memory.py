"""Accounting of live unsharded parameter bytes: what FSDP exists to bound."""

from __future__ import annotations

import dataclasses

__all__ = ["MemoryTracker"]


@dataclasses.dataclass
class MemoryTracker:
    """Bytes of unsharded (full) parameters alive now, per unit, and the high-water mark.

    A unit counts from the moment its gather is started (its full parameters are allocated
    then) until it is freed. Flat communication buffers are transient and not counted.

    Attributes:
      live: ``{unit: bytes}`` of units currently unsharded or being gathered.
      high_water: the largest ``sum(live.values())`` seen since the last :meth:`reset`.
      high_water_units: the units alive at that moment.
      offloaded: ``{unit: bytes}`` an offloaded unit holds on the device outside its full
        parameters: the copy of its shards from ``copy_in`` to the gather's ``wait``, its reduced
        gradient shards from ``wait_reduce`` to ``copy_out``. Empty between steps.

    Example:
      >>> m = MemoryTracker()
      >>> m.allocate("blocks.0", 1024); m.allocate("blocks.1", 512); m.release("blocks.0")
      >>> m.current, m.high_water, m.high_water_units
      (512, 1536, ('blocks.0', 'blocks.1'))
    """

    live: dict[str, int] = dataclasses.field(default_factory=dict)
    high_water: int = 0
    high_water_units: tuple[str, ...] = ()
    # Offloaded units: device copies of their shards (copy_in .. wait) and gradient shards
    # (wait_reduce .. copy_out); empty between steps.
    offloaded: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def current(self) -> int:
        return sum(self.live.values())

    def allocate(self, unit: str, nbytes: int) -> None:
        """Counts ``nbytes`` for ``unit`` from now until :meth:`release`."""
        assert unit not in self.live, f"unit {unit!r} allocated twice"
        self.live[unit] = nbytes
        if self.current > self.high_water:
            self.high_water = self.current
            self.high_water_units = tuple(self.live)

    def release(self, unit: str) -> None:
        self.live.pop(unit, None)

    def reset(self) -> None:
        """Starts a new high-water measurement from what is alive now."""
        self.high_water = self.current
        self.high_water_units = tuple(self.live)
