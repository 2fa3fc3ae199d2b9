"""REST: people's feedback on a session, ``POST /api/v1/sessions/<id>/feedback/``."""

from __future__ import annotations

import math

from django.contrib.auth import get_user_model
from drf_spectacular.utils import extend_schema
from rest_framework import serializers, status
from rest_framework.response import Response

from webapp.api.views import ProjectAPIView
from webapp.gateway.selectors import session_get
from webapp.rewards.models import Feedback
from webapp.rewards.selectors import session_feedback_list
from webapp.rewards.services import FeedbackInvalid, feedback_record


class FeedbackInput(serializers.Serializer):
    rating = serializers.ChoiceField(
        choices=Feedback.Rating.values,
        required=False,
        allow_blank=True,
        allow_null=True,
        help_text="Thumbs up or down: a reward of 1.0 or 0.0 unless a score is given.",
    )
    score = serializers.FloatField(
        required=False,
        allow_null=True,
        min_value=0.0,
        max_value=1.0,
        help_text="A reward from 0 to 1; wins over the rating.",
    )
    comment = serializers.CharField(
        required=False, allow_blank=True, max_length=4000, trim_whitespace=True
    )
    interaction_id = serializers.CharField(
        required=False,
        allow_blank=True,
        max_length=64,
        help_text="A turn's id (chatcmpl-...): feedback on that turn. Absent: on the session"
        " (its last turn's reward, the outcome).",
    )

    def validate_score(self, value):
        if value is not None and not math.isfinite(value):
            raise serializers.ValidationError("Must be a finite number from 0 to 1.")
        return value

    def validate(self, attrs):
        if not attrs.get("rating") and attrs.get("score") is None and not attrs.get("comment"):
            raise serializers.ValidationError("Give a rating (up or down), a score or a comment.")
        return attrs


class FeedbackOutput(serializers.Serializer):
    id = serializers.IntegerField()
    session = serializers.UUIDField(source="session_id")
    interaction = serializers.CharField(source="interaction_id", allow_null=True)
    rating = serializers.CharField(help_text="up, down or empty.")
    score = serializers.FloatField(allow_null=True)
    comment = serializers.CharField()
    reward = serializers.FloatField(
        allow_null=True, help_text="The reward the feedback makes (the documented rule)."
    )
    reward_applied = serializers.BooleanField(
        help_text="False when the trajectory was already claimed, trained or dropped, or"
        " the feedback is a comment only: kept, but the reward is unchanged."
    )
    trajectory = serializers.CharField(
        source="session.trajectory", help_text="The session's trajectory state after it."
    )
    created_at = serializers.DateTimeField()


class SessionFeedbackApi(ProjectAPIView):
    """A person's verdict on a session or one of its turns, turned into its reward."""

    @extend_schema(
        responses=FeedbackOutput(many=True), summary="List a session's feedback, newest first"
    )
    def get(self, request, session_id):
        session = session_get(project=self.project, session_id=session_id)
        return self.paginate(session_feedback_list(session=session), FeedbackOutput)

    @extend_schema(
        request=FeedbackInput,
        responses={201: FeedbackOutput},
        summary="Give feedback on a session (thumbs, score, comment): it becomes a reward",
    )
    def post(self, request, session_id):
        session = session_get(project=self.project, session_id=session_id)
        data = FeedbackInput(data=request.data)
        data.is_valid(raise_exception=True)
        values = data.validated_data
        try:
            feedback = feedback_record(
                session=session,
                interaction_id=values.get("interaction_id") or None,
                rating=values.get("rating") or "",
                score=values.get("score"),
                comment=values.get("comment") or "",
                author=request.user if isinstance(request.user, get_user_model()) else None,
            )
        except FeedbackInvalid as exc:
            field = "interaction_id" if values.get("interaction_id") else "non_field_errors"
            raise serializers.ValidationError({field: [str(exc)]}) from None
        feedback.session.refresh_from_db(fields=["trajectory"])
        return Response(FeedbackOutput(feedback).data, status=status.HTTP_201_CREATED)
