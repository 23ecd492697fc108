"""The app's saved settings (`store.settings`): one JSON value per key in the settings table (m004).

The store does not know what the keys mean: the app decides (chat/ui_model.py's settings form)
and applies them at start. Writes go through `Connections.write()` like every other part's.
"""

from __future__ import annotations

import json
from typing import Any

from memory.connections import Connections


class SavedSettings:
    """Key-value settings that survive a restart."""

    def __init__(self, connections: Connections):
        self._connections = connections

    def get(self) -> dict[str, Any]:
        """Every saved setting ({} before the first save)."""
        with self._connections.read() as db:
            return {row["key"]: json.loads(row["value"]) for row in db["settings"].rows}

    def put(self, values: dict[str, Any]) -> None:
        """Save `values` (JSON values), replacing those keys' old values; other keys are kept."""
        now = self._connections.clock()
        encoded = [{"key": key, "value": json.dumps(value), "updated": now} for key, value in values.items()]
        with self._connections.write() as db:
            db["settings"].upsert_all(encoded, pk="key")
