"""The scheduler's view of the adapter slots: which adapter each of the ``max_loras`` slots holds
and how many admitted requests use it. A request's adapter must hold a slot for it to run; a slot
is given to another adapter only when no admitted request uses it (least recently used first),
so the runner can load the new adapter's weights into it before the step that needs them."""
from __future__ import annotations

import itertools


class LoRASlots:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"max_loras must be >= 1, got {num_slots}")
        self._adapter = [0] * num_slots  # lora_int_id held (0: none)
        self._users = [0] * num_slots
        self._last_use = [0] * num_slots
        self._clock = itertools.count(1)

    def _slot_of(self, lora_int_id: int) -> int | None:
        try:
            return self._adapter.index(lora_int_id)
        except ValueError:
            return None

    def _victim(self) -> int | None:
        """The unused slot to give a new adapter: an empty one, else the least recently used."""
        idle = [s for s, users in enumerate(self._users) if users == 0]
        if not idle:
            return None
        return min(idle, key=lambda s: (self._adapter[s] != 0, self._last_use[s]))

    def can_acquire(self, lora_int_id: int) -> bool:
        return self._slot_of(lora_int_id) is not None or self._victim() is not None

    def acquire(self, lora_int_id: int) -> int:
        """The slot ``lora_int_id`` runs in for one more request (check ``can_acquire``)."""
        slot = self._slot_of(lora_int_id)
        if slot is None:
            slot = self._victim()
            if slot is None:
                raise RuntimeError(f"no free LoRA slot for adapter {lora_int_id}")
            self._adapter[slot] = lora_int_id
        self._users[slot] += 1
        self._last_use[slot] = next(self._clock)
        return slot

    def release(self, slot: int) -> None:
        if self._users[slot] < 1:
            raise RuntimeError(f"LoRA slot {slot} released more often than acquired")
        self._users[slot] -= 1

    def forget(self, lora_int_id: int) -> None:
        """An unloaded adapter: its slot, once unused, no longer counts as holding it."""
        slot = self._slot_of(lora_int_id)
        if slot is not None and self._users[slot] == 0:
            self._adapter[slot] = 0

    def users(self, lora_int_id: int) -> int:
        slot = self._slot_of(lora_int_id)
        return 0 if slot is None else self._users[slot]

    @property
    def num_active(self) -> int:
        return sum(users > 0 for users in self._users)
