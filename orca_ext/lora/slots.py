"""The scheduler's view of the adapter slots: which adapter each of the ``max_loras`` slots holds
and how many admitted requests use it. A request's adapter must hold a slot for it to run; a slot
is given to another adapter only when no admitted request uses it (least recently used first),
so the runner can load the new adapter's weights into it before the step that needs them. Each
load of an adapter also gets a number of its own (``load_token``), which the prefix cache keys its
blocks by."""
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
        self._load_tokens: dict[int, int] = {}  # lora_int_id -> its current load's number
        self._loads = itertools.count(1)

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

    def load_token(self, lora_int_id: int) -> int:
        """A number unique to the current load of adapter ``lora_int_id``: after ``forget``, the
        id (reused, perhaps, for another adapter) gets a new one, so the prefix cache's blocks
        of the unloaded adapter are never hit again."""
        return self._load_tokens.setdefault(lora_int_id, next(self._loads))

    def forget(self, lora_int_id: int) -> None:
        """An unloaded adapter: its slot, once unused, no longer counts as holding it, and its
        next load gets a new ``load_token``."""
        self._load_tokens.pop(lora_int_id, None)
        slot = self._slot_of(lora_int_id)
        if slot is not None and self._users[slot] == 0:
            self._adapter[slot] = 0

    def users(self, lora_int_id: int) -> int:
        slot = self._slot_of(lora_int_id)
        return 0 if slot is None else self._users[slot]

    @property
    def num_active(self) -> int:
        return sum(users > 0 for users in self._users)
