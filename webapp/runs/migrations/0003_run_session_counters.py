from django.db import migrations, models

ACCEPTED = ("ready", "claimed", "trained")


def count_sessions(apps, schema_editor):
    Run = apps.get_model("runs", "Run")
    Session = apps.get_model("gateway", "Session")
    for run in Run.objects.all():
        sessions = Session.objects.filter(run=run)
        Run.objects.filter(pk=run.pk).update(
            sessions_open=sessions.filter(status="open").count(),
            sessions_accepted=sessions.filter(trajectory__in=ACCEPTED).count(),
        )


class Migration(migrations.Migration):
    dependencies = [
        ("runs", "0002_run_job"),
        ("gateway", "0002_session_agent_optional"),
    ]

    operations = [
        migrations.AddField(
            model_name="run",
            name="sessions_open",
            field=models.IntegerField(default=0),
        ),
        migrations.AddField(
            model_name="run",
            name="sessions_accepted",
            field=models.IntegerField(default=0),
        ),
        migrations.RunPython(count_sessions, migrations.RunPython.noop),
    ]
