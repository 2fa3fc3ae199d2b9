"""Websocket: ``/ws/runs/<run_id>/?since_step=N`` streams a run's metric and status events."""

from __future__ import annotations

from urllib.parse import parse_qs

from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncJsonWebsocketConsumer
from django.core.exceptions import ValidationError

from webapp.runs.events import metrics_event, run_group, status_event


class RunConsumer(AsyncJsonWebsocketConsumer):
    async def connect(self):
        self.run_id = self.scope["url_route"]["kwargs"]["run_id"]
        backlog = await self._backlog()
        if backlog is None:
            await self.close(code=4404)
            return
        await self.channel_layer.group_add(run_group(self.run_id), self.channel_name)
        await self.accept()
        await self.send_json(backlog)

    async def disconnect(self, code):
        await self.channel_layer.group_discard(run_group(self.run_id), self.channel_name)

    async def run_event(self, message):
        await self.send_json(message["event"])

    @database_sync_to_async
    def _backlog(self):
        """The run's current status and the metric points after ``since_step`` (so reconnects resume), or None."""
        from webapp.accounts.models import Membership
        from webapp.runs.models import Run
        from webapp.runs.selectors import metric_list

        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            return None
        try:
            run = Run.objects.get(pk=self.run_id)
        except (Run.DoesNotExist, ValidationError):  # unknown, or not a UUID
            return None
        if not Membership.objects.filter(project_id=run.project_id, user=user).exists():
            return None
        query = parse_qs(self.scope.get("query_string", b"").decode())
        try:
            since = int(query.get("since_step", ["-1"])[0])
        except ValueError:
            since = -1
        points = list(metric_list(run=run, since_step=since))
        return {
            "type": "snapshot",
            "status": status_event(run),
            "metrics": metrics_event(run, points)["points"],
        }
