"""The recipe's tool: ``lookup(key)`` over the records table, a ``verl.tools.base_tool.BaseTool``.

veRL's ToolAgentLoop loads it from ``tool_config.yaml`` (``class_name: lookup_tool.LookupTool``; run.sh puts this
folder on ``PYTHONPATH``) in each agent-loop worker. The table is the JSON file ``config.table_path`` written by
``prepare.py`` (``{key: {"next": key, "value": "d d d"}}``); the schema is ``task.TOOL_SCHEMA``, the one the chat
template renders into every system prompt.
"""

from __future__ import annotations

import json
import os
import runpy
from typing import Any

from verl.tools.base_tool import BaseTool
from verl.tools.schemas import OpenAIFunctionToolSchema, ToolResponse

_task = runpy.run_path(os.path.join(os.path.dirname(os.path.abspath(__file__)), "task.py"))


class LookupTool(BaseTool):
    """Answers ``lookup(key)`` with ``key value d d d next key2`` (``task.record_text``), or ``no record`` for a key
    outside the table. Stateless: every call of a trajectory reads the same table."""

    def __init__(self, config: dict, tool_schema: OpenAIFunctionToolSchema | None = None):
        schema = tool_schema or OpenAIFunctionToolSchema.model_validate(_task["TOOL_SCHEMA"])
        super().__init__(config, schema)
        with open(config["table_path"]) as f:
            self.table: dict[str, dict] = json.load(f)

    async def execute(self, instance_id: str, parameters: dict[str, Any], **kwargs) -> tuple[ToolResponse, float, dict]:
        key = "".join(str(parameters.get("key", "")).split())  # " 0 4 2 " -> "042"
        if key in self.table:
            return ToolResponse(text=_task["record_text"](key, self.table[key])), 0.0, {"found": 1.0}
        return ToolResponse(text=_task["NO_RECORD"]), 0.0, {"found": 0.0}
