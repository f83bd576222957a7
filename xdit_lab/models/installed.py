"""Installed: every hook and forward (or attribute) replacement that parallelize puts on a model, each
under a name, with what undoes it. `parallel_state(model).hooks` lists the names; unparallelize undoes
them, last first. A hook installed around it would survive unparallelize (tests/test_unparallelize.py
checks that every hook on a parallelized model is one listed here)."""

from __future__ import annotations

import weakref

_ABSENT = object()


class Installed:
    def __init__(self):
        self._undo: dict[str, object] = {}  # name -> a RemovableHandle, or a function that restores
        self._last: dict[str, int] = {}  # a name's base -> the count given out: "ulysses.attn[3]"

    @property
    def names(self) -> list[str]:
        return list(self._undo)

    def __iter__(self):
        return iter(self._undo)

    def __len__(self) -> int:
        return len(self._undo)

    def __repr__(self) -> str:
        return f"Installed({', '.join(self._undo)})"

    def handles(self) -> list:
        """The torch hook handles held (each has the `id` under which its module keeps the hook)."""
        return [undo for undo in self._undo.values() if hasattr(undo, "remove")]

    def numbered(self, base: str) -> str:
        """`base[i]`, i counting the names given out for `base`: "shard_text[0]", "step_cache[1]", ..."""
        index = self._last.get(base, 0)
        self._last[base] = index + 1
        return f"{base}[{index}]"

    def forward_hook(self, name: str, module, fn, **options) -> None:
        self._add(name, module.register_forward_hook(fn, **options))

    def forward_pre_hook(self, name: str, module, fn, **options) -> None:
        self._add(name, module.register_forward_pre_hook(fn, **options))

    def replace(self, name: str, obj, **attributes) -> None:
        """Set `attributes` on `obj` (a module's forward, a processor's backend); undone by setting back
        what the instance held before, or deleting what it did not hold."""
        before = {key: _held(obj, key) for key in attributes}
        held = weakref.ref(obj)  # the registry lives on the model: a strong reference would be a cycle through it

        def restore():
            target = held()
            if target is None:
                return
            for key, value in before.items():
                if value is _ABSENT:
                    if _held(target, key) is not _ABSENT:
                        delattr(target, key)
                else:
                    setattr(target, key, value)

        for key, value in attributes.items():
            setattr(obj, key, value)
        self._add(name, restore)

    def remove_all(self) -> None:
        """Undo everything installed, last first (a forward replaced twice comes back to the first)."""
        while self._undo:
            _undo(self._undo.popitem()[1])

    def _add(self, name: str, undo) -> None:
        if name in self._undo:
            _undo(undo)
            raise ValueError(f"a hook named {name!r} is installed already")
        self._undo[name] = undo


def _held(obj, key: str):
    """What the instance itself holds under `key` (a module keeps its submodules, parameters and buffers
    apart from its __dict__), else _ABSENT: what the class provides is not the instance's."""
    for place in (vars(obj), *(vars(obj).get(kind, {}) for kind in ("_modules", "_parameters", "_buffers"))):
        if key in place:
            return place[key]
    return _ABSENT


def _undo(undo) -> None:
    undo.remove() if hasattr(undo, "remove") else undo()
